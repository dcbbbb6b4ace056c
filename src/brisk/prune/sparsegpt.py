"""SparseGPT (Frantar & Alistarh, ICML 2023): prune one linear layer so that its output on the calibration
inputs changes as little as possible, compensating every removed weight with the ones still to come.

The layer-wise problem: given inputs X [K, T] (T calibration tokens), find W' with the chosen sparsity that
minimises ||W X - W' X||^2. Row by row this is a quadratic with Hessian H = X X^T [K, K], shared by all rows.
Optimal Brain Surgeon (OBS) says: removing weight w_j (and letting the not-yet-fixed weights move) costs
w_j^2 / [H^-1]_jj and the best compensation moves the rest by -w_j / [H^-1]_jj * H^-1[j, :].

SparseGPT sweeps the columns left to right and, to make each step cheap, uses the upper Cholesky factor U of
H^-1 (H^-1 = U^T U): row j of U, divided by U_jj, is exactly the OBS update direction restricted to the
columns j.. that are still free, and U_jj^2 is the matching [H^-1]_jj. Per column j:

    q_j    = w_j with the masked entries set to 0 (then quantized, in joint prune + quantize mode)
    err_j  = (w_j - q_j) / U_jj                              [N]
    W[:, j:] -= err_j (outer) U[j, j:]                       the OBS compensation of column j's change

Columns go in blocks of B = 128: the update is applied inside the block column by column and to the columns
after the block at once (a [N, B] x [B, K - b1] matmul: GPTQ's "lazy batch" trick; the loop is GPTQ's own,
quant/gptq.py obs_columns, shared with SqueezeLLM's error feedback). The mask is chosen
adaptively: for unstructured sparsity at the start of each block from the saliency w^2 / U_jj^2 of the block's
*current* (already compensated) weights, the lowest fraction s over the whole block (all rows x B columns);
for N:M at every M-th column, per row, among the next M columns.

    | done (pruned, fixed) | current block b0..b1: mask chosen, swept col by col | later: lazy update |

Joint quantization (paper sec. 3.5): q_j is the quantized value of the masked column, with group scales
chosen (GPTQ style) from the current weights when the sweep reaches a group's first column. Masked weights
stay exactly 0 because 0 is always on the grid (quant_format.md: lo <= 0 <= hi, symmetric zero code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brisk.prune.masks import NMPattern, PruneConfigError, check_sparsity, nm_mask, unstructured_mask
from brisk.quant import primitives
from brisk.quant.config import LayerQuant
from brisk.quant.gptq import obs_columns

BLOCK_SIZE = 128
PERCDAMP = 0.01  # dampening lambda = 1% of mean(diag H), as GPTQ / SparseGPT


@dataclass
class SparseGPTResult:
    weight: torch.Tensor  # [N, K] float32, pruned and compensated (dequantized values in joint mode)
    mask: torch.Tensor  # [N, K] bool, True = removed
    codes: torch.Tensor | None = None  # joint mode: uint8 [N, K]
    scale: torch.Tensor | None = None  # joint mode: [N, K/G] (float16-representable)
    zero: torch.Tensor | None = None  # joint mode: [N, K/G]


def inverse_hessian_factor(hessian: torch.Tensor, percdamp: float = PERCDAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, dead): U = upper Cholesky factor of (H + lambda I)^-1 [K, K]; dead [K] marks inputs that were never
    nonzero (H_jj = 0). Their diagonal is set to 1 so H stays invertible; their weights are pruned for free."""
    h = hessian.detach().double().clone()  # float64: H of long calibration runs is ill-conditioned
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(percdamp * torch.diagonal(h).mean())
    lower = torch.linalg.cholesky(h)
    h_inv = torch.cholesky_inverse(lower)
    return torch.linalg.cholesky(h_inv, upper=True).float(), dead


def sparsegpt_prune(weight: torch.Tensor, hessian: torch.Tensor, sparsity: float, pattern: NMPattern | None = None,
                    block_size: int = BLOCK_SIZE, percdamp: float = PERCDAMP, quant: LayerQuant | None = None
                    ) -> SparseGPTResult:
    """Prune W [N, K] given H = X X^T [K, K] of its calibration inputs (any positive scale: the mask and the
    updates do not depend on it). `pattern` overrides `sparsity` with N:M; `quant` also quantizes (int only)."""
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise PruneConfigError(f"Hessian has shape {tuple(hessian.shape)}, the weight needs [{k}, {k}]")
    if pattern is None:
        check_sparsity(sparsity)
    elif k % pattern.m or block_size % pattern.m:
        raise PruneConfigError(f"pattern {pattern} needs the input dimension ({k}) and the block size "
                               f"({block_size}) to be multiples of {pattern.m}")
    if quant is not None and quant.scheme != "int":
        raise PruneConfigError("joint SparseGPT quantization supports the int scheme only (not nf4)")
    group = k if quant is None or quant.group_size == -1 else quant.group_size
    if quant is not None:
        quant.groups(k)  # the group size must divide the row

    u, dead = inverse_hessian_factor(hessian, percdamp)
    w = weight.detach().float().clone()
    w[:, dead] = 0
    out = torch.empty_like(w)  # the pruned (and quantized) columns, as each is decided
    mask = torch.zeros(n, k, dtype=torch.bool)
    codes = torch.zeros(n, k, dtype=torch.uint8) if quant is not None else None
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    qparams: list[torch.Tensor] = []  # the current group's (scale, zero)

    def error_of(j: int, w1: torch.Tensor, i: int) -> torch.Tensor:
        """Column i of the block w1 (column j of w): decide its mask (the block's, at its first column; N:M's at
        each group of M), prune and quantize it, and return its error w - ŵ."""
        b0, b1 = j - i, j - i + w1.shape[1]
        d1 = torch.diagonal(u[b0:b1, b0:b1])  # [B]
        mask1 = mask[:, b0:b1]  # [N, B] view
        if pattern is None and i == 0:
            mask1.copy_(unstructured_mask(w1.pow(2) / d1.pow(2)[None, :], sparsity, per_row=False))
        if pattern is not None and i % pattern.m == 0:
            saliency = w1[:, i:i + pattern.m].pow(2) / d1[i:i + pattern.m].pow(2)[None, :]  # [N, M]
            mask1[:, i:i + pattern.m] = nm_mask(saliency, pattern.n, pattern.m)
        col = w1[:, i]
        q = col.masked_fill(mask1[:, i], 0.0)
        if quant is not None:
            if j % group == 0:  # the group's current weights: the rest of this block, then the later columns
                current = torch.cat([w1[:, i:], w[:, b1:]], 1)[:, :group]
                qparams[:] = _group_qparams(current, mask[:, j:j + group], quant)
                scales.append(qparams[0])
                zeros.append(qparams[1])
            assert codes is not None
            codes[:, j] = primitives.quantize(q[:, None], qparams[0], qparams[1], quant.bits)[:, 0]
            q = primitives.dequantize(codes[:, j:j + 1], qparams[0], qparams[1])[:, 0]
        out[:, j] = q
        return col - q

    obs_columns(w, u, block_size, error_of)
    w = out
    w[mask] = 0.0
    if quant is None:
        return SparseGPTResult(weight=w, mask=mask)
    return SparseGPTResult(weight=w, mask=mask, codes=codes, scale=torch.cat(scales, dim=1),
                           zero=torch.cat(zeros, dim=1))


def _group_qparams(current: torch.Tensor, removed: torch.Tensor, quant: LayerQuant
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero [N, 1] of a group from its current weights [N, G] with the entries already known to be removed
    set to 0 (they will be exactly 0); scale rounded to float16 as stored."""
    current = current.masked_fill(removed, 0.0)
    scale, zero = primitives.choose_qparams(current, quant.bits, group_size=None, sym=quant.sym)  # [N, 1] each
    scale = scale.clamp_min(torch.finfo(torch.float16).tiny).half().float()
    return scale, zero
