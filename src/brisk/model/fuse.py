"""Load-time fusion: q/k/v projections into one matmul, gate/up projections into another.

Applied from outside the model (model code stays plain; checkpoints keep HF names). One wide matmul instead of
three reads the same bytes but pays one op's overhead instead of three, and at batch 1 the per-op overhead is
a real share of a decode step. Only plain `nn.Linear` layers are fused: a layer swapped for a quantized or
sharded one keeps its own module.
"""

from __future__ import annotations

import torch
from torch import nn

from brisk.model.config import ModelConfig
from brisk.model.llama import LlamaForCausalLM


class FusedTensorError(ValueError):
    """A checkpoint's fused qkv_proj / gate_up_proj tensor does not have the rows its config implies."""


def split_fused_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi3's checkpoints store `self_attn.qkv_proj` ([q heads | k heads | v heads] rows) and `mlp.gate_up_proj`
    ([gate | up] rows); split them into HF's q/k/v_proj and gate/up_proj names in place, so the model, the
    quantizers and fuse_projections see one layout. Returns `tensors`."""
    q, kv, inter = (config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim,
                    config.intermediate_size)
    splits = {"self_attn.qkv_proj.": (("self_attn.q_proj.", q), ("self_attn.k_proj.", kv), ("self_attn.v_proj.", kv)),
              "mlp.gate_up_proj.": (("mlp.gate_proj.", inter), ("mlp.up_proj.", inter))}
    for name in [n for n in tensors if any(f".{fused}" in n for fused in splits)]:
        fused = next(f for f in splits if f".{f}" in name)
        parts = splits[fused]
        t = tensors[name]
        rows = sum(n for _, n in parts)
        if t.shape[0] != rows:
            raise FusedTensorError(f"tensor {name} has {t.shape[0]} rows, expected {rows} "
                                   f"({' + '.join(str(n) for _, n in parts)}) from the model config")
        for (part, _), piece in zip(parts, torch.split(t, [n for _, n in parts]), strict=True):
            tensors[name.replace(fused, part)] = piece.contiguous()
        del tensors[name]
    return tensors


def _concat_linear(layers: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output rows are the given layers' rows, in order."""
    weight = torch.cat([m.weight for m in layers])  # [sum(out), in]
    has_bias = layers[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in layers]), requires_grad=False)
    return fused


def _plain(*modules: nn.Module | None) -> bool:
    return all(type(m) is nn.Linear for m in modules)


def fuse_projections(model: LlamaForCausalLM) -> int:
    """Fuse every layer's q/k/v and gate/up projections in place; returns the number of fusions done."""
    done = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is None and _plain(attn.q_proj, attn.k_proj, attn.v_proj):
            attn.qkv_proj = _concat_linear([attn.q_proj, attn.k_proj, attn.v_proj])
            attn.q_proj = attn.k_proj = attn.v_proj = None
            done += 1
        if mlp.gate_up_proj is None and _plain(mlp.gate_proj, mlp.up_proj):
            mlp.gate_up_proj = _concat_linear([mlp.gate_proj, mlp.up_proj])
            mlp.gate_proj = mlp.up_proj = None
            done += 1
    return done
