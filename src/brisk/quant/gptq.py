"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
ICLR 2023): quantize a linear layer's columns one at a time, pushing each column's rounding error onto the columns
not yet quantized so that the layer's *output* on calibration data stays close.

Per layer with weight W [N, K] and inputs X (tokens x K), minimise ||W Xᵀ - Ŵ Xᵀ||² row by row. Its Hessian
H = 2 Xᵀ X [K, K] is shared by all rows (calib.HessianObserver). With U the upper Cholesky factor of H⁻¹
(H⁻¹ = Uᵀ U), fixing column j to q_j leaves the optimal update of the later columns (OBS, paper eq. 3-4)

    e_j = (w_j - q_j) / U_jj,        W[:, j+1:] -= e_j ⊗ U[j, j+1:]

Columns go in blocks of B = 128: inside a block the update touches only the block's columns; the rest of W gets
one lazy GEMM per block, W[:, end:] -= E_block · U[block, end:] (paper §4 "lazy batch-updates").

    columns:  | quantized | block: column j, then j+1 ... | not yet touched (one GEMM per block) |

Details, each from the paper or its reference code:
- dampening: H += damp · mean(diag H) · I (damp 1%), so the Cholesky exists for few or collinear samples;
  retried with 10x more damping if it still fails;
- dead inputs (diag H = 0, a channel that was always 0): H_ii = 1 and W[:, i] = 0, it cannot matter;
- groups: one (scale, zero) per G consecutive input columns of a row, in the checkpoint's layout. Without act-order
  a group's parameters are chosen when its first column is reached, from the error-updated weights;
- act-order: columns in descending diag(H) (the most activated inputs first, while there are many columns left
  to absorb their error) with *static groups*: every group's parameters come from the original W before any
  update, so a group is still G consecutive columns and the kernels need no per-column group index;
- the scale is rounded to float16 (the checkpoint's precision) before any code is chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from brisk.quant import primitives
from brisk.quant.calib import BlockContext, HessianObserver, stages
from brisk.quant.checkpoint import encode_layer
from brisk.quant.config import LayerQuant
from brisk.quant.support import DENSE_ARCHITECTURES, MethodSupport

# the calibration driver runs every dense architecture's layers; GPTQ only observes the linears' inputs
SUPPORT = MethodSupport("gptq", DENSE_ARCHITECTURES)


@dataclass(frozen=True)
class GPTQConfig:
    damp: float = 0.01  # fraction of mean(diag H) added to the diagonal
    block_size: int = 128  # columns per lazy batch update
    act_order: bool = True  # columns by descending diag(H), with static groups
    true_sequential: bool = True  # q/k/v, then o, then gate/up, then down, each on re-computed inputs

    def __post_init__(self) -> None:
        if not 0 < self.damp < 1:
            raise ValueError(f"damp must be in (0, 1) (a fraction of mean(diag H)), got {self.damp}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _qparams(w: torch.Tensor, spec: LayerQuant, group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """RTN (scale, zero) of w, the scale rounded to float16 as the checkpoint stores it."""
    scale, zero = primitives.choose_qparams(w, spec.bits, group_size=group_size, sym=spec.sym)
    return scale.clamp_min(torch.finfo(torch.float16).tiny).half().float(), zero


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of (H + λI)⁻¹, λ = damp · mean(diag H); float64 factorisations, float32 result."""
    h = h.double()
    k = h.shape[0]
    lam = damp * float(h.diagonal().mean())
    for _ in range(4):  # a Hessian that is still not positive definite gets 10x the damping
        try:
            ch = torch.linalg.cholesky(h + lam * torch.eye(k, dtype=h.dtype))
            h_inv = torch.cholesky_inverse(ch)
            return torch.linalg.cholesky(h_inv, upper=True).float()
        except torch.linalg.LinAlgError:
            lam *= 10
    raise torch.linalg.LinAlgError("Hessian not positive definite even with 1000x the damping; "
                                   "use more calibration samples (--num-samples)")


def gptq_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, spec: LayerQuant,
                         config: GPTQConfig = GPTQConfig()
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ of one weight [N, K] given H [K, K]: (codes uint8 [N, K], scale [N, K/G], zero [N, K/G], Ŵ [N, K]).

    Ŵ = scale * (codes - zero) is what the checkpoint will compute, in float32.
    """
    assert spec.scheme == "int", "GPTQ chooses codes on a uniform grid; nf4 is RTN-only"
    w = weight.detach().float().clone()  # [N, K]
    h = hessian.detach().float().clone()  # [K, K]
    n, k = w.shape
    g = k if spec.group_size == -1 else spec.group_size
    spec.groups(k)  # checks that g divides K
    top = primitives.qmax(spec.bits)

    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    static = config.act_order or g == k  # per-channel parameters never change with the updates: choose them now
    scale = torch.empty(n, k // g)
    zero = torch.empty(n, k // g)
    if static:
        scale, zero = _qparams(w, spec, g)
    perm = torch.argsort(h.diagonal(), descending=True) if config.act_order else torch.arange(k)
    w = w[:, perm]
    h = h[perm][:, perm]
    group_of = perm // g  # [K]: the (original-order) group of each permuted column
    u = _inverse_hessian_factor(h, config.damp)  # [K, K] upper

    # without act-order a group's parameters come from its own columns once the earlier blocks' errors have
    # reached them; with a block a multiple of G, a group never straddles two blocks
    block = config.block_size if static else max(1, config.block_size // g) * g
    codes = torch.empty(n, k, dtype=torch.uint8)

    def error_of(col: int, w1: torch.Tensor, i: int) -> torch.Tensor:
        grp = int(group_of[col])
        if not static and col % g == 0:
            s, z = _qparams(w1[:, i:i + g], spec, None)
            scale[:, grp], zero[:, grp] = s[:, 0], z[:, 0]
        s, z = scale[:, grp], zero[:, grp]  # [N]
        wc = w1[:, i]
        q = torch.round(wc / s).add_(z).clamp_(0, top)  # [N]: codes of this column
        codes[:, col] = q.to(torch.uint8)
        return wc - s * (q - z)

    obs_columns(w, u, block, error_of)
    inv = torch.argsort(perm)
    codes = codes[:, inv].contiguous()
    w_hat = primitives.dequantize(codes, scale, zero)
    return codes, scale, zero, w_hat


def obs_columns(w: torch.Tensor, u: torch.Tensor, block: int,
                error_of: Callable[[int, torch.Tensor, int], torch.Tensor]) -> None:
    """The blocked OBS loop over the (permuted) columns of w [N, K], in place, given U [K, K] (the upper Cholesky
    factor of H⁻¹): error_of(col, w1, i) codes column i of the current block w1 (column col of w) and returns its
    error w - ŵ [N], which the later columns absorb (module docstring). The column loop is thousands of small
    vector ops: it runs on one thread, as thread hand-offs cost more than the ops (measured 30x slower with 2
    threads on a busy 2-core machine); the lazy block GEMM is small too."""
    k = w.shape[1]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i1 in range(0, k, block):
            i2 = min(i1 + block, k)
            w1 = w[:, i1:i2].clone()  # [N, B]: this block's columns, updated column by column
            err = torch.empty_like(w1)
            u1 = u[i1:i2, i1:i2]
            for i in range(i2 - i1):
                e = error_of(i1 + i, w1, i) / u1[i, i]
                w1[:, i:] -= e[:, None] * u1[i, i:][None, :]  # OBS update of the block's later columns
                err[:, i] = e
            w[:, i2:] -= err @ u[i1:i2, i2:]  # lazy batch update of everything after the block
    finally:
        torch.set_num_threads(threads)


@dataclass
class StackedProblem:
    """Linears of one block that share an input (q/k/v, gate/up) and a setting: their weights stacked by rows
    [sum N, K] with the Hessian of that input; `write(w_hat, encode)` puts each member's rows back."""

    prefix: str
    members: list[str]
    modules: list[torch.nn.Linear]
    key: object
    weight: torch.Tensor
    hessian: torch.Tensor

    def write(self, w_hat: torch.Tensor, encode: Callable[[str, slice], dict[str, torch.Tensor]],
              encoded: dict[str, dict[str, torch.Tensor]]) -> None:
        """Ŵ into each member (so later stages and blocks see the quantized layer) and encode(name, rows) into
        `encoded` by full module name."""
        start = 0
        for name, module in zip(self.members, self.modules, strict=True):
            rows = slice(start, start + module.out_features)
            start += module.out_features
            module.weight.data.copy_(w_hat[rows].to(module.weight.dtype))
            encoded[f"{self.prefix}.{name}"] = encode(f"{self.prefix}.{name}", rows)


def stacked_problems(ctx: BlockContext, planned: Callable[[str], bool], key: Callable[[str], object], label: str,
                     true_sequential: bool = True) -> Iterator[StackedProblem]:
    """The block's planned linears (planned(full name)), stage by stage (calib.TRUE_SEQUENTIAL, or all at once),
    each stage's input Hessians observed on the current weights, as one problem per shared input and key(full
    name). Linears that share an input share H, and GPTQ-style coding treats rows independently given H: one column
    loop instead of three. A stage is observed only once the problems before it were written back."""
    linears = ctx.linears()
    groups = stages(ctx) if true_sequential else [tuple(linears)]
    for stage in groups:
        names = [n for n in stage if planned(f"{ctx.prefix}.{n}")]
        if not names:
            continue
        ctx.status(f"observe {', '.join(n.split('.')[-1] for n in names)}")
        observers = ctx.observe(names, lambda _n, m: HessianObserver(m.in_features))
        batches: dict[tuple[int, object], list[str]] = {}
        for name in names:
            batches.setdefault((id(observers[name]), key(f"{ctx.prefix}.{name}")), []).append(name)
        for (_, k), members in batches.items():
            obs = observers[members[0]]
            assert isinstance(obs, HessianObserver)
            ctx.status(f"{label} {', '.join(n.split('.')[-1] for n in members)}")
            modules = [linears[n] for n in members]
            yield StackedProblem(ctx.prefix, members, modules, k, torch.cat([m.weight for m in modules]),
                                 obs.hessian())


def gptq_apply(plan: dict[str, LayerQuant], config: GPTQConfig, encoded: dict[str, dict[str, torch.Tensor]]
               ) -> Callable[[BlockContext], None]:
    """The per-block step for calib.run_layerwise: quantize the block's planned linears with GPTQ, stage by stage,
    write Ŵ into the model (so later stages and blocks see the quantized layer) and the checkpoint tensors into
    `encoded` (by full module name)."""
    def apply(ctx: BlockContext) -> None:
        for prob in stacked_problems(ctx, plan.__contains__, plan.__getitem__, "gptq", config.true_sequential):
            spec = prob.key
            assert isinstance(spec, LayerQuant)
            codes, scale, zero, w_hat = gptq_quantize_weight(prob.weight, prob.hessian, spec, config)
            prob.write(w_hat, lambda _name, rows, c=codes, s=scale, z=zero, q=spec: encode_layer(c[rows], s[rows],
                                                                                                z[rows], q), encoded)
    return apply
