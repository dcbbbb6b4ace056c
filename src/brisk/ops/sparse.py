"""Sparse linear layers: a pruned weight stored as bitmask + packed nonzeros, multiplied without its zeros.

Batch-1 decode is bound by memory bandwidth, so 50% zeros only buy speed if fewer bytes are read. `compress`
turns a float weight with zeros into the layout of ops/csrc/sparse_linear.cpp (a bit per weight saying "stored",
the stored values in row order, one int64 offset per row); `compress_packed` does the same for a quantized
weight (`PackedWeight` of ops/qlinear.py), keeping its codes and group scales. Bytes per weight at 50%:

    float32   4 -> 2.13          int8 (per channel)   1 -> 0.63          int4 (g64)   0.63 -> 0.50

`sparse_linear` then runs
- few activation rows (decode, M <= MAX_SMALL_M): the C++ kernel, which expands each mask byte's values in
  registers (a permute from a 256-entry table) and never forms the dense weight;
- many rows (prefill): densify (C++) a chunk of rows and multiply with oneDNN (ops.linear.dense_gemm; MKL where
  oneDNN is missing), as the quantized path does: at large M the GEMM is compute-bound and the O(N K) densify is a
  small share of it (a 128-token prefill of the 50%-pruned default model: 75 ms of linears, 236 ms with MKL);
- the reference path (torch densify + F.linear) when the kernels are disabled or did not build, or off the CPU.

`sparsify_model` swaps, at load time, every decoder linear layer whose zero fraction reaches the threshold at
which the kernel was measured faster than the dense path (MIN_SPARSITY); the dense layer stays the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from brisk.ops import sparse_q8
from brisk.ops.kernels import get_op
from brisk.ops.linear import dense_gemm

COLS = 8  # columns per mask byte
MAX_SMALL_M = 8  # activation rows the kernel takes in one pass (one accumulator each); beyond, densify + GEMM
# Sparsity from which a layer is converted at load, per value kind (32 = float32 values; 8 = int8 values; 4 = 2- to
# 4-bit codes); None = never automatically. Chosen from `brisk bench sparse --kernels` (M = 1, the default model's
# shapes, weights far beyond the caches; figures in BENCHMARKS.md): the float32 kernel is level with the dense GEMV
# near 20% zeros and faster from 30%, so 30% leaves a margin. For codes, the decode (a table lookup, a shuffle and
# a conversion per 8 weights) costs more than the bytes it saves against brisk's dense int8/int4 kernels, which
# already run near the bandwidth limit, so quantized layers stay dense unless asked (`sparsify_model(...,
# min_sparsity=...)`, as `brisk bench sparse` does to measure them); the integer-dot kernel for int8 values
# (ops/sparse_q8.py, `int8_dot=True`) rounds x, so it stays opt-in.
MIN_SPARSITY: dict[int, float | None] = {32: 0.3, 8: None, 4: None}


@dataclass(eq=False)
class SparseWeight:
    """A [out_features, in_features] weight in the layout of ops/csrc/sparse_linear.cpp."""

    kind: int  # 32: float32 values; 8: signed values, w = scale * v; 4: 4-bit codes, w = scale * q + min
    out_features: int
    in_features: int
    mask: torch.Tensor  # uint8 [N, K / 8]: bit l of byte b <=> column 8 b + l is stored
    row_ptr: torch.Tensor  # int64 [N + 1]: row n's values are entries row_ptr[n] .. row_ptr[n + 1] - 1
    # float32 [nnz + 8]; int8 values (as uint8) [nnz + 32]; 4-bit codes, two per byte, [nnz / 2 + 8]: padded
    values: torch.Tensor
    scales: torch.Tensor | None = None  # float32 [N, K / G] (kinds 8 and 4)
    mins: torch.Tensor | None = None  # float32 [N, K / G] (kind 4)
    group_size: int = 0  # codes: columns per scale group (a multiple of 8); 0 for float32

    @property
    def nnz(self) -> int:
        return int(self.row_ptr[-1])

    def nbytes(self) -> int:
        """Bytes of every tensor the weight holds (what a decode step reads)."""
        tensors = [self.mask, self.row_ptr, self.values, self.scales, self.mins]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _mask_bits(keep: torch.Tensor) -> torch.Tensor:
    """bool [N, K] -> uint8 [N, K / 8], bit l of byte b = keep[:, 8 b + l]."""
    n, k = keep.shape
    weights = (1 << torch.arange(COLS, dtype=torch.int32)).to(torch.uint8)
    return (keep.view(n, k // COLS, COLS).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def _keep_from_mask(mask: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 [N, K / 8] -> bool [N, K] (inverse of _mask_bits)."""
    shifts = torch.arange(COLS, dtype=torch.uint8)
    return ((mask[..., None] >> shifts) & 1).bool().reshape(mask.shape[0], in_features)  # [N, K/8, 8] -> [N, K]


def _row_ptr(keep: torch.Tensor) -> torch.Tensor:
    counts = keep.sum(dim=1, dtype=torch.int64)  # [N]
    return torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])  # [N + 1]


def _check_shape(n: int, k: int) -> None:
    if k % COLS:
        raise ValueError(f"sparse weights need in_features divisible by {COLS}, got {k}")
    if n < 1 or k < 1:
        raise ValueError(f"weight must be non-empty, got [{n}, {k}]")


def compress(weight: torch.Tensor) -> SparseWeight:
    """Float weight [N, K] (K % 8 == 0) with zeros -> SparseWeight of float32 values (exact: no rounding)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-d [out_features, in_features], got shape {list(weight.shape)}")
    n, k = weight.shape
    _check_shape(n, k)
    w = weight.detach().cpu().float()
    keep = w != 0  # [N, K]
    values = w[keep]  # row-major boolean indexing = CSR order
    values = torch.cat([values, values.new_zeros(COLS)])  # padding: the kernel loads 8 entries at a time
    return SparseWeight(kind=32, out_features=n, in_features=k, mask=_mask_bits(keep), row_ptr=_row_ptr(keep),
                        values=values)


def compress_codes(q: torch.Tensor, keep: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
                   group_size: int) -> SparseWeight:
    """Unsigned codes q [N, K] (uint8, < 2^bits), the stored positions `keep` [N, K] and the affine group params
    (w = scale * q + min, [N, K / G]) -> SparseWeight.

    8-bit codes become signed values v = q - zero (kind 8, w = scale * v: the kernel's cheap path), which needs
    integer zero points with every q - zero in [-128, 127], as symmetric codes (zero 128) have; 2- to 4-bit codes
    stay unsigned with their mins (kind 4)."""
    n, k = q.shape
    _check_shape(n, k)
    if group_size % COLS or k % group_size:
        raise ValueError(f"group_size must be a multiple of {COLS} dividing in_features {k}, got {group_size}")
    if bits not in (8, 4, 3, 2):
        raise ValueError(f"bits must be 8, 4, 3 or 2, got {bits}")
    scales = scales.float().contiguous()
    mask, row_ptr = _mask_bits(keep), _row_ptr(keep)
    if bits == 8:
        zero = -mins.float() / scales.clamp_min(torch.finfo(torch.float32).tiny)  # [N, K / G]
        if not bool((zero == zero.round()).all()):
            zero = zero.round()
            if not torch.allclose(-scales * zero, mins.float(), rtol=1e-6, atol=0.0):
                raise ValueError("8-bit sparse values need integer zero points (mins = -scale * zero)")
        v = q.view(n, k // group_size, group_size).to(torch.int32) - zero.round().to(torch.int32)[..., None]
        v = v.reshape(n, k)[keep]  # [nnz], row order
        if v.numel() and (v.min() < -128 or v.max() > 127):
            raise ValueError("8-bit sparse values need q - zero in [-128, 127] (symmetric codes); "
                             "asymmetric 8-bit codes have no sparse kernel")
        # 32 bytes of padding: sparse_q8.cpp's AVX-512 path loads 32 bytes at a time
        values = torch.cat([v.to(torch.int8), torch.zeros(4 * COLS, dtype=torch.int8)]).view(torch.uint8)
        return SparseWeight(kind=8, out_features=n, in_features=k, mask=mask, row_ptr=row_ptr, values=values,
                            scales=scales, group_size=group_size)
    codes = q[keep].to(torch.uint8)  # [nnz] in row order
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    codes = codes[0::2] | (codes[1::2] << 4)  # even entry in the low nibble
    values = torch.cat([codes, codes.new_zeros(COLS)])
    return SparseWeight(kind=4, out_features=n, in_features=k, mask=mask, row_ptr=row_ptr, values=values,
                        scales=scales, mins=mins.float().contiguous(), group_size=group_size)


def compress_packed(pw) -> SparseWeight | None:  # noqa: ANN001 - brisk.ops.qlinear.PackedWeight
    """A quantized weight -> SparseWeight keeping its codes, or None when the format has no sparse kernel
    (codebook / NF4 codes, group sizes that are not a multiple of 8). A weight is pruned where it dequantizes to
    exactly 0: then q == zero point (scale * q + min with min = -scale * zero cancels exactly)."""
    from brisk.ops.qlinear import dequantize_packed, unpack_codes

    if pw.codebook is not None or pw.group_size % COLS or pw.in_features % COLS:
        return None
    keep = dequantize_packed(pw) != 0  # [N, K]
    try:
        return compress_codes(unpack_codes(pw), keep, pw.group_scales().float(), pw.mins, pw.bits, pw.group_size)
    except ValueError:  # asymmetric 8-bit codes: no sparse kernel, the layer stays dense
        return None


def _stored(sw: SparseWeight) -> torch.Tensor:
    """The nnz stored entries as float32 values (float kind) or integer codes (as float32)."""
    nnz = sw.nnz
    if sw.kind == 32:
        return sw.values[:nnz]
    if sw.kind == 8:
        return sw.values.view(torch.int8)[:nnz].float()
    pairs = sw.values[: (nnz + 1) // 2]
    return torch.stack([pairs & 0xF, pairs >> 4], dim=-1).reshape(-1)[:nnz].float()  # [nnz/2, 2] -> [nnz]


def densify_reference(sw: SparseWeight) -> torch.Tensor:
    """Pure-PyTorch float32 [N, K] weight of a SparseWeight (the oracle of the kernels)."""
    n, k = sw.out_features, sw.in_features
    keep = _keep_from_mask(sw.mask, k)  # [N, K]
    if sw.kind == 32:
        w = torch.zeros(n, k, dtype=torch.float32)
        w[keep] = _stored(sw)
        return w
    q = torch.zeros(n, k, dtype=torch.float32)
    q[keep] = _stored(sw)
    assert sw.scales is not None, "a code SparseWeight carries scales"
    g = sw.group_size
    if sw.kind == 8:
        w = (q.view(n, k // g, g) * sw.scales[..., None]).reshape(n, k)  # [N, K/G, G]
        return torch.where(keep, w, torch.zeros((), dtype=w.dtype))
    assert sw.mins is not None, "4-bit codes carry mins"
    w = torch.addcmul(sw.mins[..., None], q.view(n, k // g, g), sw.scales[..., None]).reshape(n, k)  # [N, K/G, G]
    return torch.where(keep, w, torch.zeros((), dtype=w.dtype))


def densify(sw: SparseWeight, n0: int = 0, n1: int | None = None) -> torch.Tensor:
    """float32 [n1 - n0, K]: rows n0 .. n1 - 1 of the weight (C++ when built, else the reference)."""
    n1 = sw.out_features if n1 is None else n1
    op = get_op("sparse_densify")
    if op is None:
        return densify_reference(sw)[n0:n1]
    scales = None if sw.scales is None else sw.scales[n0:n1]
    mins = None if sw.mins is None else sw.mins[n0:n1]
    return op(sw.mask[n0:n1], sw.row_ptr[n0:n1 + 1], sw.values, scales, mins, sw.kind, sw.group_size,
              sw.in_features)


# rows densified at a time on the large-M path: 2^21 float32 weights (8 MiB) stay in the last-level cache between
# the densify that writes them and the GEMM that reads them (the quantized path's choice)
_DENSIFY_CHUNK_WEIGHTS = 1 << 21


def sparse_linear(x: torch.Tensor, sw: SparseWeight, bias: torch.Tensor | None = None,
                  int8_dot: bool = False) -> torch.Tensor:
    """x: [..., K] (float32 or bfloat16) @ W^T (+ bias) -> [..., N] in x's dtype; float32 arithmetic. `int8_dot`:
    int8 values at decode (few rows) take ops.sparse_q8's integer dot products instead, with x rounded to int8 per
    32 columns (faster than the float kernel, but not exact; see ops/sparse_q8.py)."""
    k, n = sw.in_features, sw.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features in its last dim, this weight expects {k}")
    rows = x.numel() // k
    bf = None if bias is None else bias.float()
    if x.is_cpu and 0 < rows <= MAX_SMALL_M:
        if int8_dot and sparse_q8.covers(sw):  # int8 values: integer dot products with int8 activations
            out = sparse_q8.sparse_q8_linear(x.reshape(rows, k).float().contiguous(), sw, bf)  # [M, N]
            if out is not None:
                return out.view(*x.shape[:-1], n).to(x.dtype)
        op = get_op("sparse_linear")
        if op is not None:
            x2 = x.reshape(rows, k).float().contiguous()  # [M, K]
            out = op(x2, sw.mask, sw.row_ptr, sw.values, sw.scales, sw.mins, sw.kind, sw.group_size, bf)  # [M, N]
            return out.view(*x.shape[:-1], n).to(x.dtype)
    xf = x.float()
    if x.is_cpu and get_op("sparse_densify") is not None:
        step = max(1, _DENSIFY_CHUNK_WEIGHTS // k)
        parts = [dense_gemm(xf, densify(sw, n0, min(n, n0 + step)), None if bf is None else bf[n0:n0 + step])
                 for n0 in range(0, n, step)]  # each [..., rows of the chunk]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [..., N]
        return out.to(x.dtype)
    w = densify_reference(sw).to(x.device)  # [N, K]
    return F.linear(xf, w, None if bf is None else bf.to(x.device)).to(x.dtype)


def zero_fraction(module: nn.Module) -> float | None:
    """Fraction of exactly-zero weights of a linear layer (float nn.Linear or quant.layers.QuantLinear), None for
    anything else."""
    if isinstance(module, nn.Linear):
        w = module.weight
        return 1.0 - torch.count_nonzero(w).item() / w.numel()
    packed = getattr(module, "packed", None)
    if packed is not None and packed.codebook is None:  # affine codes
        from brisk.ops.qlinear import dequantize_packed

        w = dequantize_packed(packed)
        return 1.0 - torch.count_nonzero(w).item() / w.numel()
    return None


def _row_sample_zero_fraction(w: torch.Tensor, every: int = 8) -> float:
    """Zero fraction of every `every`-th row of `w`: the load's quick look before `zero_fraction`'s exact count,
    which reads every weight (a 1B float32 model: 0.46 of a 1.25 s load that maps its weights). Pruning spreads its
    zeros over the rows (unstructured, N:M) or zeroes whole rows or columns (structured), so the sample estimates
    the fraction well; a dense layer leaves after reading an eighth of its bytes."""
    rows = w[::every] if w.dim() == 2 and w.shape[0] >= 8 * every else w
    return 1.0 - torch.count_nonzero(rows).item() / max(1, rows.numel())


def to_sparse_module(module: nn.Module, min_sparsity: dict[int, float | None] | None = None,
                     int8_dot: bool = False) -> nn.Module | None:
    """The SparseLinear for a linear layer whose zero fraction reaches the threshold of its value kind, else None.
    `int8_dot`: int8 layers decode through ops.sparse_q8 (integer dot products, x rounded to int8)."""
    from brisk.ops.layers import SparseLinear  # the module class sits with the other runtime linears

    thresholds = MIN_SPARSITY if min_sparsity is None else min_sparsity
    if getattr(module, "in_features", 1) % COLS:
        return None
    packed = getattr(module, "packed", None)
    if packed is not None:  # quant.layers.QuantLinear
        threshold = thresholds.get(8 if packed.bits == 8 else 4)
        if threshold is None:
            return None
        frac = zero_fraction(module)
        if frac is None or frac < threshold:
            return None
        sw = compress_packed(packed)
        return None if sw is None else SparseLinear(sw, module.bias, label=getattr(module.spec, "label", ""),
                                                    int8_dot=int8_dot)
    if isinstance(module, nn.Linear):
        threshold = thresholds.get(32)
        # bfloat16 models keep the dense path: float32 values would double their bytes
        if threshold is None or module.weight.dtype != torch.float32:
            return None
        if _row_sample_zero_fraction(module.weight) < threshold / 2:
            return None  # far from sparse enough in a look at every 8th row: not worth the exact count of all
        frac = zero_fraction(module)
        if frac is None or frac < threshold:
            return None
        return SparseLinear(compress(module.weight), module.bias)
    return None


def sparsify_model(model: nn.Module, min_sparsity: dict[int, float | None] | None = None,
                   int8_dot: bool = False) -> int:
    """Swap, in place, every linear layer inside the decoder layers (`model.model.layers`; never the embedding or
    lm_head, which pruning leaves dense) whose zero fraction reaches `min_sparsity` for a SparseLinear. Run after
    fuse_projections: a fused q/k/v or gate/up layer of pruned parts is as sparse as its parts. Returns the count."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return 0
    done = 0
    for parent in layers.modules():
        for name, child in list(parent.named_children()):
            sparse = to_sparse_module(child, min_sparsity, int8_dot)
            if sparse is not None:
                setattr(parent, name, sparse)
                done += 1
    return done
