"""8- and 4-bit codes in the tiled layout (ops/csrc/quant_q8t.cpp, AVX2 and AVX-512 builds): the layout switch is exact
and in place; the int8-activation kernel equals the float64 oracle, and the float-activation kernel the float64
product with the dequantized weight, over the default model's shapes and every group size, at any row count; the
tiled dequantization is bit-exact; load_model tiles exactly the layers the kernels take."""

from __future__ import annotations

import pytest
import torch
from conftest import ops_with
from hf_utils import make_tiny_hf_model
from test_model import prefill_logits
from test_qlinear_q8 import assert_kernel_matches_oracle, random_packed
from test_quant_checkpoint import quantize_folder

from brisk.model.loader import load_model
from brisk.ops import qlinear_q8 as Q
from brisk.ops.kernels import kernel_isa
from brisk.ops.layers import QuantLinear
from brisk.ops.qlinear import (
    MAX_TILED_M,
    can_tile,
    dequantize_packed,
    max_tiled_rows,
    prepack,
    prepack_nf4,
    quant_linear,
    round_activations_16,
    set_tiled,
    unpack_codes,
)
from brisk.quant.config import LayerQuant
from brisk.quant.layers import set_quant_activations


@pytest.fixture(autouse=True)
def kernels_enabled(kernel_settings):
    kernel_settings(enabled=True)


@pytest.fixture(scope="module")
def ops():
    # built on every x86 tier (AVX2 and up); elsewhere (generic, ARM) nothing is tiled. ops_with fails, never skips,
    # where it should have built and did not
    if kernel_isa() not in ("avx2", "avx512"):
        pytest.skip(f"quant_q8t is built on the AVX2 and AVX-512 tiers only (this one: {kernel_isa()})")
    return ops_with("quant_linear_q8t")


def tiled(n: int, k: int, group: int, sym: bool = False, seed: int = 0, bits: int = 4):
    pw = random_packed(n, k, bits, group, sym=sym, seed=seed)
    assert set_tiled(pw, True) and pw.tiled
    return pw


# the default model's shapes (N, K) and small ones; N a multiple of 16 (one tile), K / 8 column chunks
SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (16, 64), (48, 96), (32, 192)]
CASES = [(n, k, group) for n, k in SHAPES for group in (-1, 32, 64, 96, 192) if group == -1 or k % group == 0]


@pytest.mark.parametrize("bits", [8, 4])
def test_layout_switch_is_exact_and_in_place(bits):
    pw = random_packed(48, 192, bits, 64, seed=3)
    before = {f: getattr(pw, f).clone() for f in ("data", "scales", "zeros")}
    ptrs = {f: getattr(pw, f).data_ptr() for f in before}
    codes, mins, w = unpack_codes(pw), pw.mins, dequantize_packed(pw)
    assert set_tiled(pw, True) and not set_tiled(pw, True)  # a second call changes nothing
    assert {f: getattr(pw, f).data_ptr() for f in before} == ptrs  # the same storages (buffers, huge pages)
    assert not torch.equal(pw.data, before["data"]) and not torch.equal(pw.scales, before["scales"])
    # every reader sees the same weight through the tiled layout
    assert torch.equal(unpack_codes(pw), codes) and torch.equal(pw.mins, mins)
    assert torch.equal(pw.group_scales(), before["scales"]) and torch.equal(pw.group_zeros(), before["zeros"])
    assert torch.equal(dequantize_packed(pw), w)
    # 4 bits: row 16 t + r's codes 8 c .. 8 c + 7 sit in tile t's line c, dword r: q[8 c + j] | q[8 c + 4 + j] << 4;
    # 8 bits: codes 4 c .. 4 c + 3 in line c, dword r
    t, r, c = 2, 5, 7
    per_line = 32 // bits
    line = pw.data.view(-1)[(t * (192 // per_line) + c) * 64 + r * 4:][:4]
    q = codes[16 * t + r, per_line * c: per_line * (c + 1)]
    assert torch.equal(line, q if bits == 8 else q[:4] | (q[4:] << 4))
    assert set_tiled(pw, False)
    assert all(torch.equal(getattr(pw, f), before[f]) for f in before)


def test_weights_made_in_inference_mode_are_tiled_outside_it():
    with torch.inference_mode():
        pw = random_packed(48, 64, 4, 32, seed=5)
    codes = unpack_codes(pw)
    assert set_tiled(pw, True) and torch.equal(unpack_codes(pw), codes)


def test_only_8_and_4bit_codes_in_whole_tiles_are_tiled():
    from brisk.ops.qlinear import prepack

    three = prepack(torch.randint(0, 256, (48, 24), dtype=torch.uint8), torch.rand(48, 2), None, 3, 32, 64)
    with pytest.raises(ValueError, match="4-bit affine codes"):
        set_tiled(three, True)
    with pytest.raises(ValueError, match="multiple of 16"):
        set_tiled(random_packed(40, 64, 4, 32), True)


@pytest.mark.parametrize("n,k,group", CASES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 9, 13])
def test_kernel_equals_reference(ops, n, k, group, bits, m):
    assert_kernel_matches_oracle(tiled(n, k, group, sym=m in (1, 8, 13), seed=n + m, bits=bits), m)


@pytest.mark.parametrize("bits", [8, 4])
def test_bfloat16_activations_and_many_rows(ops, bits):
    pw = tiled(960, 576, 64, seed=4, bits=bits)
    x = torch.randn(Q.MAX_Q8_ROWS + 37, 576, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(960, generator=torch.Generator().manual_seed(6))
    # past MAX_Q8_ROWS the tiled kernel still runs (it outruns the GEMM path; on plain AVX2 the float GEMM of the
    # rounded x takes over, Q.max_tiled_q8_rows): the oracle's numbers
    ref = Q.quant_q8_reference(x, pw, bias)
    torch.testing.assert_close(Q.quant_linear_q8(x, pw, bias), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    for rows in (5, 1000):  # 1000 bfloat16 rows: the float32 result no longer fits the kept scratch (1 Mi floats)
        xb = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
        out = Q.quant_linear_q8(xb, pw, bias)
        assert out.dtype == torch.bfloat16
        want = Q.quant_q8_reference(xb, pw, bias).float()
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("bits", [8, 4])
def test_blocked_and_tiled_kernels_agree(ops, bits):
    pw = random_packed(576, 1536, bits, 64, seed=7)
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(8))
    blocked = Q.quant_linear_q8(x, pw)
    set_tiled(pw, True)
    torch.testing.assert_close(Q.quant_linear_q8(x, pw), blocked, rtol=1e-5, atol=1e-5 * blocked.abs().max().item())


def test_no_kernel_takes_the_reference_path(kernel_settings, ops):
    pw = tiled(48, 96, 32, seed=9)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(10))
    want = Q.quant_linear_q8(x, pw)
    kernel_settings(enabled=False)
    assert not can_tile(random_packed(48, 96, 4, 32))
    torch.testing.assert_close(Q.quant_linear_q8(x, pw), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("n,k,group", CASES)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 13])
def test_float_kernel_equals_the_product_with_the_dequantized_weight(ops, n, k, group, bits, m):
    pw = tiled(n, k, group, sym=m in (1, 8), seed=n + m, bits=bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)) if m % 2 else None
    w = dequantize_packed(pw).double()
    b = None if bias is None else bias.double()
    got = quant_linear(x, pw, bias)
    # 8-bit codes multiply x rounded to int16 per 32 columns: the product with those numbers, and within the
    # rounding's bound of the exact one
    xr = round_activations_16(x) if bits == 8 else x
    want = torch.nn.functional.linear(xr.double(), w, b)
    # float32 sums of codes times x per group, then scaled: a per-channel 8-bit row sums 576 products up to 255 |x|
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * want.abs().max().item())
    if bits == 8:
        exact = torch.nn.functional.linear(x.double(), w, b)
        assert not torch.equal(xr, x)
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-4 * exact.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_float_kernel_multiplies_x_rounded_to_16_bits(ops, dtype):
    # an identity weight (codes 129 on the diagonal, 128 elsewhere, symmetric, scale 1) returns the activations the
    # kernel multiplies: exactly round_activations_16(x), ties and all
    k = 576
    q = torch.full((k, k), 128, dtype=torch.uint8)
    q.fill_diagonal_(129)
    pw = prepack(q, torch.ones(k, k // 32, dtype=torch.float16), None, 8, 32, k)
    assert set_tiled(pw, True)
    x = (torch.randn(13, k, generator=torch.Generator().manual_seed(13)) * 3).to(dtype)
    assert torch.equal(quant_linear(x, pw).float(), round_activations_16(x).to(dtype).float())


def test_8bit_float_kernel_rows_do_not_depend_on_their_batch(ops):
    pw = tiled(576, 1536, 32, seed=5, bits=8)
    x = torch.randn(21, 1536, generator=torch.Generator().manual_seed(21))
    together = quant_linear(x, pw)
    for r in (0, 7, 8, 20):
        assert torch.equal(quant_linear(x[r:r + 1], pw)[0], together[r])
    assert torch.equal(quant_linear(x[3:11], pw), together[3:11])


@pytest.mark.parametrize("bits", [8, 4])
def test_float_path_bfloat16_and_prefill_rows(ops, bits):
    pw = tiled(576, 1536, 64, seed=11, bits=bits)
    bias = torch.randn(576, generator=torch.Generator().manual_seed(12))
    w = dequantize_packed(pw).double()
    for m in (5, 40, MAX_TILED_M + 9):  # the kernel, then dequantize_t + GEMM (past 32 rows on AVX2 builds)
        x = torch.randn(m, 1536, generator=torch.Generator().manual_seed(m))
        xr = round_activations_16(x) if bits == 8 and m <= max_tiled_rows() else x
        want = torch.nn.functional.linear(xr.double(), w, bias.double())
        torch.testing.assert_close(quant_linear(x, pw, bias).double(), want, rtol=1e-5,
                                   atol=2e-6 * want.abs().max().item())
    xb = torch.randn(3, 1536, generator=torch.Generator().manual_seed(13)).bfloat16()
    out = quant_linear(xb, pw, bias)
    assert out.dtype == torch.bfloat16
    want = torch.nn.functional.linear(xb.double(), w, bias.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("bits", [8, 4])
def test_tiled_dequantization_is_bit_exact(ops, bits):
    pw = random_packed(96, 576, bits, 64, seed=14)
    want = dequantize_packed(pw)
    set_tiled(pw, True)
    assert torch.equal(ops.quant_dequantize_t(pw.data, pw.scales, pw.zeros, None, bits, 64, 576, 0, 6), want)
    assert torch.equal(ops.quant_dequantize_t(pw.data, pw.scales, pw.zeros, None, bits, 64, 576, 2, 4), want[32:64])
    with pytest.raises(RuntimeError, match="out of"):
        ops.quant_dequantize_t(pw.data, pw.scales, pw.zeros, None, bits, 64, 576, 5, 7)


def nf4_packed(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)  # every code 0..15
    return prepack_nf4(qweight, torch.rand(n, k // group, generator=g) + 0.1, group, k)


@pytest.mark.parametrize("n,k,group", [(576, 576, 64), (960, 576, 32), (48, 1536, 64), (16, 192, 192)])
@pytest.mark.parametrize("m", [1, 3, 8, 13, MAX_TILED_M + 3])
def test_nf4_codes_take_the_float_kernel(ops, n, k, group, m):
    pw = nf4_packed(n, k, group, seed=n + m)
    w = dequantize_packed(pw)
    assert set_tiled(pw, True) and torch.equal(dequantize_packed(pw), w)  # codebook codes tile as 4-bit codes
    assert torch.equal(ops.quant_dequantize_t(pw.data, pw.scales, None, pw.codebook, 4, group, k, 0, n // 16), w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2)) if m % 2 else None
    want = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
    got = quant_linear(x, pw, bias)  # past MAX_TILED_M rows: dequantize_t + GEMM
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * want.abs().max().item())
    # no integer form: int8 activations leave codebook codes on the float path
    assert not Q.covers(pw) and torch.equal(quant_linear(x, pw, bias, int8_activations=True), got)
    with pytest.raises(RuntimeError, match="no zero points"):
        ops.quant_linear_t(x, pw.data, pw.scales, pw.scales.to(torch.uint8), pw.codebook, 4, group, None)


def test_load_model_tiles_the_layers_the_kernels_take(ops, tmp_path):
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=6)
    qfolder = quantize_folder(src, tmp_path / "q", LayerQuant(bits=4, group_size=32, sym=False))
    loaded = load_model(qfolder)
    layers = [m for m in loaded.model.modules() if type(m) is QuantLinear]
    assert any(m.packed.bits == 8 for m in layers) and all(m.packed.out_features % 16 == 0 for m in layers)
    assert all(m.packed.tiled for m in layers)  # the 4-bit layers and the 8-bit head
    ids = torch.tensor([9, 8, 7, 100, 200, 31, 5])
    want = prefill_logits(loaded, ids)
    # the blocked layout (quant_linear_small) gives the same logits up to float32 summation order
    for m in layers:
        set_tiled(m.packed, False)
    blocked = prefill_logits(loaded, ids)
    torch.testing.assert_close(blocked, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    set_quant_activations(loaded.model, "int8")  # tiles again, and rounds x to int8 at every layer
    assert all(m.packed.tiled for m in layers)
    rel = ((prefill_logits(loaded, ids) - want).norm() / want.norm()).item()
    assert 0 < rel < 5e-2, rel  # x rounded to int8 (see test_qlinear_q8's tiny-model test)
    set_quant_activations(loaded.model, "float")
    assert all(m.packed.tiled for m in layers) and torch.equal(prefill_logits(loaded, ids), want)
