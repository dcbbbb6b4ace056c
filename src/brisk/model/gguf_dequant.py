"""Dequantization of GGML block formats (the tensor encodings inside GGUF files) to float32, in torch.

Every format stores a row as a run of fixed-size blocks; a block holds `block_size` weights in
`type_size` bytes. All blocks of a tensor are unpacked at once: the raw bytes are viewed as
`[n_blocks, type_size]` and each field (fp16 scales, packed low/high bits) is sliced out of that
view as a column range, so there is no Python loop over blocks.

The layouts follow ggml's `block_*` structs (ggml-common.h) and `dequantize_row_*` (ggml-quants.c).
The arithmetic order matches the `gguf` package's numpy reference (scale products first, then
`scale * q - min`, each op rounded to float32 on its own), which makes the output bit-identical to it;
tests check that. Ops run in place on the freshly made float tensor to save allocations.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256  # weights per "K-quant" super-block

T = GGMLQuantizationType


class GGUFError(ValueError):
    """A GGUF file brisk cannot load: not GGUF, damaged, or holding a model or encoding brisk does not run.

    Defined here, the lowest module, so the dequantizer can raise it; `brisk.model.gguf` re-exports it.
    """


def _f16(field: torch.Tensor) -> torch.Tensor:
    """[n_blocks, 2] little-endian fp16 bytes -> [n_blocks, 1] float32."""
    return field.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: the k low nibbles, then the k high nibbles (ggml's 4-bit order)."""
    qs = qs.contiguous()  # bit ops on a contiguous copy of the column range are ~2x faster than strided
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 8k] 0/1 values, bit j of byte i at position 8i + j (a little-endian bit field)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """[n, m, 32] bytes -> [n, m, 4, 32] 2-bit fields: shifts 0, 2, 4, 6 of each byte, one shift per run."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    return (qs.unsqueeze(-2) >> shifts) & 3


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    # block_q4_0: d f16 | qs[16]  -> x = d * (q - 8)
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 2:18]).to(torch.int8) - 8
    return q.float().mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # block_q4_1: d f16 | m f16 | qs[16]  -> x = d * q + m
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:20]).float().mul_(d).add_(m)


def _q5(b: torch.Tensor, has_min: bool) -> torch.Tensor:
    # block_q5_0: d f16 | qh u32 | qs[16];  block_q5_1: d f16 | m f16 | qh u32 | qs[16]
    # the 5th bit of weight j is bit j of qh
    off = 4 if has_min else 2
    low = _nibbles(b[:, off + 4:off + 20])
    q = low | (_bits(b[:, off:off + 4]) << 4)  # [n, 32] in 0..31
    d = _f16(b[:, 0:2])
    if has_min:
        return q.float().mul_(d).add_(_f16(b[:, 2:4]))
    return (q.to(torch.int8) - 16).float().mul_(d)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    # block_q8_0: d f16 | qs int8[32]
    return b[:, 2:34].view(torch.int8).float().mul_(_f16(b[:, 0:2]))


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    # block_q2_K: scales[16] (low nibble scale, high nibble min, per 16 weights) | qs[64] | d f16 | dmin f16
    # weight index = 128 h + 32 s + l  holds bits 2s..2s+1 of qs[32 h + l]
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _crumbs(b[:, 16:80].reshape(n, 2, 32)).reshape(n, 16, 16).float()  # [n, 16 groups, 16 weights]
    return q.mul_(dl).sub_(ml).view(n, QK_K)


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """12 bytes -> 16 signed 6-bit scales. Scale i: low 4 bits from byte i % 8 (low nibble for i < 8,
    high nibble after), high 2 bits from byte 8 + i % 4 at bit 2 * (i // 4); stored with offset 32."""
    low = torch.cat([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], dim=-1)  # [n, 16]
    high = _crumbs(s[:, 8:12].unsqueeze(1)).reshape(-1, 16)  # [n, 16]: shift 2 * (i // 4), byte 8 + i % 4
    return ((low | (high << 4)).to(torch.int8) - 32).float()


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    # block_q3_K: hmask[32] | qs[64] | scales[12] | d f16
    # weight 128 h + 32 s + l: low 2 bits from qs[32 h + l] >> 2s; its hmask bit (4 h + s of hmask[l])
    # set means +0, clear means -4.
    n = b.shape[0]
    d = _f16(b[:, 108:110])
    dl = (d * _q3_k_scales(b[:, 96:108])).view(n, 16, 1)
    low = _crumbs(b[:, 32:96].reshape(n, 2, 32)).reshape(n, QK_K)
    # hmask bits: [n, 32 l, 8 bit] -> [n, 8 bit, 32 l] so that bit (4 h + s) runs with weight 32 (4 h + s) + l
    high = ((b[:, 0:32].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).transpose(1, 2)
    q = low.to(torch.int8) - ((high.reshape(n, QK_K) ^ 1) << 2).to(torch.int8)
    return q.float().view(n, 16, 16).mul_(dl).view(n, QK_K)


def _k4_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes -> 8 6-bit scales and 8 6-bit mins (ggml's get_scale_min_k4).
    j < 4: scale = s[j] & 63, min = s[j+4] & 63;
    j >= 4: scale = (s[j+4] & 15) | (s[j-4] >> 6) << 4, min = (s[j+4] >> 4) | (s[j] >> 6) << 4."""
    a, m, lo_hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 0x3F, (lo_hi & 0x0F) | ((a >> 6) << 4)], dim=-1)
    mn = torch.cat([m & 0x3F, (lo_hi >> 4) | ((m >> 6) << 4)], dim=-1)
    return sc.float(), mn.float()


def _q45_k(b: torch.Tensor, five_bit: bool) -> torch.Tensor:
    # block_q4_K: d f16 | dmin f16 | scales[12] | qs[128]
    # block_q5_K: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    # 8 sub-blocks of 32; sub-block 2c is the low nibbles of qs[32 c : 32 c + 32], 2c + 1 the high ones;
    # for Q5_K the 5th bit of weight 32 j + l is bit j of qh[l]
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k4_scale_min(b[:, 4:16])
    d = (d * sc).view(n, 8, 1)
    dm = (dmin * mn).view(n, 8, 1)
    qs = b[:, -128:].reshape(n, 4, 1, 32)
    q = ((qs >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F).reshape(n, 8, 32)
    if five_bit:
        qh = (b[:, 16:48].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [n, 32 l, 8 j]
        q = q | (qh.transpose(1, 2) << 4)
    return q.float().mul_(d).sub_(dm).view(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # block_q6_K: ql[128] | qh[64] | scales int8[16] | d f16
    # half h (128 weights) uses ql[64 h : 64 h + 64] and qh[32 h : 32 h + 32]; within it weight 32 s + l:
    #   low 4 bits: ql[64 h + l + 32 (s % 2)] >> 4 (s // 2);  high 2 bits: qh[32 h + l] >> 2 s
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 64)
    low = ((ql >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F).reshape(n, 2, 4, 32)
    high = _crumbs(b[:, 128:192].reshape(n, 2, 32))  # [n, 2, 4, 32]
    q = ((low | (high << 4)).to(torch.int8) - 32).float().view(n, 16, 16)
    d = _f16(b[:, 208:210])
    d = (d * b[:, 192:208].view(torch.int8).float()).view(n, 16, 1)
    return q.mul_(d).view(n, QK_K)


_BLOCK_DEQUANT = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: lambda b: _q5(b, has_min=False),
    T.Q5_1: lambda b: _q5(b, has_min=True),
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: lambda b: _q45_k(b, five_bit=False),
    T.Q5_K: lambda b: _q45_k(b, five_bit=True),
    T.Q6_K: _q6_k,
}
SUPPORTED_TYPES = (T.F32, T.F16, T.BF16, *_BLOCK_DEQUANT)


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(raw, torch.Tensor):
        return raw.reshape(-1).view(torch.uint8)
    with warnings.catch_warnings():
        # a read-only memory map is fine: nothing here writes to the input
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8))


def dequantize(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType,
               shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of a GGML-encoded tensor.

    raw: the tensor's bytes (any shape, uint8 or viewed as uint8), in ggml order;
    shape: the torch shape to return, ggml's `ne` reversed: the last dim is the innermost one, along which
        the blocks run.
    The result never aliases `raw` (so a memory-mapped file can be closed afterwards).
    """
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise GGUFError(f"unknown GGML tensor type id {int(qtype)}") from None
    if qtype not in SUPPORTED_TYPES:
        raise GGUFError(f"tensor type {qtype.name} is not supported; supported types: "
                        f"{', '.join(t.name for t in SUPPORTED_TYPES)}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(int(s) for s in shape)
    numel = int(np.prod(shape))
    if shape and shape[-1] % block_size:
        raise GGUFError(f"a {qtype.name} tensor's rows must be a multiple of {block_size} long, "
                        f"got shape {shape}")
    data = _as_bytes(raw)
    n_blocks = numel // block_size
    if data.numel() != n_blocks * type_size:
        raise GGUFError(f"{qtype.name} tensor of shape {shape} needs {n_blocks * type_size} bytes, "
                        f"got {data.numel()}")
    if qtype == T.F32:
        return data.view(torch.float32).clone().view(shape)
    if qtype == T.F16:
        return data.view(torch.float16).float().view(shape)
    if qtype == T.BF16:
        return data.view(torch.bfloat16).float().view(shape)
    blocks = data.view(n_blocks, type_size)  # [n_blocks, type_size]
    return _BLOCK_DEQUANT[qtype](blocks).view(shape)
