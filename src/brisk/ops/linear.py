"""Linear layers for decode: a C++ GEMV/small-GEMM for few rows, F.linear otherwise.

At batch-1 decode a linear layer is a matrix-vector product: it reads every weight once and does 2 flops per
weight, so its speed is memory bandwidth. MKL's sgemm reaches only ~10 GB/s of this machine's ~24 GB/s for
M = 1, and its bfloat16 path on an AVX2 CPU is slower still; `linear_small_m` (ops/csrc/linear_small.cpp)
streams each weight row once per step, 4 rows at a time, and keeps those rows in L1 while it runs them
against every activation row (M <= MAX_SMALL_M). Larger M is compute-bound and stays with F.linear (MKL).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from brisk.ops import kernels
from brisk.ops.kernels import cpu_flags, get_op

MAX_SMALL_M = 8  # beyond this many rows, a blocked GEMM (oneDNN, else MKL) wins
# weight rows widened at a time on the bfloat16 large-M path: 2^21 float32 weights (8 MiB) stay in the last-level
# cache between the conversion that writes them and the GEMM that reads them
_WIDEN_CHUNK_WEIGHTS = 1 << 21


def native_bf16_gemm() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX), so that MKL's bf16 GEMM is fast.

    Without it (an AVX2-only CPU) MKL emulates bf16 GEMM at ~1/5 of its float32 speed. A kernel tier capped below
    AVX-512 (BRISK_KERNEL_ISA=avx2 / avx2vnni) answers as such a CPU would, so a forced run takes the AVX2 CPU's
    paths in Python too (set ONEDNN_MAX_CPU_ISA=AVX2 and ATEN_CPU_CAPABILITY=avx2 as well for the libraries)."""
    return _bf16_flags() and kernels.kernel_isa() not in ("avx2", "generic")


@functools.cache
def _bf16_flags() -> bool:
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bfloat16 at many rows (prefill, large batches) on a CPU without bf16 arithmetic: float32 GEMMs over
    chunks of weight rows widened to float32 (exact), then the result rounded to bfloat16. MKL's bf16 GEMM
    also accumulates in float32, so only the rounding of the products' sum differs; the weights stay stored in
    bfloat16 (half the memory), the widening costs O(N K) against the GEMM's O(M N K)."""
    xf = x.float()
    n, k = weight.shape
    bf = None if bias is None else bias.float()
    rows = max(1, _WIDEN_CHUNK_WEIGHTS // k)
    if n <= rows:
        return dense_gemm(xf, weight.float(), bf).to(x.dtype)
    parts = [dense_gemm(xf, weight[n0:n0 + rows].float(), None if bf is None else bf[n0:n0 + rows])
             for n0 in range(0, n, rows)]
    return torch.cat(parts, dim=-1).to(x.dtype)


def prepack_weight(weight: torch.Tensor, batch_hint: int = 64) -> torch.Tensor | None:
    """The weight reordered into oneDNN's blocked GEMM layout (an opaque tensor), or None where that is not
    available (not float32 / bfloat16, not on the CPU, no oneDNN in this torch). Its GEMMs run 1.2-2.2x faster
    than MKL's sgemm for 16-512 rows on this AMD CPU (MKL picks a slower path on non-Intel CPUs); at <= 8 rows
    brisk's own kernel is faster still, so the plain weight is kept too (twice the float32 weight memory).
    A bfloat16 weight is packed widened to float32 (exact): on a CPU without bf16 arithmetic its GEMMs then skip
    the per-call widening (1.1-1.65x at 64 rows here), for a float32 copy of the weights."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_cpu \
            or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float(), batch_hint)
    except (RuntimeError, AttributeError):  # an op this build of torch does not have
        return None


@functools.cache
def _onednn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def gemm_rows(rows: int) -> int:
    """The row count a oneDNN GEMM of `rows` rows runs at (x padded with zero rows up to it).

    oneDNN keeps state per GEMM shape that it does not give back (JIT kernels, primitives: ~0.6 MB a row count
    for the default model's gate/up projection, still there with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0), and a
    server's steps bring ever-new row counts (running decodes + prefill tokens): a 4,000-request soak grew
    +196 MiB/min and 1,000 distinct row counts cost +600 MiB in one process (float32 and native bfloat16 alike).
    Buckets bound the shapes: multiples of 8 up to 128 rows, of 32 up to 512, then of 128: at most 7 padded rows
    up to 128 and at most ~6% more rows beyond. With them the soak's RSS stayed flat (+0.5 MiB late against early
    half), and the 128-request offline run kept its speed (947 vs 958 tok/s exact, alternated in one process)."""
    step = 8 if rows <= 128 else 32 if rows <= 512 else 128
    return -(-rows // step) * step


def _bucketed_gemm(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, n: int) -> torch.Tensor:
    """fn(x2) for x's rows as a 2-D [rows, K] matrix, run at gemm_rows(rows) rows; -> [..., n]."""
    k = x.shape[-1]
    rows = x.numel() // k
    x2 = x.reshape(rows, k)
    padded = gemm_rows(rows)
    if padded != rows:
        xp = x2.new_empty(padded, k)
        xp[:rows].copy_(x2)
        xp[rows:].zero_()
        x2 = xp
    out = fn(x2)
    if padded != rows:
        out = out[:rows]  # leading rows of a contiguous matrix: contiguous
    return out.view(*x.shape[:-1], n)


def dense_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for many float32 rows through oneDNN (which reorders the plain weight itself) where it is
    available: 1.2-2x MKL's sgemm on this AMD CPU (64 x 576 x 49152: 86 vs 42 GFLOPS; 512 x 576 x 3072: 125 vs
    80) with no extra memory; prepacked weights (prepack_weight) gain another 10-25%. F.linear otherwise."""
    if (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.is_cpu and weight.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
            and x.dim() >= 1 and x.numel() > 0 and _onednn_linear_available()):
        return _onednn_linear(x, weight, bias, weight.shape[0])
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.is_cpu and x.dim() >= 1
            and x.numel() > 0 and native_bf16_gemm()):  # oneDNN's bf16 GEMM underneath: bucketed shapes
        return _bucketed_gemm(lambda x2: F.linear(x2, weight, bias), x, weight.shape[0])
    return F.linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """oneDNN's linear on x's rows (at gemm_rows(rows) rows); `weight` plain [n, K] or prepacked
    (prepack_weight). -> [..., n]"""
    return _bucketed_gemm(lambda x2: torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [None], ""), x, n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with the small-M kernel when it applies, and oneDNN's GEMM on `packed` (prepack_weight) for
    many float32 rows when given. x: [..., K], weight: [N, K] -> [..., N]."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if packed is not None and rows > MAX_SMALL_M and x.dtype == torch.float32 and x.is_cpu:
        return _onednn_linear(x, packed, bias, weight.shape[0])
    if packed is not None and rows > MAX_SMALL_M and x.dtype == torch.bfloat16 and x.is_cpu:  # widened at packing
        bf = None if bias is None else bias.float()
        return _onednn_linear(x.float(), packed, bf, weight.shape[0]).to(x.dtype)
    # bfloat16 too: the kernel widens bf16 weights to float32 in registers and reads them ~20% faster than
    # MKL's bf16 GEMV on this AVX2 CPU (whole-model microbenchmark: 13.6 vs 11.5 GB/s)
    small = 0 < rows <= MAX_SMALL_M
    if small and x.device.type == "cpu" and weight.is_contiguous():
        op = get_op("linear_small_m")
        if op is not None:
            out = op(x.reshape(rows, x.shape[-1]), weight, bias)  # [rows, N]
            return out.view(*x.shape[:-1], weight.shape[0])
    if (rows > MAX_SMALL_M and weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 and x.is_cpu
            and not native_bf16_gemm()):
        return _widened_linear(x, weight, bias)
    if rows > MAX_SMALL_M:
        return dense_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


def prepack_linears(model: nn.Module, bfloat16: bool = False) -> int:
    """Give every float32 FastLinear in `model` (and bfloat16 ones when asked: a float32 copy, four times their
    bytes) a oneDNN-packed copy of its weight (see prepack_weight); returns how many got one. Batched decode and
    prefill then run ~1.2-2x faster, for the weights' memory. An executor built over the model before must be
    rebuilt (engine/executor.py): its plan holds each layer's kernel as it was."""
    from brisk.ops.layers import FastLinear  # the module class sits with the other runtime linears

    count = 0
    for module in model.modules():
        if type(module) is FastLinear and module.packed_weight is None and (
                module.weight.dtype == torch.float32 or bfloat16):
            module.packed_weight = prepack_weight(module.weight)
            count += module.packed_weight is not None
    return count


def float32_linear_bytes(model: nn.Module) -> int:
    """Bytes of the float32 copies prepack_linears would make (bfloat16=False): one per float32 FastLinear."""
    from brisk.ops.layers import FastLinear

    return sum(m.weight.numel() * 4 for m in model.modules()
               if type(m) is FastLinear and m.packed_weight is None and m.weight.dtype == torch.float32)


def use_fast_linear(model: nn.Module) -> int:
    """Turn every plain nn.Linear in `model` into a FastLinear in place; returns how many were converted."""
    from brisk.ops.layers import FastLinear

    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FastLinear
            count += 1
    return count
