"""W8A8 linears: int8 weights and int8 activations multiplied on the CPU's integer units (SmoothQuant, LLM.int8()).

    y[m, n] = xs[m] * ws[n] * sum_k xq[m, k] wq[n, k]   (+ bias[n])

- weights: symmetric int8 per output channel, wq in [-127, 127], ws = max_k |W[n, k]| / 127 (RTN's 8-bit symmetric
  codes, as the checkpoint stores them);
- activations, rounded per call (`quantize_rows`): per token (dynamic: xs[m] = max_k |x[m, k]| / 127) or per
  tensor (static: xs = a scale calibrated offline, the checkpoint's `X.input_scale`, values clamped to +-127);
- the integer GEMM (ops/csrc/int8_gemm.cpp): VNNI (VPDPBUSD, u8 x s8, the +128 shift of the activations paid back
  by the weights' column sums, computed here once) on AVX-512 builds, VPMADDUBSW/VPMADDWD on AVX2 builds; the same
  int32 sums as `torch` int32 matmul, bit for bit (tests/test_smoothquant.py). The decode rows take it too: unlike
  the weight-only int8 kernels (ops/qlinear_q8.py: activations per 32 columns, the weight's group scales), this
  GEMM's per-token scales are what SmoothQuant's accuracy was measured with, so one kernel serves every row count.
- without the kernels (not built, disabled, off the CPU, a shape that is not whole 16-row tiles): `w8a8_reference`,
  the same rounding and an exact integer product (float64 sums of integers), then the same float scaling.

`Int8Linear` is the runtime module; with `outlier_threshold` it is LLM.int8() (Dettmers et al. 2022): the input
columns whose |x| exceeds the threshold in any row of the call are taken out of the int8 product and multiplied in
float32 against those columns of the weight, dequantized on the fly from the int8 codes (w = ws * wq: no float copy
is kept, so the layer holds 1 byte a weight; the outlier part then carries the weight's rounding but not the
activations'), as bitsandbytes' int8 inference does with its stored int8 weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from brisk.ops.kernels import get_op
from brisk.ops.layers import MAX_ROWS, LinearKernel, LinearKind, _CachedKernel, _slots

Tensor = torch.Tensor
TILE = 16  # weight rows per tile of the kernel's layout
QMAX = 127


@dataclass(eq=False)
class Int8Weight:
    """An int8 [out_features, in_features] weight with per-output-channel scales, in the kernel's layout."""

    data: Tensor  # int8: tiled [N / 16][K / 4][16][4] when `tiled`, else [N, K] row-major
    scales: Tensor  # float32 [N]
    col_sum: Tensor  # int32 [N]: sum_k wq[n, k]
    shift_terms: Tensor  # int32 [N]: what the kernel subtracts for its activation shift (128 * col_sum on VNNI)
    in_features: int
    out_features: int
    tiled: bool

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scales.numel()


def _tile(q: Tensor) -> Tensor:
    n, k = q.shape
    return q.view(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(n, k)  # [N/16, K/4, 16, 4]


def _untile(data: Tensor) -> Tensor:
    n, k = data.shape
    return data.view(n // TILE, k // 4, TILE, 4).permute(0, 2, 1, 3).reshape(n, k)


def pack_weight(codes: Tensor, scales: Tensor) -> Int8Weight:
    """codes [N, K] (int8 in [-127, 127], or RTN's 8-bit symmetric uint8 codes q + 128) and scales [N] -> Int8Weight,
    tiled when the shape takes whole tiles (N % 16 == 0, K % 4 == 0)."""
    if codes.dtype == torch.uint8:
        codes = (codes.to(torch.int16) - 128).to(torch.int8)
    assert codes.dtype == torch.int8 and codes.dim() == 2, "int8 codes [N, K]"
    n, k = codes.shape
    if int(codes.min()) < -QMAX:
        raise ValueError("int8 weight codes must lie in [-127, 127] (symmetric absmax / 127 scales); -128 found")
    scales = scales.reshape(-1).float().contiguous()
    assert scales.numel() == n, f"one scale per output channel: {scales.numel()} for {n} rows"
    col_sum = codes.to(torch.int32).sum(1).to(torch.int32)  # [N]
    tiled = n % TILE == 0 and k % 4 == 0
    op = get_op("w8a8_shift_terms")
    shift = op(col_sum) if op is not None else torch.zeros_like(col_sum)
    return Int8Weight(_tile(codes) if tiled else codes.contiguous(), scales, col_sum, shift, k, n, tiled)


def weight_codes(w: Int8Weight) -> Tensor:
    """int8 [N, K] in row order."""
    return _untile(w.data) if w.tiled else w.data


def weight_columns(w: Int8Weight, cols: Tensor) -> Tensor:
    """Columns `cols` [C] of the dequantized weight: float32 [N, C], read from the tiled layout directly."""
    if not w.tiled:
        return w.data[:, cols].float() * w.scales[:, None]
    n, k = w.out_features, w.in_features
    tiles = w.data.view(n // TILE, k // 4, TILE, 4)
    q = tiles[:, cols // 4, :, cols % 4]  # [C, N/16, 16]: column c of rows 16 t + r
    return q.reshape(cols.numel(), n).t().float() * w.scales[:, None]  # [N, C]


def quantize_rows(x: Tensor, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (xq int8 [M, K], xs float32 [M]), as the kernel rounds (see ops/csrc/int8_gemm.cpp)."""
    x = x.float()
    if input_scale is not None:
        s = input_scale.float().reshape(())
        inv = torch.ones_like(s) / s  # a true division (`1.0 / s` is computed as reciprocal(s), not always the same)
        xq = (x * inv).round().clamp(-QMAX, QMAX)
        return xq.to(torch.int8), s.expand(x.shape[0]).contiguous()
    amax = x.abs().amax(-1)  # [M]
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # true division
    xq = (x * inv[:, None]).round().clamp(-QMAX, QMAX)
    return xq.to(torch.int8), amax / 127.0


def int_mm_reference(xq: Tensor, codes: Tensor) -> Tensor:
    """Exact int32 sums xq [M, K] int8 x codes [N, K] int8 -> [M, N] int32 (torch's int32 matmul)."""
    return xq.to(torch.int32) @ codes.to(torch.int32).t()


def w8a8_reference(x: Tensor, w: Int8Weight, bias: Tensor | None = None, input_scale: Tensor | None = None
                   ) -> Tensor:
    """Pure-PyTorch W8A8: x [..., K] -> float32 [..., N]. The integer sums are exact (float64 holds every
    |sum| < 2^53; an int8 K-term sum is below 2^31), then the kernel's float32 scaling."""
    k = x.shape[-1]
    xq, xs = quantize_rows(x.reshape(-1, k), input_scale)
    acc = (xq.double() @ weight_codes(w).double().t()).float()  # [M, N], exact integers (|acc| < 2^24 typically)
    y = acc * (xs[:, None] * w.scales[None, :])
    if bias is not None:
        y = y + bias.float()
    return y.view(*x.shape[:-1], w.out_features)


def w8a8_linear(x: Tensor, w: Int8Weight, bias: Tensor | None = None, input_scale: Tensor | None = None) -> Tensor:
    """x [..., K] float32 / bfloat16 -> [..., N] in x's dtype: the integer GEMM where it is built, else the
    reference."""
    op = get_op("w8a8_linear")
    k = x.shape[-1]
    if op is None or not x.is_cpu or not w.tiled:
        return w8a8_reference(x, w, bias, input_scale).to(x.dtype)
    x2 = x.reshape(-1, k).float().contiguous()  # [M, K]
    b = None if bias is None else bias.float().contiguous()
    y = op(x2, w.data, w.scales, w.shift_terms, input_scale, b)  # [M, N] float32
    return y.to(x.dtype).view(*x.shape[:-1], w.out_features)


@dataclass
class OutlierStats:
    """LLM.int8(): what the outlier decomposition did over this layer's forwards."""

    num_calls: int = 0
    num_rows: int = 0
    num_outlier_columns: int = 0  # summed over calls
    max_outlier_columns: int = 0  # in any one call
    columns_seen: set[int] | None = None  # every column that was an outlier at least once

    def add(self, rows: int, cols: Tensor) -> None:
        self.num_calls += 1
        self.num_rows += rows
        self.num_outlier_columns += cols.numel()
        self.max_outlier_columns = max(self.max_outlier_columns, cols.numel())
        self.columns_seen = (self.columns_seen or set()) | set(cols.tolist())


def llm_int8_linear(x: Tensor, w: Int8Weight, threshold: float, bias: Tensor | None = None,
                    stats: OutlierStats | None = None) -> Tensor:
    """LLM.int8(): x [..., K] -> [..., N]. Outlier columns O = {j : max_m |x[m, j]| > threshold} go through float32
    against the dequantized weight columns; the rest through the W8A8 GEMM with per-token scales (computed on the
    non-outlier columns only, which is what makes the int8 part precise)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    cols = (x2.abs().amax(0) > threshold).nonzero().flatten()  # [C]
    if stats is not None:
        stats.add(x2.shape[0], cols)
    if cols.numel() == 0:
        return w8a8_linear(x, w, bias)
    inner = x2.float().clone()
    inner[:, cols] = 0.0
    y = w8a8_linear(inner, w, bias)  # [M, N] float32
    y = y.addmm_(x2[:, cols].float(), weight_columns(w, cols).t())  # + x_O W_O^T in float32
    return y.to(x.dtype).view(*x.shape[:-1], w.out_features)


class Int8Linear(_CachedKernel, nn.Module):
    """y = x W^T + b on the W8A8 GEMM: SmoothQuant's layers (activations per token, or per tensor with the
    calibrated `input_scale`), or LLM.int8()'s with `outlier_threshold`. The tensors are buffers, so state_dict() and
    memory accounting see what is held: 1 byte a weight and 4 bytes a row."""

    def __init__(self, weight: Int8Weight, bias: Tensor | None, input_scale: Tensor | None = None,
                 outlier_threshold: float | None = None, label: str = "") -> None:
        super().__init__()
        if input_scale is not None and outlier_threshold is not None:
            raise ValueError("LLM.int8() rounds activations per token: a static input_scale does not apply")
        self.weight8 = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("qweight", weight.data)
        self.register_buffer("weight_scale", weight.scales)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(1))
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self.outlier_threshold = outlier_threshold
        self.outlier_stats = OutlierStats()
        self.label = label

    def _kernel_key(self) -> tuple[Any, ...]:
        return id(self.weight8), id(self.bias), id(self.input_scale), self.outlier_threshold

    def _build_kernel(self, ops: Any) -> LinearKernel:
        w, b, s, thr = self.weight8, self.bias, self.input_scale, self.outlier_threshold
        slots = _slots(w.data, w.scales, w.shift_terms, s, b)
        if thr is not None:
            # LLM.int8(): the outlier columns change with every call, so there is no fixed kernel for the decode
            # plan and the C++ layer loop to call (loop_dtypes empty): the executor runs the model's modules
            return LinearKernel(LinearKind.W8A8_OUTLIER, slots, 8, -1, MAX_ROWS[LinearKind.W8A8_OUTLIER],
                                w.out_features, None, lambda x: llm_int8_linear(x, w, thr, b, self.outlier_stats), ())
        op = getattr(ops, "w8a8_linear", None) if w.tiled else None
        small = None
        if op is not None:
            def small(x2: Tensor) -> Tensor:  # every row count: the GEMM serves decode rows too
                return op(x2.float().contiguous(), w.data, w.scales, w.shift_terms, s, b).to(x2.dtype)
        # the decode plan and the C++ layer loop (kind 7) call the op itself on float32 rows (slots in its order)
        return LinearKernel(LinearKind.W8A8, slots, 8, -1, MAX_ROWS[LinearKind.W8A8], w.out_features, small,
                            lambda x: w8a8_linear(x, w, b, s), (torch.float32,) if small is not None else ())

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel()(x)

    def extra_repr(self) -> str:
        act = (f"int8 activations per token, outliers > {self.outlier_threshold} in float" if self.outlier_threshold
               is not None else "int8 activations " + ("per tensor (static)" if self.input_scale is not None
                                                        else "per token"))
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel, {act}"
