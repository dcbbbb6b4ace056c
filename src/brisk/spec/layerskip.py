"""Choosing which layers the layer-skip draft skips (self-speculative decoding, Zhang et al. 2023 "Draft &
Verify"; LayerSkip, Elhoushi et al. 2024), and where the choice is stored.

The search, on calibration text (default: 192 tokens of the bundled calibration text, brisk.data, from a fixed offset):
  1. One teacher-forced forward of the full model gives its greedy token at every position.
  2. Rank: for each layer except the first and the last (both carry most of the model's work in small
     Llamas), skip it alone and measure the *agreement* — the fraction of positions where the skipped
     model's greedy token equals the full model's. Agreement is what greedy verification accepts: it is the
     acceptance rate α of a draft fed the true prefix.
  3. Grow: skip the m best-ranked layers together, m = 1 .. max_skip, measuring the agreement α_m of each set.
  4. Pick the m >= 1 that maximises the predicted speedup max_γ≥1 E(α_m, γ) / (1 + γ (kept_m / total +
     verify_cost)) (spec.adaptive), the cost model adaptive γ uses at run time. A best value below 1 means
     layer skip cannot pay on this model; the set is still stored, and adaptive γ keeps such drafts near 0.
That is 1 + (L - 2) + max_skip forwards instead of the O(L²) of a full greedy removal; the ranking step is the
approximation (layers are assumed to hurt roughly independently), checked by step 3's measured agreement.

Stored as JSON inside a model folder (brisk_layerskip.json) or next to a .gguf file
(<file>.brisk_layerskip.json); brisk also ships the result for the default model (spec/data/), used when no
file sits next to it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

import torch

from brisk.engine.model_runner import ModelRunner
from brisk.engine.scheduler import ScheduledRequest, SchedulerOutput
from brisk.model.llama import LlamaForCausalLM
from brisk.spec.adaptive import expected_tokens

LAYERSKIP_FILE = "brisk_layerskip.json"


def layerskip_path(model_path: Path) -> Path:
    """Where the searched skip set is stored: inside a model folder, or next to a .gguf file."""
    model_path = Path(model_path)
    if model_path.is_dir():
        return model_path / LAYERSKIP_FILE
    return model_path.with_name(model_path.name + "." + LAYERSKIP_FILE)


def load_skip_layers(model_path: Path) -> list[int]:
    """The stored skip set of a model: next to it, else the one brisk ships for that model file."""
    path = layerskip_path(model_path)
    if path.exists():
        return [int(i) for i in json.loads(path.read_text())["skip_layers"]]
    bundled = resources.files("brisk.spec").joinpath("data", Path(model_path).name + "." + LAYERSKIP_FILE)
    if bundled.is_file():
        return [int(i) for i in json.loads(bundled.read_text())["skip_layers"]]
    raise FileNotFoundError(f"no layer-skip set stored for {model_path} ({path} is missing); run "
                            f"`brisk spec layerskip-search --model {model_path}` first, or pass skip_layers")


@torch.inference_mode()
def greedy_tokens(model: LlamaForCausalLM, token_ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Teacher-forced greedy token at every position: one prefill forward over a private paged cache. [T]"""
    block_size = 16
    num_blocks = -(-len(token_ids) // block_size)
    runner = ModelRunner(model, num_blocks, block_size, dtype)
    sched = SchedulerOutput([ScheduledRequest("calib", list(token_ids), 0, list(range(num_blocks)), 1)])
    ids, positions, meta, ctx = runner.prepare(sched)
    meta.logits_indices = None  # every row's logits
    return runner.executor(ids, positions, meta, runner.kv_caches, ctx).argmax(dim=-1)


@dataclass
class LayerSkipSearch:
    skip_layers: list[int]
    agreement: float  # α of the chosen set
    predicted_speedup: float
    num_layers: int
    calibration: str
    single_layer_agreement: dict[int, float] = field(default_factory=dict)
    prefix_agreement: list[float] = field(default_factory=list)  # α of skipping the m best-ranked, m = 1..


def predicted_speedup(alpha: float, kept_fraction: float, verify_cost: float, max_gamma: int) -> float:
    """max over γ in [1, max_gamma] of E(α, γ) / (1 + γ c): below 1 when this draft cannot pay (adaptive γ then
    falls back to plain decoding at run time)."""
    cost = kept_fraction + verify_cost
    return max(expected_tokens(alpha, g) / (1.0 + g * cost) for g in range(1, max_gamma + 1))


def search_skip_layers(model: LlamaForCausalLM, token_ids: list[int], dtype: torch.dtype, max_skip: int,
                       calibration: str, verify_cost: float = 0.08, max_gamma: int = 4,
                       log=lambda msg: None) -> LayerSkipSearch:
    from brisk.spec.draft_model import layer_skip_model

    num_layers = len(model.model.layers)
    reference = greedy_tokens(model, token_ids, dtype)

    def agreement(skip: list[int]) -> float:
        return float((greedy_tokens(layer_skip_model(model, skip), token_ids, dtype) == reference).float().mean())

    single = {}
    for i in range(1, num_layers - 1):
        single[i] = agreement([i])
        log(f"skip layer {i}: agreement {single[i]:.3f}")
    order = sorted(single, key=lambda i: -single[i])
    best = LayerSkipSearch([], 0.0, 0.0, num_layers, calibration, single)
    for m in range(1, min(max_skip, len(order)) + 1):
        skip = sorted(order[:m])
        alpha = agreement(skip)
        best.prefix_agreement.append(alpha)
        speedup = predicted_speedup(alpha, (num_layers - m) / num_layers, verify_cost, max_gamma)
        log(f"skip {m} layers {skip}: agreement {alpha:.3f}, predicted speedup {speedup:.2f}x")
        if speedup > best.predicted_speedup:
            best.skip_layers, best.agreement, best.predicted_speedup = skip, alpha, speedup
    return best


def save_search(result: LayerSkipSearch, path: Path) -> None:
    data = asdict(result)
    data["single_layer_agreement"] = {str(k): v for k, v in result.single_layer_agreement.items()}
    path.write_text(json.dumps(data, indent=1) + "\n")
