"""GGUF block formats repacked into brisk's own quantized-kernel formats at load, instead of dequantized to float.

A GGML block format stores, per block of a row, integer codes and one or two float parameters. Where those map
onto brisk's packed weights (ops/qlinear.py: codes of 8/4 bits in groups of G = 32 m, a float16 or float32 scale
per group and an integer zero point or a float minimum), the codes are moved into brisk's layout and the block
parameters become the group parameters, so that the dequantized weight is the gguf package's reference
dequantization bit for bit in float32 (tests/test_gguf_repack.py checks every type):

    GGUF type  codes          brisk form (container, group, parameters)                    B/weight  file B/w
    Q8_0       int8           int8 g32 symmetric: code = q + 128, scale = d (float16)          1.0625    1.0625
    Q4_0       4-bit          int4 g32 symmetric: code = q, scale = d (float16)                0.5625    0.5625
    Q4_1       4-bit          int4 g32, float16 scale d and float16 minimum m                  0.625     0.625
    Q5_0       5-bit          int8 g32 symmetric: code = q + 112, scale = d (float16)          1.0625    0.6875
    Q5_1       5-bit          int8 g32, float16 scale d and float16 minimum m                  1.125     0.75
    Q4_K       4-bit          int4 g32, per sub-block scale d * sc_j and minimum -dmin * m_j   0.75      0.5625
    Q5_K       5-bit          int8 g32, the same parameters as Q4_K                            1.25      0.6875
    Q6_K       6-bit          int8 g16 symmetric: code = q + 96, scale = d * sc_j (int8 sc_j)   1.25      0.8203
    Q3_K       3-bit          int4 g16 symmetric: code = q + 8 (q in -4..3), scale d * sc_j    0.75      0.4297
    Q2_K       2-bit          int4 g16, scale d * sc_j and minimum -dmin * m_j (4-bit each)    1.0       0.3281

The K-quants' sub-block scale d * sc_j is an 11-bit float16 significand times a 4- to 8-bit integer: exact in float32
but not, in general, in float16, so those parameters are float32 (float16 when every value of the tensor is
exactly a float16). 5- and 6-bit codes live in the 8-bit container, 3- and 2-bit ones in the 4-bit container
(the tiled kernels read 8- and 4-bit codes only): exact, at the cost of the bytes in the table. Q6_K, Q3_K
and Q2_K scale sub-blocks of 16 weights: groups of 16, which the float-activation kernels take (two groups per
32-column block; the int8-activation kernels want groups of 32 and leave these layers to the float ones).
F16/BF16/F32 matrices are dequantized at load (to the model's float dtype).

Arithmetic order. gguf computes x = (d * sc) * q - dmin * m (Q4_K, Q2_K) or d * q + m (Q4_1) in float32; the product of
an integer code with the group scale is exact in float32 (at most 11 + 6 + 5 significant bits), so the only rounding
is the final addition of the minimum, which brisk's dequantization (s * q + m) performs once as well. The symmetric
forms (Q6_K: (d * sc) * (q - 32), Q3_K: (d * sc) * q) are one rounded product, as brisk's s * (code - zero).

Memory: a tensor is repacked from its raw bytes straight into its final buffers; no float copy of the tensor
exists. The work is the C++ kernel `gguf_repack` (ops/csrc/repack.cpp: one pass, a row of codes as its only
temporary), which the loader runs on the file's memory map into each weight's final layout and place
(model/gguf_place.py: fused rows, tiled layout, huge-page arena); `repack` here gives the blocked layout (the
loader's way for stacked experts, and where the kernels are not built: then the PyTorch reference below does the
same a chunk of rows at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from brisk.model.gguf_dequant import GGUFError, _bits, _crumbs, _f16, _k4_scale_min, _nibbles, _q3_k_scales
from brisk.ops.kernels import get_op
from brisk.ops.qlinear import BLOCK, PackedWeight, _to_blocked

T = GGMLQuantizationType
QK_K = 256

# GGUF type -> (container bits, group size, form); form: "sym" (zero point 2^(bits-1)) or "min" (float minimum)
REPACKED: dict[GGMLQuantizationType, tuple[int, int, str]] = {
    T.Q8_0: (8, 32, "sym"),
    T.Q4_0: (4, 32, "sym"),
    T.Q4_1: (4, 32, "min"),
    T.Q5_0: (8, 32, "sym"),
    T.Q5_1: (8, 32, "min"),
    T.Q4_K: (4, 32, "min"),
    T.Q5_K: (8, 32, "min"),
    T.Q6_K: (8, 16, "sym"),
    T.Q3_K: (4, 16, "sym"),
    T.Q2_K: (4, 16, "min"),
}
# repacked weights a chunk of rows at a time: bounds the temporaries (uint8 codes and their permutations) to a few
# times this many bytes, whatever the tensor's size (an 8B model's embedding is 525 M weights)
_CHUNK_WEIGHTS = 1 << 22


@contextmanager
def _one_thread() -> Iterator[None]:
    """Each op of a repack is a short pass over one chunk: with intra-op threads their end-of-op barriers dominate,
    worst on a busy machine. Gemma-3-270M's 127 tensors (2-core machine, load average ~4.5): 2 threads 7.5-28 s,
    1 thread 2.7 s."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def repackable(qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of this type and shape becomes a packed weight (a matrix whose rows hold whole groups)."""
    return qtype in REPACKED and len(shape) == 2 and shape[1] % GGML_QUANT_SIZES[qtype][0] == 0


def repackable_tensor(qtype: GGMLQuantizationType, hf_name: str, shape: tuple[int, ...]) -> bool:
    """Whether the loader repacks this GGUF tensor (transformers name `hf_name`, torch shape): a linear layer's
    matrix, or a stack of expert matrices (`*` in the name, shape [E, N, K]: repacked one expert at a time). MoE
    routers stay float (RouterWeight, not a linear), as llama.cpp keeps them."""
    if not hf_name.endswith(".weight") or hf_name.endswith((".mlp.gate.weight", "shared_expert_gate.weight")):
        return False
    return repackable(qtype, tuple(shape[1:]) if "*" in hf_name and len(shape) == 3 else tuple(shape))


def _codes_and_params(b: torch.Tensor, qtype: GGMLQuantizationType
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks [n, type_size] uint8 -> (codes [n, block_size] uint8 in the container's coding, scales [n, groups]
    float32, minimums [n, groups] float32 or None for symmetric codes). Field layouts: model/gguf_dequant.py."""
    n = b.shape[0]
    if qtype == T.Q8_0:  # d f16 | qs int8[32]; q + 128 (mod 256) flips the sign bit of the two's complement byte
        return b[:, 2:34] ^ 0x80, _f16(b[:, 0:2]), None
    if qtype == T.Q4_0:  # d f16 | qs[16]: x = d (q - 8)
        return _nibbles(b[:, 2:18]), _f16(b[:, 0:2]), None
    if qtype == T.Q4_1:  # d f16 | m f16 | qs[16]: x = d q + m
        return _nibbles(b[:, 4:20]), _f16(b[:, 0:2]), _f16(b[:, 2:4])
    if qtype in (T.Q5_0, T.Q5_1):  # d f16 | (m f16) | qh u32 | qs[16]; the 5th bit of weight j is bit j of qh
        off = 4 if qtype == T.Q5_1 else 2
        q = _nibbles(b[:, off + 4:off + 20]) | (_bits(b[:, off:off + 4]) << 4)  # [n, 32] in 0..31
        if qtype == T.Q5_0:  # x = d (q - 16) = d ((q + 112) - 128)
            return q + 112, _f16(b[:, 0:2]), None
        return q, _f16(b[:, 0:2]), _f16(b[:, 2:4])
    if qtype in _SIXTEENS:
        return _SIXTEENS[qtype](b)
    # Q4_K / Q5_K: d f16 | dmin f16 | scales[12] | (qh[32]) | qs[128]; 8 sub-blocks of 32: x = d sc_j q - dmin m_j
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k4_scale_min(b[:, 4:16])
    scales = d * sc  # [n, 8]: exact (11-bit significand times a 6-bit integer)
    mins = -(dmin * mn)  # exact likewise; the negation too
    qs = b[:, -128:].reshape(n, 4, 1, 32)
    q = ((qs >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F).reshape(n, 8, 32)
    if qtype == T.Q5_K:  # bit 4 of weight 32 j + l is bit j of qh[l]
        qh = (b[:, 16:48].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1  # [n, 32 l, 8 j]
        q = q | (qh.transpose(1, 2) << 4)
    return q.reshape(n, QK_K), scales, mins


def _q6_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    # ql[128] | qh[64] | scales int8[16] | d f16; weight 128 h + 32 s + l: low nibble ql[64 h + 32 (s % 2) + l] >>
    # 4 (s // 2), bits 4-5 qh[32 h + l] >> 2 s; x = (d sc_j) (q - 32) = s_j ((q + 96) - 128), j = weight // 16
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 64)
    low = ((ql >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F).reshape(n, 2, 4, 32)
    q = low | (_crumbs(b[:, 128:192].reshape(n, 2, 32)) << 4)  # [n, 2 h, 4 s, 32 l] in 0..63
    scales = _f16(b[:, 208:210]) * b[:, 192:208].view(torch.int8).float()  # [n, 16]: exact
    return (q + 96).reshape(n, QK_K), scales, None


def _q3_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    # hmask[32] | qs[64] | scales[12] | d f16; weight 128 h + 32 s + l: q = (qs[32 h + l] >> 2 s & 3) - 4 unless bit
    # 4 h + s of hmask[l] is set; x = (d sc_j) q = s_j ((q + 8) - 8)
    n = b.shape[0]
    low = _crumbs(b[:, 32:96].reshape(n, 2, 32)).reshape(n, QK_K)
    high = ((b[:, 0:32].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).transpose(1, 2)  # [n, 8, 32 l]
    q = low + 4 + (high.reshape(n, QK_K) << 2)  # q + 8 in 4..11
    return q, _f16(b[:, 108:110]) * _q3_k_scales(b[:, 96:108]), None


def _q2_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # scales[16] (low nibble scale, high nibble min) | qs[64] | d f16 | dmin f16; weight 128 h + 32 s + l: bits 2 s,
    # 2 s + 1 of qs[32 h + l]; x = (d sc_j) q - dmin m_j
    n = b.shape[0]
    sc = b[:, 0:16]
    q = _crumbs(b[:, 16:80].reshape(n, 2, 32)).reshape(n, QK_K)
    return q, _f16(b[:, 80:82]) * (sc & 0x0F).float(), -(_f16(b[:, 82:84]) * (sc >> 4).float())


_SIXTEENS = {T.Q6_K: _q6_k, T.Q3_K: _q3_k, T.Q2_K: _q2_k}  # the K-quants of 16-weight sub-blocks


def _param_dtype(t: torch.Tensor) -> torch.dtype:
    """float16 when every value survives the round trip (Q4_1's d and m always do), else float32."""
    return torch.float16 if bool((t.half().float() == t).all()) else torch.float32


def repack(raw: torch.Tensor | np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...],
           rows_perm: torch.Tensor | None = None) -> PackedWeight:
    """A GGML-encoded matrix [N, K] (torch order) as a PackedWeight in the blocked layout (tile it afterwards).

    raw: the tensor's bytes; rows_perm: optional row order (out row i = stored row rows_perm[i]), for llama.cpp's
    Q/K permutation, applied to codes and parameters alike."""
    if qtype not in REPACKED:
        raise GGUFError(f"tensor type {qtype.name} has no packed form; types that do: "
                        f"{', '.join(t.name for t in REPACKED)}")
    bits, group, form = REPACKED[qtype]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n, k = (int(s) for s in shape)
    if k % block_size:
        raise GGUFError(f"a {qtype.name} tensor's rows must be a multiple of {block_size} long, got shape {shape}")
    data = torch.as_tensor(raw).reshape(-1).view(torch.uint8)
    row_bytes = k // block_size * type_size
    if data.numel() != n * row_bytes:
        raise GGUFError(f"{qtype.name} tensor of shape {tuple(shape)} needs {n * row_bytes} bytes, got {data.numel()}")
    rows = data.view(n, row_bytes)  # [N, row_bytes]
    ngroups = k // group
    out = torch.empty(n, k // BLOCK * 4 * bits, dtype=torch.uint8)  # blocked layout, as _to_blocked makes it
    scales = torch.empty(n, ngroups, dtype=torch.float32)
    mins = torch.empty(n, ngroups, dtype=torch.float32) if form == "min" else None
    kernel = get_op("gguf_repack") if rows.is_cpu else None
    if kernel is not None:  # ops/csrc/repack.cpp: one pass, the same bits as the loop below
        kernel(rows.contiguous(), int(qtype), k, rows_perm, out, scales, mins)
    else:
        _repack_reference(rows if rows_perm is None else rows[rows_perm], qtype, out, scales, mins)
    with _one_thread():
        # the legacy types' parameters are stored float16 values (exact as float16); the K-quants' are products
        exact16 = qtype in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
        scales = scales.to(torch.float16 if exact16 else _param_dtype(scales))
        if mins is not None:
            mins = mins.to(torch.float16 if exact16 else _param_dtype(mins))
    return PackedWeight(bits=bits, group_size=group, out_features=n, in_features=k, data=out, scales=scales,
                        zeros=mins, codebook=None, blocked=True)


def _repack_reference(rows: torch.Tensor, qtype: GGMLQuantizationType, out: torch.Tensor, scales: torch.Tensor,
                      mins: torch.Tensor | None) -> None:
    """The PyTorch path of `repack` (no C++ kernels): rows [N, row_bytes] -> out, scales, mins, a chunk at a time."""
    bits, group, _ = REPACKED[qtype]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n, k = rows.shape[0], rows.shape[1] // type_size * block_size
    ngroups = k // group
    step = max(1, _CHUNK_WEIGHTS // k)
    with _one_thread():
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            blocks = rows[r0:r1].reshape(-1, type_size)  # [(r1 - r0) * K / block_size, type_size]
            q, s, m = _codes_and_params(blocks, qtype)
            out[r0:r1] = _to_blocked(q.reshape(r1 - r0, k), bits)
            scales[r0:r1] = s.reshape(r1 - r0, ngroups)
            if mins is not None:
                assert m is not None
                mins[r0:r1] = m.reshape(r1 - r0, ngroups)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Packed weights of one format (blocked layout) stacked along the rows: q/k/v or gate/up fused at load."""
    first = parts[0]
    assert all(_same_format(first, p) for p in parts), "concat_rows: parts of different formats"
    assert not any(p.tiled for p in parts), "concat_rows: tile after fusing"

    def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if ts[0] is None else torch.cat([t for t in ts if t is not None])

    with _one_thread():  # a few MB each: the copy is shorter than two threads' barrier on a busy machine
        scales, zeros = cat([p.scales for p in parts]), cat([p.zeros for p in parts])
        data = cat([p.data for p in parts])
    assert scales is not None and data is not None
    return PackedWeight(bits=first.bits, group_size=first.group_size, out_features=sum(p.out_features for p in parts),
                        in_features=first.in_features, data=data, scales=scales, zeros=zeros, codebook=None,
                        blocked=first.blocked)


def _same_format(a: PackedWeight, b: PackedWeight) -> bool:
    za, zb = a.zeros, b.zeros
    return (a.bits == b.bits and a.group_size == b.group_size and a.in_features == b.in_features
            and a.blocked == b.blocked and a.scales.dtype == b.scales.dtype and (za is None) == (zb is None)
            and (za is None or zb is None or za.dtype == zb.dtype) and a.codebook is None and b.codebook is None)


def can_concat(parts: list[PackedWeight | None]) -> bool:
    """Whether these parts (None: not packed) can share one fused packed layer."""
    first = parts[0]
    return first is not None and all(p is not None and _same_format(first, p) for p in parts)


def packed_bytes_per_weight(qtype: GGMLQuantizationType) -> float:
    """Resident bytes per weight of a repacked tensor of this type (parameters at their narrowest dtype)."""
    bits, group, form = REPACKED[qtype]
    param = 4 if qtype in (T.Q4_K, T.Q5_K, *_SIXTEENS) else 2
    return bits / 8 + param * (2 if form == "min" else 1) / group
