"""The decoder's parts as differentiable functions of [B, T, ...] tensors, for the training forward (forward.py).

Each function takes a serving module (model/llama.py, model/moe.py) and applies its own weights with plain
PyTorch ops. What differs between architectures is read from the modules (the data model/llama.py builds them
from), never from the architecture's name, so a layer trains exactly as it serves:

    part          module data                  training math
    norm          RMSNorm                      x / rms(x) * w            (float32 statistics, HF's RMSNorm)
                  .round_once, .offset         x / rms(x) * (w + 1)      (gemma3's: all in float32, then the dtype)
    q / k norm    attn.q_norm / k_norm         the layer's norm over each head's d dims, before RoPE (qwen3, gemma3)
    attention     Attention                    causal SDPA with attn.scale; the layer's window and RoPE table come
                                               in `LayerInputs`
    feed-forward  MLP .act                     down(silu(gate(x)) * up(x)), or tanh-GELU (gemma3)
                  SparseMoeBlock               model/moe.py's route + grouped_experts over these MLPs, and
                                               qwen2_moe's sigmoid-gated shared expert
    layer         DecoderLayer.norms()         x += [attn_out](attn(input(x))); x += [mlp_out](mlp(mlp(x)))
                                               (the bracketed norms where the layer has them: gemma3's sandwich)

The mixture of experts reuses model/moe.py's functions as they are: `route` (softmax in float32, top-k, each
architecture's renormalisation) and `grouped_experts` (the routed rows gathered by index_select, one call per
expert over its rows, scattered back by index_add_), all of them differentiable. A token's gradient reaches the
k experts it was routed to and, through the routing weights, the router; the top-k choice itself has none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from brisk.model.llama import GELU_TANH, MLP, Attention, DecoderLayer, RMSNorm
from brisk.model.moe import SparseMoeBlock, grouped_experts, route
from brisk.model.rope import apply_rope
from brisk.ops.fused import rms_norm_reference


@dataclass
class LayerInputs:
    """What one layer's attention needs besides the stream: its RoPE table and its mask."""

    cos: torch.Tensor  # [T, d/2] (the layer's own table: gemma3's local layers have theirs)
    sin: torch.Tensor  # [T, d/2]
    mask: torch.Tensor | None  # [T, T] bool (a sliding window shorter than T), or None: plain causal


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A float nn.Linear as F.linear (a kernel-backed subclass has no backward); a module that trains as it is
    (LoRA-wrapped, a frozen quantized base) by its own forward."""
    if getattr(module, "trains_as_module", False):
        return module(x)
    return F.linear(x, module.weight, module.bias)


def rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """x [..., D] normalized over D as `norm` does it at inference (Gemma's 1 + w in float32, see above)."""
    if norm.round_once:  # all in float32, rounded once (gemma3's 1 + w)
        return F.rms_norm(x.float(), norm.weight.shape, norm.weight.float() + norm.offset, norm.eps).to(x.dtype)
    return rms_norm_reference(x, norm.weight, norm.eps)


def attention(attn: Attention, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
    """x [B, T, hidden] (normed) -> the attention's output projection [B, T, hidden]."""
    b, t, _ = x.shape
    h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = linear(attn.q_proj, x).view(b, t, h, d)  # [B, T, h, d]
    k = linear(attn.k_proj, x).view(b, t, kvh, d)  # [B, T, kvh, d]
    v = linear(attn.v_proj, x).view(b, t, kvh, d)
    if attn.q_norm is not None:  # qwen3 / gemma3: each head's d dims normed before RoPE
        q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
    # apply_rope takes [T, heads, d] with cos, sin [T, d/2]; a leading batch dim broadcasts
    q, k = apply_rope(q, inputs.cos, inputs.sin), apply_rope(k, inputs.cos, inputs.sin)
    o = F.scaled_dot_product_attention(  # [B, h, T, d]; kv heads shared by h / kvh query heads each
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=inputs.mask,
        is_causal=inputs.mask is None, scale=attn.scale, enable_gqa=h != kvh)
    return linear(attn.o_proj, o.transpose(1, 2).reshape(b, t, h * d))


def mlp(module: MLP, x: torch.Tensor) -> torch.Tensor:
    """A gated MLP: down(act(gate(x)) * up(x)), act tanh-GELU for Gemma's, SiLU otherwise. x [..., hidden]."""
    act = partial(F.gelu, approximate="tanh") if module.act == GELU_TANH else F.silu
    return linear(module.down_proj, act(linear(module.gate_proj, x)) * linear(module.up_proj, x))


def moe(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """x [B, T, hidden] -> the routed experts' weighted sum (+ qwen2_moe's gated shared expert), as
    SparseMoeBlock.forward computes it (module docstring)."""
    rows = x.reshape(-1, x.shape[-1])  # [B*T, H]: routing is per token, batch and time alike
    weights, ids = route(F.linear(rows, block.gate.weight), block.top_k, block.normalize)  # [N, k] x 2
    if not block.float32_weights:
        weights = weights.to(rows.dtype)
    experts: list[Callable[[torch.Tensor], torch.Tensor]] = [partial(mlp, e) for e in block.experts]
    out = grouped_experts(rows, weights, ids, experts)  # [N, H]
    if block.shared_expert is not None:
        gate = torch.sigmoid(F.linear(rows, block.shared_expert_gate.weight))  # [N, 1]
        out = out + gate * mlp(block.shared_expert, rows)
    return out.view(x.shape)


def feed_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return moe(module, x) if isinstance(module, SparseMoeBlock) else mlp(module, x)


def layer_forward(layer: DecoderLayer, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
    """x [B, T, hidden] (the residual stream) -> the stream after this layer's attention and feed-forward."""
    norms = layer.norms()
    a = attention(layer.self_attn, rms_norm(norms.input, x), inputs)
    x = x + (a if norms.attn_out is None else rms_norm(norms.attn_out, a))
    f = feed_forward(layer.mlp, rms_norm(norms.mlp, x))
    return x + (f if norms.mlp_out is None else rms_norm(norms.mlp_out, f))
