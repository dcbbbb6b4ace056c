"""The sampling values a request gets for the fields it leaves out: the model's own, else brisk's.

`generation_config` (an engine setting, vLLM's `--generation-config`) says where they come from:

    auto    the model's generation config (model/generation_config.py: an HF folder's generation_config.json,
            a GGUF file's general.sampling.* keys). A model that states any sampling field gets exactly the
            fields it states, the rest at SamplingParams' neutral values (vLLM's rule); a model that states
            none gets CONSERVATIVE below.
    vllm    SamplingParams' own defaults (temperature 1.0, no truncation), as vLLM and OpenAI: the model's
            file is ignored.
    PATH    a folder with a generation_config.json, the file itself, or a .gguf file, read as under auto.

`override_generation_config` (a JSON object or dict, vLLM's `--override-generation-config`) then sets single
fields on top. A request's explicit value always wins over all of them.

Why a fallback at all: temperature 1.0 with no truncation samples from the whole 49k-token tail, which a 135M
model cannot survive ("What is the capital of France?" came back as "Bonjour Fau Coulibre, the capital of
France is Monaco."). CONSERVATIVE is llama.cpp's server default (temperature 0.8, top-k 40, top-p 0.95,
min-p 0.05), which keeps only tokens with a real share of the probability mass.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from brisk.engine.sampling_params import SamplingParams
from brisk.model.generation_config import GenerationConfigError, read_generation_config, sampling_fields

GENERATION_CONFIG_MODES = ("auto", "vllm")
CONSERVATIVE: dict[str, Any] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
# the names an override may use: SamplingParams' fields, and HF's max_new_tokens for max_tokens
_ALIASES = {"max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for the sampling fields a request omits; `source` says where they came from."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # None = the caller's own default (16 for /v1/completions, the context for chat)
    source: str = "SamplingParams defaults"

    def __post_init__(self) -> None:
        # SamplingParams' checks, with the source named: a bad generation_config.json fails at start-up
        try:
            SamplingParams(max_tokens=self.max_tokens, **self._values(skip_max_tokens=True))
        except ValueError as e:
            raise ValueError(f"bad sampling default from {self.source}: {e}") from None

    def _values(self, skip_max_tokens: bool = False) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "source" and not (skip_max_tokens and f.name == "max_tokens")}

    def sampling_params(self, **explicit: Any) -> SamplingParams:
        """SamplingParams from `explicit` (a None value means "not given"), the defaults filling in the rest."""
        given = {k: v for k, v in explicit.items() if v is not None}
        values = self._values()
        if values["max_tokens"] is None:
            del values["max_tokens"]  # SamplingParams' own default
        return SamplingParams(**{**values, **given})

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line for the start-up log."""
        values = " ".join(f"{k}={v}" for k, v in self._values().items() if not (k == "max_tokens" and v is None))
        return f"{values} (from {self.source}; a request's own fields win)"


def parse_overrides(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """`override_generation_config` -> {SamplingParams field: value}; ValueError for bad JSON or unknown keys."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"override_generation_config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"override_generation_config must be a JSON object, got {value!r}")
    allowed = [f.name for f in fields(SamplingDefaults) if f.name != "source"]
    out = {}
    for key, v in value.items():
        name = _ALIASES.get(key, key)
        if name not in allowed:
            raise ValueError(f"override_generation_config: unknown field {key!r}; the fields are "
                             f"{', '.join(allowed)} (max_new_tokens is read as max_tokens)")
        out[name] = v
    SamplingDefaults(**out, source="override_generation_config")  # values checked now, before the model loads
    return out


def check_generation_config(value: str) -> None:
    """ValueError unless `value` is auto, vllm, or an existing path."""
    if value not in GENERATION_CONFIG_MODES and not Path(value).expanduser().exists():
        raise ValueError(f"generation_config must be auto, vllm or the path of a folder with a generation_config.json "
                         f"(or the file itself), got {value!r}, which does not exist")


def resolve_sampling_defaults(mode: str, overrides: dict[str, Any], model_generation_config: dict[str, Any],
                              model_name: str) -> SamplingDefaults:
    """The defaults in effect for a model whose own generation config is `model_generation_config`."""
    if mode == "vllm":
        base: dict[str, Any] = {}
        source = "SamplingParams defaults (--generation-config vllm)"
    else:
        if mode == "auto":
            own, where = model_generation_config, f"{model_name}'s generation config"
        else:
            try:
                own, where = read_generation_config(Path(mode).expanduser()), mode
            except GenerationConfigError as e:
                raise ValueError(str(e)) from None
        base = sampling_fields(own)
        if base:
            source = where
        else:
            base = dict(CONSERVATIVE)
            source = f"brisk's conservative defaults ({where} sets no sampling field)"
    if overrides:
        source += f" + override_generation_config {json.dumps(overrides)}"
    return SamplingDefaults(**{**base, **overrides}, source=source)
