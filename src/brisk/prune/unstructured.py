"""Unstructured and N:M pruning of a whole model: magnitude, Wanda and SparseGPT.

Every linear layer of the decoder (q/k/v/o, gate/up/down) is pruned to the same sparsity; the embedding and
lm_head are not (Wanda and SparseGPT leave them dense too: the head's errors land directly on the logits).
The model must be unfused (load_model(..., fuse=False)) so module names are the checkpoint's HF names.

    magnitude   |W|, no data. Per layer by default: one threshold over the whole matrix, the baseline both
                papers compare against (scope "per_row" is available as an ablation).
    wanda       |W_ij| * ||X_j||_2 per output row, statistics from one pass of the block on inputs that have
                been through the already pruned blocks (Sun et al. 2023, sec. 3); no weight update.
    sparsegpt   OBS reconstruction (prune/sparsegpt.py) with the Hessian of each linear's inputs, observed in
                GPTQ's true-sequential order (q/k/v, o, gate/up, down), so each stage is calibrated on what
                it receives after the stages before it were pruned.

Calibration comes from the shared driver (quant/calib.py): block by block, each block's inputs are the outputs
of the blocks before it *after* they were pruned.

Mixture-of-experts layers (prune/support.py): every routed expert's gate/up/down and the shared expert are pruned
like an MLP; the router is not. Wanda and SparseGPT hook each expert's linears, so each expert is calibrated on
the rows routed to it; the true-sequential stages group the experts' gate/up, then their down projections. An
expert no calibration row reached is pruned by magnitude (Wanda with uniform norms, SparseGPT with H = I, which
is magnitude pruning without compensation) and counted.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from brisk.model.llama import LlamaForCausalLM
from brisk.prune.masks import NMPattern, magnitude_metric, select_mask, wanda_metric
from brisk.prune.sparsegpt import BLOCK_SIZE, sparsegpt_prune
from brisk.quant.calib import TRUE_SEQUENTIAL, ActStatsObserver, BlockContext, HessianObserver, run_layerwise
from brisk.quant.checkpoint import encode_layer
from brisk.quant.config import LayerQuant

_LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prunable_linears(model: LlamaForCausalLM) -> dict[str, nn.Linear]:
    """HF name -> linear for every projection of every decoder block, in forward order."""
    out = {}
    for name, module in model.model.layers.named_modules(prefix="model.layers"):
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in _LINEAR_SUFFIXES:
            out[name] = module
    fused = [n for n, m in model.named_modules() if n.endswith(("qkv_proj", "gate_up_proj")) and m is not None]
    assert not fused, "prune an unfused model (load_model(..., fuse=False))"
    return out


def prune_stages(ctx: BlockContext) -> list[tuple[str, ...]]:
    """TRUE_SEQUENTIAL over this block's linears, a MoE block's experts included: "mlp.gate_proj" stands for
    every "mlp.<...>.gate_proj" (experts.3, shared_expert), so all experts' gate/up form one stage, their down
    projections the next."""
    present = list(ctx.linears())

    def members(name: str) -> list[str]:
        kind, proj = name.split(".")
        return [n for n in present if n == name or (n.startswith(f"{kind}.") and n.endswith(f".{proj}"))]

    out = [tuple(n for n in present if any(n in members(s) for s in stage)) for stage in TRUE_SEQUENTIAL]
    return [s for s in out if s]


def magnitude_prune(model: LlamaForCausalLM, sparsity: float, pattern: NMPattern | None = None,
                    per_row: bool = False) -> list[str]:
    """Zero the smallest |W| of every decoder linear, in place; returns the pruned module names."""
    linears = prunable_linears(model)
    for module in linears.values():
        w = module.weight.data
        w.masked_fill_(select_mask(magnitude_metric(w), sparsity, pattern, per_row=per_row), 0.0)
    return list(linears)


def wanda_prune(model: LlamaForCausalLM, ids: torch.Tensor, sparsity: float, pattern: NMPattern | None = None,
                batch_size: int = 8, progress: bool = True, unreached: list[str] | None = None) -> list[str]:
    """Wanda, block by block, in place; ids [num_samples, seq_len] calibration tokens. `unreached` collects the
    linears (routed experts') that no calibration row reached: pruned by magnitude."""
    names: list[str] = []

    def apply(ctx: BlockContext) -> None:
        linears = ctx.linears()
        ctx.status("observe")
        observers = ctx.observe(list(linears), lambda _n, lin: ActStatsObserver(lin.in_features))
        for short, module in linears.items():
            ctx.status(f"prune {short}")
            stats = observers[short]
            assert isinstance(stats, ActStatsObserver)
            w = module.weight.data
            norms = stats.sq_norm()
            if stats.num_tokens == 0:  # an expert the router never chose: uniform norms, i.e. |W| per row
                norms = torch.ones_like(norms)
                if unreached is not None:
                    unreached.append(f"{ctx.prefix}.{short}")
            w.masked_fill_(select_mask(wanda_metric(w, norms), sparsity, pattern), 0.0)
            names.append(f"{ctx.prefix}.{short}")

    run_layerwise(model, ids, apply, batch_size=batch_size, progress=progress, label="wanda",
                  moe_experts=model.config.is_moe)
    return names


def sparsegpt_prune_model(model: LlamaForCausalLM, ids: torch.Tensor, sparsity: float,
                          pattern: NMPattern | None = None, quant: LayerQuant | None = None,
                          block_size: int = BLOCK_SIZE, batch_size: int = 8, progress: bool = True,
                          unreached: list[str] | None = None) -> tuple[list[str], dict[str, dict[str, torch.Tensor]]]:
    """SparseGPT, block by block and stage by stage, in place (the weights become the pruned, compensated and,
    with `quant`, dequantized values). Returns the pruned names and, with `quant`, each module's checkpoint
    tensors (qweight, scales[, qzeros]) in the quantized format. `unreached` collects the linears (routed
    experts') that no calibration row reached: pruned with H = I (magnitude, no compensation)."""
    names: list[str] = []
    packed: dict[str, dict[str, torch.Tensor]] = {}

    def apply(ctx: BlockContext) -> None:
        linears = ctx.linears()
        for stage in prune_stages(ctx):
            ctx.status(f"observe {'/'.join(s.rsplit('.', 1)[-1] for s in stage)}")
            observers = ctx.observe(list(stage), lambda _n, lin: HessianObserver(lin.in_features))
            for short in stage:
                ctx.status(f"prune {short}")
                hess = observers[short]
                assert isinstance(hess, HessianObserver)
                module = linears[short]
                full = f"{ctx.prefix}.{short}"
                if hess.num_tokens:
                    hessian = hess.hessian()
                else:  # an expert the router never chose
                    hessian = torch.eye(module.in_features)
                    if unreached is not None:
                        unreached.append(full)
                result = sparsegpt_prune(module.weight.data, hessian, sparsity, pattern,
                                         block_size=block_size, quant=quant)
                module.weight.data.copy_(result.weight.to(module.weight.dtype))
                names.append(full)
                if quant is not None:
                    assert result.codes is not None
                    packed[full] = encode_layer(result.codes, result.scale, result.zero, quant)

    run_layerwise(model, ids, apply, batch_size=batch_size, progress=progress, label="sparsegpt",
                  moe_experts=model.config.is_moe)
    return names, packed


def measured_sparsity(model: LlamaForCausalLM, names: Iterable[str]) -> float:
    """Zeros / weights over the named modules."""
    zeros = total = 0
    for name in names:
        w = model.get_submodule(name).weight
        zeros += int((w == 0).sum())
        total += w.numel()
    return zeros / max(total, 1)
