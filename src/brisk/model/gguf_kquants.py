"""Encoders for llama.cpp's K-quants Q4_K, Q5_K and Q6_K (the `gguf` package only decodes them).

A super-block holds 256 consecutive weights of a row. Byte layouts (ggml-common.h; what gguf.quants decodes):

    Q4_K  144 B: d f16 | dmin f16 | scales[12] | qs[128]          8 sub-blocks of 32, w = d*sc_j*q - dmin*m_j, q < 16
    Q5_K  176 B: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]   as Q4_K with a fifth bit, q < 32
    Q6_K  210 B: ql[128] | qh[64] | scales[16] int8 | d f16        16 sub-blocks of 16, w = d*sc_j*(q - 32), q < 64

    scales[12] of Q4_K/Q5_K, 6-bit sc_j and m_j:  bytes 0-3: sc_j | (sc_j+4 >> 4) << 6   (j < 4)
                                                  bytes 4-7: m_j  | (m_j+4 >> 4) << 6
                                                  bytes 8-11: (sc_j+4 & 15) | (m_j+4 & 15) << 4
    qs: byte 32 i + l = q[2 i][l] | q[2 i + 1][l] << 4      (sub-blocks 2 i, 2 i + 1; l < 32)
    Q5_K qh: byte l, bit u = bit 4 of q[u][l]
    Q6_K: element e = 128 h + 32 s + l of a half h: ql[64 h + (e mod 64)] holds its low nibble (elements
          128 h + 64 .. in the high nibbles), qh[32 h + l] bits 2 s, 2 s + 1 hold its bits 4-5.

The parameters are chosen by min/max per sub-block (a plain rounding, not llama.cpp's iterative search, which
lowers the error further), then the sub-block scales are rounded to their 6- or 8-bit codes, and the weights are
rounded on the grid those codes actually give: what the decoder computes is what was optimised.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _super_blocks(w: np.ndarray) -> np.ndarray:
    if w.ndim != 2 or w.shape[1] % QK_K:
        raise ValueError(f"K-quants need rows that are a multiple of {QK_K} long, got shape {list(w.shape)}")
    return w.astype(np.float32).reshape(-1, QK_K)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _affine(x: np.ndarray, top: int) -> tuple[np.ndarray, ...]:
    """Super-blocks [B, 8, 32] -> (d f16 [B], dmin f16 [B], sc [B, 8], m [B, 8] 6-bit, q [B, 8, 32])."""
    lo = np.minimum(x.min(-1), 0.0)  # [B, 8]: the grid reaches 0 so that the minimum is >= 0, as llama.cpp's
    hi = x.max(-1)
    scale = (hi - lo) / top
    minimum = -lo
    d = _f16(scale.max(-1) / 63)  # [B]
    dmin = _f16(minimum.max(-1) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.clip(np.rint(scale / d[:, None]), 0, 63), 0)
        m = np.where(dmin[:, None] > 0, np.clip(np.rint(minimum / dmin[:, None]), 0, 63), 0)
        step = (d[:, None] * sc)[..., None]  # [B, 8, 1]: the grid the decoder uses
        offset = (dmin[:, None] * m)[..., None]
        q = np.where(step > 0, np.clip(np.rint((x + offset) / step), 0, top), 0)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit sc, m [B, 8] -> scales [B, 12]."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [B, 8, 32] -> qs [B, 128]: byte 32 i + l = low nibble of q[2 i][l] | of q[2 i + 1][l] << 4."""
    return ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(q.shape[0], 128)


def _header(d: np.ndarray, dmin: np.ndarray) -> list[np.ndarray]:
    return [d.astype(np.float16).view(np.uint8).reshape(-1, 2), dmin.astype(np.float16).view(np.uint8).reshape(-1, 2)]


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float [N, K] (K % 256 == 0) -> Q4_K bytes [N, K / 256 * 144]."""
    x = _super_blocks(w).reshape(-1, 8, 32)
    d, dmin, sc, m, q = _affine(x, 15)
    blocks = np.concatenate([*_header(d, dmin), _pack_scales(sc, m), _nibbles(q)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """float [N, K] (K % 256 == 0) -> Q5_K bytes [N, K / 256 * 176]."""
    x = _super_blocks(w).reshape(-1, 8, 32)
    d, dmin, sc, m, q = _affine(x, 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)  # [B, 32]
    blocks = np.concatenate([*_header(d, dmin), _pack_scales(sc, m), qh, _nibbles(q)], axis=1)
    return blocks.reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """float [N, K] (K % 256 == 0) -> Q6_K bytes [N, K / 256 * 210]."""
    x = _super_blocks(w).reshape(-1, 16, 16)  # [B, 16, 16]
    b = x.shape[0]
    amax_idx = np.abs(x).argmax(-1)
    peak = np.take_along_axis(x, amax_idx[..., None], -1)[..., 0]  # [B, 16]: the signed largest value
    scale = peak / -32  # llama.cpp's choice: the largest magnitude lands on code -32, the one-sided end
    d = _f16(np.abs(scale).max(-1) / 127)  # [B]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.clip(np.rint(scale / d[:, None]), -128, 127), 0)
        step = (d[:, None] * sc)[..., None]
        q = np.where(step != 0, np.clip(np.rint(x / step), -32, 31), 0) + 32  # [B, 16, 16] in [0, 63]
    q = q.astype(np.uint8).reshape(b, 2, 128)  # [B, half, e]
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)  # [B, 2, 64]
    hi = (q >> 4).reshape(b, 2, 4, 32)  # [B, half, s, l]
    qh = (hi << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)  # [B, 2, 32]
    blocks = np.concatenate([ql.reshape(b, 128), qh.reshape(b, 64), sc.astype(np.int8).view(np.uint8),
                             d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(w.shape[0], -1)
