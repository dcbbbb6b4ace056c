"""The small-M linear kernel against F.linear, and its fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from brisk.ops.layers import FastLinear
from brisk.ops.linear import MAX_SMALL_M, linear, use_fast_linear


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 12])
# odd N and K exercise the tails; N below the AVX-512 loop's 4-row tile, and N % 4 = 3, the rows left after tiles
@pytest.mark.parametrize("n,k", [(1539, 576), (576, 1536), (7, 20), (4, 8), (3, 40)])
def test_float32_equals_f_linear(ops, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    want = F.linear(x.double(), w.double(), b.double())
    # float32 accumulation in a different order: error ~ sqrt(K) * eps * |x||w|
    torch.testing.assert_close(ops.linear_small_m(x, w, b).double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ops.linear_small_m(x, w, None).double(), want - b.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 12])
# N = 577 and 5 leave rows after the AVX-512 loop's 3-row tiles; N = 2 is below one tile
@pytest.mark.parametrize("n,k,bias", [(960, 576, False), (577, 1536, True), (9, 40, True), (5, 20, False),
                                      (2, 64, True)])
def test_bfloat16_weights_accumulate_in_float32(ops, m, n, k, bias):
    # K % 16 == 0 with M <= 8 takes the even/odd split kernel; K = 40 and 20 (and M = 12) the widening loads
    g = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())  # exact products of the bf16 values
    got = ops.linear_small_m(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # the only rounding that matters is the final cast to bf16 (relative 2^-8)
    torch.testing.assert_close(got.double(), want, atol=0.05, rtol=2**-7)
    # float32 x against bf16 weights: a float32 result, accurate to float32 accumulation
    got32 = ops.linear_small_m(x.float(), w, b)
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, atol=1e-4, rtol=1e-4)


def test_fast_linear_module_and_fallback(kernel_settings, ops):
    lin = nn.Linear(64, 48)
    x1, x_big = torch.randn(1, 3, 64), torch.randn(MAX_SMALL_M + 4, 64)
    want1, want_big = lin(x1), lin(x_big)
    assert use_fast_linear(nn.Sequential(lin)) == 1 and type(lin) is FastLinear
    torch.testing.assert_close(lin(x1), want1, atol=1e-5, rtol=1e-5)  # [1, 3, 64]: 3 rows, kernel path
    torch.testing.assert_close(lin(x_big), want_big)  # many rows: F.linear
    kernel_settings(enabled=False)
    torch.testing.assert_close(linear(x1, lin.weight, lin.bias), want1)  # reference path, same values


@pytest.mark.parametrize("chunk", [1 << 21, 64 * 20])  # one GEMM, and 64-row chunks (a ragged last one)
def test_bfloat16_many_rows_widen_to_float32(monkeypatch, chunk):
    """Without native bf16 arithmetic, bf16 prefill-sized matmuls run as float32 GEMMs over widened weight
    chunks: the same values as the exact product up to the final bf16 rounding, and as MKL's bf16 GEMM."""
    import brisk.ops.linear as lin_mod

    monkeypatch.setattr(lin_mod, "_WIDEN_CHUNK_WEIGHTS", chunk)
    monkeypatch.setattr(lin_mod, "native_bf16_gemm", lambda: False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 7, 20, generator=g).bfloat16()  # 21 rows > MAX_SMALL_M
    w, b = torch.randn(300, 20, generator=g).bfloat16(), torch.randn(300, generator=g).bfloat16()
    got = linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 7, 300)
    want = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), want, atol=0.02, rtol=2**-7)
    assert (got == F.linear(x, w, b)).float().mean() > 0.97  # MKL's bf16 GEMM rounds the same sums alike


def test_prepacked_weights_for_many_rows():
    """oneDNN-packed copies serve the GEMMs of > MAX_SMALL_M rows (float32 only); few rows keep the kernel."""
    import brisk.ops.linear as lin_mod

    g = torch.Generator().manual_seed(9)
    model = nn.Sequential(nn.Linear(96, 200), nn.Linear(200, 40, bias=False), nn.Linear(40, 8).bfloat16())
    use_fast_linear(model)
    x_big = torch.randn(3, 7, 96, generator=g)  # 21 rows
    want = [F.linear(x_big, model[0].weight, model[0].bias)]
    assert lin_mod.prepack_linears(model) == 2  # the bf16 layer gets none unless asked
    assert model[2].packed_weight is None and lin_mod.prepack_linears(model) == 0  # idempotent
    got = model[0](x_big)
    assert got.shape == (3, 7, 200)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    h = torch.randn(30, 200, generator=g)
    torch.testing.assert_close(model[1](h), F.linear(h, model[1].weight), atol=1e-5, rtol=1e-5)
    # the packed path really is taken for many rows, and not for few
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    lin_mod.torch.ops.mkldnn._linear_pointwise = lambda *a: calls.append(1) or real(*a)
    try:
        model[0](x_big)
        model[0](x_big[0, :2])
    finally:
        lin_mod.torch.ops.mkldnn._linear_pointwise = real
    assert len(calls) == 1


def test_dense_gemm_equals_f_linear():
    """Many float32 rows go to oneDNN with the plain weight: F.linear's values to float32 rounding; other dtypes
    and layouts fall back to F.linear itself."""
    from brisk.ops.linear import dense_gemm

    g = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(2, 30, 96, generator=g), torch.randn(130, 96, generator=g), torch.randn(130, generator=g)
    torch.testing.assert_close(dense_gemm(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dense_gemm(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    wt = torch.randn(96, 130, generator=g).t()  # non-contiguous weight: F.linear
    assert torch.equal(dense_gemm(x, wt), F.linear(x, wt))
    xh = x.bfloat16()
    assert torch.equal(dense_gemm(xh, w.bfloat16()), F.linear(xh, w.bfloat16()))


def test_prepacked_bfloat16_weights_equal_the_widened_path(monkeypatch):
    """A bfloat16 layer's packed copy is its weight widened to float32: > 8 rows give the widened GEMM's result
    (the same float32 products, rounded once to bf16), <= 8 rows keep the small-M kernel."""
    import brisk.ops.linear as lin_mod

    monkeypatch.setattr(lin_mod, "native_bf16_gemm", lambda: False)
    g = torch.Generator().manual_seed(11)
    model = nn.Sequential(nn.Linear(64, 300).bfloat16())
    use_fast_linear(model)
    x = torch.randn(40, 64, generator=g).bfloat16()
    want = lin_mod._widened_linear(x, model[0].weight, model[0].bias)
    assert lin_mod.prepack_linears(model, bfloat16=True) == 1 and model[0].packed_weight is not None
    got = model[0](x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2**-7)  # at most one bf16 rounding step
    assert (got == want).float().mean() > 0.97
    small = x[:3]
    assert torch.equal(model[0](small), lin_mod.linear(small, model[0].weight, model[0].bias))


@pytest.mark.parametrize("rows", [9, 17, 100, 129, 300, 513, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_gemms_run_at_bucketed_row_counts(rows, dtype):
    """Many-row GEMMs pad x with zero rows to a bucket (oneDNN keeps state per shape it never frees) and return
    exactly the rows asked for, with F.linear's values."""
    from brisk.ops.linear import gemm_rows, prepack_weight

    padded = gemm_rows(rows)
    assert rows <= padded < rows + (8 if rows <= 128 else 32 if rows <= 512 else 128)
    g = torch.Generator().manual_seed(rows)
    x, w, b = (torch.randn(2, rows, 64, generator=g)[1], torch.randn(48, 64, generator=g),
               torch.randn(48, generator=g))
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    want = F.linear(x.double(), w.double(), b.double())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=2**-7)
    for packed in (None, prepack_weight(w)):
        got = linear(x, w, b, packed)
        assert got.shape == (rows, 48) and got.dtype == dtype and got.is_contiguous()
        torch.testing.assert_close(got.double(), want, **tol)
    # a [B, T, K] input keeps its leading dimensions
    assert linear(x.view(1, rows, 64), w, b).shape == (1, rows, 48)


def test_gemm_row_buckets_are_few():
    from brisk.ops.linear import gemm_rows

    assert len({gemm_rows(r) for r in range(9, 8193)}) == 15 + 12 + 60


def test_bfloat16_rows_from_the_threshold_take_atens_gemm(ops):
    """linear_small_m hands bfloat16 x bfloat16 calls of BF16_GEMM_ROWS+ rows to ATen's GEMM where the AMX switch
    set the threshold (CPUs with AMX-BF16); below it, and for float32 x, its own loops run."""
    from brisk.ops import kernels

    torch.manual_seed(0)
    w, b = torch.randn(48, 64).bfloat16(), torch.randn(48)
    try:
        assert ops.linear_small_bf16_gemm_rows(kernels.BF16_GEMM_ROWS) == kernels.BF16_GEMM_ROWS
        x = torch.randn(8, 64).bfloat16()
        assert torch.equal(ops.linear_small_m(x, w, b), F.linear(x, w, b.bfloat16()))
        below = ops.linear_small_m(x[:3], w, b)  # the kernel: float32 sums rounded once
        torch.testing.assert_close(below, (x[:3].float() @ w.float().T + b).bfloat16(), rtol=1e-2, atol=1e-2)
        assert ops.linear_small_bf16_gemm_rows(0) == 0
        torch.testing.assert_close(ops.linear_small_m(x, w, b), (x.float() @ w.float().T + b).bfloat16(),
                                   rtol=1e-2, atol=1e-2)
    finally:
        kernels._apply_amx()  # the process's own setting back: the CPU's flags and the AMX switch
