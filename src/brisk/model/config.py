"""Model configuration: one dataclass for the Llama family, filled from an HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")

# HF `architectures[0]` -> our architecture name
_HF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
}
# HF `model_type` -> our architecture name, where they differ
_HF_MODEL_TYPE = {"gemma3_text": "gemma3"}
# HF layer_types entries
SLIDING, FULL = "sliding_attention", "full_attention"
# architectures whose config.json enables the sliding window with a separate `use_sliding_window` flag
_WINDOW_FLAG_ARCHS = ("qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model brisk cannot run (unknown architecture, bad hyper-parameters)."""


@dataclass
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 -> hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF dict: {"rope_type": "linear"|"dynamic"|"llama3"|"longrope", "factor": ...}; longrope (phi3) also holds
    # short_factor, long_factor [head_dim / 2] and original_max_position_embeddings
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (qwen2)
    sliding_window: int | None = None  # mistral-style local attention window, None = full
    qk_norm: bool | None = None  # per-head RMSNorm of q and k before RoPE (qwen3); None -> the architecture's
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # dtype the checkpoint was saved in, informational
    # gemma3 (model/gemma.py). layer_types: per layer "sliding_attention" (window `sliding_window`, RoPE base
    # rope_local_base_freq) or "full_attention" (rope_theta + rope_scaling); None: every layer alike
    layer_types: list[str] | None = None
    rope_local_base_freq: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale = query_pre_attn_scalar ** -0.5 (else head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unknown architecture {self.architecture!r}; brisk supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.qk_norm is None:
            self.qk_norm = self.architecture in ("qwen3", "gemma3")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.is_gemma:
            if self.hidden_act not in ("gelu_pytorch_tanh", "gelu_tanh"):
                raise UnsupportedModelError(f"gemma3: hidden_activation {self.hidden_act!r} is not supported "
                                            "(only gelu_pytorch_tanh)")
            if self.layer_types is not None and (len(self.layer_types) != self.num_hidden_layers
                                                 or set(self.layer_types) - {SLIDING, FULL}):
                raise UnsupportedModelError(f"gemma3: layer_types must list {self.num_hidden_layers} entries of "
                                            f"{SLIDING!r} / {FULL!r}, got {self.layer_types}")
            if self.sliding_window is not None and self.sliding_window <= 0:
                raise UnsupportedModelError(f"sliding_window must be positive, got {self.sliding_window}")
        elif self.hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]

    @property
    def is_gemma(self) -> bool:
        """Gemma's decoder: (1 + w) RMSNorms around attention and MLP, GeGLU, scaled embeddings (model/gemma.py)."""
        return self.architecture == "gemma3"

    def layer_window(self, index: int) -> int | None:
        """The attention window of layer `index`: the model's sliding window, or None for a global layer."""
        if self.layer_types is not None and self.layer_types[index] == FULL:
            return None
        return self.sliding_window

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        if self.qk_norm:
            layer += 2 * self.head_dim
        if self.attention_bias:
            layer += q + 2 * kv
        if self.is_gemma:
            layer += 2 * h  # pre- and post-feed-forward norms
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def to_hf_dict(self) -> dict[str, Any]:
        """A transformers `config.json` dict that `from_hf_dict` (and transformers) read back as this config."""
        arch_class = {v: k for k, v in _HF_ARCH.items()}[self.architecture]
        if self.is_gemma:
            from brisk.model.gemma import gemma_hf_dict

            return gemma_hf_dict(self, arch_class)
        d: dict[str, Any] = {
            "architectures": [arch_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "sliding_window": self.sliding_window,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id),
        }
        if self.architecture in _WINDOW_FLAG_ARCHS:
            d["use_sliding_window"] = self.sliding_window is not None
        if self.rope_scaling and "original_max_position_embeddings" in self.rope_scaling:
            d["original_max_position_embeddings"] = self.rope_scaling["original_max_position_embeddings"]
        if self.torch_dtype:
            d["torch_dtype"] = self.torch_dtype
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a transformers `config.json` dict."""
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        arch = None
        for a in archs:
            arch = _HF_ARCH.get(a)
            if arch:
                break
        if arch is None and model_type in SUPPORTED_ARCHITECTURES:
            arch = model_type
        if arch is None and model_type in _HF_MODEL_TYPE:
            arch = _HF_MODEL_TYPE[model_type]
        if arch is None:
            name = archs[0] if archs else model_type
            raise UnsupportedModelError(
                f"unknown architecture {name!r} in config.json; brisk supports "
                f"{', '.join(_HF_ARCH)} (model_type {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if arch == "gemma3":
            from brisk.model.gemma import gemma_config_fields

            d = {**d, **gemma_config_fields(d)}
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in d]
        if missing:
            raise UnsupportedModelError(f"config.json is missing {', '.join(missing)}")
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and isinstance(d.get("rope_parameters"), dict):
            rp = dict(d["rope_parameters"])
            if rp.get("rope_type", "default") != "default":
                rope_scaling = rp
        rope_theta = d.get("rope_theta")
        if rope_theta is None and isinstance(d.get("rope_parameters"), dict):
            rope_theta = d["rope_parameters"].get("rope_theta")
        sliding_window = d.get("sliding_window")
        if arch in _WINDOW_FLAG_ARCHS and not d.get("use_sliding_window", False):
            sliding_window = None
        if float((d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
                 ) != 1.0:
            raise UnsupportedModelError(f"{arch}: partial_rotary_factor != 1 (RoPE on part of each head) is not "
                                        "supported; brisk rotates whole heads")
        if rope_scaling is not None:
            rope_scaling = {k: v for k, v in rope_scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind in ("su", "longrope"):  # phi3: "su" is longrope's older name
                rope_scaling["rope_type"] = "longrope"
                rope_scaling.setdefault("original_max_position_embeddings",
                                        d.get("original_max_position_embeddings")
                                        or d.get("max_position_embeddings", 2048))
        eos = d.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
            head_dim=d.get("head_dim") or 0,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6 if arch in ("qwen2", "qwen3") else 1e-5),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            sliding_window=sliding_window,
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            layer_types=d.get("layer_types") if arch == "gemma3" else None,
            rope_local_base_freq=d.get("rope_local_base_freq"),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
        )
