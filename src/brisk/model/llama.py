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

from brisk.model.config import ModelConfig
from brisk.model.rope import RotaryEmbedding, apply_rope
from brisk.ops.attention import AttentionMetadata, paged_attention, rope_write_kv, write_kv
from brisk.ops.fused import add_rms_norm, rms_norm, rms_norm_qk_heads_, silu_mul


class RMSNorm(nn.Module):
    # a float32 weight on lower-precision rows multiplies in float32 and rounds once (ops.fused.rms_norm_reference):
    # gemma3's norm, whose 1 + w is float32; Llama's applies the weight in the model dtype
    round_once = False

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
        """What multiplies the normalized rows: the weight (Gemma's norm: 1 + weight, model/gemma.py)."""
        return self.weight


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        h, q, kv = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, q, bias=bias)
        self.k_proj = nn.Linear(h, kv, bias=bias)
        self.v_proj = nn.Linear(h, kv, bias=bias)
        self.o_proj = nn.Linear(q, h, bias=False)
        self.qkv_proj: nn.Linear | None = None  # set by model.fuse.fuse_projections (replaces q/k/v_proj)
        # qwen3: RMSNorm over each head's d dims of q and of k, before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_cache: torch.Tensor) -> torch.Tensor:
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


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or config.intermediate_size  # a MoE expert's own width (model/moe.py)
        self.gate_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inter, bias=False)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # set by model.fuse.fuse_projections

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.down_proj(silu_mul(self.gate_up_proj(x)))  # [T, 2 I] -> silu(gate) * up: [T, I]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):  # mixtral / qwen2_moe / qwen3_moe: routed experts for the MLP
            from brisk.model.moe import SparseMoeBlock

            self.mlp: nn.Module = SparseMoeBlock(config, layer_idx)
        else:
            self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream without it), as in vLLM.

        The hidden state is residual + x; each residual add is fused into the norm that follows it, which
        updates `residual` in place. The first layer gets residual None: the embeddings are the stream.
        """
        if residual is None:
            residual = x  # [T, hidden] from the embedding lookup: a fresh tensor, ours to update in place
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, meta, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # built around an empty weight: nn.Embedding's own random init, run on the meta device, goes through
        # torch's reference decompositions and imports torch._dynamo (3-19 s of every start-up); the checkpoint's
        # tensor replaces the weight anyway
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        if config.is_gemma:
            from brisk.model.gemma import GemmaDecoderLayer, GemmaRMSNorm

            self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
            self.norm: RMSNorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
            return
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


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
        if self.config.is_gemma:
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
        cos, sin = self.cos_sin(positions, context_lens)  # [T, d/2]; gemma3: [2, T, d/2]
        return self.embed(input_ids), cos, sin  # [T, hidden]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] -> the first layer's input [..., hidden]: the embeddings (gemma3: times sqrt(hidden))."""
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    def cos_sin(self, positions: torch.Tensor, context_lens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of `positions` [T]: cos, sin [T, d/2]; gemma3 stacks the global and the local table: [2, T, d/2]."""
        assert self.rope is not None, "call init_rope() after loading weights"
        cos, sin = self.rope.cos_sin(positions, context_lens)
        if self.local_rope is None:
            return cos, sin
        cos_l, sin_l = self.local_rope.cos_sin(positions, context_lens)
        return torch.stack((cos, cos_l)), torch.stack((sin, sin_l))

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
