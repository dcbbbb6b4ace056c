"""Lookup-table quantized linear (SqueezeLLM's dense-and-sparse format): W = LUT[q] + S.

A weight [N, K] is held as
- codes q [N, K], one 4-bit field per weight (3-bit codes too: one decoder for both), packed two a byte
  (`pack_nibbles`: byte j of a row = q[2 j] | q[2 j + 1] << 4);
- a table per output row, lut [N, E] float32, E = 2^bits (8 or 16): w_dense[n, k] = lut[n, q[n, k]];
- the outliers, a CSR matrix S (row_ptr int32 [N + 1], cols int32 [nnz], values float32 [nnz]) added to the
  dense part: W = w_dense + S. No outliers: the three are None.

`lut_linear` runs
- few activation rows (decode, M <= MAX_SMALL_M): the C++ kernel of ops/csrc/lut_linear.cpp, which decodes the
  codes through the row's table in registers and adds the row's outliers, reading every weight once (float32
  products on AVX2, bfloat16 ones on AVX-512 with BF16);
- many rows (prefill): the weights dequantized (C++) a chunk of rows at a time, then the GEMM, as the affine
  formats do (ops/qlinear.py): at large M the decode is a small part of the O(M N K) product;
- the reference path (gather from the tables, scatter the outliers, F.linear in float32) when the kernels are off
  or did not build, off the CPU, or for K not a multiple of 8.

With int8 activations (`lut_linear_q8`, the engine's `quant_activations` for these layers) x is rounded to int8 per
32 columns as for the affine int4 kernels (ops/qlinear_q8.py) and each row's table to uint8 once
(`quantize_tables`): the kernel then multiplies bytes with integer dot products (lut_linear.cpp: vpermb tables on
AVX-512 VBMI, vpshufb ones on the other builds, with vpdpbusd where the tier has VNNI), and every other path (many
rows, the kernels off) computes the same function in float: the rounded x times the rounded tables plus the outliers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from brisk.ops.kernels import get_op
from brisk.ops.linear import dense_gemm

MAX_SMALL_M = 16  # as the affine kernel's limit (ops/qlinear.py): past it, dequantize + GEMM
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_DEQUANT_CHUNK_WEIGHTS = 1 << 21  # rows dequantized at a time on the large-M path (8 MiB of float32)


@dataclass(eq=False)
class LutWeight:
    """A [out_features, in_features] weight as per-row tables, 4-bit codes and float outliers (module docstring)."""

    bits: int  # 3 or 4: lut has 2^bits entries a row
    out_features: int
    in_features: int
    codes: torch.Tensor  # uint8 [N, K / 2], two codes a byte (pack_nibbles)
    lut: torch.Tensor  # float32 [N, 2^bits]
    row_ptr: torch.Tensor | None = None  # int32 [N + 1]: row n's outliers are cols / values[row_ptr[n]:row_ptr[n+1]]
    cols: torch.Tensor | None = None  # int32 [nnz]
    values: torch.Tensor | None = None  # float32 [nnz]

    def __post_init__(self) -> None:
        n, k = self.out_features, self.in_features
        assert self.bits in (3, 4), f"LUT codes are 3 or 4 bits, got {self.bits}"
        assert k % 2 == 0 and self.codes.dtype == torch.uint8 and tuple(self.codes.shape) == (n, k // 2), \
            f"codes must be uint8 [{n}, {k // 2}], got {self.codes.dtype} {list(self.codes.shape)}"
        assert self.lut.dtype == torch.float32 and tuple(self.lut.shape) == (n, 1 << self.bits), \
            f"lut must be float32 [{n}, {1 << self.bits}], got {self.lut.dtype} {list(self.lut.shape)}"
        parts = (self.row_ptr, self.cols, self.values)
        assert all(t is None for t in parts) or all(t is not None for t in parts), "row_ptr, cols, values together"
        if self.row_ptr is not None:
            assert self.cols is not None and self.values is not None
            assert self.row_ptr.dtype == torch.int32 and self.row_ptr.numel() == n + 1, "row_ptr: int32 [N + 1]"
            assert self.cols.dtype == torch.int32 and self.values.dtype == torch.float32, "cols int32, values float32"

    @property
    def nnz(self) -> int:
        """Outliers held in the sparse part."""
        return 0 if self.values is None else self.values.numel()

    def nbytes(self) -> int:
        """Bytes of every tensor this weight holds."""
        tensors = (self.codes, self.lut, self.row_ptr, self.cols, self.values)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (values < 16, K even) -> uint8 [N, K / 2], byte j = q[2 j] | q[2 j + 1] << 4."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: uint8 [N, K / 2] -> codes [N, K] uint8."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)  # [N, K/2, 2] -> [N, K]


def csr_from_dense(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A dense [N, K] matrix's nonzeros as CSR (row_ptr int32 [N + 1], cols int32 [nnz], values float32 [nnz]),
    row-major order."""
    rows, cols = s.nonzero(as_tuple=True)  # row-major
    counts = torch.bincount(rows, minlength=s.shape[0])
    row_ptr = torch.zeros(s.shape[0] + 1, dtype=torch.int64)
    row_ptr[1:] = counts.cumsum(0)
    return row_ptr.to(torch.int32), cols.to(torch.int32), s[rows, cols].float()


def dequantize_lut(lw: LutWeight, rows: slice | None = None) -> torch.Tensor:
    """Reference dequantization of rows [n0, n1) (default: all) to float32 [n1 - n0, K]: a gather from each row's
    table, plus the rows' outliers."""
    n0, n1, _ = (rows or slice(0, lw.out_features)).indices(lw.out_features)
    q = unpack_nibbles(lw.codes[n0:n1]).long()  # [R, K]
    w = torch.gather(lw.lut[n0:n1], 1, q)  # [R, K]: w[r, k] = lut[r, q[r, k]]
    if lw.row_ptr is not None:
        assert lw.cols is not None and lw.values is not None
        start, end = int(lw.row_ptr[n0]), int(lw.row_ptr[n1])
        counts = (lw.row_ptr[n0 + 1:n1 + 1] - lw.row_ptr[n0:n1]).long()  # [R]
        r = torch.repeat_interleave(torch.arange(n1 - n0), counts)  # [nnz of the rows]
        w.index_put_((r, lw.cols[start:end].long()), lw.values[start:end], accumulate=True)
    return w


def _sparse_args(lw: LutWeight) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    return lw.row_ptr, lw.cols, lw.values


def lut_linear(x: torch.Tensor, lw: LutWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., K] (float32 or bfloat16) @ W^T (+ bias) -> [..., N] in x's dtype. Float32 arithmetic, except the
    AVX-512 build's small-row kernel: bfloat16 tables and activations, float32 sums (ops/csrc/lut_linear.cpp)."""
    k = lw.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features in its last dim, this weight expects {k}")
    if x.is_cpu and lw.codes.is_cpu and x.dtype in _KERNEL_DTYPES and k % 8 == 0:
        if x.numel() <= MAX_SMALL_M * k:
            op = get_op("lut_linear")
            if op is not None:
                return op(x, lw.codes, lw.lut, *_sparse_args(lw), bias)
        else:
            op = get_op("lut_dequantize")
            if op is not None:
                xf = x.float()
                bf = None if bias is None else bias.float()
                step = max(1, _DEQUANT_CHUNK_WEIGHTS // k)
                parts = []
                for n0 in range(0, lw.out_features, step):
                    n1 = min(lw.out_features, n0 + step)
                    w = op(lw.codes, lw.lut, *_sparse_args(lw), n0, n1)  # [n1 - n0, K]
                    parts.append(dense_gemm(xf, w, None if bf is None else bf[n0:n1]))
                out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [..., N]
                return out.to(x.dtype)
    w = dequantize_lut(lw).to(x.device)  # [N, K]
    return F.linear(x.float(), w, None if bias is None else bias.float().to(x.device)).to(x.dtype)


def concat_rows(parts: list[LutWeight]) -> LutWeight:
    """One LutWeight with the rows of `parts` stacked (load-time q/k/v and gate/up fusion)."""
    first = parts[0]
    assert all(p.bits == first.bits and p.in_features == first.in_features for p in parts), "fused parts differ"
    if len(parts) == 1:
        return first
    sparse = [p for p in parts if p.row_ptr is not None]
    row_ptr = cols = values = None
    if sparse:
        ptrs, offset = [torch.zeros(1, dtype=torch.int64)], 0
        cols_l, values_l = [], []
        for p in parts:
            if p.row_ptr is None:
                ptrs.append(torch.full((p.out_features,), offset, dtype=torch.int64))
                continue
            assert p.cols is not None and p.values is not None
            ptrs.append(p.row_ptr[1:].long() + offset)
            offset += p.nnz
            cols_l.append(p.cols)
            values_l.append(p.values)
        row_ptr = torch.cat(ptrs).to(torch.int32)
        cols, values = torch.cat(cols_l), torch.cat(values_l)
    return LutWeight(bits=first.bits, out_features=sum(p.out_features for p in parts), in_features=first.in_features,
                     codes=torch.cat([p.codes for p in parts]), lut=torch.cat([p.lut for p in parts]),
                     row_ptr=row_ptr, cols=cols, values=values)


QLUT_BYTES = 20  # a row of quantize_tables' uint8 table: 16 table bytes, then the row's float32 scale


@dataclass(eq=False)
class RoundedTables:
    """The tables of one LutWeight rounded for int8 activations (quantize_tables)."""

    qlut: torch.Tensor  # uint8 [N, 20]: u = round(lut / t) + 128 (16 bytes; a 3-bit row's 8 .. 15 hold 128), then t
    weight: LutWeight  # the same codes and outliers with the rounded float tables t * (u - 128)


def quantize_tables(lw: LutWeight) -> RoundedTables:
    """Round every row's table to uint8 with zero point 128 and the row's scale t = max|lut| / 127, as the int8
    table kernel reads it (ops/csrc/lut_linear.cpp): entries t * (u - 128), u in 1 .. 255. A 3-bit or 4-bit
    non-uniform table moves by at most t / 2 = max|lut| / 254 per entry."""
    lut = lw.lut
    t = lut.abs().amax(dim=1) / 127.0  # [N] float32
    inv = torch.where(t > 0, 1.0 / t.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(t))
    u = (torch.round(lut * inv[:, None]).clamp(-127, 127) + 128).to(torch.uint8)  # [N, E]
    qlut = torch.full((lw.out_features, QLUT_BYTES), 128, dtype=torch.uint8)
    qlut[:, :u.shape[1]] = u
    qlut[:, 16:] = t.contiguous().view(torch.uint8).view(-1, 4)
    rounded = t[:, None] * (u.float() - 128.0)  # [N, E]
    return RoundedTables(qlut, LutWeight(lw.bits, lw.out_features, lw.in_features, lw.codes, rounded.contiguous(),
                                         lw.row_ptr, lw.cols, lw.values))


def lut_linear_q8(x: torch.Tensor, tables: RoundedTables, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (K % 32 == 0) rounded to int8 per 32 columns, times the rounded tables plus the outliers (+ bias)
    -> [..., N] in x's dtype. Few rows where the kernels are built: the integer kernel (exact int32 sums per block);
    otherwise the rounded x through lut_linear's paths: the same function, up to their float rounding."""
    from brisk.ops.qlinear_q8 import fake_quantize_activations

    lw = tables.weight
    k = lw.in_features
    if x.shape[-1] != k or k % 32:
        raise ValueError(f"x has {x.shape[-1]} features, this weight expects {k} (int8 activations: a multiple of 32)")
    if x.is_cpu and x.dtype in _KERNEL_DTYPES and x.numel() <= MAX_SMALL_M * k:
        op = get_op("lut_linear_q8")
        if op is not None:
            return op(x, lw.codes, tables.qlut, *_sparse_args(lw), bias)
    return lut_linear(fake_quantize_activations(x).float(), lw, bias).to(x.dtype)


def lut_q8_reference(x: torch.Tensor, tables: RoundedTables, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Oracle of the int8 table kernel in float64: x [M, K] -> [M, N] float32, the integer sums per 32-column block
    exact, times the blocks' scales and the rows' scales, plus the outliers against the rounded x."""
    from brisk.ops.sparse_q8 import quantize_activations_q8

    lw = tables.weight
    m, k = x.shape
    xq, xs = quantize_activations_q8(x.float())  # [M, K], [M, K / 32]
    q = unpack_nibbles(lw.codes).long()  # [N, K]
    u = torch.gather(tables.qlut[:, :16].long(), 1, q) - 128  # [N, K]
    t = tables.qlut[:, 16:].contiguous().view(torch.float32).reshape(-1).double()  # [N]
    nb = k // 32
    dots = torch.einsum("mbc,nbc->mnb", xq.view(m, nb, 32).double(), u.view(-1, nb, 32).double())  # exact
    out = (dots * xs.double()[:, None, :]).sum(-1) * t[None, :]
    if lw.row_ptr is not None:
        xr = (xq.view(m, nb, 32).double() * xs.double()[..., None]).view(m, k)
        assert lw.cols is not None and lw.values is not None
        rows = torch.repeat_interleave(torch.arange(lw.out_features), (lw.row_ptr[1:] - lw.row_ptr[:-1]).long())
        sparse = torch.zeros(lw.out_features, k, dtype=torch.float64)
        sparse.index_put_((rows, lw.cols.long()), lw.values.double(), accumulate=True)
        out = out + xr @ sparse.T
    if bias is not None:
        out = out + bias.double()
    return out.float()
