"""Dense 8/4-bit quantized linears with int8 activations (ops/csrc/quant_q8.cpp): the kernel against its float64
oracle over the default model's shapes, odd N, M = 1..8, per-channel and 32/64-column groups, bias and bfloat16
activations; its error against the exact product (an SQNR floor); the routing of quant_linear; and a tiny quantized
model's logits through the int8 path against the float-activation path."""

from __future__ import annotations

import pytest
import torch
from conftest import ops_with
from hf_utils import make_tiny_hf_model
from test_model import prefill_logits
from test_quant_checkpoint import quantize_folder

from brisk.model.loader import load_model
from brisk.ops import qlinear_q8 as Q
from brisk.ops.layers import QuantLinear
from brisk.ops.qlinear import dequantize_packed, prepack, prepack_nf4, quant_linear
from brisk.quant.config import LayerQuant
from brisk.quant.layers import set_quant_activations


@pytest.fixture(autouse=True)
def kernels_enabled(kernel_settings):
    kernel_settings(enabled=True)


@pytest.fixture(scope="module")
def ops():
    return ops_with("quant_linear_q8")


def random_packed(n: int, k: int, bits: int, group: int, sym: bool = False, seed: int = 0):
    """Random codes over the whole range (codes 0 and 2^bits - 1 included: the saturation cases of maddubs)."""
    g = torch.Generator().manual_seed(seed)
    group = k if group == -1 else group
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    q[0, :] = (1 << bits) - 1  # a row of maximal codes
    q[-1, ::2] = 0
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous() if bits == 4 else q  # brisk-packed v1
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    zeros = None if sym else torch.randint(0, 1 << bits, (n, k // group), generator=g).float()
    return prepack(packed, scales, zeros, bits, group, k)


# the default model's shapes (N, K): o_proj, fused qkv, fused gate/up, down_proj; plus odd N and small K
SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (37, 64), (5, 96), (101, 192)]


# (N, K, bits, group) with the group dividing K (a 96-wide layer has no 64-element groups)
CASES = [(n, k, bits, group) for n, k in SHAPES
         for bits, group in [(8, -1), (8, 32), (8, 64), (4, -1), (4, 32), (4, 64), (4, 96), (4, 128), (4, 192)]
         if group == -1 or k % group == 0]
# 4-bit codes run two blocks at a time where K / 32 is even and a group is one block or an even number (576 per
# channel, 32, 64, 128, 192); (5, 96) (3 blocks) and group 96 (3 blocks a group) take the one-block path. On the
# avx512 build two pairs run per 512-bit step: K = 576 (9 pairs) and 192 (3) leave a last pair alone, 64 has no
# full step; groups of 3 pairs (192, and 576 per channel) straddle steps; batch 1 runs 4 weight rows at a time (N
# = 37, 5, 101 leave remainders), up to 8 activation rows share a tile (m = 9, 13: a full tile and a remainder).


@pytest.mark.parametrize("n,k,bits,group", CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 13])
def test_kernel_equals_reference(ops, n, k, bits, group, m):
    # symmetric codes (no mins passed: the kernel derives them from the scales) on every path of both widths
    pw = random_packed(n, k, bits, group, sym=m % 2 == 0 if bits == 8 else m in (1, 3, 8, 13), seed=n + m)
    assert pw.symmetric == (pw.zeros is None)
    assert_kernel_matches_oracle(pw, m)


def assert_kernel_matches_oracle(pw, m: int) -> None:  # noqa: ANN001 - PackedWeight
    """quant_linear_q8 on m random rows (bias on odd m) against the float64 oracle."""
    x = torch.randn(m, pw.in_features, generator=torch.Generator().manual_seed(m)) * 3
    bias = torch.randn(pw.out_features, generator=torch.Generator().manual_seed(1)) if m % 2 else None
    ref = Q.quant_q8_reference(x, pw, bias)
    out = Q.quant_linear_q8(x, pw, bias)
    # the integer dots are exact in both; what differs is float32 against float64 summation of K / 32 scaled
    # partial sums and K / G min terms
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [8, 4])
def test_lm_head_shape(ops, bits):
    pw = random_packed(49152, 576, bits, -1, sym=True, seed=2)  # the default model's 8-bit per-channel head
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(3))
    for m in (1, 8):
        ref = Q.quant_q8_reference(x[:m], pw)
        torch.testing.assert_close(Q.quant_linear_q8(x[:m], pw), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("bits,group", [(8, -1), (4, 64)])
def test_bfloat16_activations_and_bias(ops, bits, group):
    pw = random_packed(67, 192, bits, group, seed=4)
    x = torch.randn(2, 3, 192, generator=torch.Generator().manual_seed(5)).bfloat16()  # leading dims kept
    for bias in (torch.randn(67).bfloat16(), torch.randn(67), None):
        out = Q.quant_linear_q8(x, pw, bias)
        assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 67)
        ref = Q.quant_q8_reference(x.float(), pw, None if bias is None else bias.float())  # float32 result
        # the kernel's float32 result rounded once to bfloat16 (8 significant bits)
        torch.testing.assert_close(out.float(), ref, rtol=8e-3, atol=8e-3 * ref.abs().max().item())


@pytest.mark.parametrize("bits,group", [(8, -1), (4, 64)])
def test_error_against_the_exact_product(ops, bits, group):
    pw = random_packed(256, 576, bits, group, seed=6)
    x = torch.randn(4, 576, generator=torch.Generator().manual_seed(7))
    w = dequantize_packed(pw).double()
    exact = x.double() @ w.T
    err = Q.quant_linear_q8(x, pw).double() - exact
    sqnr = 10 * torch.log10(exact.pow(2).mean() / err.pow(2).mean()).item()
    # rounding x to 8 bits per 32 columns: step max|x| / 127 with max|x| ~ 2.2 sigma for Gaussian blocks, i.e. noise
    # power ~ (2.2 / 127)^2 / 12 = 2.5e-5 of the signal's -> ~46 dB (measured 44-45 dB); 40 dB fails a
    # kernel that misplaces a few elements (a wrong permutation of x is ~0 dB) or saturates an int16 pair sum
    assert sqnr > 40, sqnr
    assert sqnr < 80, sqnr  # and x really is rounded (the float-activation kernel: 130-134 dB)
    float_err = quant_linear(x, pw).double() - exact
    assert float_err.pow(2).mean() < err.pow(2).mean()


@pytest.mark.parametrize("bits", [8, 4])
def test_group_parameters(ops, bits):
    # float16 scales and uint8 zero points (none when symmetric: no zero points given, or all at the middle code);
    # the kernel's min = -scale * zero equals the float32 mins the reference uses, with or without zero points
    sym = random_packed(64, 576, bits, 64, sym=True, seed=12)
    assert sym.scales.dtype == torch.float16 and sym.zeros is None and sym.symmetric
    middle = torch.full(sym.scales.shape, 1 << (bits - 1))
    assert prepack(*_checkpoint_of(sym), middle, bits, 64, 576).zeros is None
    asym = random_packed(64, 576, bits, 64, seed=14)
    assert asym.zeros.dtype == torch.uint8 and not asym.symmetric
    torch.testing.assert_close(asym.mins, -asym.scales.float() * asym.zeros.float(), rtol=0, atol=0)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(13))
    for pw in (sym, asym):
        for m in (1, 2, 5):
            want = Q.quant_q8_reference(x[:m], pw)
            out = Q.quant_linear_q8(x[:m], pw)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    with pytest.raises(ValueError, match="float16"):
        prepack(_checkpoint_of(sym)[0], torch.full(sym.scales.shape, 1e6), None, bits, 64, 576)


def _checkpoint_of(pw):
    """(qweight, scales) in the checkpoint layout of a blocked PackedWeight."""
    from brisk.ops.qlinear import unpack_codes

    q = unpack_codes(pw)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous() if pw.bits == 4 else q
    return packed, pw.scales.clone()


def test_activation_sums_use_the_rounded_x(ops):
    # a large min term (zero point 255) against a small dot: the kernel's result is the product of the ROUNDED x
    # with W_hat, so it matches fake-quantized x times the dequantized weight, min term included
    pw = random_packed(16, 128, 8, 32, seed=8)
    pw.zeros.fill_(255)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(9)) + 2
    want = Q.fake_quantize_activations(x).double() @ dequantize_packed(pw).double().T
    torch.testing.assert_close(Q.quant_linear_q8(x, pw).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max())


def test_quant_linear_routing(kernel_settings, ops):
    pw = random_packed(33, 96, 4, 32, seed=10)
    x = torch.randn(12, 96, generator=torch.Generator().manual_seed(11))
    # every row count takes the int8 kernel (a row's numbers do not depend on its batch), and differs from the
    # float-activation path
    for m in (1, 8, 9, 12):
        assert torch.equal(quant_linear(x[:m], pw, int8_activations=True), Q.quant_linear_q8(x[:m], pw))
    assert not torch.equal(quant_linear(x, pw, int8_activations=True), quant_linear(x, pw))
    # formats the kernel does not take (NF4 codebook, 3 bits): the float-activation path
    nf4 = prepack_nf4(torch.randint(0, 256, (33, 48), dtype=torch.uint8), torch.rand(33, 3), 32, 96)
    assert not Q.covers(nf4)
    assert torch.equal(quant_linear(x[:2], nf4, int8_activations=True), quant_linear(x[:2], nf4))
    # no kernel: the float32 product of the rounded x (the same numbers up to summation order)
    want = Q.quant_linear_q8(x[:3], pw)
    kernel_settings(enabled=False)
    got = quant_linear(x[:3], pw, int8_activations=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    with pytest.raises(ValueError, match="quant_activations"):
        set_quant_activations(torch.nn.Linear(2, 2), "int4")


@pytest.mark.parametrize("bits,group", [(8, -1), (4, 32)])
def test_tiny_quantized_model_through_the_int8_path(ops, tmp_path, bits, group):
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=6)
    qfolder = quantize_folder(src, tmp_path / "q", LayerQuant(bits=bits, group_size=group, sym=False))
    loaded = load_model(qfolder)
    ids = torch.tensor([9, 8, 7, 100, 200, 31, 5])

    def decode_logits():  # every prefix (<= 8 rows) goes through the kernels at every quantized linear
        return torch.stack([prefill_logits(loaded, ids[: i + 1])[-1] for i in range(len(ids))])

    want = decode_logits()
    # every decoder linear and the 8-bit head
    assert set_quant_activations(loaded.model, "int8") == sum(type(m) is QuantLinear for m in loaded.model.modules())
    got = decode_logits()
    # x rounded to int8 at every quantized linear (2 layers x 4, and the head) of a random tiny model moves the
    # logits by ~2.5e-2 relative (measured 2.5e-2 int8, 2.4e-2 int4); 5e-2 bounds it, while a wrong scale or a
    # lost group gives O(1)
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 5e-2, rel
    set_quant_activations(loaded.model, "float")
    assert torch.equal(decode_logits(), want)


def test_engine_config_validates_the_setting():
    from brisk.engine.config import EngineConfig

    assert EngineConfig(quant_activations="int8").quant_activations == "int8"
    with pytest.raises(ValueError, match="quant_activations"):
        EngineConfig(quant_activations="int4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quantize_kernel_equals_the_reference_bit_for_bit(kernel_settings, ops, dtype):
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(37, 192, generator=g) * torch.logspace(-3, 2, 192)).to(dtype)
    x[3, 32:64] = 0  # an all-zero block: scale 0, codes 0
    x[4, :32] = 0.01
    x[4, 0], x[4, 5] = 0.3671875, 0.18359375  # x * (127 / amax) = 63.5 in float32: a tie, rounded half to even (64)
    got = Q.fake_quantize_activations(x)
    assert got[4, 5] == torch.tensor(64.0) * (torch.tensor(0.3671875) / 127)
    kernel_settings(enabled=False)
    want = Q.fake_quantize_activations(x)
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got, want)


def test_many_rows_take_the_gemm_path_with_the_same_numbers(ops):
    # past MAX_Q8_ROWS the rounded x goes through the float GEMM: the kernel's numbers up to summation order
    pw = random_packed(96, 256, 4, 64, seed=22)
    x = torch.randn(Q.MAX_Q8_ROWS + 9, 256, generator=torch.Generator().manual_seed(23))
    many = Q.quant_linear_q8(x, pw)
    rows = torch.cat([Q.quant_linear_q8(x[i : i + 8], pw) for i in range(0, x.shape[0], 8)])  # the kernel
    torch.testing.assert_close(many, rows, rtol=1e-5, atol=1e-5 * rows.abs().max().item())
    want = Q.quant_q8_reference(x, pw)
    torch.testing.assert_close(many, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
