"""LLM.int8() (Dettmers et al., "LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale", NeurIPS 2022):
vector-wise int8 with a mixed-precision decomposition of the outlier features.

    weights:      int8 per output row (absmax / 127), rounded once here (RTN's 8-bit symmetric format)
    activations:  at run time, per forward: the input columns O = {j : max_t |x_tj| > threshold} are multiplied in
                  float32; the rest is rounded to int8 per token and goes through the integer GEMM (ops/w8a8.py
                  llm_int8_linear); y = x_O W_Oᵀ + int8 part.

The threshold. bitsandbytes fixes it at 6.0 (`llm_int8_threshold`), tuned on models of 6.7B parameters and more,
whose emergent outlier features reach 20-60 while the rest stay below ~2. Small models have no such gap: on
SmolLM2-135M the norms' outputs carry channels of 2-5 that never cross 6 but still stretch each token's int8 scale
(+1.6% perplexity against int8 weight-only's +0.02%). So by default (`threshold=None`, "auto") it is calibrated:
the largest value of THRESHOLD_GRID at which the model's next-token distributions on the calibration text, with
every decoder linear on LLM.int8(), stay within `tolerance` (0.001 nats a token of KL, ~0.1% perplexity) of the
same model with the int8 weights and float activations (`search_threshold`), each calibration sample one forward
(`fake_llm_int8`, as the layer computes it). A call of fewer rows takes out fewer columns (a decode row: only its
own), so its int8 part is coarser than the search saw: at 2.0 a 1,024-token forward of SmolLM2-135M runs 37% of
down_proj's inputs in float, a single row 0.9%. A fixed `threshold=6.0` is bitsandbytes' rule.

The set O changes with every input, so it is not stored; the threshold is (`method_config.threshold`, with the
search's KL per threshold in `method_config.search`). The quantize command reports the outliers on the calibration
text (`outliers`: per linear, how many distinct columns crossed the threshold in any calibration forward, and the
most in one forward) to say where the decomposition works, and records them in the checkpoint's `method_config`.
Calibration does not change any weight: the walk is only for the statistics, on the inputs the already rounded
blocks produce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from brisk.console import progress_bar
from brisk.model.loader import LoadedModel
from brisk.ops.w8a8 import quantize_rows
from brisk.quant import primitives
from brisk.quant.awq import rtn_codes
from brisk.quant.calib import BlockContext
from brisk.quant.checkpoint import encode_layer
from brisk.quant.config import LayerQuant
from brisk.quant.smoothquant import W8
from brisk.quant.support import DENSE_ARCHITECTURES, MethodSupport

SUPPORT = MethodSupport("llm-int8", DENSE_ARCHITECTURES)  # observes the linears' inputs, folds nothing

THRESHOLD_GRID = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5)  # tried largest first: the fewest float columns
KL_TOLERANCE = 0.001  # nats a token LLM.int8() may move the outputs from int8 weight-only rounding's (~0.1% ppl)


@dataclass
class LLMInt8Config:
    threshold: float | None = None  # fixed, or None: searched on the calibration text (then filled in)
    tolerance: float = KL_TOLERANCE
    # filled in: the search's KL per threshold of the grid (nats a token), and per
    # module {"columns": distinct outlier columns over the calibration forwards, "max_per_forward": the most in one}
    search: dict[str, float] = field(default_factory=dict)
    outliers: dict[str, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.threshold is not None and not self.threshold > 0:
            raise ValueError(f"the LLM.int8() outlier threshold must be positive (bitsandbytes uses 6.0), got "
                             f"{self.threshold}")
        if not self.tolerance >= 0:
            raise ValueError(f"the KL tolerance must be >= 0, got {self.tolerance}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class OutlierObserver:
    """Each calibration forward's per-column max |x|, to count the outlier columns once the threshold is known."""

    def __init__(self) -> None:
        self.col_max: list[torch.Tensor] = []  # [K] per forward

    def update(self, x: torch.Tensor) -> None:
        self.col_max.append(x.reshape(-1, x.shape[-1]).abs().amax(0).float())

    def counts(self, threshold: float) -> dict[str, int]:
        hits = torch.stack(self.col_max) > threshold  # [F, K]
        return {"columns": int(hits.any(0).sum()), "max_per_forward": int(hits.sum(1).max())}


def fake_llm_int8(x: torch.Tensor, weight: torch.Tensor, threshold: float) -> torch.Tensor:
    """x [..., K] @ weight [N, K]ᵀ as the LLM.int8() layer computes one forward (ops/w8a8.py llm_int8_linear): the
    columns over `threshold` in any row in float, the rest rounded to int8 with each row's scale."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).float()
    out = (x.abs().amax(0) > threshold)[None, :]  # [1, K]
    xq, xs = quantize_rows(x.masked_fill(out, 0.0))
    return ((xq.float() * xs[:, None] + x * out) @ weight.float().t()).view(*shape[:-1], -1)


def llm_int8_apply(plan: dict[str, LayerQuant], encoded: dict[str, dict[str, torch.Tensor]],
                   observers: dict[str, OutlierObserver]) -> Callable[[BlockContext], None]:
    """The per-block step for calib.run_layerwise: record the per-column maxima of every planned linear's input
    (into `observers`), then round its weight to int8 per row (into the model, for the next block's inputs and for
    the threshold search, and into `encoded`)."""
    def apply(ctx: BlockContext) -> None:
        linears = ctx.linears()
        names = [n for n in linears if f"{ctx.prefix}.{n}" in plan]
        if not names:
            return
        ctx.status("outliers")
        seen = ctx.observe(names, lambda _n, _m: OutlierObserver())
        for name in names:
            full = f"{ctx.prefix}.{name}"
            obs = seen[name]
            assert isinstance(obs, OutlierObserver)
            observers[full] = obs
            module = linears[name]
            codes, scale, zero = rtn_codes(module.weight.detach().float(), W8)
            module.weight.data.copy_(primitives.dequantize(codes, scale, zero).to(module.weight.dtype))
            encoded[full] = encode_layer(codes, scale, zero, W8)
    return apply


def threshold_divergence(loaded: LoadedModel, ids: torch.Tensor, plan: dict[str, LayerQuant],
                         thresholds: tuple[float, ...] = THRESHOLD_GRID, progress: bool = True) -> dict[float, float]:
    """Mean KL(weights only || LLM.int8() at t) in nats a token over the calibration samples ids [N, L], for each t:
    every planned decoder linear computing as LLM.int8() (`fake_llm_int8`, one forward a sample) against the same
    model with float activations. A paired measure, far less noisy than a perplexity difference on a few thousand
    tokens; to first order it is what the perplexity's log rises by."""
    from brisk.eval.ppl import sequence_logits

    modules = dict(loaded.model.named_modules())
    linears = [modules[n] for n in plan if n.startswith("model.layers.") and isinstance(modules.get(n), nn.Linear)]
    kl = dict.fromkeys(thresholds, 0.0)
    with progress_bar("LLM.int8() threshold", ids.shape[0], enabled=progress) as advance:
        for row in ids:
            base = F.log_softmax(sequence_logits(loaded, row), -1)  # [L, V]
            for t in thresholds:
                def hook(m: nn.Module, args: tuple[torch.Tensor, ...], _out: torch.Tensor, t: float = t
                         ) -> torch.Tensor:
                    y = fake_llm_int8(args[0], m.weight, t)
                    return (y if m.bias is None else y + m.bias.float()).to(args[0].dtype)
                hooks = [m.register_forward_hook(hook) for m in linears]
                try:
                    logp = F.log_softmax(sequence_logits(loaded, row), -1)
                finally:
                    for h in hooks:
                        h.remove()
                kl[t] += float((base.exp() * (base - logp)).sum())
            advance(1)
    return {t: v / ids.numel() for t, v in kl.items()}


def search_threshold(loaded: LoadedModel, ids: torch.Tensor, plan: dict[str, LayerQuant], config: LLMInt8Config,
                     progress: bool = True) -> float:
    """The largest threshold of THRESHOLD_GRID whose divergence from the int8-weights, float-activations model
    is at most `config.tolerance` nats a token (the smallest when none is); fills `config.search`."""
    kl = threshold_divergence(loaded, ids, plan, THRESHOLD_GRID, progress)
    config.search = {f"{t:g}": v for t, v in kl.items()}
    return next((t for t in THRESHOLD_GRID if kl[t] <= config.tolerance), THRESHOLD_GRID[-1])


def outlier_summary(config: LLMInt8Config, top: int = 8) -> list[str]:
    """Lines for the quantize command: the threshold (and its search), how many linears saw outliers, and the ones
    with the most columns."""
    assert config.threshold is not None, "the threshold is chosen before the summary"
    stats = config.outliers
    hit = {k: v for k, v in stats.items() if v["columns"]}
    lines = []
    if config.search:
        tried = ", ".join(f"{k}: {v:.5f}" for k, v in config.search.items())
        lines.append(f"LLM.int8() threshold {config.threshold:g}: the largest whose outputs stay within "
                     f"{config.tolerance:g} nats a token (KL) of int8 weights with float activations on the "
                     f"calibration text ({tried})")
    lines.append(f"LLM.int8() outliers (|x| > {config.threshold:g}) on the calibration text: {len(hit)} of "
                 f"{len(stats)} linears, {sum(v['columns'] for v in hit.values())} input columns in all")
    for name, v in sorted(hit.items(), key=lambda kv: -kv[1]["columns"])[:top]:
        lines.append(f"  {name}: {v['columns']} columns (at most {v['max_per_forward']} in one forward)")
    return lines
