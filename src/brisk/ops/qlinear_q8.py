"""Dense 8/4-bit affine quantized linears with int8 activations: integer dot products (every row, prefill too).

ops/csrc/quant_q8.cpp reads the same packed codes as quant_linear.cpp (nothing new is stored) but rounds x once
per call to int8 per 32 columns, as llama.cpp's Q8_0 dot products do (xs = max|x| / 127, xq = round(x / xs),
bit for bit `sparse_q8.quantize_activations_q8`), and multiplies a block of 32 codes with two integer
instructions instead of decoding them to floats. Its result is the product of the ROUNDED activations with the
dequantized weights (the min term uses the sum of the rounded x as well), so the only approximation besides
float32 summation is x's rounding: relative error <= 1/254 of each 32-block's max |x| per element.

`quant_q8_reference` is the kernel's oracle (exact integer dots per block, scaled in float64), and
`quant_linear_q8` the entry point: the kernel, or when it is not built a float32 product of the rounded x with
the dequantized weights (the same numbers up to summation order).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from brisk.ops.kernels import get_op, kernel_tier
from brisk.ops.qlinear import BLOCK, PackedWeight, dequantize_packed, unpack_codes
from brisk.ops.sparse_q8 import quantize_activations_q8

ACTIVATION_MODES = ("auto", "float", "int8")
# Up to this many rows the integer-dot kernel runs; beyond, the rounded activations (fake_quantize_activations) go
# through the float GEMM path of dequantized weights: the same numbers up to float32 summation order, and faster
# there. Default model, int4 g32, 2 threads, one layer's four linears (ms, kernel / float path): M = 128 8.5 / 11.0,
# M = 256 16.5 / 18.3, M = 512 34.5 / 32.2 (the float path dequantizes and lets oneDNN reorder the weight per call).
MAX_Q8_ROWS = 256
# A tiled weight's kernel (quant_q8t.cpp) runs at any row count on AVX-512 and AVX-VNNI builds, but on plain AVX2
# (vpmaddubsw + vpmaddwd, no vpdpbusd) the same float path as above wins past MAX_Q8_ROWS. Xeon (AVX-512 + AMX)
# forced to a tier, 1 thread, the default model's four int4 g64 linears (ms, kernel / fake-quantized x through the
# float paths, best of 5 on a shared machine): avx2 M = 256 33.0 / 61.6, 512 72.6 / 55.7, 1024 110 / 76; avx2vnni
# M = 256 9.8 / 40.7, 512 25.6 / 35.5.
ANY_ROWS = sys.maxsize


def max_tiled_q8_rows() -> int:
    """The most activation rows a tiled weight's int8-activation kernel takes in this build (see above)."""
    return MAX_Q8_ROWS if kernel_tier().name == "avx2" else ANY_ROWS


def covers(pw: PackedWeight) -> bool:
    """Whether the int8-activation kernel takes this weight: 8- or 4-bit affine codes in the blocked layout. Float
    minimums and float32 scales (GGUF's Q4_1 / K-quants as they are) only in the tiled layout, whose kernel reads
    them; the blocked int8 kernel takes float16 scales and uint8 zero points. Groups of 32 columns or more (the
    activations' blocks): GGUF's 16-weight sub-blocks (Q6_K, Q3_K, Q2_K) take the float-activation kernels."""
    plain = not pw.float_mins and pw.scales.dtype == torch.float16
    return (pw.blocked and pw.bits in (8, 4) and pw.codebook is None and (plain or pw.tiled)
            and pw.group_size % BLOCK == 0)


def _rounded_sums(xq: torch.Tensor, xs: torch.Tensor, group_size: int) -> torch.Tensor:
    """xq [M, K] int8, xs [M, K / 32] -> xr [M, K / G] float64: sum of the rounded activations per weight group."""
    m, nb = xs.shape
    per_block = xq.view(m, nb, BLOCK).double().sum(-1) * xs.double()  # [M, nb]
    return per_block.view(m, -1, group_size // BLOCK).sum(-1)  # [M, K / G]


def quant_q8_reference(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                       rows_per_chunk: int = 4096) -> torch.Tensor:
    """Pure-PyTorch oracle of the kernel: x [..., K] -> [..., N] in x's dtype. Per 32-column block the integer
    dot of the codes with the rounded activations is exact (float64), scaled by xs_b and the group's scale; plus
    min_g times the sum of the rounded activations of the group."""
    assert covers(pw), "8- or 4-bit affine codes in the blocked layout"
    n, k, g = pw.out_features, pw.in_features, pw.group_size
    xq, xs = quantize_activations_q8(x.reshape(-1, k).float())  # [M, K] int8, [M, K / 32]
    m, nb = xs.shape
    xqb = xq.view(m, nb, BLOCK).double()  # [M, nb, 32]
    xr = _rounded_sums(xq, xs, g)  # [M, K / G]
    group_of_block = torch.arange(nb) * BLOCK // g  # [nb]
    mins = pw.mins  # [N, K / G] float32
    codes = unpack_codes(pw)  # [N, K] uint8
    group_scales = pw.group_scales()
    parts = []
    for n0 in range(0, n, rows_per_chunk):  # bounds the float64 codes to rows_per_chunk * K
        n1 = min(n, n0 + rows_per_chunk)
        q = codes[n0:n1].double().view(n1 - n0, nb, BLOCK)  # [n, nb, 32]
        dots = torch.einsum("mjc,njc->mnj", xqb, q)  # [M, n, nb], exact integers
        scale = group_scales[n0:n1].double()[:, group_of_block]  # [n, nb]
        out = (dots * xs.double()[:, None, :] * scale[None]).sum(-1)  # [M, n]
        parts.append(out + xr @ mins[n0:n1].double().T)  # + sum_g min_g xr_g
    out = torch.cat(parts, dim=-1)  # [M, N]
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype).view(*x.shape[:-1], n)


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K % 32 == 0) -> float32 [..., K]: the values the kernel multiplies, xs_b * xq."""
    op = get_op("fake_quantize_q8")
    if op is not None and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) and x.shape[-1] % BLOCK == 0:
        return op(x)
    k = x.shape[-1]
    xq, xs = quantize_activations_q8(x.reshape(-1, k).float())  # [M, K], [M, K / 32]
    xf = xq.view(xs.shape[0], -1, BLOCK).float() * xs[..., None]  # [M, nb, 32]
    return xf.view(*x.shape[:-1], k)


def quant_linear_q8(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32 / bfloat16 -> [..., N] in x's dtype, with int8-rounded activations. The caller checks
    `covers(pw)`. A tiled weight takes quant_q8t's kernel at any row count (its integer dots outrun the float GEMM
    path at every M measured), except on plain AVX2 (max_tiled_q8_rows); a blocked one up to MAX_Q8_ROWS rows.
    Past them, or without the kernel (not built, disabled, off the CPU): a float32 product of the rounded x with the
    dequantized weights."""
    op = get_op("quant_linear_q8t" if pw.tiled else "quant_linear_q8")
    if op is not None and x.is_cpu and x.dtype in (torch.float32, torch.bfloat16):
        if x.numel() <= (max_tiled_q8_rows() if pw.tiled else MAX_Q8_ROWS) * x.shape[-1]:
            return op(x, pw.data, pw.scales, pw.zeros, pw.bits, pw.group_size, bias)  # [..., N]
        from brisk.ops.qlinear import quant_linear

        return quant_linear(fake_quantize_activations(x), pw, bias).to(x.dtype)
    w = dequantize_packed(pw).to(x.device)  # [N, K]
    return F.linear(fake_quantize_activations(x), w, None if bias is None else bias.float()).to(x.dtype)
