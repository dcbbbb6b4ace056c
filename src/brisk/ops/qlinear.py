"""Weight-only quantized linear: 8/4/3/2-bit affine codes or 4-bit NF4 codes, decoded inside the matmul.

`prepack` turns a checkpoint's packed codes (the "brisk-packed v1" layout of notes/quant_format.md) into the
runtime layout of ops/csrc/quant_linear.cpp once, at load time: blocks of 32 elements permuted so that every
code sits in a fixed bit field of the 32-bit lane that the kernel decodes it into (one AND and one int->float
conversion per 8 codes), with the checkpoint's float16 scales and uint8 zero points (none for symmetric codes), so
that a weight is w = scale * (q - zero) = scale * q + min. The kernels form min = -scale * zero in float32 (exact:
an 11-bit significand times an integer below 256): 3 bytes of group parameters instead of 8 for float32 scales and
mins, the same numbers. On x86 builds (AVX2 and up), load_model then retiles 8/4-bit layers (affine, or NF4) of
whole 16-row tiles into the row-interleaved layout of ops/csrc/quant_q8t.cpp (`set_tiled`, in place), whose kernels
take every row count up to `max_tiled_rows()` (float activations) or, with int8 activations, up to
qlinear_q8.max_tiled_q8_rows() (all of them but on plain AVX2); the rest keep the blocked layout, and `quant_linear`
runs

- few activation rows (decode, M <= MAX_SMALL_M): the C++ kernel, which reads each packed weight once per call
  and never materialises float weights. At M = 1 a linear layer is a matrix-vector product bound by memory
  bandwidth, and 4-bit codes (with their scales and zero points) are 1/5 to 1/8 of the float32 bytes;
- many rows (prefill): dequantize to float32 (in C++, a chunk of rows at a time) and F.linear (MKL).
  Dequantizing costs O(N K) and the GEMM O(M N K), so beyond MAX_SMALL_M rows the decode is a small fraction of
  the call, and MKL's register-blocked GEMM beats a kernel that decodes weights inside its inner loop;
- the reference path (pure PyTorch dequantize + F.linear, float32 accumulation) when the kernels are disabled or
  did not build, off the CPU, or for a shape the kernel does not cover (group size not a multiple of 32).

Activations may be float32 or bfloat16; the arithmetic is float32 either way and the result has x's dtype. One
exception, on the tiled kernels: 8-bit codes multiply x rounded to 16-bit integers per 32 columns
(`round_activations_16`, the kernel's numbers: error <= max|x_b| / 65534 per element, ~2e-5 of an output's scale),
with integer dot products: widening each 8-bit code to float32 made batched 8-bit decode compute-bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from brisk.ops.kernels import get_op, kernel_isa
from brisk.ops.linear import dense_gemm

BLOCK = 32  # elements per packed block of the runtime layout; group sizes must be multiples of it for the kernel
SUPPORTED_BITS = (8, 4, 3, 2)
# Up to this many activation rows the kernel runs; beyond, dequantize + MKL's GEMM. Measured on the 2-core AVX2
# box at the default model's shapes (int4, 2 threads): the kernel is 1.2-1.5x faster at M = 16, even at ~24,
# and 1.2-1.7x slower at 32-48, where MKL's register blocking outweighs the float32 weights it has to read.
MAX_SMALL_M = 16
# The same for tiled weights (quant_q8t.cpp's float-activation kernel, AVX-512 builds), measured on the Zen 5 VM
# with one layer's four linears of the default model (ms, kernel / dequantize + GEMM): int4 g64 M = 64 1.34 / 2.68,
# 128 2.63 / 3.57, 256 5.07 / 5.30, 512 10.6 / 9.4. 8-bit codes (x rounded to int16, tile16), the 1B shape's qkv, o
# and gate_up of g32 codes, Xeon AMX VM, 2 threads, a helper job on one core (ms): M = 128 170 / 497, 256 483 / 796,
# 512 961 / 1018, 1024 1758 / 1323.
MAX_TILED_M = 256
# The AVX2 builds of that kernel (two 256-bit vectors a tile, codes widened by shift + AND + convert) level with
# dequantize + GEMM much earlier. Xeon (AVX-512 + AMX) forced to the avx2 tier, 1 thread, the same four int4 g64
# linears (ms, kernel / dequantize + GEMM, best of 5 on a shared machine): M = 32 3.8 / 5.4, 48 9.9 / 9.9, 64 11.5 /
# 10.3, 128 26.6 / 17.5, 256 58 / 26; forced to avx2vnni (the float kernel is the same code): 32 3.7 / 3.7, 48 5.5 /
# 4.1, 128 17.4 / 11.7.
MAX_TILED_M_AVX2 = 32

# The 16 NormalFloat-4 levels of QLoRA (Dettmers et al. 2023): quantiles of N(0, 1) scaled to [-1, 1], with an
# exact zero; 7 negative and 8 positive levels.
NF4_CODEBOOK = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982544708252, 0.5626170039176941, 0.7229568362236023, 1.0,
)


@dataclass(eq=False)
class PackedWeight:
    """A quantized [out_features, in_features] weight in brisk's runtime layout (see module docstring)."""

    bits: int
    group_size: int
    out_features: int
    in_features: int
    data: torch.Tensor  # uint8; blocked: [N, K / 32 * 4 * bits] (quant_linear.cpp layout), else [N, K * bits / 8]
    scales: torch.Tensor  # float16 [N, K / G] (NF4: per-group absmax); float32 where float16 cannot hold them
    # uint8 [N, K / G] zero points; None: symmetric (2^(bits - 1)), or codebook mode; float16 / float32: the
    # float-minimum form w = scale * q + min (GGUF's Q4_1, Q5_1 and K-quants as they are: model/gguf_repack.py)
    zeros: torch.Tensor | None
    codebook: torch.Tensor | None  # float32 [16] in codebook (NF4) mode, else None
    blocked: bool  # False: the kernel does not cover this shape; data keeps the checkpoint layout
    # True: 8/4-bit codes, scales and zero points in the row-interleaved layout of ops/csrc/quant_q8t.cpp (tiles of
    # 16 rows), read by its kernels only; set_tiled switches in place (load_model tiles every layer they take)
    tiled: bool = False

    @property
    def symmetric(self) -> bool:
        """Affine codes with every zero point at 2^(bits - 1): the kernels take them from the bit width."""
        return self.codebook is None and self.zeros is None

    @property
    def float_mins(self) -> bool:
        """Whether `zeros` holds float minimums (w = scale * q + min) rather than integer zero points."""
        return self.zeros is not None and self.zeros.is_floating_point()

    @property
    def mins(self) -> torch.Tensor | None:
        """float32 [N, K / G] = -scale * zero (w = scale * q + min), None in codebook mode; made on each call, for
        reference paths (the kernels form them from the scales and zero points)."""
        if self.codebook is not None:
            return None
        zeros = self.group_zeros()
        if self.float_mins:
            assert zeros is not None
            return zeros.float()
        zero = float(1 << (self.bits - 1)) if zeros is None else zeros.float()
        return -self.group_scales().float() * zero

    def group_scales(self) -> torch.Tensor:
        """The scales as [N, K / G] in row order, whatever the layout (a copy when tiled)."""
        return _untile_rows(self.scales) if self.tiled else self.scales

    def group_zeros(self) -> torch.Tensor | None:
        """The zero points as [N, K / G] in row order (None: symmetric or codebook), whatever the layout."""
        return _untile_rows(self.zeros) if self.tiled and self.zeros is not None else self.zeros

    def nbytes(self) -> int:
        """Bytes of every tensor this weight holds (codes, scales, zero points, codebook)."""
        tensors = [self.data, self.scales, self.zeros, self.codebook]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ---- checkpoint layout ("brisk-packed v1"): consecutive elements, little end first ----

def _unpack_checkpoint(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """[N, K * bits / 8] uint8 -> codes [N, K] uint8."""
    n = packed.shape[0]
    if bits == 8:
        return packed.clone()
    if bits == 3:
        b = packed.view(n, -1, 3).to(torch.int32)  # [N, K/8, 3]: one 24-bit word per 8 codes
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)  # [N, K/8]
        shifts = torch.arange(8, dtype=torch.int32) * 3
        return ((word[..., None] >> shifts) & 7).to(torch.uint8).reshape(n, in_features)
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.uint8) * bits
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)  # [N, K / per_byte, per_byte]
    return codes.reshape(n, in_features)


# ---- runtime layout (see the top of ops/csrc/quant_linear.cpp): blocks of 32 elements; the kernel decodes
# element e = 8 i + l of a block into lane l of vector i, and each lane reads one 32-bit word of the block ----

def _to_blocked(q: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] uint8 (K % 32 == 0) -> runtime layout [N, K / 32 * 4 * bits] uint8."""
    n, k = q.shape
    nb = k // BLOCK
    if bits == 8:  # word l, byte i = q[8 i + l]
        return q.view(n, nb, 4, 8).transpose(-1, -2).reshape(n, -1)  # [N, nb, i, l] -> [N, nb, l, i]
    if bits == 4:  # word j < 4, byte i = q[8 i + j] | q[8 i + j + 4] << 4 (lanes j and j + 4 share word j)
        q4 = q.view(n, nb, 4, 2, 4)  # [N, nb, i, h, j]: element 8 i + 4 h + j
        return (q4[:, :, :, 0] | (q4[:, :, :, 1] << 4)).transpose(-1, -2).reshape(n, -1)  # [N, nb, j, i]
    if bits == 2:  # word j < 2, byte i = sum_p q[8 i + 2 p + j] << 2 p (lanes j, j + 2, j + 4, j + 6 share word j)
        q4 = q.view(n, nb, 4, 4, 2)  # [N, nb, i, p, j]
        byte = q4[:, :, :, 0] | (q4[:, :, :, 1] << 2) | (q4[:, :, :, 2] << 4) | (q4[:, :, :, 3] << 6)  # [N, nb, i, j]
        return byte.transpose(-1, -2).reshape(n, -1)  # [N, nb, j, i]
    # 3 bits: 12-bit field per lane, F_l = sum_i q[8 i + l] << 3 i; lanes 2 t, 2 t + 1 share bytes 3 t .. 3 t + 2
    q4 = q.view(n, nb, 4, 8).to(torch.int32)  # [N, nb, i, l]
    field = q4[:, :, 0] | (q4[:, :, 1] << 3) | (q4[:, :, 2] << 6) | (q4[:, :, 3] << 9)  # [N, nb, l]
    word = field[..., 0::2] | (field[..., 1::2] << 12)  # [N, nb, 4]: 24 bits each
    data = torch.stack([word & 0xFF, (word >> 8) & 0xFF, word >> 16], dim=-1)  # [N, nb, 4, 3]
    return data.to(torch.uint8).reshape(n, -1)


def _from_blocked(data: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of _to_blocked: runtime layout -> codes [N, K] uint8."""
    n, nb = data.shape[0], in_features // BLOCK
    if bits == 8:
        return data.view(n, nb, 8, 4).transpose(-1, -2).reshape(n, in_features)
    if bits == 4:
        d = data.view(n, nb, 4, 4).transpose(-1, -2)  # [N, nb, i, j]
        return torch.stack([d & 0xF, d >> 4], dim=-2).reshape(n, in_features)  # [N, nb, i, h, j]
    if bits == 2:
        d = data.view(n, nb, 2, 4).transpose(-1, -2)[:, :, :, None, :]  # [N, nb, i, 1, j]
        shifts = (torch.arange(4, dtype=torch.uint8) * 2).view(4, 1)
        return ((d >> shifts) & 3).reshape(n, in_features)  # [N, nb, i, p, j]
    b = data.view(n, nb, 4, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)  # [N, nb, 4]
    field = torch.stack([word & 0xFFF, word >> 12], dim=-1).view(n, nb, 1, 8)  # [N, nb, 1, l]
    shifts = (torch.arange(4, dtype=torch.int32) * 3).view(4, 1)
    return ((field >> shifts) & 7).to(torch.uint8).reshape(n, in_features)  # [N, nb, i, l]


def _check_codes(qweight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, in_features: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if in_features <= 0 or group_size <= 0 or in_features % group_size:
        raise ValueError(f"group_size ({group_size}) must be positive and divide in_features ({in_features}); "
                         "use group_size = in_features for per-channel scales")
    multiple = {8: 1, 4: 2, 3: 8, 2: 4}[bits]  # codes that fill a whole number of bytes
    if in_features % multiple:
        raise ValueError(f"{bits}-bit codes pack {multiple} to {multiple * bits // 8} byte(s): in_features "
                         f"({in_features}) must be a multiple of {multiple}")
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.shape[1] != in_features * bits // 8:
        raise ValueError(f"qweight must be uint8 [out_features, {in_features * bits // 8}] (in_features * bits / 8 "
                         f"bytes per row), got {qweight.dtype} {list(qweight.shape)}")
    want = [qweight.shape[0], in_features // group_size]
    if not scales.is_floating_point() or list(scales.shape) != want:
        raise ValueError(f"scales must be a float tensor of shape {want} ([out_features, in_features / "
                         f"group_size]), got {scales.dtype} {list(scales.shape)}")


def _finish(q: torch.Tensor, bits: int, group_size: int, in_features: int, packed: torch.Tensor,
            scales: torch.Tensor, zeros: torch.Tensor | None, codebook: torch.Tensor | None) -> PackedWeight:
    blocked = group_size % BLOCK == 0  # then in_features % 32 == 0 too
    data = _to_blocked(q, bits) if blocked else packed.contiguous()
    return PackedWeight(bits=bits, group_size=group_size, out_features=q.shape[0], in_features=in_features,
                        data=data, scales=scales, zeros=zeros, codebook=codebook, blocked=blocked)


def prepack(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int,
            in_features: int) -> PackedWeight:
    """Checkpoint codes -> runtime layout. qweight: uint8 [N, K * bits / 8] (brisk-packed v1), scales: [N, K / G]
    (kept as float16, the checkpoint's dtype; other float dtypes are rounded to it), zeros: [N, K / G]
    integer-valued in [0, 2^bits - 1], or None for symmetric (zero = 2^(bits - 1)); zeros all at 2^(bits - 1) are
    symmetric too."""
    _check_codes(qweight, scales, bits, group_size, in_features)
    scales = _half_scales(scales)
    if zeros is not None:
        if list(zeros.shape) != list(scales.shape):
            raise ValueError(f"zeros must have the shape of scales {list(scales.shape)}, got {list(zeros.shape)}")
        zf = zeros.detach().to(torch.float32)
        if not bool(((zf == zf.round()) & (zf >= 0) & (zf <= (1 << bits) - 1)).all()):
            raise ValueError(f"zeros must be integers in [0, {(1 << bits) - 1}] for {bits}-bit codes")
        zeros = None if bool((zf == (1 << (bits - 1))).all()) else zf.to(torch.uint8).contiguous()
    q = _unpack_checkpoint(qweight.detach().cpu(), bits, in_features)
    return _finish(q, bits, group_size, in_features, qweight.detach(), scales, zeros, None)


def _half_scales(scales: torch.Tensor) -> torch.Tensor:
    """Scales as the kernels read them: float16 (finite: a checkpoint's float16 scales always are)."""
    half = scales.detach().to(torch.float16).contiguous()
    if not bool(torch.isfinite(half).all()):
        raise ValueError("scales must be finite and within float16's range (|scale| <= 65504)")
    return half


def prepack_nf4(qweight: torch.Tensor, absmax: torch.Tensor, group_size: int, in_features: int,
                codebook: torch.Tensor | tuple[float, ...] = NF4_CODEBOOK) -> PackedWeight:
    """4-bit codebook codes -> runtime layout; w = absmax[n, g] * codebook[q]. qweight: uint8 [N, K / 2] packed as
    4-bit codes (brisk-packed v1), absmax: [N, K / G]; codebook: 16 values, NF4 unless given."""
    _check_codes(qweight, absmax, 4, group_size, in_features)
    codebook = torch.as_tensor(codebook, dtype=torch.float32).flatten().contiguous()
    if codebook.numel() != 16:
        raise ValueError(f"a 4-bit codebook has 16 entries, got {codebook.numel()}")
    q = _unpack_checkpoint(qweight.detach().cpu(), 4, in_features)
    return _finish(q, 4, group_size, in_features, qweight.detach(), _half_scales(absmax), None, codebook)


# ---- tiled layout (see the top of ops/csrc/quant_q8t.cpp): 8- or 4-bit codes of 16 weight rows interleaved, so
# that lane r of the tiled kernels' vectors is row 16 t + r. Per tile one 64-byte line per 4 columns (8
# bits: row r's dword = q[4 c .. 4 c + 3]) or per 8 columns (4 bits: byte j of row r's dword = q[8 c + j] |
# q[8 c + 4 + j] << 4); scales and zero points [tile][group][16] ----

TILE_ROWS = 16


def _tile_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> the same values in [N / 16, C, 16] order (shaped [N, C])."""
    n = t.shape[0]
    return t.view(n // TILE_ROWS, TILE_ROWS, -1).transpose(1, 2).reshape(n, -1)


def _untile_rows(t: torch.Tensor) -> torch.Tensor:
    """Inverse of _tile_rows."""
    n = t.shape[0]
    return t.view(n // TILE_ROWS, -1, TILE_ROWS).transpose(1, 2).reshape(n, -1)


def _to_tiled(q: torch.Tensor, bits: int) -> torch.Tensor:
    """8- or 4-bit codes [N, K] uint8 (N % 16 == 0, K % 8 == 0) -> tiled data [N, K * bits / 8] uint8."""
    n, k = q.shape
    if bits == 8:
        return q.view(n // TILE_ROWS, TILE_ROWS, k // 4, 4).transpose(1, 2).reshape(n, k)  # [t, c, r, j]
    q5 = q.view(n // TILE_ROWS, TILE_ROWS, k // 8, 2, 4)  # [t, r, c, h, j]: column 8 c + 4 h + j
    return (q5[:, :, :, 0] | (q5[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(n, k // 2)  # [t, c, r, j]


def _from_tiled(data: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of _to_tiled: tiled data -> codes [N, K] uint8."""
    n = data.shape[0]
    if bits == 8:
        return data.view(n // TILE_ROWS, in_features // 4, TILE_ROWS, 4).transpose(1, 2).reshape(n, in_features)
    d = data.view(n // TILE_ROWS, in_features // 8, TILE_ROWS, 4).permute(0, 2, 1, 3)  # [t, r, c, j]
    return torch.stack([d & 0xF, d >> 4], dim=-2).reshape(n, in_features)  # [t, r, c, h, j]


_TILE_CHUNK_WEIGHTS = 1 << 22  # set_tiled converts this many weights (whole tiles) at a time


def _tileable(pw: PackedWeight) -> bool:
    """8- or 4-bit affine codes, or 4-bit codebook (NF4) codes, in the blocked layout, in whole 16-row tiles."""
    codes = pw.bits in (8, 4) if pw.codebook is None else pw.bits == 4
    return pw.blocked and codes and pw.out_features % TILE_ROWS == 0


def max_tiled_rows() -> int:
    """The most activation rows the tiled float-activation kernel takes in this build; beyond, dequantize + GEMM."""
    return MAX_TILED_M if kernel_isa() == "avx512" else MAX_TILED_M_AVX2


def can_tile(pw: PackedWeight) -> bool:
    """Whether the tiled kernels (x86 builds, AVX2 and up) can take this weight: 8- or 4-bit affine or 4-bit codebook
    codes in the blocked layout (or tiled already), a multiple of 16 rows, on the CPU. (Codebook codes have no
    integer form: they take the float-activation kernel only.)"""
    return (pw.tiled or (_tileable(pw) and pw.data.is_cpu)) and get_op("quant_linear_q8t") is not None


def set_tiled(pw: PackedWeight, tiled: bool) -> bool:
    """Switch an 8- or 4-bit weight between the blocked and the tiled layout, in place: the same storages (so views,
    buffers and huge-page arenas that hold them stay valid) get the permuted bytes. Returns whether it changed."""
    if pw.tiled == tiled:
        return False
    if tiled and not _tileable(pw):
        raise ValueError(f"only 8- or 4-bit affine codes and 4-bit codebook codes in the blocked layout with a "
                         f"multiple of {TILE_ROWS} rows can be tiled (this weight: {pw.bits}-bit, "
                         f"{pw.out_features} rows)")
    k, bits = pw.in_features, pw.bits
    kernel = get_op("packed_retile") if pw.data.is_cpu and pw.data.is_contiguous() else None
    # Both layouts keep each 16-row tile in the same byte range (a row-local permutation), so the weight is
    # converted a chunk of whole tiles at a time: the temporaries are a chunk's, not the matrix's (an 8B model's
    # head is 525 M codes)
    step = max(TILE_ROWS, _TILE_CHUNK_WEIGHTS // max(k, 1) // TILE_ROWS * TILE_ROWS)
    # inference mode: weights made under it (inference tensors) take in-place writes only there, and others do too
    with torch.inference_mode():
        for r0 in range(0, pw.out_features, step):
            r1 = min(pw.out_features, r0 + step)
            part = pw.data.view(pw.out_features, -1)[r0:r1]
            if kernel is not None:  # ops/csrc/repack.cpp: the codes in place, a tile at a time
                kernel(part, bits, k, tiled)
                data = None
            elif tiled:
                data = _to_tiled(_from_blocked(part, bits, k), bits)
            else:
                data = _to_blocked(_from_tiled(part, bits, k), bits)
            if tiled:
                scales = _tile_rows(pw.scales[r0:r1])
                zeros = None if pw.zeros is None else _tile_rows(pw.zeros[r0:r1])
            else:
                scales = _untile_rows(pw.scales[r0:r1])
                zeros = None if pw.zeros is None else _untile_rows(pw.zeros[r0:r1])
            for dst, src in ((part, None if data is None else data.view_as(part)), (pw.scales[r0:r1], scales),
                             (None if pw.zeros is None else pw.zeros[r0:r1], zeros)):
                if dst is not None and src is not None:  # a permutation that is a view of its source is copied first
                    same = src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr()
                    dst.copy_(src.clone() if same else src)
    pw.tiled = tiled
    return True


def unpack_codes(pw: PackedWeight) -> torch.Tensor:
    """The integer codes q [N, K] (uint8) of a packed weight, whatever its layout."""
    if pw.tiled:
        return _from_tiled(pw.data, pw.bits, pw.in_features)
    if pw.blocked:
        return _from_blocked(pw.data, pw.bits, pw.in_features)
    return _unpack_checkpoint(pw.data, pw.bits, pw.in_features)


def round_activations_16(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K % 32 == 0) -> float32 [..., K]: the activations that the tiled kernel of 8-bit codes with float
    activations multiplies (quant_q8t.cpp, tile16): per 32 columns xs = max|x| / 32767, x rounded to xs * q with q
    = round_half_even(x * (32767 / max|x|)) in int16, in the kernel's float32 operations."""
    xf = x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = xf.abs().amax(-1, keepdim=True).double()
    # correctly rounded float32 quotients, as the kernel's scalar divisions (PyTorch's vectorized division of a
    # float32 tensor can differ in the last bit, which moves a rounding tie)
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax)).float()
    q = torch.round(xf * inv).clamp(-32768, 32767)
    return (q * (amax / 32767.0).float()).reshape(x.shape)


def dequantize_packed(pw: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference dequantization to [N, K]: scale * q + min (affine) or scale * codebook[q], in float32."""
    q = unpack_codes(pw)
    n, k, g = pw.out_features, pw.in_features, pw.group_size
    scales = pw.group_scales().float()[..., None]
    if pw.codebook is not None:
        w = pw.codebook[q.long()].view(n, k // g, g) * scales  # [N, K/G, G]
    elif not pw.float_mins:  # scale * (q - zero): the same value as scale * q + min, and the sign of zero of
        # GGUF's d * (q - zero) (a negative scale gives -0.0 where q == zero)
        zeros = pw.group_zeros()
        zero = float(1 << (pw.bits - 1)) if zeros is None else zeros.float()[..., None]
        w = (q.view(n, k // g, g).float() - zero) * scales  # [N, K/G, G]
    else:
        mins = pw.mins
        assert mins is not None, "affine codes have mins"
        w = torch.addcmul(mins[..., None], q.view(n, k // g, g).float(), scales)  # [N, K/G, G]
    return w.reshape(n, k).to(dtype)


def quant_linear(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None = None,
                 int8_activations: bool = False) -> torch.Tensor:
    """x: [..., K] (float32 or bfloat16) @ dequantized weight^T (+ bias) -> [..., N] in x's dtype.
    int8_activations: for 8/4-bit affine codes, round every row of x to int8 per 32 columns and use integer dot
    products (ops/qlinear_q8.py), whatever the row count, so a row's numbers do not depend on the batch it runs in;
    other formats take the float-activation paths."""
    k = pw.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features in its last dim, this weight expects {k}")
    if int8_activations:
        from brisk.ops import qlinear_q8

        if qlinear_q8.covers(pw):
            return qlinear_q8.quant_linear_q8(x, pw, bias)
    if pw.blocked and x.is_cpu and x.dtype in _KERNEL_DTYPES:
        # the layout's kernels: tiled (quant_q8t.cpp) or blocked (quant_linear.cpp), with the same arguments
        small, dequantize, max_rows = (("quant_linear_t", "quant_dequantize_t", max_tiled_rows()) if pw.tiled
                                       else ("quant_linear_small", "quant_dequantize", MAX_SMALL_M))
        if x.numel() <= max_rows * k:  # few rows (decode): decode the codes inside the kernel
            op = get_op(small)
            if op is not None:
                return op(x, pw.data, pw.scales, pw.zeros, pw.codebook, pw.bits, pw.group_size, bias)  # [..., N]
        else:
            op = get_op(dequantize)
            if op is not None:
                return _dequantize_and_multiply(x, pw, bias, op)
    # reference path: float32 weights and accumulation, like the kernel
    w = dequantize_packed(pw).to(x.device)  # [N, K]
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# rows of weights dequantized at a time on the large-M path: 2^21 float32 weights (8 MiB) stay in the last-level
# cache between the decode that writes them and the GEMM that reads them, and bound the temporary memory
_DEQUANT_CHUNK_WEIGHTS = 1 << 21


def _dequantize_and_multiply(x: torch.Tensor, pw: PackedWeight, bias: torch.Tensor | None,
                             op: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Many rows (prefill): dequantize (C++) a chunk of weight rows at a time and multiply with F.linear. The
    decode costs O(N K) and the GEMM O(M N K), so for the M that reach this path the decode is a few percent of
    the time, and MKL's blocked GEMM is faster than any decode-in-the-inner-loop kernel at large M."""
    xf = x.float()
    bf = None if bias is None else bias.float()
    rows = max(1, _DEQUANT_CHUNK_WEIGHTS // pw.in_features)
    if pw.tiled:  # whole tiles of 16 rows
        rows = max(TILE_ROWS, rows // TILE_ROWS * TILE_ROWS)
    parts = []
    for n0 in range(0, pw.out_features, rows):
        n1 = min(pw.out_features, n0 + rows)
        if pw.tiled:
            w = op(pw.data, pw.scales, pw.zeros, pw.codebook, pw.bits, pw.group_size, pw.in_features,
                   n0 // TILE_ROWS, n1 // TILE_ROWS)
            parts.append(dense_gemm(xf, w, None if bf is None else bf[n0:n1]))
            continue
        zeros = None if pw.zeros is None else pw.zeros[n0:n1]
        w = op(pw.data[n0:n1], pw.scales[n0:n1], zeros, pw.codebook, pw.bits, pw.group_size, pw.in_features)
        parts.append(dense_gemm(xf, w, None if bf is None else bf[n0:n1]))  # [..., n1 - n0]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [..., N]
    return out.to(x.dtype)
