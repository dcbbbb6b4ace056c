"""Weight-only quantized linear (ops/qlinear.py, ops/csrc/quant_linear.cpp) against dequantize-then-F.linear.

The oracle is built here from notes/quant_format.md alone: codes are packed in the checkpoint layout by a local
helper, dequantized as scale * (q - zero) in float64, and multiplied in float64. The kernel accumulates in float32,
so float32 results must match to ~1e-5 of the output's scale (errors grow like sqrt(K) * eps); bfloat16 results
are the float32 result rounded once, so they may differ by half a bf16 ulp (2^-9 relative) more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from brisk.ops import kernels, qlinear
from brisk.ops.qlinear import (
    MAX_SMALL_M,
    NF4_CODEBOOK,
    dequantize_packed,
    prepack,
    prepack_nf4,
    quant_linear,
    unpack_codes,
)

N, K = 40, 192  # N not a multiple of any tile; K = 6 blocks of 32, 3 groups of 64


@pytest.fixture(autouse=True)
def kernels_enabled(kernel_settings):
    """Every test starts on the kernel path whatever the environment says; tests flip to the reference path."""
    kernel_settings(enabled=True)


@pytest.fixture(scope="module")
def ops():
    with kernels.override(enabled=True):  # build (or load) the kernels whatever the environment said
        found = kernels.get_ops()
    if found is None or not hasattr(found, "quant_linear_small"):
        pytest.fail("the quant_linear C++ kernels did not build; see the warning logged by brisk.ops.kernels")
    return found


def pack_checkpoint(q: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] -> brisk-packed v1 [N, K * bits / 8] uint8, as notes/quant_format.md spells it."""
    n = q.shape[0]
    q = q.to(torch.int32)
    if bits == 8:
        packed = q
    elif bits == 3:  # 8 codes -> one 24-bit little-endian word -> 3 bytes
        word = sum(q.view(n, -1, 8)[..., i] << (3 * i) for i in range(8))  # [N, K/8]
        packed = torch.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], dim=-1).view(n, -1)
    else:  # 4 bits: q[2j] | q[2j+1] << 4;  2 bits: q[4j] | q[4j+1] << 2 | ...
        per = 8 // bits
        packed = sum(q.view(n, -1, per)[..., i] << (bits * i) for i in range(per))
    return packed.to(torch.uint8)


def random_codes(bits: int, group: int, symmetric: bool, seed: int, n: int = N, k: int = K):
    """codes, scales, zeros (None when symmetric), and the float64 oracle weight scale * (q - zero)."""
    g = torch.Generator().manual_seed(seed)
    lo = 1 if symmetric else 0  # symmetric codes use the restricted range [1, 2^bits - 1]
    q = torch.randint(lo, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
    # float16-representable, as a checkpoint stores them (prepack keeps scales as float16)
    scales = (torch.rand(n, k // group, generator=g) * 0.1 + 0.001).half().float()
    zeros = None if symmetric else torch.randint(0, 1 << bits, (n, k // group), generator=g)
    z = torch.full_like(scales, float(1 << (bits - 1))) if zeros is None else zeros.double()
    w = (q.double().view(n, k // group, group) - z[..., None].double()) * scales[..., None].double()
    return q, scales, zeros, w.view(n, k)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """got (float32 or bf16) against a float64 oracle, at the precision of got's dtype."""
    scale = want.abs().max().item() + 1e-30
    err = (got.double() - want).abs()
    bound = 2e-5 * scale  # float32 accumulation: ~sqrt(K) eps of the output scale, with margin
    if got.dtype == torch.bfloat16:
        bound = bound + want.abs() * 2.0**-8  # one rounding to bf16: half an ulp is 2^-9 relative
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g} at output scale {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8, 17, 64])
@pytest.mark.parametrize("group", [32, 64, K])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_quant_linear_equals_dequantize_then_linear(kernel_settings, ops, bits, symmetric, group, m, dtype):
    seed = bits * 1000 + group * 10 + m + symmetric
    q, scales, zeros, w = random_codes(bits, group, symmetric, seed)
    pw = prepack(pack_checkpoint(q, bits), scales, zeros, bits, group, K)
    assert pw.blocked
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g) if m % 2 else None  # odd M: with a bias (kernel path and large-M path)
    want = F.linear(x.double(), w, None if bias is None else bias.double())

    got = quant_linear(x, pw, bias)  # M <= MAX_SMALL_M: C++ kernel; beyond: C++ dequantize + F.linear
    assert got.dtype == dtype and got.shape == (m, N)
    assert_matches(got, want)

    kernel_settings(enabled=False)  # the pure-PyTorch reference path
    ref = quant_linear(x, pw, bias)
    assert_matches(ref, want)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2.0**-7 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-5 * want.abs().max().item())


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
def test_layout_round_trip_and_dequantize(bits):
    q, scales, zeros, w = random_codes(bits, 64, False, seed=bits)
    pw = prepack(pack_checkpoint(q, bits), scales, zeros, bits, 64, K)
    assert pw.data.shape == (N, K * bits // 8) and pw.data.dtype == torch.uint8
    assert torch.equal(unpack_codes(pw), q)  # the runtime layout is a permutation of the codes, nothing lost
    # scale * q + min is scale * (q - zero) up to float32 rounding
    torch.testing.assert_close(dequantize_packed(pw).double(), w, rtol=1e-6, atol=1e-6 * w.abs().max().item())
    # float16 scales and uint8 zero points: 3 bytes a group
    assert pw.scales.dtype == torch.float16 and pw.zeros.dtype == torch.uint8
    assert pw.nbytes() == N * K * bits // 8 + scales.numel() * 3


def test_kernel_direct_call_is_deterministic_and_handles_leading_dims(ops):
    q, scales, zeros, w = random_codes(4, 32, False, seed=7)
    pw = prepack(pack_checkpoint(q, 4), scales, zeros, 4, 32, K)
    x = torch.randn(2, 3, K)
    out = quant_linear(x, pw)  # 6 rows: kernel path
    assert out.shape == (2, 3, N)
    assert_matches(out, F.linear(x.double(), w))
    direct = ops.quant_linear_small(x, pw.data, pw.scales, pw.zeros, None, 4, 32, None)
    assert torch.equal(direct, out)
    assert torch.equal(ops.quant_linear_small(x, pw.data, pw.scales, pw.zeros, None, 4, 32, None), direct)
    empty = quant_linear(torch.randn(0, K), pw)
    assert empty.shape == (0, N)


def test_large_m_dequantizes_in_chunks(ops, monkeypatch):
    q, scales, zeros, w = random_codes(3, 32, False, seed=11)
    pw = prepack(pack_checkpoint(q, 3), scales, zeros, 3, 32, K)
    monkeypatch.setattr(qlinear, "_DEQUANT_CHUNK_WEIGHTS", 7 * K)  # 40 rows -> chunks of 7, a ragged last one
    x, bias = torch.randn(4, MAX_SMALL_M, K), torch.randn(N)
    out = quant_linear(x, pw, bias)
    assert out.shape == (4, MAX_SMALL_M, N)
    assert_matches(out, F.linear(x.double(), w, bias.double()))


def test_bfloat16_bias(ops):
    q, scales, zeros, w = random_codes(8, 32, True, seed=3)
    pw = prepack(pack_checkpoint(q, 8), scales, zeros, 8, 32, K)
    x, bias = torch.randn(2, K).bfloat16(), torch.randn(N).bfloat16()
    got = quant_linear(x, pw, bias)
    assert got.dtype == torch.bfloat16
    assert_matches(got, F.linear(x.double(), w, bias.double()))


def test_nf4_codebook_mode(kernel_settings, ops):
    table = torch.tensor(NF4_CODEBOOK, dtype=torch.float64)
    # QLoRA's NF4: 16 sorted levels in [-1, 1] with an exact zero, 7 below it and 8 above
    assert table.numel() == 16 and bool((table.diff() > 0).all()) and table[7] == 0 and table[0] == -1
    assert table[-1] == 1
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    absmax = (torch.rand(N, K // 64, generator=g) + 0.1).half().float()  # float16, as checkpoints store it
    pw = prepack_nf4(pack_checkpoint(q, 4), absmax, 64, K)
    w = table[q.long()] * absmax.double().repeat_interleave(64, dim=1)  # absmax[n, g] * NF4[q]
    torch.testing.assert_close(dequantize_packed(pw).double(), w, rtol=1e-6, atol=1e-7)
    for m in (1, 5, 40):
        x = torch.randn(m, K, generator=g)
        assert_matches(quant_linear(x, pw), F.linear(x.double(), w))
    kernel_settings(enabled=False)
    assert_matches(quant_linear(x, pw), F.linear(x.double(), w))


@pytest.mark.parametrize("bits,k,group", [(4, 48, 16), (3, 24, 24), (2, 36, 12), (8, 20, 10)])
def test_shapes_the_kernel_does_not_cover_take_the_reference_path(ops, bits, k, group):
    q, scales, zeros, w = random_codes(bits, group, False, seed=k, k=k)
    pw = prepack(pack_checkpoint(q, bits), scales, zeros, bits, group, k)
    assert not pw.blocked  # groups not a multiple of 32: the checkpoint layout is kept
    assert torch.equal(unpack_codes(pw), q)
    x = torch.randn(3, k)
    assert_matches(quant_linear(x, pw), F.linear(x.double(), w))


def test_prepack_rejects_bad_inputs():
    q, scales, zeros, _ = random_codes(4, 32, False, seed=1)
    packed = pack_checkpoint(q, 4)
    with pytest.raises(ValueError, match="bits must be one of"):
        prepack(packed, scales, zeros, 5, 32, K)
    with pytest.raises(ValueError, match="must be positive and divide in_features"):
        prepack(packed, scales[:, :2], zeros[:, :2], 4, 100, K)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        prepack(packed[:, :-1], scales, zeros, 4, 32, K)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        prepack(packed.to(torch.int32), scales, zeros, 4, 32, K)
    with pytest.raises(ValueError, match="scales must be a float tensor of shape"):
        prepack(packed, scales[:, :3], zeros, 4, 32, K)
    with pytest.raises(ValueError, match="zeros must have the shape of scales"):
        prepack(packed, scales, zeros[:, :3], 4, 32, K)
    with pytest.raises(ValueError, match=r"zeros must be integers in \[0, 15\]"):
        prepack(packed, scales, zeros + 16, 4, 32, K)
    with pytest.raises(ValueError, match=r"zeros must be integers in \[0, 15\]"):
        prepack(packed, scales, zeros + 0.5, 4, 32, K)
    with pytest.raises(ValueError, match="must be a multiple of 8"):
        prepack(torch.zeros(2, 15, dtype=torch.uint8), torch.ones(2, 1), None, 3, 20, 20)
    with pytest.raises(ValueError, match="a 4-bit codebook has 16 entries"):
        prepack_nf4(packed, scales, 32, K, codebook=NF4_CODEBOOK[:8])
    pw = prepack(packed, scales, zeros, 4, 32, K)
    with pytest.raises(ValueError, match="this weight expects 192"):
        quant_linear(torch.randn(1, K + 1), pw)
