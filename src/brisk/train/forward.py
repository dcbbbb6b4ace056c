"""The training forward: a brisk decoder's own weights over [B, T] token batches, with autograd.

The inference forward (model/llama.py) runs flattened tokens over a paged KV cache and custom kernels that
have no backward. Training needs none of that: every sequence of a batch has the same length and starts at
position 0, so attention is plain causal SDPA. This function walks `model.model.layers` and applies each
module's weights with differentiable PyTorch ops (train/decoder.py), the same math as the module path, so a
model trained here is saved and served by the ordinary engine with no conversion.

Every architecture brisk serves trains: llama, mistral, qwen2, qwen3 (q/k norms), phi3 (its fused checkpoint
tensors are split at load; long-RoPE), gemma3 (sandwich (1 + w) norms, local and global layers, GeGLU, scaled
embeddings, soft-capped logits) and the mixture-of-experts models mixtral, qwen2_moe and qwen3_moe.

The RoPE tables are the model's own for positions 0..T-1 of a T-token window, as the engine computes them for a
T-token sequence: length-dependent variants (phi3's long-RoPE, dynamic NTK) get the window's length, so a window
within phi3's original context rotates with the short factors and a longer one with the long factors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from brisk.model.config import SUPPORTED_ARCHITECTURES
from brisk.model.llama import MLP, LlamaForCausalLM
from brisk.model.moe import SparseMoeBlock
from brisk.ops.metadata import causal_mask
from brisk.train.decoder import LayerInputs, layer_forward, linear, rms_norm

TRAINABLE_ARCHITECTURES = SUPPORTED_ARCHITECTURES


class UntrainableModelError(ValueError):
    """The model cannot be run by the training forward (fused, quantized or unknown layers)."""


@dataclass
class ForwardOutput:
    logits: torch.Tensor | None  # [B, T, V] (None when the head was left to the loss)
    hidden_states: list[torch.Tensor] | None  # [B, T, hidden] after each layer (residual stream), if asked
    last_hidden: torch.Tensor  # [B, T, hidden] after the final norm: the head's input


def check_trainable(model: LlamaForCausalLM) -> None:
    """Raise UntrainableModelError unless every layer is a plain (unfused, float) layer of a served architecture."""
    arch = model.config.architecture
    if arch not in TRAINABLE_ARCHITECTURES:
        raise UntrainableModelError(f"training supports {', '.join(TRAINABLE_ARCHITECTURES)}, not {arch!r}")
    if model.rope is None:
        raise UntrainableModelError("the model has no RoPE tables; load it with brisk.model.loader.load_model")
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        if attn.qkv_proj is not None:
            raise UntrainableModelError("the model's projections are fused; load it with load_model(..., fuse=False)")
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _check_linear(getattr(attn, name), f"model.layers.{i}.self_attn.{name}")
        for path, mlp in _mlps(layer.mlp, f"model.layers.{i}.mlp"):
            if mlp.gate_up_proj is not None:
                raise UntrainableModelError("the model's projections are fused; load it with "
                                            "load_model(..., fuse=False)")
            for name in ("gate_proj", "up_proj", "down_proj"):
                _check_linear(getattr(mlp, name), f"{path}.{name}")
    _check_linear(model.lm_head, "lm_head")
    embed = model.model.embed_tokens
    if not isinstance(embed, nn.Embedding) and not getattr(embed, "trains_as_module", False):
        raise UntrainableModelError("the embedding table is quantized; train a float checkpoint")


def _mlps(module: nn.Module, path: str) -> list[tuple[str, MLP]]:
    """The gated MLPs of a layer's feed-forward: the MLP itself, or a MoE block's experts (and shared expert)."""
    if isinstance(module, SparseMoeBlock):
        return [(f"{path}.{name}", m) for name, m in module.named_modules() if isinstance(m, MLP)]
    return [(path, module)]


def _check_linear(module: nn.Module, name: str) -> None:
    if getattr(module, "trains_as_module", False):  # a LoRA-wrapped or frozen quantized base (brisk/lora)
        return
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Linear) or not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise UntrainableModelError(f"{name} is a {type(module).__name__}, not a float linear layer: train a float "
                                    "checkpoint (quantize after training)")
    if weight.layout != torch.strided:
        raise UntrainableModelError(f"{name} is stored sparse; load the model with sparse=False")


def layer_inputs(model: LlamaForCausalLM, t: int, device: torch.device) -> list[LayerInputs]:
    """Per layer, the RoPE table and the mask of a [B, T] window whose rows all start at position 0.

    A layer's window is config.layer_window(i) (mistral's, phi3's and qwen's for every layer; gemma3's for its
    sliding layers only); gemma3's sliding layers rotate with their own table (model.local_rope)."""
    positions = torch.arange(t, device=device)
    rope = model.rope
    assert rope is not None, "call init_rope() after loading weights"
    context_lens = torch.full((t,), t, device=device) if rope.length_dependent else None
    cos, sin = model.cos_sin(positions, context_lens)  # [T, d/2]; several tables: [tables, T, d/2]
    masks: dict[int | None, torch.Tensor | None] = {}
    out = []
    for i, layer in enumerate(model.model.layers):
        window = model.config.layer_window(i)
        if window not in masks:
            masks[window] = causal_mask(t, t, window).to(device) if window is not None and window < t else None
        index = layer.self_attn.rope_index
        if index is not None:  # each attention picks its table (model/llama.py Attention.rope_index)
            out.append(LayerInputs(cos[index], sin[index], masks[window]))
        else:
            out.append(LayerInputs(cos, sin, masks[window]))
    return out


def head_logits(model: LlamaForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., H] (after the final norm) -> logits [..., V], soft-capped where the model caps them (gemma3)."""
    logits = linear(model.lm_head, hidden)
    cap = model.config.final_logit_softcapping
    return torch.tanh(logits / cap) * cap if cap else logits


def causal_lm_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, *, output_hidden_states: bool = False,
                      activation_checkpointing: bool = False, head: bool = True) -> ForwardOutput:
    """input_ids: [B, T] (every row from position 0) -> logits [B, T, V] in the weights' dtype (or autocast's).

    head=False stops at the final norm (logits None): losses.head_loss then forms the logits a chunk at a time
    (pass it softcap=model.config.final_logit_softcapping).

    activation_checkpointing recomputes each layer in the backward instead of keeping its activations
    (memory ~ one layer instead of all of them, for about a third more compute).
    """
    assert input_ids.dim() == 2, f"input_ids must be [B, T], got {tuple(input_ids.shape)}"
    inputs = layer_inputs(model, input_ids.shape[1], input_ids.device)
    x = model.embed(input_ids)  # [B, T, hidden] (gemma3: times sqrt(hidden), in the model dtype)
    hidden_states: list[torch.Tensor] | None = [] if output_hidden_states else None
    for layer, layer_in in zip(model.model.layers, inputs, strict=True):
        if activation_checkpointing and torch.is_grad_enabled():
            x = checkpoint(layer_forward, layer, x, layer_in, use_reentrant=False)
        else:
            x = layer_forward(layer, x, layer_in)
        if hidden_states is not None:
            hidden_states.append(x)
    x = rms_norm(model.model.norm, x)
    return ForwardOutput(logits=head_logits(model, x) if head else None, hidden_states=hidden_states,
                         last_hidden=x)
