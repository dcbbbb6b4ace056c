"""The W8A8 integer GEMM (ops/csrc/int8_gemm.cpp, ops/w8a8.py) against plain PyTorch: the activation rounding and
the int32 sums bit for bit, the float result against the reference's float scaling. Runs on every build (the
AVX-512 VNNI one, AVX-VNNI's and plain AVX2's; tests/test_kernel_isa.py runs it on the avx2 tier); on a CPU with
AMX-INT8, the AMX path against the VNNI path (the same int32 sums and float outputs, bit for bit)."""

from __future__ import annotations

import pytest
import torch
from conftest import ops_with

from brisk.ops import kernels, w8a8

# (M, N, K): row tails of the 6-row (AVX-512 VNNI, AVX-VNNI) and 4-row (AVX2) blocks, panels of 1-4 tiles, K not a
# multiple of 16
SHAPES = [(1, 64, 64), (7, 48, 580), (13, 576, 576), (50, 960, 576), (3, 16, 4), (64, 32, 1536)]
# the AMX path (from 4 rows): odd row counts in 16-row tiles and 32-row blocks, K tails of 1, 9 and 15 groups of 4
# beside whole 64-column steps (and K = 4: the tail alone), panels of 1 and 2 tiles (N / 16 odd and even)
AMX_SHAPES = [(4, 16, 64), (5, 48, 4), (17, 48, 580), (33, 576, 576), (50, 960, 100), (64, 32, 1536), (129, 80, 68),
              (31, 16, 124)]


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201
    return ops_with("w8a8_linear")


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, w8a8.Int8Weight]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    s = w.abs().amax(1) / 127
    q = (w / s[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, s, w8a8.pack_weight(q, s)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_int_mm_is_bit_exact_against_torch_int32_matmul(ops, m: int, n: int, k: int) -> None:  # noqa: ANN001
    q, _, packed = _weight(n, k, seed=m)
    gen = torch.Generator().manual_seed(100 + m)
    xq = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    xq[0, : min(k, 8)] = 127  # the extremes: the VNNI build's shifted 255, and -127
    xq[-1, : min(k, 8)] = -127
    assert packed.tiled
    assert torch.equal(w8a8.weight_codes(packed), q)  # the tiled layout round-trips
    got = ops.w8a8_int_mm(xq, packed.data, packed.col_sum)
    assert torch.equal(got, w8a8.int_mm_reference(xq, q))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("bf16_values", [False, True])
def test_activation_rounding_is_bit_exact(ops, static: bool, bf16_values: bool) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 580, generator=gen) * 4
    if bf16_values:  # short significands: many products land exactly on a .5 tie (round half to even)
        x = x.bfloat16().float()
    x[3] = 0.0  # an all-zero row: scale 0, codes 0
    x[4, 7] = 1e3  # one huge value: everything else rounds to small codes
    scale = torch.tensor([0.02]) if static else None  # static: values beyond 127 * 0.02 clamp
    xq, xs = ops.w8a8_quantize_rows(x, scale)
    rq, rs = w8a8.quantize_rows(x, scale)
    assert torch.equal(xq, rq) and torch.equal(xs, rs)
    assert int(xq.min()) >= -127


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_w8a8_linear_matches_the_reference(ops, m: int, n: int, k: int) -> None:  # noqa: ANN001
    _, _, packed = _weight(n, k, seed=7 + m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen) * 3
    bias = torch.randn(n, generator=gen)
    for b, s in ((None, None), (bias, None), (bias, torch.tensor([0.05]))):
        got = w8a8.w8a8_linear(x, packed, b, s)
        ref = w8a8.w8a8_reference(x, packed, b, s)
        # the same int32 sums and the same float32 scaling, up to one fused multiply-add's rounding
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    xb = x.to(torch.bfloat16)
    got = w8a8.w8a8_linear(xb, packed, bias)
    assert got.dtype == torch.bfloat16
    # the float32 result rounded to bfloat16 (one bfloat16 step where the float32 values straddle a rounding tie)
    torch.testing.assert_close(got, w8a8.w8a8_reference(xb, packed, bias).to(torch.bfloat16))


def test_w8a8_approximates_the_float_product() -> None:
    """The SQNR of W8A8 on Gaussian data: per-token int8 activations and per-channel int8 weights each keep about
    ~38 dB (uniform rounding over absmax / 127 steps); together > 30 dB."""
    _, _, packed = _weight(96, 256, seed=3)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 256, generator=gen)
    x = torch.randn(32, 256, generator=gen)
    ref = x @ w.t()
    err = w8a8.w8a8_linear(x, packed) - ref
    sqnr = 10 * torch.log10(ref.square().mean() / err.square().mean())
    assert sqnr > 30, float(sqnr)


def test_llm_int8_takes_outlier_columns_in_float(ops) -> None:  # noqa: ANN001
    q, s, packed = _weight(64, 128, seed=5)
    w_hat = q.float() * s[:, None]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(10, 128, generator=gen)
    x[2, [5, 70]] = 40.0  # two outlier columns (one token each)
    stats = w8a8.OutlierStats()
    got = w8a8.llm_int8_linear(x, packed, 6.0, stats=stats)
    inner = x.clone()
    inner[:, [5, 70]] = 0
    expect = w8a8.w8a8_reference(inner, packed) + x[:, [5, 70]] @ w_hat[:, [5, 70]].t()
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-4)
    assert torch.equal(w8a8.weight_columns(packed, torch.tensor([5, 70])), w_hat[:, [5, 70]])
    assert (stats.num_calls, stats.num_outlier_columns, stats.columns_seen) == (1, 2, {5, 70})
    # against plain W8A8, the outliers no longer flatten every other column of token 2 to a few codes
    plain = w8a8.w8a8_linear(x, packed)
    exact = x @ w_hat.t()
    assert (got - exact)[2].abs().max() < 0.2 * (plain - exact)[2].abs().max()


@pytest.fixture(scope="module")
def amx_rows(ops) -> int:  # noqa: ANN001
    """The row count from which the GEMM takes AMX here (switched on for the module), or skip: no AMX-INT8."""
    with kernels.override(amx=True):
        rows = kernels.amx_min_rows()
    if not rows:
        pytest.skip("no AMX-INT8 here (the CPU, the build tier, or the kernel's tile-state request)")
    return rows


@pytest.mark.parametrize(("m", "n", "k"), AMX_SHAPES)
def test_amx_int_mm_is_bit_exact(ops, amx_rows: int, m: int, n: int, k: int) -> None:  # noqa: ANN001
    assert m >= amx_rows  # (each shape takes the AMX path)
    q, _, packed = _weight(n, k, seed=m + k)
    gen = torch.Generator().manual_seed(200 + m)
    xq = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    xq[0] = 127  # whole rows of extremes: shifted 255 across every K step and the tail, and -127
    xq[-1] = -127
    ref = w8a8.int_mm_reference(xq, q)
    with kernels.override(amx=True):
        assert kernels.amx_in_use()
        got_amx = ops.w8a8_int_mm(xq, packed.data, packed.col_sum)
    with kernels.override(amx=False):
        assert not kernels.amx_in_use()
        got_vnni = ops.w8a8_int_mm(xq, packed.data, packed.col_sum)
    assert torch.equal(got_amx, ref)
    assert torch.equal(got_vnni, ref)


@pytest.mark.parametrize(("m", "n", "k"), AMX_SHAPES)
def test_amx_w8a8_linear_equals_the_vnni_path(ops, amx_rows: int, m: int, n: int, k: int) -> None:  # noqa: ANN001
    _, _, packed = _weight(n, k, seed=11 + m)
    gen = torch.Generator().manual_seed(m + 1)
    x = torch.randn(m, k, generator=gen) * 3
    x[m // 2] = 0.0  # a zero row: scale 0
    bias = torch.randn(n, generator=gen)
    static = torch.tensor([0.02])  # static: values beyond 127 * 0.02 clamp
    for b, s in ((None, None), (bias, None), (None, static), (bias, static)):
        with kernels.override(amx=True):
            got = w8a8.w8a8_linear(x, packed, b, s)
        with kernels.override(amx=False):
            vnni = w8a8.w8a8_linear(x, packed, b, s)
        # the same int32 sums through the same epilogue: equal bit for bit, not just close
        assert torch.equal(got, vnni)
        torch.testing.assert_close(got, w8a8.w8a8_reference(x, packed, b, s), rtol=1e-6, atol=1e-5)


def test_amx_switch(ops, amx_rows: int) -> None:  # noqa: ANN001
    with kernels.override(amx=False):
        assert kernels.amx_min_rows() == 0
        with kernels.override(amx=True):
            assert kernels.amx_min_rows() == amx_rows
        assert not kernels.amx_in_use()
    with kernels.override(amx=True), kernels.disabled():
        assert not kernels.amx_in_use()  # the kernels off: nothing runs on AMX
