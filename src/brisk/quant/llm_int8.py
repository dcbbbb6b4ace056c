"""LLM.int8() (Dettmers et al., "LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale", NeurIPS 2022):
vector-wise int8 with a mixed-precision decomposition of the outlier features.

    weights:      int8 per output row (absmax / 127), rounded once here (RTN's 8-bit symmetric format)
    activations:  at run time, per forward: the input columns O = {j : max_t |x_tj| > threshold} (6.0, bitsandbytes'
                  `llm_int8_threshold`) are multiplied in float32; the rest is rounded to int8 per token and goes
                  through the integer GEMM (ops/w8a8.py llm_int8_linear); y = x_O W_Oᵀ + int8 part.

The set O changes with every input, so nothing about it is stored; the quantize command measures it on the
calibration text (`outlier_stats`: per linear, how many distinct columns crossed the threshold in any calibration
forward, and the most in one forward) to say where the decomposition works, and records it in the checkpoint's
`method_config`. Calibration does not change any weight: the walk is only for those statistics, on the inputs the
already rounded blocks produce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from brisk.quant import primitives
from brisk.quant.awq import rtn_codes
from brisk.quant.calib import BlockContext
from brisk.quant.checkpoint import encode_layer
from brisk.quant.config import LayerQuant
from brisk.quant.smoothquant import W8
from brisk.quant.support import DENSE_ARCHITECTURES, MethodSupport

SUPPORT = MethodSupport("llm-int8", DENSE_ARCHITECTURES)  # observes the linears' inputs, folds nothing

DEFAULT_THRESHOLD = 6.0


@dataclass
class LLMInt8Config:
    threshold: float = DEFAULT_THRESHOLD
    # filled in by the calibration walk: module -> {"columns": distinct outlier columns, "max_per_forward": ...}
    outliers: dict[str, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"the LLM.int8() outlier threshold must be positive (bitsandbytes uses 6.0), got "
                             f"{self.threshold}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class OutlierObserver:
    """Which input columns exceed the threshold in each mini-batch (one calibration forward)."""

    def __init__(self, in_features: int, threshold: float) -> None:
        self.threshold = threshold
        self.seen = torch.zeros(in_features, dtype=torch.bool)
        self.max_per_forward = 0

    def update(self, x: torch.Tensor) -> None:
        hit = x.reshape(-1, x.shape[-1]).abs().amax(0) > self.threshold  # [K]
        self.seen |= hit
        self.max_per_forward = max(self.max_per_forward, int(hit.sum()))


def llm_int8_apply(plan: dict[str, LayerQuant], config: LLMInt8Config,
                   encoded: dict[str, dict[str, torch.Tensor]]) -> Callable[[BlockContext], None]:
    """The per-block step for calib.run_layerwise: record the outlier columns of every planned linear's input,
    then round its weight to int8 per row (into the model, for the next block's inputs, and into `encoded`)."""
    def apply(ctx: BlockContext) -> None:
        linears = ctx.linears()
        names = [n for n in linears if f"{ctx.prefix}.{n}" in plan]
        if not names:
            return
        ctx.status("outliers")
        observers = ctx.observe(names, lambda _n, m: OutlierObserver(m.in_features, config.threshold))
        for name in names:
            full = f"{ctx.prefix}.{name}"
            obs = observers[name]
            assert isinstance(obs, OutlierObserver)
            config.outliers[full] = {"columns": int(obs.seen.sum()), "max_per_forward": obs.max_per_forward}
            module = linears[name]
            codes, scale, zero = rtn_codes(module.weight.detach().float(), W8)
            module.weight.data.copy_(primitives.dequantize(codes, scale, zero).to(module.weight.dtype))
            encoded[full] = encode_layer(codes, scale, zero, W8)
    return apply


def outlier_summary(config: LLMInt8Config, top: int = 8) -> list[str]:
    """Lines for the quantize command: how many linears saw outliers, and the ones with the most columns."""
    stats = config.outliers
    hit = {k: v for k, v in stats.items() if v["columns"]}
    lines = [f"LLM.int8() outliers (|x| > {config.threshold:g}) on the calibration text: {len(hit)} of "
             f"{len(stats)} linears, {sum(v['columns'] for v in hit.values())} input columns in all"]
    for name, v in sorted(hit.items(), key=lambda kv: -kv[1]["columns"])[:top]:
        lines.append(f"  {name}: {v['columns']} columns (at most {v['max_per_forward']} in one forward)")
    return lines
