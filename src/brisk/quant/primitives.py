"""Quantization primitives: qparams, quantize/dequantize, bit packing, NormalFloat4. Pure torch functions.

Uniform affine quantization of a weight W [N, K] (N output rows, K input features) in groups of G consecutive
elements along K; one (scale, zero) pair per group:

    q     = clamp(round(w / scale) + zero, 0, 2^bits - 1)      round = torch.round (half to even)
    w_hat = scale * (q - zero)

    row n:  | group 0: G values | group 1: G values | ... | group K/G - 1 |   scale, zero: [N, K/G]

- symmetric:  zero = 2^(bits-1), scale = absmax / (2^(bits-1) - 1). The restricted range of PyTorch's and
  TensorRT's per-channel int8 (w / scale in [-127, 127]): q never takes the value 0, but the grid is
  symmetric about 0 and one code is spent for it.
- asymmetric: the range [lo, hi] = [min(w_min, 0), max(w_max, 0)] always contains 0, so that with an integer
  zero point 0.0 is exactly representable (zero-padding and pruned weights stay exactly 0);
  scale = (hi - lo) / (2^bits - 1), zero = round(-lo / scale).
- an all-zero group gets scale = 1, so no division by zero happens and every q equals zero.

All arithmetic is float32 whatever the input dtype, one op at a time, so the results are reproducible
bit for bit by a per-element float32 loop (the tests' oracle). No Python loops over groups or elements:
every function reshapes to [N, K/G, G] and broadcasts the [N, K/G, 1] parameters.

The bit layout ("brisk-packed v1") and NF4 are described above `pack` and `NF4_CODEBOOK`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

SUPPORTED_BITS = (2, 3, 4, 8)
QMAX = {8: 255, 4: 15, 3: 7, 2: 3}  # largest unsigned code, 2^bits - 1

# values per packing unit: a run of this many codes fills whole bytes (8 values x 3 bits = 3 bytes)
PACK_GRANULARITY = {8: 1, 4: 2, 3: 8, 2: 4}


def qmax(bits: int) -> int:
    """Largest code of a `bits`-bit unsigned quantizer (2^bits - 1)."""
    _check_bits(bits)
    return QMAX[bits]


# ---------------------------------------------------------------------------------------------------------
# validation


def _check_bits(bits: int) -> None:
    if bits not in QMAX:
        raise ValueError(f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {bits!r}")


def _check_weight(w: Tensor, what: str = "w") -> None:
    if w.dim() != 2:
        raise ValueError(f"{what} must be a 2-D [out_features, in_features] tensor, got shape "
                         f"{tuple(w.shape)}; reshape it (e.g. w.flatten(1)) before quantizing")
    if not w.is_floating_point():
        raise ValueError(f"{what} must be a floating-point tensor, got {w.dtype}")
    if w.numel() == 0:
        raise ValueError(f"{what} is empty (shape {tuple(w.shape)}); there is nothing to quantize")
    lo, hi = torch.aminmax(w)  # NaN propagates into both: one fast reduction instead of an isfinite pass
    if not (torch.isfinite(lo) and torch.isfinite(hi)):
        num_bad = int((~torch.isfinite(w)).sum())
        raise ValueError(f"{what} has {num_bad} non-finite value(s) (NaN or inf) out of {w.numel()}; "
                         f"quantization needs finite weights, so fix or zero them first")


def _group_size_hint(k: int, group_size: int) -> str:
    """Which group sizes would work for K, e.g. '576 is divisible by 16, 32 and 64, not 128'."""
    candidates = [g for g in (16, 32, 64, 128, 256, 512, 1024) if g < k and k % g == 0]
    if not candidates:
        return f"{k} has no power-of-two divisor from 16 up; use group_size=None (one group per row)"
    listed = ", ".join(map(str, candidates[:-1]))
    listed += (" and " if listed else "") + str(candidates[-1])
    return (f"{k} is divisible by {listed}, not {group_size}; pick one of those, or group_size=None "
            f"(one group per row)")


def _resolve_group_size(k: int, group_size: int | None) -> int:
    """group_size None means per-channel (G = K); an int must be positive and divide K."""
    if group_size is None:
        return k
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int or None (per-channel), got {group_size!r}")
    if k % group_size:
        raise ValueError(f"group_size={group_size} does not divide K={k} (in_features): "
                         f"{_group_size_hint(k, group_size)}")
    return group_size


def _check_qparams(n: int, k: int, scale: Tensor, zero: Tensor) -> int:
    """Validate scale/zero against W [N, K]; returns the number of groups per row, K/G."""
    if scale.shape != zero.shape or scale.dim() != 2:
        raise ValueError(f"scale and zero must both be 2-D [N, K/G] of the same shape, got "
                         f"{tuple(scale.shape)} and {tuple(zero.shape)}")
    rows, num_groups = scale.shape
    if rows not in (1, n) or num_groups == 0 or k % num_groups:
        raise ValueError(f"scale/zero of shape {tuple(scale.shape)} do not fit a [{n}, {k}] weight: expected "
                         f"[{n} or 1, K/G] with K/G dividing {k}")
    return num_groups


# ---------------------------------------------------------------------------------------------------------
# uniform affine quantization


def choose_qparams(w: Tensor, bits: int, group_size: int | None = None, sym: bool = False,
                   per_tensor: bool = False) -> tuple[Tensor, Tensor]:
    """Round-to-nearest quantization parameters of W [N, K].

    group_size None: per-channel (one group per row); an int G must divide K; per_tensor=True: one group for
    the whole tensor. Returns (scale, zero), float32 [N, K/G] ([1, 1] per tensor); zero is integer-valued
    in [0, 2^bits - 1].
    """
    _check_bits(bits)
    _check_weight(w)
    n, k = w.shape
    if per_tensor:
        if group_size is not None:
            raise ValueError(f"per_tensor=True uses one group for the whole tensor; "
                             f"drop group_size={group_size}")
        wg = w.float().reshape(1, 1, n * k)  # [1, 1, N*K]
    else:
        g = _resolve_group_size(k, group_size)
        wg = w.float().reshape(n, k // g, g)  # [N, K/G, G]
    top = QMAX[bits]
    if sym:
        absmax = wg.abs().amax(dim=-1)  # [N, K/G]
        scale = absmax / (2 ** (bits - 1) - 1)
        scale = torch.where(absmax == 0, torch.ones_like(scale), scale)
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        lo = wg.amin(dim=-1).clamp(max=0.0)  # [N, K/G], <= 0
        hi = wg.amax(dim=-1).clamp(min=0.0)  # [N, K/G], >= 0
        span = hi - lo
        scale = span / top
        scale = torch.where(span == 0, torch.ones_like(scale), scale)
        # + 0.0 turns the -0.0 of round(-0.0) into +0.0, so equal checkpoints are equal byte for byte
        zero = torch.round(-lo / scale).clamp_(0, top).add_(0.0)
    return scale, zero


def quantize(w: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """W [N, K] float -> q [N, K] uint8 in [0, 2^bits - 1]; scale/zero [N or 1, K/G] broadcast over groups.

    Values beyond the grid's range saturate at 0 or 2^bits - 1 (the grid is fixed by scale/zero, which may
    come from other data, e.g. a calibration set).
    """
    _check_bits(bits)
    _check_weight(w)
    n, k = w.shape
    num_groups = _check_qparams(n, k, scale, zero)
    wg = w.float().reshape(n, num_groups, k // num_groups)  # [N, K/G, G]
    s = scale.float().unsqueeze(-1)  # [N or 1, K/G, 1]
    z = zero.float().unsqueeze(-1)  # [N or 1, K/G, 1]
    q = torch.round(wg / s).add_(z).clamp_(0, QMAX[bits])  # [N, K/G, G]
    return q.to(torch.uint8).reshape(n, k)


def dequantize(q: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """q [N, K] -> scale * (q - zero) [N, K] in `dtype` (computed in float32, then cast)."""
    if q.dim() != 2:
        raise ValueError(f"q must be a 2-D [N, K] tensor of codes, got shape {tuple(q.shape)}")
    n, k = q.shape
    num_groups = _check_qparams(n, k, scale, zero)
    qg = q.float().reshape(n, num_groups, k // num_groups)  # [N, K/G, G]
    w = (qg - zero.float().unsqueeze(-1)).mul_(scale.float().unsqueeze(-1))  # [N, K/G, G]
    return w.reshape(n, k).to(dtype)


def quantize_tensor(w: Tensor, bits: int, group_size: int | None = None,
                    sym: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """choose_qparams then quantize: returns (q uint8 [N, K], scale [N, K/G], zero [N, K/G])."""
    scale, zero = choose_qparams(w, bits, group_size, sym)
    return quantize(w, scale, zero, bits), scale, zero


def fake_quantize(w: Tensor, bits: int, group_size: int | None = None, sym: bool = False) -> Tensor:
    """W rounded to its own quantization grid, in W's dtype: dequantize(quantize(W)).

    No gradient flows through the rounding (torch.round's derivative is 0); QAT wants a straight-through
    estimator on top, `w + (fake_quantize(w) - w).detach()`.
    """
    q, scale, zero = quantize_tensor(w, bits, group_size, sym)
    return dequantize(q, scale, zero, dtype=w.dtype)


# ---------------------------------------------------------------------------------------------------------
# bit packing ("brisk-packed v1"), along the last dim; [..., K] uint8 codes -> [..., K * bits / 8] bytes
#
#   8 bits: identity
#   4 bits: byte j = q[2j] | q[2j+1] << 4                                  (first value in the low nibble)
#   2 bits: byte j = q[4j] | q[4j+1] << 2 | q[4j+2] << 4 | q[4j+3] << 6
#   3 bits: 8 values -> one 24-bit little-endian word  sum_i q[8j+i] << 3i,  stored as 3 bytes:
#
#       value:   q7  q6  q5  q4  q3  q2  q1  q0
#       bits:   23-21 ...            8-6 5-3 2-0      bytes 3j, 3j+1, 3j+2 = word bits 0-7, 8-15, 16-23
#
#   (q2 and q5 straddle byte boundaries; that is the price of no wasted bits)


def _check_codes_shape(bits: int, k: int, what: str) -> None:
    _check_bits(bits)
    unit = PACK_GRANULARITY[bits]
    if k % unit:
        raise ValueError(f"{what} with bits={bits} needs the last dim (K) to be a multiple of {unit} "
                         f"({unit} values fill {unit * bits // 8} byte(s)), got K={k}")


def pack(q: Tensor, bits: int) -> Tensor:
    """uint8 codes [..., K] (each < 2^bits) -> packed uint8 [..., K * bits / 8], layout above."""
    if q.dtype != torch.uint8:
        raise ValueError(f"pack expects uint8 codes, got {q.dtype}")
    if q.dim() == 0:
        raise ValueError("pack expects at least one dim, got a 0-d tensor")
    k = q.shape[-1]
    _check_codes_shape(bits, k, "pack")
    if q.numel() and int(q.max()) > QMAX[bits]:
        raise ValueError(f"q holds a value up to {int(q.max())}, which does not fit in {bits} bits "
                         f"(max {QMAX[bits]})")
    lead = q.shape[:-1]
    if bits == 8:
        return q.clone()
    if bits == 4:
        v = q.reshape(*lead, k // 2, 2)  # [..., K/2, 2]
        return (v[..., 0] | (v[..., 1] << 4)).contiguous()
    if bits == 2:
        v = q.reshape(*lead, k // 4, 4)  # [..., K/4, 4]
        return (v[..., 0] | (v[..., 1] << 2) | (v[..., 2] << 4) | (v[..., 3] << 6)).contiguous()
    # 3 bits
    v = q.reshape(*lead, k // 8, 8).to(torch.int32)  # [..., K/8, 8]
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=q.device)  # 0, 3, ..., 21
    word = (v << shifts).sum(dim=-1, dtype=torch.int32)  # [..., K/8]; fields do not overlap, so sum == or
    byte_shifts = torch.tensor([0, 8, 16], dtype=torch.int32, device=q.device)
    b = (word.unsqueeze(-1) >> byte_shifts) & 0xFF  # [..., K/8, 3]
    return b.to(torch.uint8).reshape(*lead, k // 8 * 3)


def unpack(packed: Tensor, bits: int, k: int) -> Tensor:
    """Inverse of `pack`: packed uint8 [..., K * bits / 8] -> codes uint8 [..., K]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack expects uint8 bytes, got {packed.dtype}")
    if packed.dim() == 0:
        raise ValueError("unpack expects at least one dim, got a 0-d tensor")
    _check_codes_shape(bits, k, "unpack")
    if packed.shape[-1] != k * bits // 8:
        raise ValueError(f"{k} values of {bits} bits take {k * bits // 8} bytes, but the packed tensor's "
                         f"last dim is {packed.shape[-1]}")
    lead = packed.shape[:-1]
    if bits == 8:
        return packed.clone()
    if bits == 4:
        v = torch.stack([packed & 0x0F, packed >> 4], dim=-1)  # [..., K/2, 2]
        return v.reshape(*lead, k)
    if bits == 2:
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
        v = (packed.unsqueeze(-1) >> shifts) & 0x03  # [..., K/4, 4]
        return v.reshape(*lead, k)
    # 3 bits
    b = packed.reshape(*lead, k // 8, 3).to(torch.int32)  # [..., K/8, 3]
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)  # [..., K/8], 24-bit little-endian
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)
    v = (word.unsqueeze(-1) >> shifts) & 0x07  # [..., K/8, 8]
    return v.to(torch.uint8).reshape(*lead, k)


# ---------------------------------------------------------------------------------------------------------
# NormalFloat4 (Dettmers et al., "QLoRA", 2023, section 3 and appendix E)
#
# Pretrained weights are roughly zero-mean normal, so a 4-bit code whose levels are the normal distribution's
# quantiles puts (about) the same share of the weights in every bin: the information-theoretically best use
# of 16 levels for normal data. A group is scaled by its absmax into [-1, 1], then rounded to the nearest
# level.
#
# The levels are quantiles of N(0, 1) at evenly spaced probabilities, built asymmetrically so that 0 is exact
# (padding and pruned weights stay 0): 8 levels for the positive half, 7 for the negative half, plus 0.
#   positive: Phi^-1(p) for p = 8 evenly spaced points from 1 - delta down to (not including) 0.5
#   negative: -Phi^-1(p) for p = 7 evenly spaced points from 1 - delta down to (not including) 0.5
# delta = (1/32 + 1/30) / 2 is the paper's offset: the outermost probability sits halfway between the
# centres of the last of 16 and 15 equal bins, since Phi^-1(1) = inf cannot be a level. Dividing by the
# largest value maps both ends to exactly -1 and +1.


def _nf4_codebook() -> Tensor:
    delta = 0.5 * (1 / 32 + 1 / 30)
    top = 1.0 - delta
    pos = torch.special.ndtri(torch.linspace(top, 0.5, 9, dtype=torch.float64)[:-1])  # 8 values > 0
    neg = -torch.special.ndtri(torch.linspace(top, 0.5, 8, dtype=torch.float64)[:-1])  # 7 values < 0
    levels = torch.cat([neg, torch.zeros(1, dtype=torch.float64), pos]).sort().values  # [16], ascending
    return (levels / levels.max()).float()


NF4_CODEBOOK: Tensor = _nf4_codebook()  # [16] float32, ascending; code 7 is 0.0, codes 0 and 15 are -1 and +1
# decision boundaries between neighbouring levels: [15]; a value on a boundary goes to the lower code
_NF4_MIDPOINTS: Tensor = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2


def quantize_nf4(w: Tensor, group_size: int | None = 64) -> tuple[Tensor, Tensor]:
    """W [N, K] -> (codes uint8 [N, K] in [0, 15], absmax float32 [N, K/G]); w_hat = absmax * NF4[code].

    group_size None: one group per row. An all-zero group stores absmax = 1 (like the affine scale = 1) and
    gets code 7, the exact 0.
    """
    _check_weight(w)
    n, k = w.shape
    g = _resolve_group_size(k, group_size)
    wg = w.float().reshape(n, k // g, g)  # [N, K/G, G]
    absmax = wg.abs().amax(dim=-1)  # [N, K/G]
    absmax = torch.where(absmax == 0, torch.ones_like(absmax), absmax)
    x = wg / absmax.unsqueeze(-1)  # [N, K/G, G] in [-1, 1]
    # nearest level = number of boundaries strictly below x (bucketize: boundaries[i-1] < x <= boundaries[i])
    codes = torch.bucketize(x, _NF4_MIDPOINTS.to(x.device))  # [N, K/G, G] int64 in [0, 15]
    return codes.to(torch.uint8).reshape(n, k), absmax


def dequantize_nf4(codes: Tensor, absmax: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """codes [N, K] uint8, absmax [N, K/G] -> absmax * NF4[codes], [N, K] in `dtype`."""
    if codes.dim() != 2 or absmax.dim() != 2:
        raise ValueError(f"codes [N, K] and absmax [N, K/G] must be 2-D, got {tuple(codes.shape)} and "
                         f"{tuple(absmax.shape)}")
    n, k = codes.shape
    if absmax.shape[0] != n or absmax.shape[1] == 0 or k % absmax.shape[1]:
        raise ValueError(f"absmax of shape {tuple(absmax.shape)} does not fit codes of shape {(n, k)}: "
                         f"expected [{n}, K/G] with K/G dividing {k}")
    num_groups = absmax.shape[1]
    levels = NF4_CODEBOOK.to(codes.device)[codes.long()]  # [N, K]; a code > 15 raises IndexError
    w = levels.reshape(n, num_groups, k // num_groups) * absmax.float().unsqueeze(-1)  # [N, K/G, G]
    return w.reshape(n, k).to(dtype)


# ---------------------------------------------------------------------------------------------------------
# error measure


def sqnr_db(reference: Tensor, approx: Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(sum(ref^2) / sum((ref - approx)^2)); inf if equal.

    Computed in float64 so that the noise of high-precision formats (8 bits: ~-50 dB) is not lost to
    float32 accumulation. Each bit of a uniform quantizer is worth ~6.02 dB.
    """
    if reference.shape != approx.shape:
        raise ValueError(f"sqnr_db needs tensors of the same shape, got {tuple(reference.shape)} and "
                         f"{tuple(approx.shape)}")
    ref = reference.double()
    noise = float((ref - approx.double()).square().sum())
    if noise == 0:
        return math.inf
    signal = float(ref.square().sum())
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf
