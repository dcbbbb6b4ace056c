"""SmoothQuant (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large Language
Models", ICML 2023): W8A8 with the activations' outlier channels moved into the weights by an equivalent scaling.

Activations of LLMs have a few input channels far larger than the rest, so one int8 scale per token spends most of
its range on them; weights are flat and quantize easily. For linears sharing an input x,

    y = x Wᵀ = (x diag(s)⁻¹) (W diag(s))ᵀ,   s_j = max|X_j|^α / max|W_j|^(1-α)   (paper, eq. 4)

with max|X_j| the channel's largest |activation| over the calibration tokens and max|W_j| the largest |weight| of
input column j over the linears sharing it. α = 0.5 splits the difficulty evenly; the reference uses 0.85 for
Llama-2. The 1/s is folded into what produced x (the same groups as AWQ, quant/awq.py, and the fold itself):

    input_layernorm -> q, k, v;  post_attention_layernorm -> gate, up    (the paper's pairs)
    v_proj -> o_proj (one s per KV channel under GQA);  up_proj -> down_proj   (exact folds too)

so smoothing alone leaves the float model's function unchanged (tests/test_smoothquant.py). α is searched per
group of linears (`alpha=None`, the default): every α of the grid 0, 0.05, ..., 1 (and s = 1, no smoothing) is
scored by the squared error of the group's W8A8 outputs against the float outputs, summed over the group's linears,
on the first `score_tokens` calibration tokens that reach it, and the best is folded. Then every decoder linear is
rounded to int8 per output channel (RTN's symmetric 8-bit codes, float16 scales) and, for static activations, gets
its per-tensor input scale max_j max|X_j / s_j| / 127 from the calibration maxima.

Activations (`activations`): "token", one scale per token at run time (dynamic, the paper's O1 setting); "tensor",
one calibrated scale per layer input (static, O3), clamped to +-127 at run time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from brisk.ops.w8a8 import quantize_rows
from brisk.quant import primitives
from brisk.quant.awq import _fold, _Group, _groups, rtn_codes
from brisk.quant.calib import BlockContext
from brisk.quant.checkpoint import encode_layer
from brisk.quant.config import LayerQuant
from brisk.quant.support import PLAIN_NORM_ARCHITECTURES, MethodSupport

SUPPORT = MethodSupport("smoothquant", PLAIN_NORM_ARCHITECTURES,
                        limit="SmoothQuant folds its scales into RMSNorm weights of the form x / rms * w "
                        "(gemma3's norms are (1 + w) and sandwich the attention and MLP)")

W8 = LayerQuant(bits=8, group_size=-1, sym=True)  # the weights of W8A8: int8 per output channel
ALPHA_GRID = tuple(i / 20 for i in range(21))


@dataclass(frozen=True)
class SmoothQuantConfig:
    alpha: float | None = None  # a fixed migration strength, or None: searched per group over ALPHA_GRID
    activations: str = "token"  # "token" (dynamic per-token scales) or "tensor" (static, calibrated)
    score_tokens: int = 1024  # calibration tokens each α candidate is scored on
    chosen: dict[str, float | None] = field(default_factory=dict)  # filled in: group -> α (None: s = 1 won)

    def __post_init__(self) -> None:
        if self.alpha is not None and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"SmoothQuant alpha must lie in [0, 1] (0.5 splits the difficulty evenly; the "
                             f"reference uses 0.85 for Llama-2), got {self.alpha}")
        if self.activations not in ("token", "tensor"):
            raise ValueError(f"activations must be 'token' (dynamic per-token scales) or 'tensor' (static, "
                             f"calibrated), got {self.activations!r}")
        if self.score_tokens < 1:
            raise ValueError(f"score_tokens must be positive, got {self.score_tokens}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class MaxAbsObserver:
    """Per input channel max |x| over all tokens seen, and the first `keep` tokens themselves (for scoring)."""

    def __init__(self, in_features: int, keep: int) -> None:
        self.max_abs = torch.zeros(in_features)
        self.keep = keep
        self.kept: list[torch.Tensor] = []
        self.num_kept = 0

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()  # [T, K]
        self.max_abs = torch.maximum(self.max_abs, x.abs().amax(0))
        if self.num_kept < self.keep:
            take = x[: self.keep - self.num_kept].clone()
            self.kept.append(take)
            self.num_kept += take.shape[0]

    def tokens(self) -> torch.Tensor:
        return torch.cat(self.kept)  # [T, K]


def smoothing_scales(x_max: torch.Tensor, w_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^α / max|W_j|^(1-α), clamped to [1e-5, ...] as the reference does (dead channels get 1)."""
    s = x_max.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)
    s = s.clamp_min(1e-5)
    return torch.where((x_max > 0) & (w_max > 0), s, torch.ones_like(s))


def fake_w8a8(x: torch.Tensor, w: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ W [N, K]ᵀ as the W8A8 layer computes it: int8 per-channel weights, int8 activations."""
    codes, scale, zero = rtn_codes(w, W8)
    wq = primitives.dequantize(codes, scale, zero)  # [N, K]
    xq, xs = quantize_rows(x, input_scale)
    return (xq.float() * xs[:, None]) @ wq.t()


def _static_scale(x_max: torch.Tensor) -> torch.Tensor:
    return (x_max.max().clamp_min(1e-8) / 127.0).reshape(1)


def _channel_max(group: _Group, x_max: torch.Tensor, w_abs_cols: torch.Tensor, rep: int, kvh: int, d: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(max|X_j|, max|W_j|) per channel of the op that receives 1/s: under GQA a v channel feeds `rep` o columns,
    which share its scale, so both maxima are taken over them."""
    if group.expand is None:
        return x_max, w_abs_cols
    return x_max.view(kvh, rep, d).amax(1).reshape(-1), w_abs_cols.view(kvh, rep, d).amax(1).reshape(-1)


def smooth_block(ctx: BlockContext, config: SmoothQuantConfig, plan_names: set[str]
                 ) -> dict[str, torch.Tensor]:
    """Search and fold the smoothing scales of one block; returns each linear's input max |x| after the folds."""
    linears = ctx.linears()
    ctx.status("observe")
    observers = ctx.observe(list(linears), lambda _n, m: MaxAbsObserver(m.in_features, config.score_tokens))
    attn = ctx.block.self_attn
    kvh, d = attn.num_kv_heads, attn.head_dim
    rep = attn.num_heads // kvh
    x_max = {n: o.max_abs for n, o in observers.items()}  # type: ignore[attr-defined]
    for group in _groups(ctx):
        if any(f"{ctx.prefix}.{n}" not in plan_names for n in group.names):
            continue  # a member kept in float: no common W8A8 scale to fit
        key = f"{ctx.prefix}:{'/'.join(n.split('.')[-1] for n in group.names)}"
        ctx.status(f"smooth {key.split(':')[1]}")
        first = group.names[0]
        weights = [linears[n].weight.detach().float() for n in group.names]
        w_cols = torch.cat(weights).abs().amax(0)  # [K]: max |W_j| over the group's rows
        xm, wm = _channel_max(group, x_max[first], w_cols, rep, kvh, d)
        tokens = observers[first].tokens()  # type: ignore[attr-defined]
        reference = [tokens @ w.t() for w in weights]

        def error(s: torch.Tensor, tokens: torch.Tensor = tokens, weights: list[torch.Tensor] = weights,
                  reference: list[torch.Tensor] = reference, group: _Group = group, first: str = first) -> float:
            s_full = group.expand(s) if group.expand is not None else s
            xs = tokens / s_full
            scale = _static_scale(x_max[first] / s_full) if config.activations == "tensor" else None
            return float(sum((fake_w8a8(xs, w * s_full, scale) - r).square().sum()
                             for w, r in zip(weights, reference, strict=True)))

        candidates: list[tuple[float | None, torch.Tensor]] = [(None, torch.ones_like(xm))]
        alphas = ALPHA_GRID if config.alpha is None else (config.alpha,)
        candidates += [(a, smoothing_scales(xm, wm, a)) for a in alphas]
        if config.alpha is not None:
            candidates = candidates[1:]  # a fixed α is applied as asked
        scored = [(error(s), a, s) for a, s in candidates]
        _err, alpha, s = min(scored, key=lambda t: t[0])
        config.chosen[key] = alpha
        s_full = _fold(group, linears, s)
        for n in group.names:
            x_max[n] = x_max[n] / s_full
    return x_max


def smoothquant_apply(plan: dict[str, LayerQuant], config: SmoothQuantConfig,
                      encoded: dict[str, dict[str, torch.Tensor]]) -> Callable[[BlockContext], None]:
    """The per-block step for calib.run_layerwise: smooth, then round every planned linear to int8 per channel;
    the rounded weights go back into the model (the next block calibrates on them) and the checkpoint tensors
    (RTN's 8-bit symmetric format, plus `input_scale` for static activations) into `encoded`."""
    names = set(plan)

    def apply(ctx: BlockContext) -> None:
        x_max = smooth_block(ctx, config, names)
        for name, module in ctx.linears().items():
            full = f"{ctx.prefix}.{name}"
            if full not in plan:
                continue
            codes, scale, zero = rtn_codes(module.weight.detach().float(), W8)
            module.weight.data.copy_(primitives.dequantize(codes, scale, zero).to(module.weight.dtype))
            encoded[full] = encode_layer(codes, scale, zero, W8)
            if config.activations == "tensor":
                encoded[full]["input_scale"] = _static_scale(x_max[name])
    return apply


def smooth_only(ctx: BlockContext, config: SmoothQuantConfig) -> None:
    """Fold the smoothing scales without quantizing (tests: the float function is unchanged)."""
    smooth_block(ctx, config, {f"{ctx.prefix}.{n}" for n in ctx.linears()})

