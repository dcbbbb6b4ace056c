"""Load-time fusion: q/k/v projections into one matmul, gate/up projections into another.

Applied from outside the model (model code stays plain; checkpoints keep HF names). One wide matmul instead of
three reads the same bytes but pays one op's overhead instead of three, and at batch 1 the per-op overhead is
a real share of a decode step. Only plain `nn.Linear` layers are fused: a layer swapped for a quantized or
sharded one keeps its own module.
"""

from __future__ import annotations

import torch
from torch import nn

from brisk.model.llama import LlamaForCausalLM


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
