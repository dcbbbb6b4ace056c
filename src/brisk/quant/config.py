"""The quantization config a quantized checkpoint carries: what was quantized, how, and with which method.

It lives in the folder's `config.json` under `quantization_config`, the key transformers, AutoGPTQ and AutoAWQ
use, with `"quant_method": "brisk"` so that no other loader mistakes the tensors for its own format:

    "quantization_config": {
      "quant_method": "brisk", "format_version": 1,
      "method": "rtn",                          # how the integers were chosen (rtn, gptq, awq, ...)
      "bits": 4, "group_size": 64, "sym": false, "scheme": "int",    # the defaults of the run
      "calibration": {"calib_text": "emma.txt", "num_samples": 32, "seq_len": 512, "seed": 0},  # gptq/awq
      "method_config": {"damp": 0.01, "act_order": true, ...},   # the method's own settings (gptq/awq)
      "modules": {                              # every quantized module, by its HF name
        "model.layers.0.self_attn.q_proj": {"bits": 4, "group_size": 64, "sym": false, "scheme": "int"},
        "model.embed_tokens":              {"bits": 8, "group_size": -1, "sym": true,  "scheme": "int"},
        ...
      }
    }

`group_size: -1` means one group per output row (per-channel), the convention of GPTQ checkpoints. A module
that is not listed keeps its float weight (`X.weight`); a listed one stores `X.qweight` (packed codes, layout
in quant/primitives.py), `X.scales` and, when asymmetric, `X.qzeros`. A tied lm_head uses the embedding's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

QUANT_METHOD = "brisk"
FORMAT_VERSION = 1
SUPPORTED_BITS = (2, 3, 4, 8)
SCHEMES = ("int", "nf4", "lut")  # lut: a table per output row (SqueezeLLM, quant/squeezellm.py)
METHODS = ("rtn", "gptq", "awq", "sparsegpt", "qat", "smoothquant", "llm-int8", "squeezellm")
# sparsegpt: joint prune + quantize (brisk prune); qat: quantization-aware training (brisk quantize --method qat);
# smoothquant, llm-int8: int8 weights with int8 activations (quant/w8a8.py); squeezellm: per-row tables + float
# outliers (scheme lut, quant/squeezellm.py)


class QuantConfigError(ValueError):
    """A quantization config that is malformed, inconsistent with the tensors, or of an unknown format."""


@dataclass(frozen=True)
class LayerQuant:
    """How one module's weight is quantized. group_size -1 = per output channel."""

    bits: int
    group_size: int = -1
    sym: bool = False
    # "int": uniform affine; "nf4": NormalFloat-4 codebook with a per-group absmax; "lut": a 2^bits-entry table
    # per output row (non-uniform levels, SqueezeLLM), 3 or 4 bits, per channel, with optional float outliers
    scheme: str = "int"

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise QuantConfigError(f"unknown quantization scheme {self.scheme!r}; expected one of {', '.join(SCHEMES)}")
        if self.bits not in SUPPORTED_BITS:
            raise QuantConfigError(f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {self.bits!r}")
        if self.scheme == "nf4" and self.bits != 4:
            raise QuantConfigError(f"scheme nf4 is a 4-bit format, got bits={self.bits}")
        if not isinstance(self.group_size, int) or (self.group_size != -1 and self.group_size < 1):
            raise QuantConfigError(
                f"group_size must be a positive integer or -1 (per channel), got {self.group_size!r}")
        if self.scheme == "nf4" and self.group_size == -1:
            raise QuantConfigError("scheme nf4 needs a group size (QLoRA uses 64)")
        if self.scheme == "lut" and (self.bits not in (3, 4) or self.group_size != -1):
            raise QuantConfigError(f"scheme lut is a table of 8 or 16 values per output row: bits 3 or 4 and "
                                   f"group_size -1, got bits={self.bits}, group_size={self.group_size}")

    def groups(self, in_features: int) -> int:
        """Groups per output row; checks that the group size divides the row."""
        g = in_features if self.group_size == -1 else self.group_size
        if in_features % g:
            divisors = [d for d in (32, 64, 128, 256) if in_features % d == 0]
            raise QuantConfigError(
                f"group size {g} does not divide the input dimension {in_features}; "
                + (f"{in_features} is divisible by {', '.join(map(str, divisors))}" if divisors
                   else "use group size -1 (per channel)"))
        return in_features // g

    @property
    def label(self) -> str:
        """Short human form: int4-g64-asym, int8-ch-sym, nf4-g64, lut3-ch."""
        g = "ch" if self.group_size == -1 else f"g{self.group_size}"
        if self.scheme == "nf4":
            return f"nf4-{g}"
        if self.scheme == "lut":
            return f"lut{self.bits}-ch"
        return f"int{self.bits}-{g}-{'sym' if self.sym else 'asym'}"


@dataclass
class QuantizationConfig:
    method: str  # how the codes were chosen: rtn, gptq, awq
    default: LayerQuant  # the run's settings; per-module entries may differ (e.g. 8-bit embeddings)
    modules: dict[str, LayerQuant] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # calibrated methods: the data they saw (calib.CalibConfig.to_dict()) and their own settings; informational,
    # the tensors alone define the model
    calibration: dict[str, Any] | None = None
    method_config: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        extra = {k: v for k, v in (("calibration", self.calibration), ("method_config", self.method_config))
                 if v is not None}
        return {"quant_method": QUANT_METHOD, "format_version": self.format_version, "method": self.method,
                **asdict(self.default), **extra, "modules": {name: asdict(q) for name, q in self.modules.items()}}

    @classmethod
    def from_dict(cls, d: Any, source: str = "config.json") -> QuantizationConfig:
        """Parse and validate `quantization_config`; every error names `source` and what to do."""
        if not isinstance(d, dict):
            raise QuantConfigError(f"{source}: quantization_config must be a JSON object, got {type(d).__name__}")
        method = d.get("quant_method")
        if method != QUANT_METHOD:
            raise QuantConfigError(
                f"{source}: quantization_config has quant_method {method!r}, which brisk does not read; it reads "
                "'brisk' (`brisk quantize`), 'gptq' (AutoGPTQ / GPTQModel), 'awq' (AutoAWQ GEMM) and "
                "'compressed-tensors' (pack-quantized W4A16 / W8A16). Or quantize the float model with brisk: "
                "brisk quantize --method rtn --bits 4 MODEL OUT")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise QuantConfigError(f"{source}: quantization format_version {version!r} is not supported by this "
                                   f"brisk (it reads version {FORMAT_VERSION}); re-run brisk quantize")
        if d.get("method") not in METHODS:
            raise QuantConfigError(f"{source}: unknown quantization method {d.get('method')!r}; "
                                   f"expected one of {', '.join(METHODS)}")
        modules = d.get("modules")
        if not isinstance(modules, dict) or not modules:
            raise QuantConfigError(f"{source}: quantization_config.modules must map module names to their "
                                   "settings and list at least one module")
        try:
            default = _layer_from_dict(d, "the defaults")
            parsed = {name: _layer_from_dict(q, name) for name, q in modules.items()}
        except QuantConfigError as e:
            raise QuantConfigError(f"{source}: {e}") from None
        for key in ("calibration", "method_config"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise QuantConfigError(f"{source}: quantization_config.{key} must be an object, got "
                                       f"{type(d[key]).__name__}")
        return cls(method=d["method"], default=default, modules=parsed, format_version=version,
                   calibration=d.get("calibration"), method_config=d.get("method_config"))


def _layer_from_dict(d: Any, name: str) -> LayerQuant:
    if not isinstance(d, dict):
        raise QuantConfigError(f"quantization settings of {name} must be an object, got {type(d).__name__}")
    missing = [k for k in ("bits", "group_size", "sym") if k not in d]
    if missing:
        raise QuantConfigError(f"quantization settings of {name} lack {', '.join(missing)}")
    if not isinstance(d["sym"], bool) or isinstance(d["bits"], bool) or not isinstance(d["bits"], int):
        raise QuantConfigError(f"quantization settings of {name} have a malformed bits or sym: {d}")
    try:
        return LayerQuant(bits=d["bits"], group_size=d["group_size"], sym=d["sym"], scheme=d.get("scheme", "int"))
    except QuantConfigError as e:
        raise QuantConfigError(f"{name}: {e}") from None


def read_quantization_config(config_dict: dict[str, Any], source: str) -> QuantizationConfig | None:
    """The QuantizationConfig of a folder's config.json dict, or None for a float checkpoint."""
    if "quantization_config" not in config_dict:
        return None
    return QuantizationConfig.from_dict(config_dict["quantization_config"], source)
