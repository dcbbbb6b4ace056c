"""One pruning run end to end: prune a loaded (unfused) model with a method and write the checkpoint folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from brisk.model.llama import LlamaForCausalLM
from brisk.model.loader import LoadedModel
from brisk.model.save import model_tensors
from brisk.prune import structured as st
from brisk.prune.checkpoint import add_sparsity_config, save_pruned
from brisk.prune.masks import NMPattern, PruneConfigError
from brisk.prune.support import check_prune_supports
from brisk.prune.unstructured import (
    magnitude_prune,
    measured_sparsity,
    prunable_linears,
    sparsegpt_prune_model,
    wanda_prune,
)
from brisk.quant.calib import CalibConfig
from brisk.quant.config import LayerQuant, QuantConfigError, QuantizationConfig


def prune_and_save(loaded: LoadedModel, out: str | Path, method: str, sparsity: float,
                   pattern: NMPattern | None = None, scope: str = "per_layer", bits: int | None = None,
                   group_size: int = 64, sym: bool = False, drop_head_groups: int = 0, drop_layers: int = 0,
                   ids: torch.Tensor | None = None, calib: CalibConfig | None = None, progress: bool = True) -> str:
    """Prune `loaded.model` (changed in place; structured leaves it unchanged) and write `out`; returns a
    one-line summary. ids [num_samples, seq_len]: calibration tokens (every method but magnitude)."""
    model, config = loaded.model, loaded.config
    check_prune_supports(method, config)
    if method != "magnitude" and ids is None:
        raise PruneConfigError(f"method {method} needs calibration ids")
    record: dict[str, Any] = {"method": method, "calibration": calib.to_dict() if calib else None}
    if method == "structured":
        plan = st.plan_structured(config, sparsity, num_groups=drop_head_groups, num_layers=drop_layers)
        assert ids is not None
        scores = st.structured_scores(model, ids, progress=progress)
        removals = st.choose_removals(scores, plan)
        new_config, tensors = st.apply_removals(model, config, removals, plan)
        before, after = st.count_parameters(config), st.count_parameters(new_config)
        record.update(sparsity=sparsity, pattern="structured", importance="activation: ||X_j||^2 ||W[:, j]||^2; "
                      "layers: block influence", removed=removals.to_dict(),
                      num_parameters_before=before, num_parameters_after=after,
                      measured_sparsity=round(1 - after / before, 6))
        save_pruned(out, new_config, loaded.tokenizer, tensors, record, loaded.generation_config)
        return (f"{before / 1e6:.1f}M -> {after / 1e6:.1f}M parameters ({1 - after / before:.1%} removed: "
                f"{plan.num_layers_removed} layers, {plan.num_groups_removed} head groups and "
                f"{plan.num_channels_removed} MLP channels per layer)")

    if pattern is not None:
        sparsity = pattern.sparsity
    packed: dict[str, dict[str, torch.Tensor]] = {}
    unreached: list[str] = []  # MoE: linears of experts no calibration row was routed to
    quant = LayerQuant(bits=bits, group_size=group_size, sym=sym) if bits is not None else None
    check_shapes(model, pattern, quant)
    if method == "magnitude":
        names = magnitude_prune(model, sparsity, pattern, per_row=scope == "per_row")
    elif method == "wanda":
        assert ids is not None
        names = wanda_prune(model, ids, sparsity, pattern, progress=progress, unreached=unreached)
        scope = "per_row"
    elif method == "sparsegpt":
        assert ids is not None
        names, packed = sparsegpt_prune_model(model, ids, sparsity, pattern, quant=quant, progress=progress,
                                              unreached=unreached)
        scope = "per_block"
    else:
        raise PruneConfigError(f"unknown pruning method {method!r}")
    measured = measured_sparsity(model, names)
    record.update(sparsity=sparsity, pattern=str(pattern) if pattern else "unstructured",
                  scope="n:m" if pattern else scope, modules=names, measured_sparsity=round(measured, 6))
    summary = f"{len(names)} linears at {measured:.2%} sparsity ({record['pattern']})"
    if config.is_moe and method != "magnitude":
        # experts no calibration row was routed to were pruned by magnitude (prune/support.py)
        record["experts_by_magnitude"] = sorted({n.rsplit(".", 1)[0] for n in unreached})
        if unreached:
            summary += f", {len(record['experts_by_magnitude'])} experts unreached by calibration (by magnitude)"
    if quant is None:
        save_pruned(out, config, loaded.tokenizer, model_tensors(model, config), record,
                    loaded.generation_config)
        return summary
    from brisk.quant.checkpoint import EMBEDDING, save_quantized
    from brisk.quant.rtn import HEAD_DEFAULT, quantize_layer

    tensors = model_tensors(model, config)
    modules = {}
    for name, parts in packed.items():
        tensors.pop(f"{name}.weight")
        tensors.update({f"{name}.{k}": v for k, v in parts.items()})
        modules[name] = quant
    # embedding / untied head at 8 bits per channel, as brisk quantize does by default
    heads = [EMBEDDING] + ([] if config.tie_word_embeddings else ["lm_head"])
    for name in heads:
        weight = tensors.pop(f"{name}.weight")
        tensors.update({f"{name}.{k}": v for k, v in quantize_layer(weight, HEAD_DEFAULT).items()})
        modules[name] = HEAD_DEFAULT
    qconfig = QuantizationConfig(method="sparsegpt", default=quant, modules=modules)
    save_quantized(out, config, loaded.tokenizer, qconfig, tensors, loaded.generation_config)
    add_sparsity_config(out, record)
    return summary + f", {quant.label} in the same sweep"


def check_shapes(model: LlamaForCausalLM, pattern: NMPattern | None, quant: LayerQuant | None) -> None:
    """Every linear to prune takes the N:M pattern and the quantization groups, checked before calibration (a MoE
    model's experts and shared expert have widths of their own)."""
    for name, module in prunable_linears(model).items():
        k = module.in_features
        if pattern is not None and k % pattern.m:
            raise PruneConfigError(f"--pattern {pattern} needs every input dimension to be a multiple of "
                                   f"{pattern.m}; {name} has {k}")
        if quant is not None:
            try:
                quant.groups(k)
            except QuantConfigError as e:
                raise PruneConfigError(f"--group-size for {name}: {e}") from None
