"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration", MLSys 2024):
protect the input channels that carry large activations by an equivalent per-channel scaling before rounding.

For linears that share an input x, y = W x = (W diag(s)) (diag(s)⁻¹ x). Scaling input channel j of the weight by
s_j > 1 spreads it over more of the grid, shrinking its rounding error relative to its activation by ~1/s_j (at the
cost of the channels that share its group). The 1/s is folded into whatever produced x, so the float model is
unchanged and the checkpoint format is RTN's:

    group (prev op -> linears)                     fold diag(s)⁻¹ into
    input_layernorm -> q, k, v                     the norm's weight
    v_proj -> o_proj                               v_proj's output rows (see GQA below)
    post_attention_layernorm -> gate, up           the norm's weight
    up_proj -> down_proj                           up_proj's output rows

s = s_x^α / sqrt(max · min) with s_x = mean |x| per input channel (calib.ActStatsObserver); α takes the 20 values
0, 0.05, ..., 0.95 (α = 0 is plain RTN, so the search never does worse than RTN on its objective) and the one
with the smallest output error wins. Then, for every linear but q/k (their errors meet in
the q·k product, where clipping hurts: the paper's choice), each (row, group) gets a clipping range
|w| <= amax · (1 - i/20), i < 10, that minimises its output error; then RTN.

Objective (`AWQConfig.objective`), as the reference measures it, per group:
  * "module" (default): the output of the module after the group, the way llm-awq scores a grid point:
    self_attn for q/k/v (RoPE, softmax and the float o_proj included), the whole MLP for gate/up (SiLU and the
    float down_proj included), the linear itself for v -> o and up -> down. The modules run on the first
    `module_samples` calibration samples (4 x 256 tokens by default: the reference uses its whole set of
    128 x 512, which on a 2-core CPU would cost ~20 module forwards per group and block over 64k tokens), with
    the candidate weights Q(W diag s) diag(s)⁻¹, which is exactly the folded-and-quantized module on the
    unscaled input.
  * "linear": the error of the group's linears' outputs over *all* calibration tokens, exactly, from their
    input Hessian H = 2/n Σ x xᵀ: ||X ΔWᵀ||² / n = tr(ΔW H ΔWᵀ) / 2, ΔW = W - Q(W diag s) diag(s)⁻¹. For the
    v -> o and up -> down groups both objectives are the same function (on different token sets); for q/k/v
    and gate/up it ignores what the nonlinearity does to the error (measured on the default model at W3 g64:
    the module objective recovers more of RTN's perplexity increase; BENCHMARKS.md).
The clip search uses the diagonal blocks of H (one per group), i.e. the error of each group's partial dot
products, as the reference does.

GQA: o_proj's input channel c (head h, dim j) is v's output channel (h // (heads / kv_heads), j). One v row feeds
heads/kv_heads o columns, so those columns share one scale (the reference skips v -> o unless the shapes are
equal; sharing keeps the fold exact and still protects the salient value channels).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from torch import nn

from brisk.model.llama import DecoderLayer
from brisk.ops.attention import AttentionMetadata
from brisk.quant import primitives
from brisk.quant.calib import ActStatsObserver, BlockContext, CombinedObserver, HessianObserver
from brisk.quant.checkpoint import encode_layer
from brisk.quant.config import LayerQuant
from brisk.quant.support import PLAIN_NORM_ARCHITECTURES, MethodSupport

SUPPORT = MethodSupport("awq", PLAIN_NORM_ARCHITECTURES,
                        limit="AWQ folds its scales into RMSNorm weights of the form x / rms * w (gemma3's "
                        "norms are (1 + w) and sandwich the attention and MLP)")

NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")


@dataclass(frozen=True)
class AWQConfig:
    n_grid: int = 20  # grid points of α in [0, 1), and the clip grid's step 1/n_grid
    max_shrink: float = 0.5  # clip ranges tried: amax * (1 - i / n_grid) for i < n_grid * max_shrink
    objective: str = "module"  # "module" (the output of the module after the group) or "linear" (see above)
    module_samples: int = 4  # calibration samples the module objective runs on (the first ones)
    clip: bool = True
    alpha: float | None = None  # a fixed α instead of the search (ablations; tests that need s != 1)

    def __post_init__(self) -> None:
        if self.n_grid < 1 or not 0 <= self.max_shrink < 1 or self.module_samples < 1:
            raise ValueError(f"bad AWQ settings {self}: n_grid >= 1, 0 <= max_shrink < 1, module_samples >= 1")
        if self.objective not in ("module", "linear"):
            raise ValueError(f"AWQ objective must be 'module' or 'linear', got {self.objective!r}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def fake_quantize(w: torch.Tensor, spec: LayerQuant) -> torch.Tensor:
    """RTN round trip of w [N, K] exactly as the checkpoint will compute it (float16 scale)."""
    codes, scale, zero = rtn_codes(w, spec)
    return primitives.dequantize(codes, scale, zero)


def rtn_codes(w: torch.Tensor, spec: LayerQuant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    group = None if spec.group_size == -1 else spec.group_size
    scale, zero = primitives.choose_qparams(w, spec.bits, group_size=group, sym=spec.sym)
    scale = scale.clamp_min(torch.finfo(torch.float16).tiny).half().float()
    return primitives.quantize(w, scale, zero, spec.bits), scale, zero


class OutputError:
    """tr(ΔW H ΔWᵀ) of a candidate ΔW [N, K] against the input Hessian H [K, K]: the squared error of the linear's
    output summed over the calibration tokens (up to the constant 2/n), exactly."""

    def __init__(self, hessian: torch.Tensor) -> None:
        self.hessian = hessian.float()

    def __call__(self, dw: torch.Tensor) -> float:
        return float(((dw @ self.hessian) * dw).sum())


class ModuleError:
    """Squared error of a module's output when the group's linears hold W - ΔW instead of W.

    `run()` -> the module's outputs (a list of tensors, one per mini-batch) with the linears' current weights;
    the float reference is taken at construction. A candidate is written into the linears' weights (the rows of
    ΔW split by their out_features, in order) for one run and the float weights are put back.
    """

    def __init__(self, linears: list[nn.Linear], run: Callable[[], list[torch.Tensor]]) -> None:
        self.linears = linears
        self.run = run
        self.reference = run()

    def __call__(self, dw: torch.Tensor) -> float:
        saved = [m.weight.data for m in self.linears]
        try:
            start = 0
            for m, w in zip(self.linears, saved, strict=True):
                n = w.shape[0]
                m.weight.data = (w.float() - dw[start:start + n]).to(w.dtype)
                start += n
            out = self.run()
        finally:
            for m, w in zip(self.linears, saved, strict=True):
                m.weight.data = w
        return float(sum((o.float() - r.float()).square().sum() for o, r in zip(out, self.reference, strict=True)))


def search_scale(weights: list[torch.Tensor], x_mean: torch.Tensor, error: Callable[[torch.Tensor], float],
                 spec: LayerQuant, n_grid: int, expand: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 alphas: list[float] | None = None) -> tuple[torch.Tensor, float, list[float]]:
    """Best s (per input channel of x_mean) over the α grid (i / n_grid, or `alphas`): (s, α, error per α).
    `expand` maps s to the weights' input channels when they differ (GQA's v -> o)."""
    w = torch.cat([x.detach().float() for x in weights])  # [sum N, K]
    x_mean = x_mean.float()
    best: tuple[float, torch.Tensor, float] | None = None
    errors = []
    for alpha in alphas if alphas is not None else [i / n_grid for i in range(n_grid)]:
        s = x_mean.pow(alpha).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s_full = expand(s) if expand is not None else s  # [K]
        dw = w - fake_quantize(w * s_full, spec) / s_full
        err = error(dw)
        errors.append(err)
        if best is None or err < best[0]:
            best = (err, s, alpha)
    assert best is not None
    return best[1], best[2], errors


def search_clip(weight: torch.Tensor, hessian: torch.Tensor, spec: LayerQuant, n_grid: int, max_shrink: float
                ) -> torch.Tensor:
    """Per (row, group) clipping bound [N, K/G] minimising the group's output error Δw H_gg Δwᵀ."""
    w = weight.detach().float()
    n, k = w.shape
    g = k if spec.group_size == -1 else spec.group_size
    wg = w.view(n, k // g, g)  # [N, G, g]
    hb = torch.stack([hessian[i:i + g, i:i + g] for i in range(0, k, g)]).float()  # [G, g, g]: diagonal blocks
    amax = wg.abs().amax(-1)  # [N, G]
    best_err = torch.full_like(amax, float("inf"))
    best = amax.clone()
    for i in range(max(1, int(n_grid * max_shrink))):
        bound = amax * (1 - i / n_grid)  # [N, G]
        clipped = torch.maximum(torch.minimum(wg, bound[..., None]), -bound[..., None])
        d = wg - fake_quantize(clipped.view(n, k), spec).view(n, k // g, g)  # [N, G, g]
        err = torch.einsum("ngi,gij,ngj->ng", d, hb, d)  # [N, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, bound, best)
    return best


@dataclass
class _Group:
    prev: nn.Module  # the RMSNorm or the linear whose output rows receive diag(s)⁻¹
    names: tuple[str, ...]  # the linears whose input columns receive diag(s)
    expand: Callable[[torch.Tensor], torch.Tensor] | None = None  # s [prev channels] -> s [linear inputs]
    pool: Callable[[torch.Tensor], torch.Tensor] | None = None  # x_mean [linear inputs] -> [prev channels]


def _groups(ctx: BlockContext) -> list[_Group]:
    block = ctx.block
    attn, mlp = block.self_attn, block.mlp
    h, kvh, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    rep = h // kvh

    def expand(s: torch.Tensor) -> torch.Tensor:  # [kvh*d] -> [h*d]: head i reads kv head i // rep
        return s.view(kvh, 1, d).expand(kvh, rep, d).reshape(h * d)

    def pool(x: torch.Tensor) -> torch.Tensor:  # [h*d] -> [kvh*d]: mean over the heads sharing a kv channel
        return x.view(kvh, rep, d).mean(1).reshape(kvh * d)

    groups = [_Group(block.input_layernorm, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))]
    if attn.o_proj.in_features == h * d and attn.v_proj.out_features == kvh * d:
        groups.append(_Group(attn.v_proj, ("self_attn.o_proj",), *((expand, pool) if rep > 1 else (None, None))))
    groups.append(_Group(block.post_attention_layernorm, ("mlp.gate_proj", "mlp.up_proj")))
    groups.append(_Group(mlp.up_proj, ("mlp.down_proj",)))  # down's input act(gate) * up is linear in up's rows
    return groups


def _fold(group: _Group, linears: dict[str, nn.Linear], s: torch.Tensor) -> torch.Tensor:
    """prev /= s (norm weight, or a linear's output rows and bias); linears' input columns *= s. Returns the
    per-input-channel s the linears got."""
    s_full = group.expand(s) if group.expand is not None else s
    if isinstance(group.prev, nn.Linear):
        group.prev.weight.data.div_(s[:, None].to(group.prev.weight.dtype))
        if group.prev.bias is not None:
            group.prev.bias.data.div_(s.to(group.prev.bias.dtype))
    else:
        group.prev.weight.data.div_(s.to(group.prev.weight.dtype))
    for name in group.names:
        w = linears[name].weight
        w.data.mul_(s_full[None, :].to(w.dtype))
    return s_full


def _module_run(sub: BlockContext, names: tuple[str, ...]) -> Callable[[], list[torch.Tensor]]:
    """The run() of ModuleError for a group fed by a norm: self_attn on input_layernorm's output (q/k/v), or the
    MLP on post_attention_layernorm's output (gate/up; its inputs computed once, since the group does not
    change them), over the samples of `sub`."""
    if names[0].startswith("self_attn."):
        def attn(block: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata, kv: torch.Tensor) -> torch.Tensor:
            return block.self_attn(block.input_layernorm(x), cos, sin, meta, kv)
        return lambda: sub.run(attn)

    def mlp_input(block: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  meta: AttentionMetadata, kv: torch.Tensor) -> torch.Tensor:
        a = block.self_attn(block.input_layernorm(x), cos, sin, meta, kv)
        return block.post_attention_layernorm(a, x.clone())[0]  # residual x + a, normed
    inputs = sub.run(mlp_input)
    mlp = sub.block.mlp

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return [mlp(m) for m in inputs]
    return run


def awq_scale_block(ctx: BlockContext, plan: dict[str, LayerQuant], config: AWQConfig
                    ) -> dict[str, torch.Tensor]:
    """Search and fold the scales of one block (the float block computes the same function afterwards).

    Returns each linear's input Hessian *after* the folds (a linear whose input was divided by s has
    H / (s sᵀ)), for the clip search.
    """
    linears = ctx.linears()
    ctx.status("observe")
    observers = ctx.observe(list(linears), lambda _n, m: CombinedObserver(HessianObserver(m.in_features),
                                                                           ActStatsObserver(m.in_features)))
    hessians: dict[str, torch.Tensor] = {}
    x_means: dict[str, torch.Tensor] = {}
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, obs in observers.items():
        assert isinstance(obs, CombinedObserver)
        if id(obs) not in cache:
            hess, stats = obs.observers
            assert isinstance(hess, HessianObserver) and isinstance(stats, ActStatsObserver)
            cache[id(obs)] = (hess.hessian(), stats.mean_abs())
        hessians[name], x_means[name] = cache[id(obs)]
    sub = BlockContext(ctx.model, ctx.index, ctx.inputs[:config.module_samples], ctx.batch_size, ctx.status)
    for group in _groups(ctx):
        specs = {plan.get(f"{ctx.prefix}.{n}") for n in group.names}
        if None in specs or len(specs) != 1:
            continue  # a member kept in float or quantized differently: no common scale to search for
        spec = specs.pop()
        assert spec is not None
        first = group.names[0]
        ctx.status(f"scale {'/'.join(n.split('.')[-1] for n in group.names)}")
        x_mean = group.pool(x_means[first]) if group.pool is not None else x_means[first]
        error: Callable[[torch.Tensor], float] = OutputError(hessians[first])
        if config.objective == "module" and not isinstance(group.prev, nn.Linear):
            # a norm feeds the group: score the attention / MLP module after it (a linear's own output is
            # what OutputError already scores exactly, over every calibration token)
            error = ModuleError([linears[n] for n in group.names], _module_run(sub, group.names))
        s, _alpha, _errors = search_scale([linears[n].weight for n in group.names], x_mean, error, spec,
                                          config.n_grid, group.expand,
                                          None if config.alpha is None else [config.alpha])
        s_full = _fold(group, linears, s)
        h = hessians[first] / (s_full[:, None] * s_full[None, :])  # their input is now x / s
        for name in group.names:
            hessians[name] = h
    return hessians


def awq_apply(plan: dict[str, LayerQuant], config: AWQConfig, encoded: dict[str, dict[str, torch.Tensor]]
              ) -> Callable[[BlockContext], None]:
    """The per-block step for calib.run_layerwise: fold AWQ scales, clip, quantize (RTN) the planned linears,
    write Ŵ into the model and the checkpoint tensors into `encoded` (by full module name)."""
    def apply(ctx: BlockContext) -> None:
        hessians = awq_scale_block(ctx, plan, config)
        for name, module in ctx.linears().items():
            full = f"{ctx.prefix}.{name}"
            if full not in plan:
                continue
            spec = plan[full]
            w = module.weight.detach().float()
            if config.clip and name not in NO_CLIP:
                ctx.status(f"clip {name}")
                bound = search_clip(w, hessians[name], spec, config.n_grid, config.max_shrink)  # [N, G]
                n, k = w.shape
                b = bound.repeat_interleave(k // bound.shape[1], dim=1)  # [N, K]
                w = torch.maximum(torch.minimum(w, b), -b)
            codes, scale, zero = rtn_codes(w, spec)
            module.weight.data.copy_(primitives.dequantize(codes, scale, zero).to(module.weight.dtype))
            encoded[full] = encode_layer(codes, scale, zero, spec)
    return apply
