"""The Llama-family decoder (llama, mistral, qwen2, qwen3, phi3, gemma3; mixtral, qwen2_moe, qwen3_moe) in plain
PyTorch.

The architectures differ only in data read from the config: q/k/v biases (qwen2), per-head q/k RMSNorm before
RoPE (qwen3), the sliding window (mistral), RoPE variants (model/rope.py). Phi3's fused qkv_proj / gate_up_proj
tensors are split into HF's q/k/v and gate/up names at load (model/fuse.py) and fused again like any other.
Gemma3's layers (sandwich norms, GeGLU, local and global attention) are model/gemma.py's, chosen by the config. The
mixture-of-experts models swap a layer's MLP for a routed block of MLPs (model/moe.py).

Module names match HF transformers, so an HF state dict loads as is and quantized or sharded layers can be
swapped in from outside by name. The forward runs the flattened tokens of many sequences at once:

    model(input_ids[T], positions[T], meta: AttentionMetadata, kv_caches) -> logits[N, vocab]

Prefill, decode, chunked prefill and multi-token verification differ only in `meta`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from brisk.model.config import LOCAL_ROPE, NO_ROPE, ModelConfig, UnsupportedModelError
from brisk.model.rope import RotaryEmbedding, apply_rope
from brisk.ops.attention import AttentionMetadata, paged_attention, rope_write_kv, write_kv
from brisk.ops.fused import add_rms_norm, gelu_tanh_mul, rms_norm, rms_norm_qk_heads_, silu_mul
from brisk.ops.metadata import with_sliding_window


class RMSNorm(nn.Module):
    # a float32 weight on lower-precision rows multiplies in float32 and rounds once (ops.fused.rms_norm_reference):
    # gemma3's norm, whose 1 + w is float32; Llama's applies the weight in the model dtype
    round_once = False
    offset = 0.0  # what the multiplier adds to the stored weight (GemmaRMSNorm: 1, the weight stored zero-centred)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given the residual stream, residual += x in place and (norm(residual), residual).

        Statistics in float32, the weight applied in the model dtype, as HF does (ops.fused has both paths).
        """
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)

    def scale_weight(self) -> torch.Tensor:
        """What multiplies the normalized rows: the weight (GemmaRMSNorm: 1 + weight)."""
        return self.weight


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight), HF's Gemma3RMSNorm: statistics, the scale and the product in float32, then
    rounded to the model dtype once. The parameter holds HF's zero-centred w (checkpoints save as HF does); the
    multiplier 1 + w is derived once per weight and reused, so float32 models take the fused kernels."""

    _cached: tuple[tuple[int, int, int], torch.Tensor] | None = None
    round_once = True  # bfloat16 rows: x * r * (1 + w) in float32, rounded once, as HF's Gemma3RMSNorm
    offset = 1.0

    def scale_weight(self) -> torch.Tensor:
        """1 + weight in float32, recomputed when the weight tensor or its contents change."""
        w = self.weight
        try:
            version = w._version
        except RuntimeError:  # an inference-mode tensor has no version counter: never cache it
            return w.float() + 1.0
        key = (id(w), w.data_ptr(), version)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, w.float() + 1.0)
        return self._cached[1]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        w = self.scale_weight()  # float32: the fused kernels (and their references) apply it in float32, round once
        if residual is None:
            return rms_norm(x, w, self.eps, round_once=True)
        return add_rms_norm(x, residual, w, self.eps, round_once=True)


def norm_class(config: ModelConfig) -> type[RMSNorm]:
    """The architecture's RMSNorm: x / rms(x) * w, or gemma3's x / rms(x) * (1 + w)."""
    return GemmaRMSNorm if config.norm_plus_one else RMSNorm


class Attention(nn.Module):
    """Self-attention of one layer. What differs per architecture and per layer is data read from the config:
    q/k/v biases, per-head q/k norms, the score scale, the layer's own window and which RoPE table it rotates
    with (`rope_index` into the prologue's stacked tables; None: the model has one)."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # head_dim ** -0.5; gemma3: query_pre_attn_scalar ** -0.5
        self.scale = float(config.query_pre_attn_scalar or self.head_dim) ** -0.5
        h, q, kv = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, q, bias=bias)
        self.k_proj = nn.Linear(h, kv, bias=bias)
        self.v_proj = nn.Linear(h, kv, bias=bias)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.qkv_proj: nn.Linear | None = None  # set by model.fuse.fuse_projections (replaces q/k/v_proj)
        # qwen3, gemma3: RMSNorm over each head's d dims of q and of k, before RoPE
        norm = norm_class(config)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # a window of the layer's own (gemma3's layer_types: None on its global layers), whatever the step's
        # metadata says; else the step's window (mistral's, StreamingLLM's) applies
        self.own_window = config.layer_types is not None
        self.sliding_window = config.layer_window(layer_idx) if self.own_window else None
        self.rope_index = config.layer_rope(layer_idx)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
        if self.rope_index is not None:  # cos, sin: [tables, T, d/2] from the prologue; this layer's table
            cos, sin = cos[self.rope_index], sin[self.rope_index]
        if self.own_window:
            meta = with_sliding_window(meta, self.sliding_window)
        t, h, kvh, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)  # [T, (h + 2 kvh) d]: q heads, k heads, v heads
            if self.q_norm is not None:
                rms_norm_qk_heads_(qkv, self.q_norm.scale_weight(), self.k_norm.scale_weight(), self.q_norm.eps, h,
                                   kvh, self.q_norm.round_once)
            if rope_write_kv(qkv, cos, sin, kv_cache, meta, h, kvh):  # rotated in place, k and v cached
                qkv = qkv.view(t, h + 2 * kvh, d)
                q, k, v = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
            else:
                qkv = qkv.view(t, h + 2 * kvh, d)
                qk = apply_rope(qkv[:, : h + kvh], cos, sin)  # one rotation for q and k together
                q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kvh:]
                write_kv(kv_cache, k, v, meta.slot_mapping)
        else:
            q, k = self.q_proj(x).view(t, h, d), self.k_proj(x).view(t, kvh, d)  # [T, h, d], [T, kvh, d]
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = self.v_proj(x).view(t, kvh, d)
            write_kv(kv_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, kv_cache, meta, self.scale)  # [T, h, d]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


SILU, GELU_TANH = "silu", "gelu_tanh"  # the gated MLP's activations: SwiGLU, GeGLU (gemma3)
_ACTIVATIONS = {"silu": SILU, "swish": SILU, "gelu_pytorch_tanh": GELU_TANH, "gelu_tanh": GELU_TANH}


def activation_of(config: ModelConfig) -> str:
    """The gated MLP's activation kind (SILU or GELU_TANH) for the config's hidden_act."""
    act = _ACTIVATIONS.get(config.hidden_act)
    if act is None:
        raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported (silu, gelu_pytorch_tanh)")
    return act


class MLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh-GELU (gemma3's GeGLU)."""

    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size  # a MoE expert's own width (model/moe.py)
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # set by model.fuse.fuse_projections
        self.act = activation_of(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gelu = self.act == GELU_TANH
        if self.gate_up_proj is not None:  # [T, 2 I] -> act(gate) * up: [T, I], the kernel the decode plan calls
            return self.down_proj((gelu_tanh_mul if gelu else silu_mul)(self.gate_up_proj(x)))
        g = self.gate_proj(x)
        return self.down_proj((F.gelu(g, approximate="tanh") if gelu else F.silu(g)) * self.up_proj(x))


# The norms of a layer by role, in the residual-stream form (hidden = residual + x; `add`: residual += x):
#
#     h = norms.input(add x)            (layer 0: the embeddings are the stream)
#     a = attn(h);  a = norms.attn_out(a) where the layer has one
#     h = norms.mlp(add a)
#     x = mlp(h);   x = norms.mlp_out(x) where the layer has one         -> (x, residual); the next norm adds x
#
# Each architecture names them as HF does (module names are checkpoint names): pre-norm layers (llama and most)
# have input and mlp; gemma3's "sandwich" layers all four.
PRE_NORM = ("input_layernorm", None, "post_attention_layernorm", None)
SANDWICH = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclasses.dataclass(frozen=True)
class LayerNorms:
    """A decoder layer's norms by role (see PRE_NORM above): input and mlp always, attn_out and mlp_out or None."""

    input: RMSNorm
    attn_out: RMSNorm | None
    mlp: RMSNorm
    mlp_out: RMSNorm | None

    def present(self) -> list[RMSNorm]:
        return [n for n in (self.input, self.attn_out, self.mlp, self.mlp_out) if n is not None]


class DecoderLayer(nn.Module):
    """One decoder layer of every architecture: norms by role (PRE_NORM or SANDWICH, from the config), attention,
    and a dense MLP or routed experts. This is the layer's one definition: the decode plan and its C++ loop
    (engine/decode_plan.py) and the training forward (train/decoder.py) read `norms()`, `self_attn` and `mlp`
    and run the same sequence."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        names = SANDWICH if config.sandwich_norms else PRE_NORM
        norm = norm_class(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self._norm_names = names
        # registered in forward order (input, attention, its output norm, the MLP's, MLP, its output norm)
        setattr(self, names[0], norm(h, eps))
        self.self_attn = Attention(config, layer_idx)
        for name in names[1:3]:
            if name is not None:
                setattr(self, name, norm(h, eps))
        if config.is_moe_layer(layer_idx):  # mixtral / qwen2_moe / qwen3_moe: routed experts for the MLP
            from brisk.model.moe import SparseMoeBlock

            self.mlp: nn.Module = SparseMoeBlock(config, layer_idx)
        else:
            self.mlp = MLP(config)
        if names[3] is not None:
            setattr(self, names[3], norm(h, eps))

    def norms(self) -> LayerNorms:
        return LayerNorms(*(None if n is None else getattr(self, n) for n in self._norm_names))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream without it), as in vLLM.

        The hidden state is residual + x; each residual add is fused into the norm that follows it, which
        updates `residual` in place. The first layer gets residual None: the embeddings are the stream.
        """
        norms = self.norms()
        if residual is None:
            residual = x  # [T, hidden] from the embedding lookup: a fresh tensor, ours to update in place
            x = norms.input(x)
        else:
            x, residual = norms.input(x, residual)
        x = self.self_attn(x, cos, sin, meta, kv_cache)
        if norms.attn_out is not None:
            x = norms.attn_out(x)
        x, residual = norms.mlp(x, residual)
        x = self.mlp(x)
        if norms.mlp_out is not None:
            x = norms.mlp_out(x)
        return x, residual


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # built around an empty weight: nn.Embedding's own random init, run on the meta device, goes through
        # torch's reference decompositions and imports torch._dynamo (3-19 s of every start-up); the checkpoint's
        # tensor replaces the weight anyway
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm: RMSNorm = norm_class(config)(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 / Qwen3 / Phi3. Build on the meta device, fill with `load_weights`, then `init_rope`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None
        self.local_rope: RotaryEmbedding | None = None  # gemma3's sliding layers: their own RoPE base
        self.sliding_window = config.sliding_window
        # gemma3 scales the embeddings by sqrt(hidden_size), rounded to the model dtype as HF does
        self.embed_scale = config.hidden_size**0.5 if config.is_gemma else None

    def init_rope(self, max_position: int, device: torch.device | str = "cpu") -> None:
        self.rope = RotaryEmbedding(self.config, max_position, device)
        if LOCAL_ROPE in self.config.rope_tables:
            local = dataclasses.replace(self.config, rope_theta=self.config.rope_local_base_freq or 10_000.0,
                                        rope_scaling=None)
            self.local_rope = RotaryEmbedding(local, max_position, device)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kvh, d]
        context_lens: torch.Tensor | None = None,  # [T] per-token sequence length, for dynamic RoPE only
    ) -> torch.Tensor:
        """The module path: every layer's modules in order. Faster paths (the decode plan, its C++ loop,
        torch.compile) run from outside (engine/executor.py) and share the prologue and the head with it."""
        x, cos, sin = self.prologue(input_ids, positions, meta, context_lens)
        return self.compute_logits(self.run_layers(x, cos, sin, meta, kv_caches), meta)

    def prologue(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 context_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What every execution path does before the first layer: (embeddings [T, hidden], cos, sin [T, d/2]).

        (StreamingLLM's sink rotation is part of the metadata, filled where it is built: ops/metadata.py.)"""
        cos, sin = self.cos_sin(positions, context_lens)  # [T, d/2]; several tables: [tables, T, d/2]
        return self.embed(input_ids), cos, sin  # [T, hidden]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] -> the first layer's input [..., hidden]: the embeddings (gemma3: times sqrt(hidden))."""
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def cos_sin(self, positions: torch.Tensor, context_lens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of `positions` [T]: cos, sin [T, d/2]; a model with several tables (config.rope_tables: gemma3's
        global and local, smollm3's global and the identity of its NoPE layers) stacks them: [tables, T, d/2],
        and each attention picks its own (Attention.rope_index)."""
        assert self.rope is not None, "call init_rope() after loading weights"
        cos, sin = self.rope.cos_sin(positions, context_lens)
        tables = self.config.rope_tables
        if len(tables) == 1:
            return cos, sin
        coss, sins = [], []
        for kind in tables:
            if kind == LOCAL_ROPE:
                assert self.local_rope is not None
                c, s = self.local_rope.cos_sin(positions, context_lens)
            elif kind == NO_ROPE:  # cos 1, sin 0: the rotation leaves q and k exactly as they are
                c, s = torch.ones_like(cos), torch.zeros_like(sin)
            else:
                c, s = cos, sin
            coss.append(c)
            sins.append(s)
        return torch.stack(coss), torch.stack(sins)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Embeddings [T, hidden] -> the last layer's output after the final norm: [T, hidden], ready for
        compute_logits."""
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, meta, kv_cache)
        if residual is None:  # no layers
            return self.model.norm(x)
        x, _ = self.model.norm(x, residual)  # the last residual add, fused into the final norm
        return x

    def compute_logits(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """hidden: [T, hidden], final-normed (from `run_layers`) -> logits of the rows that need them."""
        if meta.logits_indices is not None:
            hidden = hidden.index_select(0, meta.logits_indices)  # [N, hidden]
        logits = self.lm_head(hidden)  # [N, vocab]
        cap = self.config.final_logit_softcapping
        if cap:  # gemma: cap * tanh(logits / cap)
            logits = torch.tanh(logits / cap) * cap
        return logits
