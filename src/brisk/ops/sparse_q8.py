"""Sparse int8 weights (SparseWeight kind 8) times int8-quantized activations: the decode path of pruned int8 layers.

Why: the float kernel of ops/csrc/sparse_linear.cpp spends ~13 instructions per 8 weights (table load, shuffle,
int->float conversion, FMA, mask bookkeeping) against ~4 for the dense int8 kernel, and loses at the 0.63 bytes
per weight that 50% sparsity leaves (notes/issue7_sparse_results.md). ops/csrc/sparse_q8.cpp instead quantizes x
once per call to int8 per 32 columns, as llama.cpp's Q8_0 dot products do, expands 32 weights per step into one
register of int8 (a byte shuffle per 128-bit half) and multiplies with integer dot products. The weight format is
unchanged; only x is rounded (to 8 bits per 32-column block, relative error <= 1/254 of the block's max |x|).

`quantize_activations_q8` reproduces the kernel's rounding bit for bit and `sparse_q8_reference` is the
kernel's oracle: exact integer dot products per block, scaled in float64.

Why it is opt-in (figures in BENCHMARKS.md and docs/history.md): on the AVX2 build it is faster than the float
sparse kernel but slower than the dense int8 kernel; on AVX-512 with VBMI2 + VNNI it expands 32 weights with one
vpexpandb and multiplies them with one vpdpbusd, and a 50%-pruned int8 model decodes about as fast as dense int8
with int8 activations (`brisk bench sparse`); as it rounds x, it stays opt-in.
Split on one 576 x 576 layer in L2: dense int8 47 us; this kernel 80 us, of which the integer dot products alone
(weights loaded as if already expanded) take 27 us and the expansion alone (mask bookkeeping, 4 table loads, 2
value loads, a shuffle per 32 weights) 63 us. The expansion, not the arithmetic, is the cost, so the path is opt-in
(`sparse_linear(..., int8_dot=True)`, `sparsify_model(..., int8_dot=True)`; it also changes the numerics, so greedy
tokens may differ from the dense int8 model's) and not selected at load.
"""

from __future__ import annotations

import torch

from brisk.ops.kernels import get_op

BLOCK = 32  # columns per activation scale


def covers(sw) -> bool:  # noqa: ANN001 - brisk.ops.sparse.SparseWeight
    """Whether the int8-dot kernel takes this weight: int8 values whose scale groups are whole 32-column blocks
    (or one group per row)."""
    return sw.kind == 8 and (sw.group_size % BLOCK == 0 or sw.group_size == sw.in_features)


def quantize_activations_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 -> (xq int8 [M, ceil(K/32) * 32], zeros past K; xs float32 [M, ceil(K/32)]) with, per
    32-column block, xs = max|x| / 127 and xq = round_half_even(x * (127 / max|x|)), 0 where max|x| == 0 (the
    kernel's float32 operations, in the same order)."""
    m, k = x.shape
    nb = -(-k // BLOCK)
    xp = torch.zeros(m, nb * BLOCK, dtype=torch.float32)
    xp[:, :k] = x.float()
    blocks = xp.view(m, nb, BLOCK)  # [M, nb, 32]
    amax = blocks.abs().amax(-1)  # [M, nb]
    xs = amax / 127.0
    # a true division, as the kernels' 127.f / amax (`127.0 / tensor` is reciprocal(tensor) * 127 in torch, which
    # differs in the last bit and so flips ties such as x = amax / 2)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax.clamp_min(torch.finfo(torch.float32).tiny),
                      torch.zeros_like(amax))
    xq = torch.round(blocks * inv[..., None]).to(torch.int8).view(m, nb * BLOCK)  # [M, nb * 32]
    return xq, xs


def sparse_q8_reference(x: torch.Tensor, sw, bias: torch.Tensor | None = None) -> torch.Tensor:  # noqa: ANN001
    """Pure-PyTorch oracle of the kernel: x [M, K] -> [M, N] float32, int dot products per 32-column block exact
    in float64, times xs[block] and the weight group's scale."""
    from brisk.ops.sparse import _keep_from_mask, _stored

    assert covers(sw), "int8 values with 32-column scale groups (or one group per row)"
    n, k, g = sw.out_features, sw.in_features, sw.group_size
    xq, xs = quantize_activations_q8(x.reshape(-1, k))
    m, nb = xs.shape
    v = torch.zeros(n, nb * BLOCK, dtype=torch.float64)
    v[:, :k][_keep_from_mask(sw.mask, k)] = _stored(sw).double()  # signed values [N, K], zeros elsewhere
    dots = torch.einsum("mjc,njc->mnj", xq.view(m, nb, BLOCK).double(), v.view(n, nb, BLOCK))  # [M, N, nb] exact
    group_of_block = (torch.arange(nb) * BLOCK // g).clamp(max=k // g - 1)  # [nb]
    scale = sw.scales.double()[:, group_of_block]  # [N, nb]
    out = (dots * xs.double()[:, None, :] * scale[None]).sum(-1)  # [M, N]
    if bias is not None:
        out = out + bias.double()
    return out.float().view(*x.shape[:-1], n)


def sparse_q8_linear(x2: torch.Tensor, sw, bias: torch.Tensor | None = None) -> torch.Tensor | None:  # noqa: ANN001
    """The kernel: x2 [M, K] float32 contiguous -> [M, N] float32, or None when it is not built (or disabled)."""
    op = get_op("sparse_q8_linear")
    if op is None:
        return None
    return op(x2, sw.mask, sw.row_ptr, sw.values, sw.scales, sw.group_size, bias)
