"""Model configuration: one dataclass for the Llama family, filled from an HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "smollm3", "mixtral",
                           "qwen2_moe", "qwen3_moe")
# mixture-of-experts architectures (model/moe.py): every layer's, or some layers', MLP is a routed expert block
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")

# architectures whose layers are not plain pre-norm x / rms(x) * w (ModelConfig.norm_plus_one, sandwich_norms)
NORM_PLUS_ONE_ARCHITECTURES = ("gemma3",)
SANDWICH_NORM_ARCHITECTURES = ("gemma3",)

# HF `architectures[0]` -> our architecture name
_HF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "SmolLM3ForCausalLM": "smollm3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# HF `model_type` -> our architecture name, where they differ
_HF_MODEL_TYPE = {"gemma3_text": "gemma3"}
# HF layer_types entries
SLIDING, FULL = "sliding_attention", "full_attention"
# the RoPE tables a model's prologue can stack (ModelConfig.rope_tables): the model's own, gemma3's local one (its
# sliding layers' base), the identity (layers without RoPE)
GLOBAL_ROPE, LOCAL_ROPE, NO_ROPE = "global", "local", "none"
# architectures whose config.json enables the sliding window with a separate `use_sliding_window` flag
_WINDOW_FLAG_ARCHS = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "smollm3")


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
    # smollm3: per layer 1 (RoPE) or 0 (none: "NoPE"), HF's no_rope_layers; None: every layer rotates
    no_rope_layers: list[int] | None = None
    # mixture of experts (model/moe.py; HF names): 0 experts = a dense model
    num_experts: int = 0  # routed experts per MoE layer (mixtral's num_local_experts)
    num_experts_per_tok: int = 0  # top-k experts each token is routed to
    moe_intermediate_size: int = 0  # each routed expert's FFN width; 0 -> intermediate_size (mixtral)
    shared_expert_intermediate_size: int = 0  # qwen2_moe's always-on shared expert (sigmoid-gated); 0 = none
    norm_topk_prob: bool = True  # renormalize the top-k routing probabilities to sum to 1 (mixtral: always)
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: list[int] = field(default_factory=list)  # layers that keep a dense MLP (intermediate_size)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unknown architecture {self.architecture!r}; brisk supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.qk_norm is None:
            self.qk_norm = self.architecture in ("qwen3", "qwen3_moe", "gemma3")
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
        if self.no_rope_layers is not None and len(self.no_rope_layers) != self.num_hidden_layers:
            raise UnsupportedModelError(f"no_rope_layers must have one entry per layer ({self.num_hidden_layers}), "
                                        f"got {len(self.no_rope_layers)}")
        self._check_moe()

    def _check_moe(self) -> None:
        if self.architecture not in MOE_ARCHITECTURES:
            if self.num_experts:
                raise UnsupportedModelError(f"{self.architecture} is a dense architecture but the config has "
                                            f"num_experts={self.num_experts}")
            return
        if self.num_experts <= 0:
            raise UnsupportedModelError(f"{self.architecture}: num_experts must be positive, got {self.num_experts}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModelError(
                f"{self.architecture}: num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts}): each token is routed to that many distinct experts")
        if self.moe_intermediate_size == 0:
            self.moe_intermediate_size = self.intermediate_size
        if self.moe_intermediate_size < 0 or self.shared_expert_intermediate_size < 0:
            raise UnsupportedModelError(f"{self.architecture}: expert sizes must be positive")
        if self.decoder_sparse_step <= 0:
            raise UnsupportedModelError(f"decoder_sparse_step must be positive, got {self.decoder_sparse_step}")
        self.mlp_only_layers = sorted({int(i) for i in self.mlp_only_layers})

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has a routed expert block (transformers' Qwen2-MoE / Qwen3-MoE rule)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def is_gemma(self) -> bool:
        """Gemma's decoder: (1 + w) RMSNorms around attention and MLP, GeGLU, scaled embeddings (model/gemma.py)."""
        return self.architecture == "gemma3"

    @property
    def norm_plus_one(self) -> bool:
        """RMSNorms that scale by (1 + w), the weight stored zero-centred (gemma3)."""
        return self.architecture in NORM_PLUS_ONE_ARCHITECTURES

    @property
    def sandwich_norms(self) -> bool:
        """Four norms per layer, around attention and around the MLP (gemma3); else two, before each."""
        return self.architecture in SANDWICH_NORM_ARCHITECTURES

    @property
    def rope_tables(self) -> tuple[str, ...]:
        """The RoPE tables the prologue computes, in the order it stacks them (one: not stacked)."""
        if self.is_gemma:
            return (GLOBAL_ROPE, LOCAL_ROPE)
        if self.no_rope_layers is not None and not all(self.no_rope_layers):
            return (GLOBAL_ROPE, NO_ROPE)
        return (GLOBAL_ROPE,)

    def layer_rope(self, index: int) -> int | None:
        """Which of rope_tables layer `index` rotates with, or None where there is only one."""
        tables = self.rope_tables
        if len(tables) == 1:
            return None
        if self.is_gemma:
            return tables.index(LOCAL_ROPE if self.layer_window(index) is not None else GLOBAL_ROPE)
        assert self.no_rope_layers is not None
        return tables.index(GLOBAL_ROPE if self.no_rope_layers[index] else NO_ROPE)

    def per_layer_fields(self, kept: list[int]) -> dict[str, Any]:
        """The fields that hold one entry per layer, with only the `kept` layers' entries (dataclasses.replace
        arguments, for a model with layers dropped)."""
        out: dict[str, Any] = {}
        for name in ("layer_types", "no_rope_layers"):
            value = getattr(self, name)
            if value is not None:
                out[name] = [value[i] for i in kept]
        return out

    def layer_window(self, index: int) -> int | None:
        """The attention window of layer `index`: the model's sliding window, or None for a global layer."""
        if self.layer_types is not None and self.layer_types[index] == FULL:
            return None
        return self.sliding_window

    @property
    def num_params(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 2 * h
        if self.qk_norm:
            layer += 2 * self.head_dim
        if self.attention_bias:
            layer += q + 2 * kv
        if self.is_gemma:
            layer += 2 * h  # pre- and post-feed-forward norms
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        ffn = sum(self._ffn_params(i, self.num_experts) for i in range(self.num_hidden_layers))
        return self.num_hidden_layers * layer + ffn + emb + h

    @property
    def num_active_params(self) -> int:
        """Parameters one token computes with: num_params with only num_experts_per_tok routed experts per MoE
        layer (the router and a shared expert included). Equal to num_params for a dense model."""
        full = sum(self._ffn_params(i, self.num_experts) for i in range(self.num_hidden_layers))
        active = sum(self._ffn_params(i, self.num_experts_per_tok) for i in range(self.num_hidden_layers))
        return self.num_params - full + active

    def _ffn_params(self, layer_idx: int, num_experts: int) -> int:
        h = self.hidden_size
        if not self.is_moe_layer(layer_idx):
            return 3 * h * self.intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return self.num_experts * h + num_experts * 3 * h * self.moe_intermediate_size + shared

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
        if self.no_rope_layers is not None:
            d["no_rope_layers"] = list(self.no_rope_layers)
        if self.is_moe:
            d["num_local_experts" if self.architecture == "mixtral" else "num_experts"] = self.num_experts
            d["num_experts_per_tok"] = self.num_experts_per_tok
            if self.architecture != "mixtral":
                d |= {"moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": self.norm_topk_prob,
                      "decoder_sparse_step": self.decoder_sparse_step, "mlp_only_layers": list(self.mlp_only_layers)}
            if self.architecture == "qwen2_moe":
                d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
                d["qkv_bias"] = self.attention_bias
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
        if arch == "smollm3":  # its window applies to sliding layer_types only, which _no_rope_layers refuses
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
        moe: dict[str, Any] = {}
        if arch in MOE_ARCHITECTURES:
            moe = dict(num_experts=int(d.get("num_local_experts") or d.get("num_experts") or 0),
                       num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
                       moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
                       norm_topk_prob=True if arch == "mixtral" else bool(d.get("norm_topk_prob", False)),
                       decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                       mlp_only_layers=list(d.get("mlp_only_layers") or []))
            if arch == "qwen2_moe":
                moe["shared_expert_intermediate_size"] = int(d.get("shared_expert_intermediate_size") or 0)
        attention_bias = d.get("attention_bias", d.get("qkv_bias", arch in ("qwen2", "qwen2_moe")))
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
            rms_norm_eps=d.get("rms_norm_eps", 1e-6 if arch.startswith("qwen") else 1e-5),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(attention_bias),
            sliding_window=sliding_window,
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            layer_types=d.get("layer_types") if arch == "gemma3" else None,
            rope_local_base_freq=d.get("rope_local_base_freq"),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            final_logit_softcapping=d.get("final_logit_softcapping"),
            no_rope_layers=_no_rope_layers(arch, d),
            **moe,
        )


def _no_rope_layers(arch: str, d: dict[str, Any]) -> list[int] | None:
    """smollm3's per-layer RoPE switch (1: RoPE, 0: none), from no_rope_layers or its interval (every
    no_rope_layer_interval-th layer without, as transformers fills it); None for other architectures."""
    if arch != "smollm3":
        return None
    if d.get("use_sliding_window") and SLIDING in (d.get("layer_types") or []):
        raise UnsupportedModelError("smollm3: sliding-window layers are not supported (use_sliding_window is on)")
    layers = d.get("no_rope_layers")
    if layers is None:
        interval = int(d.get("no_rope_layer_interval") or 4)
        layers = [int((i + 1) % interval != 0) for i in range(d.get("num_hidden_layers", 0))]
    return [int(bool(x)) for x in layers]
