"""Pruning masks and importance metrics as pure functions of tensors.

Convention: a mask is a bool tensor shaped like the weight W [N, K] (N = out_features rows, K = in_features)
with True on the weights to **remove** (zero). A metric is a float tensor of the same shape; larger means
more important, so the lowest-scoring weights are removed.

Comparison groups (which weights compete for survival):

    unstructured, per row      every output row drops its own lowest floor(s * K) scores (Wanda, sec. 3:
                               per-output grouping beats per-layer grouping for LLMs); every row ends at
                               exactly the same sparsity
    unstructured, per layer    one threshold over the whole matrix (the classic magnitude baseline of the
                               SparseGPT and Wanda papers); rows end at different sparsities
    N:M                        in every run of M consecutive weights along K of one row, at most N survive:
                               the M - N lowest are dropped (2:4, 4:8). Needs K % M == 0.

Ties are broken by position (a stable sort), so a mask removes exactly the number it promises even when
many scores are equal (e.g. a metric that is zero on a whole column).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_PATTERN = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


class PruneConfigError(ValueError):
    """A pruning setting that cannot be honoured (bad pattern, sparsity out of range, shape mismatch)."""


@dataclass(frozen=True)
class NMPattern:
    """At most `n` nonzeros in every `m` consecutive weights of a row."""

    n: int
    m: int

    def __post_init__(self) -> None:
        if not (0 < self.n < self.m):
            raise PruneConfigError(f"N:M pattern needs 0 < N < M, got {self.n}:{self.m} (e.g. 2:4 or 4:8)")

    @property
    def sparsity(self) -> float:
        return 1.0 - self.n / self.m

    def __str__(self) -> str:
        return f"{self.n}:{self.m}"


def parse_pattern(text: str | None) -> NMPattern | None:
    """'2:4' -> NMPattern(2, 4); None, '' or 'unstructured' -> None."""
    if text is None or text.strip().lower() in ("", "unstructured", "none"):
        return None
    match = _PATTERN.match(text)
    if not match:
        raise PruneConfigError(f"pattern {text!r} is not of the form N:M (e.g. 2:4 or 4:8) or 'unstructured'")
    return NMPattern(int(match.group(1)), int(match.group(2)))


def check_sparsity(sparsity: float) -> float:
    """A fraction of weights to remove must lie in [0, 1)."""
    if not (0.0 <= sparsity < 1.0):
        raise PruneConfigError(f"sparsity is the fraction of weights removed and must be in [0, 1), got {sparsity} "
                               "(e.g. 0.5 for half of the weights)")
    return float(sparsity)


# ------------------------------------------------------------------------------------------------ metrics
def magnitude_metric(weight: torch.Tensor) -> torch.Tensor:
    """|W|: the weight's own size, blind to the inputs it multiplies."""
    return weight.detach().abs().float()


def wanda_metric(weight: torch.Tensor, input_sq_norm: torch.Tensor) -> torch.Tensor:
    """Wanda's score S_ij = |W_ij| * ||X_j||_2 (Sun et al. 2023, eq. 1).

    input_sq_norm [K]: sum (or mean: a common factor does not change any mask) over calibration tokens of
    X_j^2, the squared norm of input feature j. A weight on an outlier feature is scaled by how large that
    feature gets, which is what magnitude pruning misses on LLMs.
    """
    k = weight.shape[1]
    if input_sq_norm.shape != (k,):
        raise PruneConfigError(f"input norms have shape {tuple(input_sq_norm.shape)}, the weight needs [{k}]")
    return weight.detach().abs().float() * input_sq_norm.float().clamp_min(0).sqrt()[None, :]  # [N, K]


# ------------------------------------------------------------------------------------------------ masks
def unstructured_mask(metric: torch.Tensor, sparsity: float, per_row: bool = True) -> torch.Tensor:
    """Remove the lowest-scoring fraction `sparsity` of weights: floor(sparsity * K) in every row
    (per_row), or floor(sparsity * N * K) over the whole matrix (per layer)."""
    check_sparsity(sparsity)
    scores = metric if per_row else metric.reshape(1, -1)  # per layer: one row of N * K scores
    num_prune = int(sparsity * scores.shape[1])
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=metric.device)
    if num_prune:
        order = torch.sort(scores, dim=1, stable=True).indices  # [rows, cols] ascending
        mask.scatter_(1, order[:, :num_prune], True)
    return mask.view(metric.shape)


def nm_mask(metric: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the N highest of every M consecutive scores along each row (2:4, 4:8)."""
    pattern = NMPattern(n, m)
    rows, k = metric.shape
    if k % m:
        raise PruneConfigError(f"an N:M pattern with M={m} needs the input dimension to be a multiple of {m}, "
                               f"got {k}")
    groups = metric.reshape(rows, k // m, m)  # [N, K/M, M]
    order = torch.sort(groups, dim=2, stable=True).indices  # ascending within each group
    mask = torch.zeros_like(groups, dtype=torch.bool)
    mask.scatter_(2, order[..., : m - pattern.n], True)  # the M - N lowest
    return mask.view(rows, k)


def select_mask(metric: torch.Tensor, sparsity: float, pattern: NMPattern | None, per_row: bool = True
                ) -> torch.Tensor:
    """The mask of a run's setting: N:M when a pattern is given (its sparsity wins), else unstructured."""
    if pattern is not None:
        return nm_mask(metric, pattern.n, pattern.m)
    return unstructured_mask(metric, sparsity, per_row=per_row)


# ------------------------------------------------------------------------------------------------ reports
def sparsity_of(weight: torch.Tensor) -> float:
    """Fraction of exact zeros."""
    return float((weight == 0).sum()) / max(weight.numel(), 1)


def nm_conforms(weight: torch.Tensor, n: int, m: int) -> bool:
    """Whether every run of M consecutive weights of every row has at most N nonzeros."""
    rows, k = weight.shape
    if k % m:
        return False
    nonzeros = (weight != 0).reshape(rows, k // m, m).sum(dim=2)  # [N, K/M]
    return bool((nonzeros <= n).all())
