"""SqueezeLLM (Kim et al., "SqueezeLLM: Dense-and-Sparse Quantization", 2023): non-uniform codes from
sensitivity-weighted k-means, with the largest weights kept aside in a sparse float matrix.

Per decoder linear with weight W [N, K]:

1. Sensitivity (paper §3.1). The loss change of a small weight perturbation is, to second order, weighted by the
   Hessian of the loss; SqueezeLLM approximates its diagonal by the Fisher information, the squared gradients of
   the LM loss on calibration text:
       F_nk = (1 / S) sum_s (dL_s / dW_nk)^2        one sequence s at a time (the empirical Fisher)
   computed with autograd through brisk's training forward (train/forward.py) with activation checkpointing, one
   `chunk_size` of sequences per backward, so memory stays that of one chunk. Only the planned linears' weights
   take gradients. Unlike GPTQ's layer-wise walk this is one pass over the float model: the paper does the same.
   The k-means then weighs each weight by F / mean(F of its row) + `sensitivity_floor` (by default 1 for 3-bit
   tables, 2 for 4-bit ones; 0 is F as the paper uses it). A diagonal Fisher from a few thousand calibration
   tokens is noisy, and a weight it happens to rate near zero would otherwise take no part in placing the table.
   The defaults were chosen on the calibration book's perplexity (16 x 256 calibration tokens, step 4 on;
   BENCHMARKS.md): at 3 bits floor 1 beats 0, 2, 3 and uniform weights, at 4 bits floor 2 beats 1 and 3 (the
   held-out text agrees at 3 bits; at 4 bits it puts floor 3 a hair ahead of 2).
2. Dense-and-sparse decomposition (paper §3.2): W = D + S, S holding the `outliers` fraction of W's weights
   largest in magnitude (0.45% by default, the paper's main setting). D is quantized below; S is stored as a CSR
   matrix of float16 values, and we keep in S the *residual* w - D_hat at those positions, so an outlier is
   reconstructed to float16 precision whatever code the dense part gives it. `sensitive` adds the paper's
   sensitive values: that fraction of each matrix's weights with the largest Fisher value (as measured, before
   the floor of step 1), kept in S the same way (0.05% by default, the paper's; on the default model it lowered
   the calibration book's perplexity at 3 and 4 bits alike, for 0.03 bit a weight).
3. Per output row, a 2^bits-entry table by sensitivity-weighted k-means (paper eq. 4):
       minimise  sum_k F_nk (W_nk - c_{q_nk})^2     over the table c and the codes q
   Lloyd's algorithm in one dimension: codes = nearest centroid (the midpoints between sorted centroids cut the
   line, so a cluster is an interval of the sorted row), centroids = the F-weighted mean of their weights (a
   centroid with no weight keeps its place); with the row sorted once and prefix-summed, an iteration costs two
   lookups per centroid. The outliers take no part (weight 0). Deterministic: the start is the
   F-weighted quantiles (i + 1/2) / 2^bits of the row, the iteration count is fixed, and all rows of a chunk run
   at once (no loop over rows). The table is rounded to float16 (the checkpoint's precision) and the codes chosen
   once more against the rounded table.

4. Error feedback (brisk's addition, on by default; `error_feedback=False` is the paper's method). Step 3 picks
   each weight's nearest table entry on its own. With the table fixed, the codes are chosen instead the way GPTQ
   chooses uniform ones (quant/gptq.py): block by block through the decoder on calibration inputs, a layer's
   columns in descending diag(H) order, each column's rounding error pushed onto the columns not yet coded by the
   OBS update, so the layer's *output* stays close rather than each weight. An outlier is coded too (its table
   entry plus its float16 residual, so its error is that residual's rounding) and passes no error on. The table
   and the outliers are those of steps 2 and 3, from the original weights; only the codes change.

The embedding and the head take RTN's 8-bit codes, as with the other methods (quant/rtn.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from brisk.model.loader import LoadedModel
from brisk.quant.calib import BlockContext, CalibConfig, load_calibration_ids
from brisk.quant.checkpoint import encode_lut_layer
from brisk.quant.config import LayerQuant, QuantizationConfig
from brisk.quant.support import DENSE_ARCHITECTURES, MethodSupport

# the dense architectures (its Fisher pass runs through the training forward, which runs them all); the routed
# experts of a MoE model are refused like the other calibrated methods': step 4's error feedback would need each
# expert's Hessian from the tokens routed to it
SUPPORT = MethodSupport("squeezellm", DENSE_ARCHITECTURES)

DEFAULT_OUTLIERS = 0.0045  # the paper's 0.45%
DEFAULT_SENSITIVE = 0.0005  # the paper's 0.05%
# module docstring, step 1: each chosen on the calibration book's perplexity (held-out text's agrees)
DEFAULT_SENSITIVITY_FLOOR = {3: 1.0, 4: 2.0}


def default_sensitivity_floor(bits: int) -> float:
    """Step 1's floor for tables of `bits` bits (DEFAULT_SENSITIVITY_FLOOR)."""
    return DEFAULT_SENSITIVITY_FLOOR[bits]
MAX_OUTLIERS = 0.1  # beyond 10% the sparse part outweighs the dense codes it is meant to help
LUT_BITS = (3, 4)
_KMEANS_CHUNK_WEIGHTS = 1 << 21  # weights per chunk of rows in k-means: bounds its temporaries (~40 bytes each)


@dataclass(frozen=True)
class SqueezeLLMConfig:
    outliers: float = DEFAULT_OUTLIERS  # fraction of each matrix's weights (largest |w|) kept in the sparse part
    sensitive: float = DEFAULT_SENSITIVE  # and the fraction with the largest Fisher sensitivity (paper: 0.05%)
    kmeans_iters: int = 30  # Lloyd iterations per row table; 1-D k-means from a quantile start settles in a few tens
    chunk_size: int = 1  # sequences per backward: 1 is the per-sequence (empirical) Fisher of the paper
    error_feedback: bool = True  # step 4: GPTQ's column order and OBS updates choose the codes against the table
    # step 1's row-normalised F plus this (0: F as measured); None: default_sensitivity_floor of the layers' bits
    sensitivity_floor: float | None = None
    damp: float = 0.01  # step 4's Hessian dampening, a fraction of mean(diag H) (GPTQ's)

    def __post_init__(self) -> None:
        if not isinstance(self.sensitive, (int, float)) or not 0 <= self.sensitive <= MAX_OUTLIERS:
            raise ValueError(f"the sensitive fraction must be in [0, {MAX_OUTLIERS:g}] ({MAX_OUTLIERS:.0%}; the "
                             f"paper keeps 0.05%), got {self.sensitive!r}")
        if not isinstance(self.outliers, (int, float)) or not 0 <= self.outliers <= MAX_OUTLIERS:
            raise ValueError(f"the outlier fraction must be in [0, {MAX_OUTLIERS:g}] ({MAX_OUTLIERS:.0%}; the paper "
                             f"keeps 0.45%), got {self.outliers!r}")
        floor = self.sensitivity_floor
        if floor is not None and (not isinstance(floor, (int, float)) or not 0 <= floor < float("inf")):
            raise ValueError(f"sensitivity_floor must be a finite number >= 0, got {self.sensitivity_floor!r}")
        if not 0 < self.damp < 1:
            raise ValueError(f"damp must be in (0, 1) (a fraction of mean(diag H)), got {self.damp}")
        for name in ("kmeans_iters", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def parse_outliers(text: str, option: str = "--outliers", paper: str = "0.45%") -> float:
    """'0.45%' or '0.0045' -> 0.0045; a ValueError naming the accepted forms otherwise."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise ValueError(f"{option} {text!r} is not a number: give a percentage such as {paper} or a fraction "
                         f"such as {float(paper[:-1]) / 100:g}") from None
    if not 0 <= value <= MAX_OUTLIERS:
        raise ValueError(f"{option} {text!r}: the fraction of weights kept in float must be between 0 and "
                         f"{MAX_OUTLIERS:.0%} (the paper keeps {paper})")
    return value


# ------------------------------------------------------------------------------------------------ sensitivity

def fisher_diagonal(model: nn.Module, ids: torch.Tensor, names: list[str], chunk_size: int = 1,
                    progress: bool = False) -> dict[str, torch.Tensor]:
    """F [N, K] float32 per named linear: the mean over chunks of ids [S, L] of the squared gradient of the
    next-token loss with respect to its weight (module docstring, step 1). `model` must be unfused and float."""
    from brisk.train.distill import lm_loss
    from brisk.train.forward import check_trainable

    check_trainable(model)  # type: ignore[arg-type]
    weights = [model.get_submodule(n).weight for n in names]
    flags = {p: p.requires_grad for p in model.parameters()}
    fisher = [torch.zeros(w.shape, dtype=torch.float32) for w in weights]
    chunks = list(range(0, ids.shape[0], chunk_size))
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for w in weights:
            w.requires_grad_(True)
        with torch.enable_grad():
            for i, start in enumerate(chunks):
                batch = ids[start:start + chunk_size]  # [B, L]
                loss = lm_loss(model, batch, activation_checkpointing=True)  # type: ignore[arg-type]
                grads = torch.autograd.grad(loss, weights)
                for f, g in zip(fisher, grads, strict=True):
                    f.addcmul_(g.float(), g.float())
                if progress:
                    print(f"\rSqueezeLLM sensitivities: {i + 1}/{len(chunks)} chunks", end="", flush=True)
        if progress:
            print()
    finally:
        for p, flag in flags.items():
            p.requires_grad_(flag)
    return {n: f.div_(len(chunks)) for n, f in zip(names, fisher, strict=True)}


def floored_sensitivity(f: torch.Tensor, floor: float) -> torch.Tensor:
    """F [N, K] divided by its row mean, plus `floor` (module docstring, step 1); floor 0 keeps F as it is."""
    if floor == 0:
        return f
    return f / f.mean(1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) + floor


# ------------------------------------------------------------------------------------------------ k-means

def _assign(w: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """Nearest-centroid codes [R, K] (int64) of w [R, K] for sorted centroids [R, C]: the number of midpoints
    below each weight (a weight on a midpoint takes the lower centroid)."""
    mids = (centroids[:, 1:] + centroids[:, :-1]) * 0.5  # [R, C - 1], sorted
    return torch.searchsorted(mids.contiguous(), w.contiguous())  # [R, K] in [0, C - 1]


def _kmeans_chunk(w: torch.Tensor, weights: torch.Tensor, num_centroids: int, iters: int) -> torch.Tensor:
    """Sorted centroids [R, C] of rows w [R, K] (weights [R, K], each row with some weight > 0).

    In one dimension a cluster of the nearest-centroid assignment is an interval of the sorted row, so once each
    row is sorted and its weights and weighted values are prefix-summed (float64: the sums are differenced), an
    iteration costs O(C log K) a row, not O(K): the cluster boundaries are the midpoints' places in the sorted row
    (`searchsorted`), and a cluster's sums are two prefix-sum lookups.

        sorted row:   | cluster 0 : ws <= m_0 | cluster 1 : m_0 < ws <= m_1 | ... | cluster C-1 : ws > m_{C-2} |
        edges:        0                       b_0                           b_1 ...                          K
    """
    r, k = w.shape
    ws, order = torch.sort(w, dim=1)  # [R, K]
    fs = torch.gather(weights, 1, order).double()  # [R, K]
    zero = torch.zeros(r, 1, dtype=torch.float64)
    cum_f = torch.cat([zero, torch.cumsum(fs, dim=1)], dim=1)  # [R, K + 1]: cum_f[:, i] = sum of the first i
    cum_fw = torch.cat([zero, torch.cumsum(fs * ws.double(), dim=1)], dim=1)  # [R, K + 1]
    # start: the weighted quantiles (i + 1/2) / C, i.e. the first sorted weight whose cumulative weight reaches them
    targets = (torch.arange(num_centroids, dtype=torch.float64) + 0.5) / num_centroids * cum_f[:, -1:]  # [R, C]
    idx = torch.searchsorted(cum_f[:, 1:].contiguous(), targets.contiguous()).clamp_(max=k - 1)  # [R, C]
    c = torch.gather(ws, 1, idx)  # [R, C], ascending
    first = torch.zeros(r, 1, dtype=torch.int64)
    last = torch.full((r, 1), k, dtype=torch.int64)
    for _ in range(iters):
        mids = (c[:, 1:] + c[:, :-1]) * 0.5  # [R, C - 1]
        b = torch.searchsorted(ws, mids.contiguous(), right=True)  # [R, C - 1]: weights <= each midpoint
        edges = torch.cat([first, b, last], dim=1)  # [R, C + 1]
        lo, hi = edges[:, :-1], edges[:, 1:]  # [R, C]: cluster j is sorted positions lo_j .. hi_j - 1
        den = cum_f.gather(1, hi) - cum_f.gather(1, lo)  # [R, C]: sum of F
        num = cum_fw.gather(1, hi) - cum_fw.gather(1, lo)  # [R, C]: sum of F * w
        c = torch.where(den > 0, (num / den.clamp_min(1e-300)).float(), c)  # a centroid with no weight stays
        c = torch.sort(c, dim=1).values  # means of ordered intervals stay ordered; kept centroids may not
    return c


def weighted_kmeans(w: torch.Tensor, weights: torch.Tensor, num_centroids: int, iters: int = 30
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row weighted 1-D k-means (module docstring, step 3). w, weights [R, K] (weights >= 0; a row whose
    weights are all 0 is treated as uniformly weighted) -> (centroids [R, C] float32, ascending; codes [R, K]
    int64). Rows run together, in chunks that bound the temporaries."""
    assert w.shape == weights.shape and w.dim() == 2, "w and weights are [R, K]"
    w = w.detach().float()
    weights = weights.detach().float().clamp_min(0)
    dead = weights.sum(1, keepdim=True) == 0  # [R, 1]
    weights = torch.where(dead, torch.ones_like(weights), weights)
    r, k = w.shape
    step = max(1, _KMEANS_CHUNK_WEIGHTS // max(k, 1))
    cents = torch.cat([_kmeans_chunk(w[r0:r0 + step], weights[r0:r0 + step], num_centroids, iters)
                       for r0 in range(0, r, step)])
    return cents, _assign(w, cents)


# ------------------------------------------------------------------------------------------------ one layer

def outlier_mask(w: torch.Tensor, fraction: float) -> torch.Tensor:
    """bool [N, K]: the round(fraction * N * K) weights of largest magnitude (ties: topk's choice)."""
    return top_mask(w.detach().abs(), fraction)


def top_mask(score: torch.Tensor, fraction: float) -> torch.Tensor:
    """bool, score's shape: the round(fraction * numel) entries of largest score (ties: topk's choice)."""
    count = round(fraction * score.numel())
    mask = torch.zeros(score.numel(), dtype=torch.bool)
    if count:
        mask[torch.topk(score.flatten().float(), count, sorted=False).indices] = True
    return mask.view(score.shape)


@dataclass
class LutCodes:
    """One layer's SqueezeLLM result: codes [N, K] uint8, table [N, 2^bits] (float16 values, held as float32),
    the outliers' residual S [N, K] (float16 values, zero elsewhere) and w_hat = table[codes] + S."""

    codes: torch.Tensor
    lut: torch.Tensor
    sparse: torch.Tensor
    w_hat: torch.Tensor


def squeezellm_quantize_weight(weight: torch.Tensor, sensitivity: torch.Tensor, bits: int,
                               outliers: float = DEFAULT_OUTLIERS, iters: int = 30,
                               keep: torch.Tensor | None = None) -> LutCodes:
    """SqueezeLLM of one weight [N, K] given its sensitivity F [N, K] (module docstring, steps 2 and 3); keep: more
    positions for the sparse part (bool [N, K], the most sensitive weights), besides the `outliers` by magnitude."""
    if bits not in LUT_BITS:
        raise ValueError(f"SqueezeLLM tables are 3- or 4-bit here (8 or 16 entries a row), got {bits} bits")
    w = weight.detach().float()
    mask = outlier_mask(w, outliers)  # [N, K]
    if keep is not None:
        mask |= keep
    f = torch.where(mask, torch.zeros_like(w), sensitivity.detach().float())  # outliers take no part
    lut, _ = weighted_kmeans(w, f, 1 << bits, iters)
    lut = torch.sort(lut.half().float(), dim=1).values  # the checkpoint's float16 table, and codes against it
    codes = _assign(w, lut)  # [N, K]
    dense = torch.gather(lut, 1, codes)  # [N, K]
    sparse = torch.where(mask, (w - dense).half().float(), torch.zeros_like(w))
    return LutCodes(codes.to(torch.uint8), lut, sparse, dense + sparse)


def squeezellm_gptq_weight(weight: torch.Tensor, hessian: torch.Tensor, sensitivity: torch.Tensor, bits: int,
                           outliers: float = DEFAULT_OUTLIERS, iters: int = 30, damp: float = 0.01,
                           block_size: int = 128, keep: torch.Tensor | None = None) -> LutCodes:
    """SqueezeLLM's table and outliers for weight [N, K] (steps 2 and 3), its codes chosen with error feedback
    against the layer's input Hessian H [K, K] (module docstring, step 4); keep as squeezellm_quantize_weight's."""
    from brisk.quant.gptq import _inverse_hessian_factor, obs_columns

    if bits not in LUT_BITS:
        raise ValueError(f"SqueezeLLM tables are 3- or 4-bit here (8 or 16 entries a row), got {bits} bits")
    w = weight.detach().float().clone()  # [N, K]
    n, k = w.shape
    mask = outlier_mask(w, outliers)  # [N, K], from the original weights
    if keep is not None:
        mask |= keep
    f = torch.where(mask, torch.zeros_like(w), sensitivity.detach().float())
    lut, _ = weighted_kmeans(w, f, 1 << bits, iters)
    lut = torch.sort(lut.half().float(), dim=1).values  # [N, C]: the checkpoint's float16 table
    mids = (lut[:, 1:] + lut[:, :-1]) * 0.5  # [N, C - 1]
    h = hessian.detach().float().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0  # an input that was always 0: its weights cannot matter
    perm = torch.argsort(h.diagonal(), descending=True)  # act-order: the most activated inputs first
    w, mask_p = w[:, perm], mask[:, perm]
    u = _inverse_hessian_factor(h[perm][:, perm], damp)  # [K, K] upper
    codes = torch.empty(n, k, dtype=torch.int64)
    kept = torch.zeros(n, k)  # the outliers' float16 residuals over their table entry

    def error_of(col: int, w1: torch.Tensor, i: int) -> torch.Tensor:
        wc = w1[:, i]
        q = (wc[:, None] > mids).sum(1)  # [N]: the nearest entry (a midpoint takes the lower one)
        v = lut.gather(1, q[:, None])[:, 0]
        residual = torch.where(mask_p[:, col], (wc - v).half().float(), torch.zeros_like(v))
        codes[:, col] = q
        kept[:, col] = residual
        return wc - v - residual

    obs_columns(w, u, block_size, error_of)
    inv = torch.argsort(perm)
    codes, sparse = codes[:, inv].contiguous(), kept[:, inv].contiguous()
    dense = torch.gather(lut, 1, codes)
    return LutCodes(codes.to(torch.uint8), lut, sparse, dense + sparse)


def squeezellm_apply(plan: dict[str, LayerQuant], fisher: dict[str, torch.Tensor], config: SqueezeLLMConfig,
                     encoded: dict[str, dict[str, torch.Tensor]], keep: dict[str, torch.Tensor] | None = None
                     ) -> Callable[[BlockContext], None]:
    """The per-block step of step 4 for calib.run_layerwise (as quant/gptq.py's `gptq_apply`): each stage's planned
    linears coded against their observed input Hessian, Ŵ written into the model so later stages and blocks see the
    quantized layer."""
    from brisk.quant.gptq import stacked_problems

    def apply(ctx: BlockContext) -> None:
        for prob in stacked_problems(ctx, fisher.__contains__, lambda name: plan[name].bits, "squeezellm"):
            sens = torch.cat([fisher.pop(f"{prob.prefix}.{n}") for n in prob.members])
            kept = torch.cat([keep.pop(f"{prob.prefix}.{n}") for n in prob.members]) if keep else None
            r = squeezellm_gptq_weight(prob.weight, prob.hessian, sens, int(prob.key), config.outliers,
                                       config.kmeans_iters, config.damp, keep=kept)
            prob.write(r.w_hat, lambda name, rows, r=r: encode_lut_layer(r.codes[rows], r.lut[rows], r.sparse[rows],
                                                                         plan[name]), encoded)
    return apply


def sensitivity_weighted_error(weight: torch.Tensor, w_hat: torch.Tensor, sensitivity: torch.Tensor) -> float:
    """sum F (W - W_hat)^2: the paper's objective, the second-order estimate of the loss change (up to 1/2)."""
    return float((sensitivity.float() * (weight.float() - w_hat.float()).square()).sum())


# ------------------------------------------------------------------------------------------------ the model

def squeezellm_quantize(loaded: LoadedModel, plan: dict[str, LayerQuant], default: LayerQuant, calib: CalibConfig,
                        config: SqueezeLLMConfig = SqueezeLLMConfig(), progress: bool = True
                        ) -> tuple[dict[str, torch.Tensor], QuantizationConfig]:
    """Checkpoint tensors and config: every planned decoder linear (scheme "lut") in SqueezeLLM's format, the
    embedding/head with RTN's codes. `loaded` must be unfused (load_model(..., fuse=False)), float."""
    from brisk.quant.rtn import _progress, checkpoint_tensors

    names = [n for n, spec in plan.items() if spec.scheme == "lut"]
    floor = default_sensitivity_floor(default.bits) if config.sensitivity_floor is None else config.sensitivity_floor
    config = replace(config, sensitivity_floor=floor)  # recorded as used
    ids = load_calibration_ids(loaded.tokenizer, calib)  # [S, L]
    fisher = fisher_diagonal(loaded.model, ids, names, config.chunk_size, progress=progress)
    # the most sensitive weights by the Fisher as measured, per matrix (the paper's sensitive values)
    keep = {name: top_mask(f, config.sensitive) for name, f in fisher.items()} if config.sensitive else {}
    for name, f in fisher.items():
        fisher[name] = floored_sensitivity(f, floor)
    encoded: dict[str, dict[str, torch.Tensor]] = {}
    if config.error_feedback:
        from brisk.quant.calib import run_layerwise

        run_layerwise(loaded.model, ids, squeezellm_apply(plan, fisher, config, encoded, keep), calib.batch_size,
                      progress=progress, label="SqueezeLLM")
    rest = [n for n in names if n in fisher]  # (all of them without error feedback)
    for name in _progress(rest, progress and bool(rest), "SqueezeLLM"):
        result = squeezellm_quantize_weight(loaded.model.get_submodule(name).weight, fisher.pop(name),
                                            plan[name].bits, config.outliers, config.kmeans_iters,
                                            keep.pop(name, None))
        encoded[name] = encode_lut_layer(result.codes, result.lut, result.sparse, plan[name])
    qconfig = QuantizationConfig(method="squeezellm", default=default, modules=dict(plan),
                                 calibration=calib.to_dict(), method_config=config.to_dict())
    return checkpoint_tensors(loaded, plan, encoded), qconfig
