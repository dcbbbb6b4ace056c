"""A model's own generation config: the sampling values its authors recommend, as its files state them.

Two sources, one shape (a dict in Hugging Face `generation_config.json` names):
  * an HF folder's `generation_config.json`, kept whole (a checkpoint written from it carries it on);
  * a GGUF file's `general.sampling.*` metadata (gguf-py's `Keys.General.SAMPLING_*`), mapped to HF names:

        general.sampling.temp            -> temperature
        general.sampling.top_k           -> top_k
        general.sampling.top_p           -> top_p
        general.sampling.min_p           -> min_p
        general.sampling.penalty_repeat  -> repetition_penalty

    The other general.sampling keys (sequence, penalty_last_n, mirostat*, xtc_*) are llama.cpp sampler settings
    that brisk has no counterpart for; they are left out. SmolLM2-135M-Instruct's Q4_1 file (the default model)
    has no general.sampling key at all.

Which of these fields the engine applies, and what it falls back to, is engine/sampling_defaults.py's business.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"

GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}

# The generation_config.json fields that are sampling defaults (HF name -> SamplingParams field). vLLM's
# `--generation-config auto` reads the same ones; max_new_tokens becomes the default max_tokens.
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class GenerationConfigError(ValueError):
    """A generation config file that cannot be read; the message names the file."""


def generation_config_from_gguf_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The general.sampling.* values of a GGUF file's metadata, in generation_config.json names."""
    return {hf: metadata[key] for key, hf in GGUF_SAMPLING_KEYS.items() if key in metadata}


def read_generation_config(path: str | Path) -> dict[str, Any]:
    """The generation config of a model folder, a generation_config.json file or a GGUF file ({} if it has none)."""
    path = Path(path)
    if path.is_dir():
        path = path / GENERATION_CONFIG_FILE
        if not path.is_file():
            return {}
    if not path.is_file():
        raise GenerationConfigError(f"generation config {str(path)!r} does not exist; give a model folder, a "
                                    f"{GENERATION_CONFIG_FILE} or a .gguf file")
    with open(path, "rb") as f:
        is_gguf = f.read(4) == b"GGUF"
    if is_gguf:
        from brisk.model.gguf import read_gguf

        return generation_config_from_gguf_metadata(read_gguf(path).metadata)
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise GenerationConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise GenerationConfigError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def sampling_fields(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults a generation config sets, as SamplingParams keywords (nulls count as unset)."""
    return {field: generation_config[hf] for hf, field in SAMPLING_FIELDS.items()
            if generation_config.get(hf) is not None}
