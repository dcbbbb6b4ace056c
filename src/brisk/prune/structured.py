"""Structured pruning: remove whole attention head groups, MLP intermediate channels and decoder layers,
giving a smaller *dense* model that saves and loads as an ordinary checkpoint.

What can go (coupled structures, as LLM-Pruner's dependency groups):

    head group g      under GQA a KV head and the r = num_heads / num_kv_heads query heads that read it:
                      q_proj rows of those r heads, k_proj / v_proj rows of KV head g, o_proj columns of the
                      r heads. Removing a query head alone would leave the KV head shared unevenly, so the
                      unit is the group (SmolLM2-135M: 3 groups of 3 query heads).
    MLP channel j     gate_proj row j, up_proj row j, down_proj column j.
    layer i           the whole decoder block (its residual update disappears).

The same number of groups and channels is removed in every kept layer, so the standard Llama config
(num_attention_heads, num_key_value_heads, intermediate_size, num_hidden_layers; head_dim kept explicit)
still describes the result and every loader reads it. The first and last layers are never removed.

Per architecture (prune/support.py): qwen3's and gemma3's q/k norms are per head over head_dim, shared by all
heads, so they keep their shape; gemma3's four sandwich norms act on the hidden size and go only with their
layer; every per-layer field (ModelConfig.per_layer_fields: gemma3's `layer_types`, smollm3's `no_rope_layers`)
loses the entries of dropped layers, so every kept layer keeps its own sliding or global attention and RoPE table;
phi3's fused qkv / gate_up are split at load and cut like q/k/v and gate/up (the checkpoint fuses them again).
Mixture-of-experts models are refused: their MLPs are routed experts.

Importance (activation-based, one calibration pass of the dense model through the shared driver):

    channel j of a linear with input X and weight W:   I_j = ||X_j||^2 * ||W[:, j]||^2
        the energy channel j adds to the linear's output, sum_t ||W[:, j] x_tj||^2, i.e. the output error
        of removing it if channels were uncorrelated. MLP channel j: I_j of down_proj's input channel j.
        Head group g: the sum of o_proj's I_j over the columns of the group's query heads.
    layer i:  block influence 1 - mean_t cos(h_in_t, h_out_t) (ShortGPT, Men et al. 2024): how much the
        block turns the residual stream; a block that barely changes it is cheap to drop.

Lowest importance goes first. No recovery fine-tuning is done (LLM-Pruner follows pruning with LoRA).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from brisk.model.config import ModelConfig
from brisk.model.llama import LlamaForCausalLM
from brisk.prune.masks import PruneConfigError
from brisk.quant.calib import ActStatsObserver, BlockContext, run_layerwise

CHANNEL_MULTIPLE = 64  # kept intermediate size rounded to this, so group-size-64 quantization still applies


@dataclass(frozen=True)
class StructuredPlan:
    """How much goes, per kept layer (groups, channels) and in layers."""

    num_groups_removed: int = 0  # GQA head groups per layer
    num_channels_removed: int = 0  # MLP intermediate channels per layer
    num_layers_removed: int = 0


@dataclass
class StructuredScores:
    group: torch.Tensor  # [L, num_kv_heads]
    channel: torch.Tensor  # [L, intermediate_size]
    layer: torch.Tensor  # [L] block influence


@dataclass
class Removals:
    layers: list[int] = field(default_factory=list)  # removed layer indices (of the original model)
    groups: dict[int, list[int]] = field(default_factory=dict)  # kept layer -> removed head groups
    channels: dict[int, list[int]] = field(default_factory=dict)  # kept layer -> removed MLP channels

    def to_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "head_groups": {str(k): v for k, v in self.groups.items()},
                "num_channels_per_layer": len(next(iter(self.channels.values()), []))}


def count_parameters(config: ModelConfig) -> int:
    """Parameters of the model described by `config` (a tied head counted once; q/k norms and gemma3's extra
    norms included)."""
    return config.num_params


def pruned_config(config: ModelConfig, plan: StructuredPlan, removed_layers: list[int] | None = None
                  ) -> ModelConfig:
    """The config that describes the model after `plan` (head_dim stays what it was). `removed_layers`: which
    layers go, so per-layer fields (gemma3's layer_types, smollm3's no_rope_layers) keep the kept layers' entries;
    None (counting only): the last inner ones."""
    assert not config.is_moe, "structured pruning of mixture-of-experts layers is refused (prune/support.py)"
    r = config.num_attention_heads // config.num_key_value_heads
    n = config.num_hidden_layers
    if removed_layers is None:
        removed_layers = list(range(n - 1 - plan.num_layers_removed, n - 1))
    assert len(removed_layers) == plan.num_layers_removed, f"{removed_layers} vs {plan.num_layers_removed} layers"
    kept = [i for i in range(n) if i not in removed_layers]
    return replace(config, num_hidden_layers=n - plan.num_layers_removed,
                   num_key_value_heads=config.num_key_value_heads - plan.num_groups_removed,
                   num_attention_heads=config.num_attention_heads - r * plan.num_groups_removed,
                   intermediate_size=config.intermediate_size - plan.num_channels_removed,
                   **config.per_layer_fields(kept))


def plan_structured(config: ModelConfig, fraction: float, num_groups: int = 0, num_layers: int = 0,
                    channel_multiple: int = CHANNEL_MULTIPLE) -> StructuredPlan:
    """Remove `fraction` of the model's parameters: `num_groups` head groups per layer and `num_layers` layers
    as asked, MLP channels (the same count per layer, kept size a multiple of `channel_multiple`) for the rest."""
    if not (0.0 < fraction < 1.0):
        raise PruneConfigError(f"structured --sparsity is the fraction of parameters removed, in (0, 1); "
                               f"got {fraction}")
    if not (0 <= num_groups < config.num_key_value_heads):
        raise PruneConfigError(f"--drop-head-groups must be in [0, {config.num_key_value_heads - 1}] (this model has "
                               f"{config.num_key_value_heads} KV head groups), got {num_groups}")
    if not (0 <= num_layers <= config.num_hidden_layers - 2):
        raise PruneConfigError(f"--drop-layers must be in [0, {config.num_hidden_layers - 2}] (the first and last of "
                               f"{config.num_hidden_layers} layers are kept), got {num_layers}")
    total = count_parameters(config)
    partial = StructuredPlan(num_groups_removed=num_groups, num_layers_removed=num_layers)
    rest = fraction * total - (total - count_parameters(pruned_config(config, partial)))
    if rest < 0:
        raise PruneConfigError(f"--drop-head-groups {num_groups} and --drop-layers {num_layers} already remove "
                               f"more than {fraction:.0%} of the parameters; lower them or raise --sparsity")
    kept_layers = config.num_hidden_layers - num_layers
    per_channel = 3 * config.hidden_size * kept_layers
    kept = config.intermediate_size - rest / per_channel
    kept = max(channel_multiple, int(round(kept / channel_multiple)) * channel_multiple)
    return replace(partial, num_channels_removed=max(0, config.intermediate_size - kept))


def structured_scores(model: LlamaForCausalLM, ids: torch.Tensor, batch_size: int = 8,
                      progress: bool = True) -> StructuredScores:
    """Importance of every head group, MLP channel and layer (module docstring), from one driver pass."""
    config = model.config
    d, r = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    groups, channels, layers = [], [], []

    def apply(ctx: BlockContext) -> None:
        ctx.status("observe")
        stats = ctx.observe(["self_attn.o_proj", "mlp.down_proj"], lambda _n, lin: ActStatsObserver(lin.in_features))
        attn, mlp = ctx.block.self_attn, ctx.block.mlp
        o_energy = stats["self_attn.o_proj"].sq_norm() * attn.o_proj.weight.float().pow(2).sum(0)  # [q]
        groups.append(o_energy.view(config.num_key_value_heads, r * d).sum(1))  # [kvh]: group g = heads g*r..
        channels.append(stats["mlp.down_proj"].sq_norm() * mlp.down_proj.weight.float().pow(2).sum(0))  # [I]
        ctx.status("block influence")
        out = ctx.forward()  # [N, L, hidden]
        cos = torch.nn.functional.cosine_similarity(ctx.inputs.float(), out.float(), dim=-1)  # [N, L]
        layers.append(1.0 - cos.mean())

    run_layerwise(model, ids, apply, batch_size=batch_size, progress=progress, label="structured")
    return StructuredScores(group=torch.stack(groups), channel=torch.stack(channels), layer=torch.stack(layers))


def choose_removals(scores: StructuredScores, plan: StructuredPlan) -> Removals:
    """Lowest-importance layers (never the first or last), then per kept layer its lowest groups and channels."""
    num_layers = scores.layer.shape[0]
    inner = torch.arange(1, num_layers - 1)
    order = inner[torch.argsort(scores.layer[1:-1], stable=True)]
    removed_layers = sorted(order[:plan.num_layers_removed].tolist())
    out = Removals(layers=removed_layers)
    for i in range(num_layers):
        if i in removed_layers:
            continue
        g = torch.argsort(scores.group[i], stable=True)[:plan.num_groups_removed]
        c = torch.argsort(scores.channel[i], stable=True)[:plan.num_channels_removed]
        out.groups[i] = sorted(g.tolist())
        out.channels[i] = sorted(c.tolist())
    return out


def _keep(n: int, removed: list[int], unit: int = 1) -> torch.Tensor:
    """Indices of [0, n * unit) that survive when the units listed in `removed` go."""
    alive = torch.ones(n, dtype=torch.bool)
    alive[removed] = False
    return (torch.nonzero(alive).flatten()[:, None] * unit + torch.arange(unit)).flatten()


def apply_removals(model: LlamaForCausalLM, config: ModelConfig, removals: Removals, plan: StructuredPlan
                   ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The smaller model's config and its HF-named tensors (sliced copies; `model` is left unchanged)."""
    d, r = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    new_config = pruned_config(config, plan, removals.layers)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    out = {k: v for k, v in state.items() if not k.startswith("model.layers.")}
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    new_index = 0
    for i in range(config.num_hidden_layers):
        if i in removals.layers:
            continue
        src, dst = f"model.layers.{i}.", f"model.layers.{new_index}."
        kv_rows = _keep(config.num_key_value_heads, removals.groups[i], d)  # surviving k/v rows
        q_rows = _keep(config.num_key_value_heads, removals.groups[i], r * d)  # surviving q rows = o columns
        ch = _keep(config.intermediate_size, removals.channels[i])
        for key, value in state.items():
            if not key.startswith(src):
                continue
            leaf = key[len(src):]
            if leaf.startswith("self_attn.q_proj."):
                value = value[q_rows]
            elif leaf.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
                value = value[kv_rows]
            elif leaf == "self_attn.o_proj.weight":
                value = value[:, q_rows]
            elif leaf.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
                value = value[ch]
            elif leaf == "mlp.down_proj.weight":
                value = value[:, ch]
            out[dst + leaf] = value.contiguous()
        new_index += 1
    return new_config, out


def mask_removals(model: LlamaForCausalLM, config: ModelConfig, removals: Removals) -> None:
    """Zero, in place, exactly what `apply_removals` cuts away from the outputs' point of view: o_proj columns
    of removed head groups, down_proj columns of removed channels, o_proj and down_proj of removed layers.
    The full-size masked model computes the same function as the smaller one (the test oracle)."""
    d, r = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    for i, layer in enumerate(model.model.layers):
        o, down = layer.self_attn.o_proj.weight.data, layer.mlp.down_proj.weight.data
        if i in removals.layers:
            o.zero_()
            down.zero_()
            continue
        for g in removals.groups[i]:
            o[:, g * r * d:(g + 1) * r * d] = 0
        down[:, removals.channels[i]] = 0
