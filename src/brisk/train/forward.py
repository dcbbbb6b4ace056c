"""The training forward: a brisk decoder's own weights over [B, T] token batches, with autograd.

The inference forward (model/llama.py) runs flattened tokens over a paged KV cache and custom kernels that
have no backward. Training needs none of that: every sequence of a batch has the same length and starts at
position 0, so attention is plain causal SDPA. This function walks `model.model.layers` and applies each
module's weights with differentiable PyTorch ops, the same math as the module path (HF RMSNorm with float32
statistics, rotate-half RoPE, grouped-query attention, SiLU-gated MLP), so a model trained here is saved and
served by the ordinary engine with no conversion.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from brisk.model.llama import DecoderLayer, LlamaForCausalLM
from brisk.model.rope import apply_rope
from brisk.ops.fused import rms_norm_reference
from brisk.ops.metadata import causal_mask

TRAINABLE_ARCHITECTURES = ("llama", "mistral", "qwen2")


class UntrainableModelError(ValueError):
    """The model cannot be run by the training forward (fused, quantized or unknown layers)."""


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, T, V] (None when the head was left to the loss)
    hidden_states: list[torch.Tensor] | None  # [B, T, hidden] after each layer (residual stream), if asked
    last_hidden: torch.Tensor  # [B, T, hidden] after the final norm: the head's input


def check_trainable(model: LlamaForCausalLM) -> None:
    """Raise UntrainableModelError unless every layer is a plain (unfused, float) Llama-family layer."""
    arch = model.config.architecture
    if arch not in TRAINABLE_ARCHITECTURES:
        raise UntrainableModelError(f"training supports {', '.join(TRAINABLE_ARCHITECTURES)}, not {arch!r}")
    if model.rope is None:
        raise UntrainableModelError("the model has no RoPE tables; load it with brisk.model.loader.load_model")
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None or mlp.gate_up_proj is not None:
            raise UntrainableModelError("the model's projections are fused; load it with load_model(..., fuse=False)")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _check_linear(getattr(attn, name), f"model.layers.{i}.self_attn.{name}")
        for name in ("gate_proj", "up_proj", "down_proj"):
            _check_linear(getattr(mlp, name), f"model.layers.{i}.mlp.{name}")
    _check_linear(model.lm_head, "lm_head")
    embed = model.model.embed_tokens
    if not isinstance(embed, nn.Embedding) and not getattr(embed, "trains_as_module", False):
        raise UntrainableModelError("the embedding table is quantized; train a float checkpoint")


def _check_linear(module: nn.Module, name: str) -> None:
    if getattr(module, "trains_as_module", False):  # a LoRA-wrapped or frozen quantized base (brisk/lora)
        return
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Linear) or not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise UntrainableModelError(f"{name} is a {type(module).__name__}, not a float linear layer: train a float "
                                    "checkpoint (quantize after training)")
    if weight.layout != torch.strided:
        raise UntrainableModelError(f"{name} is stored sparse; load the model with sparse=False")


def _linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if getattr(module, "trains_as_module", False):
        return module(x)
    return F.linear(x, module.weight, module.bias)


def _layer_forward(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """x: [B, T, hidden] (the residual stream) -> the stream after this layer's attention and MLP."""
    attn, mlp = layer.self_attn, layer.mlp
    b, t, _ = x.shape
    h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    y = rms_norm_reference(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
    # apply_rope takes [T, heads, d] with cos, sin [T, d/2]; a leading batch dim broadcasts
    q = apply_rope(_linear(attn.q_proj, y).view(b, t, h, d), cos, sin)  # [B, T, h, d]
    k = apply_rope(_linear(attn.k_proj, y).view(b, t, kvh, d), cos, sin)  # [B, T, kvh, d]
    v = _linear(attn.v_proj, y).view(b, t, kvh, d)
    o = F.scaled_dot_product_attention(  # [B, h, T, d]; kv heads shared by h / kvh query heads each
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
        scale=attn.scale, enable_gqa=h != kvh)
    x = x + _linear(attn.o_proj, o.transpose(1, 2).reshape(b, t, h * d))
    y = rms_norm_reference(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
    return x + _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, y)) * _linear(mlp.up_proj, y))


def causal_lm_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, *, output_hidden_states: bool = False,
                      activation_checkpointing: bool = False, head: bool = True) -> ForwardOutput:
    """input_ids: [B, T] (every row from position 0) -> logits [B, T, V] in the weights' dtype (or autocast's).

    head=False stops at the final norm (logits None): losses.head_loss then forms the logits a chunk at a time.

    activation_checkpointing recomputes each layer in the backward instead of keeping its activations
    (memory ~ one layer instead of all of them, for about a third more compute).
    """
    assert input_ids.dim() == 2, f"input_ids must be [B, T], got {tuple(input_ids.shape)}"
    assert model.rope is not None, "call init_rope() after loading weights"
    t = input_ids.shape[1]
    positions = torch.arange(t, device=input_ids.device)
    cos, sin = model.rope.cos_sin(positions)  # [T, d/2]; the static table (dynamic NTK is plain below its limit)
    window = model.config.sliding_window
    mask = causal_mask(t, t, window).to(input_ids.device) if window is not None and window < t else None  # [T, T]
    x = model.model.embed_tokens(input_ids)  # [B, T, hidden]
    hidden_states: list[torch.Tensor] | None = [] if output_hidden_states else None
    for layer in model.model.layers:
        if activation_checkpointing and torch.is_grad_enabled():
            x = checkpoint(_layer_forward, layer, x, cos, sin, mask, use_reentrant=False)
        else:
            x = _layer_forward(layer, x, cos, sin, mask)
        if hidden_states is not None:
            hidden_states.append(x)
    x = rms_norm_reference(x, model.model.norm.weight, model.model.norm.eps)
    return ForwardOutput(logits=_linear(model.lm_head, x) if head else None, hidden_states=hidden_states,
                         last_hidden=x)
