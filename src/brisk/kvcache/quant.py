"""Quantized paged KV caches: INT8 (per token) and INT4 (KIVI: keys per channel, values per token).

Both keep the paged layout of the float cache: a token at position p of a request lives in slot
`block_ids[p // block_size] * block_size + p % block_size`; only what a slot holds changes. Attention reads them
through `gather(slots)`, which dequantizes just the gathered rows (ops/attention.py, reference path), so the
cache is never materialized in float; the C++ kernel (ops/csrc/paged_attention.cpp `paged_attention_general`)
reads the codes in place instead, widening a chunk of rows at a time, with the same float32 dequantization.
Quantization happens in `write`, when the layer stores its new K/V: one C++ pass where the kernels built
(ops/csrc/kv_write.cpp, bit-identical to the PyTorch code below, which is the reference and the fallback).

INT8 (`Int8KVCache`): symmetric, one fp16 scale per (token, kv head) for keys and for values:
    q = round(x / s), s = max|x| / 127 over the head's d channels.
Bytes per token and layer: 2 * kvh * (d + 2). For SmolLM2 (kvh 3, d 64): 396 B against 1,536 B in float32
(3.88x; exactly 4x would need the scales for free) and 768 B in 16-bit (1.94x).

INT4 (`Int4KVCache`), following KIVI (Liu et al., 2024):
  * values per token: asymmetric 4-bit, one fp16 (scale, min) per (token, kv head), quantized on write;
  * keys per channel: asymmetric 4-bit, one fp16 (scale, min) per (block, kv head, channel). The key group of
    KIVI (G tokens sharing one channel's range) is exactly one KV block, so G = block_size:

        block b:  token 0 .. token bs-1      one (scale, min) per channel c, over the bs tokens of b
                  k[b, :, h, c]  ->  codes[b, :, h, c], scale[b, h, c], min[b, h, c]

  * the full-precision window: keys of a block that is not yet full stay in float16 in a small residual pool
    (`num_residual_blocks` buffers of one block each, assigned to blocks on their first write), because a
    channel's range over the group is only known once the group is complete. When the block's last slot is
    written its keys are quantized and the buffer returns to the pool. So the last 0 .. bs-1 keys of every
    sequence are exact, as KIVI's residual of R tokens (R = G here). Values need no window: they are quantized
    per token the moment they are written.
    If every residual buffer is taken (more partially filled blocks than buffers: many requests, or blocks of
    finished requests that were never filled), the least recently written one is quantized early over the rows
    it holds; a later write into such a block dequantizes it back into a buffer and requantizes it when full
    (lossy, but never wrong). A write that starts at offset o of a block makes rows >= o dead (tokens are
    appended in order, so a rewrite from o means everything after o is being recomputed, e.g. after a
    speculative rollback).
Bytes per token and layer: kvh * (d/2 + 4 d / bs) keys + kvh * (d/2 + 4) values; for SmolLM2 at block size 64:
216 B (3.56x fewer than 16-bit), at 16: 252 B (3.05x). The residual pool is a fixed cost on top (reported).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "int4")


def _pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., d] in [0, 15] -> [..., d/2]; channel 2i in the low nibble, 2i+1 in the high one."""
    pairs = codes.view(*codes.shape[:-1], codes.shape[-1] // 2, 2)  # [..., d/2, 2]
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    """[..., d/2] -> uint8 codes [..., d]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)  # [..., d/2, 2] -> [..., d]


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (int8 codes [..., d], fp16 scale [...]); symmetric, scale = max|x| / 127 over d, at least
    2^-24 (the smallest float16: a zero row keeps a nonzero scale and zero codes, no 0 / 0)."""
    scale = (x.abs().amax(-1).float() / 127.0).clamp(min=2.0**-24).half()
    codes = torch.round(x.float() / scale.float().unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float().unsqueeze(-1)).to(dtype)


def quantize_int4(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit over `dim` (min-max): x -> (uint8 codes like x, fp16 scale, fp16 min) with `dim` reduced.

    The scale and min are rounded to fp16 *before* the codes are chosen, so codes fit the stored parameters.
    """
    x = x.float()
    lo = x.amin(dim).half()
    hi = x.amax(dim).float()
    scale = ((hi - lo.float()) / 15.0).clamp(min=1e-6).half()
    codes = torch.round((x - lo.float().unsqueeze(dim)) / scale.float().unsqueeze(dim)).clamp(0, 15)
    return codes.to(torch.uint8), scale, lo


def dequantize_int4(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, dim: int,
                    dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.float().unsqueeze(dim) + lo.float().unsqueeze(dim)).to(dtype)


def _write_kernel(name: str, cache: QuantizedKVCache, k: torch.Tensor, v: torch.Tensor,
                  slot_mapping: torch.Tensor) -> Any | None:
    """The C++ write (ops/csrc/kv_write.cpp) where it takes these tensors and built, else None."""
    if not (cache.device.type == "cpu" and k.is_cpu and v.is_cpu and k.dtype == v.dtype
            and k.dtype in (torch.float32, torch.bfloat16) and k.stride(-1) == 1 and v.stride(-1) == 1
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        return None
    from brisk.ops import kernels  # (ops imports this module)

    return kernels.get_op(name)


class QuantizedKVCache(ABC):
    """One layer's quantized paged cache. Subclasses implement write / gather / copy_blocks."""

    kind = ""
    bits = 0  # code width, as the C++ kernel names the layout

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # what gather() returns (the model's compute dtype)
        self.device = torch.device(device)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @abstractmethod
    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        raise NotImplementedError

    @abstractmethod
    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of `slots` [n]: 2 x [n, kvh, d] in self.dtype."""
        raise NotImplementedError

    @abstractmethod
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        raise NotImplementedError

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @abstractmethod
    def kernel_tensors(self) -> list[torch.Tensor]:
        """What the C++ attention kernel reads in place (ops/csrc/paged_attention.cpp `quantized_cache`)."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class Int8KVCache(QuantizedKVCache):
    kind = "int8"
    bits = 8

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        n = num_blocks * block_size
        self.codes = torch.zeros(2, n, num_kv_heads, head_dim, dtype=torch.int8, device=device)  # [2, slots, kvh, d]
        self.scales = torch.zeros(2, n, num_kv_heads, dtype=torch.float16, device=device)  # [2, slots, kvh]

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, block_size: int) -> int:
        return 2 * num_kv_heads * (head_dim + 2)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        op = _write_kernel("kv_write_int8", self, k, v, slot_mapping)
        if op is not None:  # the same codes and scales, bit for bit, in one pass
            op(self.codes, self.scales, k, v, slot_mapping)
            return
        for i, x in enumerate((k, v)):
            codes, scale = quantize_int8_per_token(x)  # [T, kvh, d], [T, kvh]
            self.codes[i].index_copy_(0, slot_mapping, codes)
            self.scales[i].index_copy_(0, slot_mapping, scale)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes = self.codes.index_select(1, slots)  # [2, n, kvh, d]
        scales = self.scales.index_select(1, slots)  # [2, n, kvh]
        kv = dequantize_int8(codes, scales, self.dtype)
        return kv[0], kv[1]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        bs = self.block_size
        for s, d in zip(src, dst, strict=True):
            self.codes[:, d * bs:(d + 1) * bs] = self.codes[:, s * bs:(s + 1) * bs]
            self.scales[:, d * bs:(d + 1) * bs] = self.scales[:, s * bs:(s + 1) * bs]

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]

    def kernel_tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]


class Int4KVCache(QuantizedKVCache):
    kind = "int4"
    bits = 4

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", num_residual_blocks: int = 16) -> None:
        super().__init__(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        if head_dim % 2:
            raise ValueError(f"int4 KV cache needs an even head_dim, got {head_dim}")
        if num_residual_blocks < 1:
            raise ValueError(f"num_residual_blocks must be at least 1, got {num_residual_blocks}")
        kvh, d, bs = num_kv_heads, head_dim, block_size
        # keys: codes [nb, bs, kvh, d/2]; per-channel params of each block [nb, kvh, d]
        self.k_codes = torch.zeros(num_blocks, bs, kvh, d // 2, dtype=torch.uint8, device=device)
        self.k_scale = torch.zeros(num_blocks, kvh, d, dtype=torch.float16, device=device)
        self.k_min = torch.zeros(num_blocks, kvh, d, dtype=torch.float16, device=device)
        # values: codes [nb * bs, kvh, d/2]; per-token params [nb * bs, kvh]
        self.v_codes = torch.zeros(num_blocks * bs, kvh, d // 2, dtype=torch.uint8, device=device)
        self.v_scale = torch.zeros(num_blocks * bs, kvh, dtype=torch.float16, device=device)
        self.v_min = torch.zeros(num_blocks * bs, kvh, dtype=torch.float16, device=device)
        # the full-precision window: float16 keys of blocks still being filled [R, bs, kvh, d], and who holds which
        # buffer; the least recently written buffer is the one with the smallest tick (ops/csrc/kv_write.cpp keeps
        # the same state)
        self.k_residual = torch.zeros(num_residual_blocks, bs, kvh, d, dtype=torch.float16, device=device)
        self.residual_of_block = torch.full((num_blocks,), -1, dtype=torch.int64)  # block -> buffer, -1 = none
        self.block_of_residual = torch.full((num_residual_blocks,), -1, dtype=torch.int64)  # buffer -> block
        self.residual_tick = torch.zeros(num_residual_blocks, dtype=torch.int64)  # when each was last written
        self.clock = torch.zeros(1, dtype=torch.int64)

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, block_size: int) -> float:
        return num_kv_heads * (head_dim / 2 + 4 * head_dim / block_size) + num_kv_heads * (head_dim / 2 + 4)

    @staticmethod
    def residual_bytes_per_block(num_kv_heads: int, head_dim: int, block_size: int) -> int:
        return block_size * num_kv_heads * head_dim * 2

    # ---- keys: per block --------------------------------------------------------------------------------

    def _quantize_keys(self, blocks: torch.Tensor, keys: torch.Tensor) -> None:
        """keys [n, rows, kvh, d] (rows <= bs: a block quantized early holds fewer) -> blocks' codes and params."""
        codes, scale, lo = quantize_int4(keys, dim=1)  # codes [n, rows, kvh, d]; scale, lo [n, kvh, d]
        rows = keys.shape[1]
        self.k_codes[blocks, :rows] = _pack4(codes)
        self.k_scale[blocks] = scale
        self.k_min[blocks] = lo

    def _dequantize_keys(self, block: int) -> torch.Tensor:
        codes = _unpack4(self.k_codes[block])  # [bs, kvh, d]
        return dequantize_int4(codes, self.k_scale[block], self.k_min[block], 0, torch.float16)

    def _touch(self, buf: int) -> None:
        self.residual_tick[buf] = self.clock
        self.clock += 1

    def _take_residual(self, block: int) -> int:
        free = torch.nonzero(self.block_of_residual < 0)
        if len(free):
            buf = int(free[0])  # the lowest free buffer
        else:  # every buffer is taken: quantize the least recently written block early (see module docstring)
            buf = int(torch.argmin(self.residual_tick))
            old_block = int(self.block_of_residual[buf])
            self._quantize_keys(torch.tensor([old_block]), self.k_residual[buf].unsqueeze(0))
            self._release_residual(old_block)
        self.residual_of_block[block] = buf
        self.block_of_residual[buf] = block
        self._touch(buf)
        return buf

    def _release_residual(self, block: int) -> None:
        self.block_of_residual[self.residual_of_block[block]] = -1
        self.residual_of_block[block] = -1

    def write_state(self) -> list[torch.Tensor]:
        """What ops/csrc/kv_write.cpp `kv_write_int4` updates in place."""
        return [*self.kernel_tensors(), self.block_of_residual, self.residual_tick, self.clock]

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        op = _write_kernel("kv_write_int4", self, k, v, slot_mapping)
        if op is not None:  # the same codes, parameters and window state, bit for bit, in one pass
            op(self.write_state(), k, v, slot_mapping)
            return
        bs = self.block_size
        # values: per token, at once
        codes, scale, lo = quantize_int4(v, dim=-1)  # [T, kvh, d], [T, kvh]
        self.v_codes.index_copy_(0, slot_mapping, _pack4(codes))
        self.v_scale.index_copy_(0, slot_mapping, scale)
        self.v_min.index_copy_(0, slot_mapping, lo)

        # keys: per block. Blocks written whole in this call (prefill) are quantized in one batch; the others go
        # through their residual buffer.
        blocks = slot_mapping // bs
        offsets = slot_mapping % bs
        uniq, counts = torch.unique_consecutive(blocks, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        first_off = offsets[starts]
        whole = (counts == bs) & (first_off == 0)
        if bool(whole.any()):
            rows = starts[whole].unsqueeze(1) + torch.arange(bs)  # [n, bs] rows of k, slot order within a block
            whole_blocks = uniq[whole]
            for b in whole_blocks.tolist():
                if int(self.residual_of_block[b]) >= 0:
                    self._release_residual(b)
            self._quantize_keys(whole_blocks, k[rows].half())  # k[rows]: [n, bs, kvh, d]
        for i in torch.nonzero(~whole).flatten().tolist():
            b, start, n = int(uniq[i]), int(starts[i]), int(counts[i])
            offs = offsets[start:start + n]
            buf = int(self.residual_of_block[b])
            first = int(offs[0])
            if buf < 0:
                buf = self._take_residual(b)
                if first > 0:  # rows [0, first) are valid and were quantized: bring them back
                    self.k_residual[buf, :first] = self._dequantize_keys(b)[:first]
            else:
                self._touch(buf)
            self.k_residual[buf, offs] = k[start:start + n].half()
            if int(offs[-1]) == bs - 1:  # the block is full: quantize its keys over all bs tokens
                self._quantize_keys(torch.tensor([b]), self.k_residual[buf].unsqueeze(0))
                self._release_residual(b)

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.block_size
        blocks = slots // bs
        k_codes = _unpack4(self.k_codes.view(-1, self.num_kv_heads, self.head_dim // 2).index_select(0, slots))
        # per-channel params of each slot's block: [n, kvh, d], broadcast over the slot's codes [n, kvh, d]
        k_scale, k_min = self.k_scale.index_select(0, blocks), self.k_min.index_select(0, blocks)
        k = k_codes.float() * k_scale.float() + k_min.float()
        if bool((self.block_of_residual >= 0).any()):
            buf = self.residual_of_block.index_select(0, blocks)  # [n]
            in_window = buf >= 0
            if bool(in_window.any()):
                k[in_window] = self.k_residual[buf[in_window], slots[in_window] % bs].float()
        v_codes = _unpack4(self.v_codes.index_select(0, slots))  # [n, kvh, d]
        v = dequantize_int4(v_codes, self.v_scale.index_select(0, slots), self.v_min.index_select(0, slots),
                            -1, self.dtype)
        return k.to(self.dtype), v

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        bs = self.block_size
        for s, d in zip(src, dst, strict=True):
            for t in (self.k_codes, self.k_scale, self.k_min):
                t[d] = t[s]
            for t in (self.v_codes, self.v_scale, self.v_min):
                t[d * bs:(d + 1) * bs] = t[s * bs:(s + 1) * bs]
            if int(self.residual_of_block[d]) >= 0:
                self._release_residual(d)
            src_buf = int(self.residual_of_block[s])
            if src_buf >= 0:
                keys = self.k_residual[src_buf].clone()  # (taking a buffer for d may quantize s's own early)
                self.k_residual[self._take_residual(d)] = keys

    def tensors(self) -> list[torch.Tensor]:
        return [self.k_codes, self.k_scale, self.k_min, self.v_codes, self.v_scale, self.v_min, self.k_residual]

    def kernel_tensors(self) -> list[torch.Tensor]:
        return [*self.tensors(), self.residual_of_block]


def make_kv_caches(kind: str, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                   num_residual_blocks: int = 16) -> list[torch.Tensor | QuantizedKVCache]:
    """One cache per layer: `kind` auto (a [2, num_blocks, block_size, kvh, d] tensor of the model dtype),
    bfloat16 (the same, 16-bit: K/V rounded on write), int8 or int4 (quantized on write)."""
    if kind in ("auto", "bfloat16"):
        cache_dtype = torch.bfloat16 if kind == "bfloat16" else dtype
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            from brisk.model.hugepages import huge_zeros

            caches = huge_zeros(num_layers, shape, cache_dtype)  # one arena on 2 MiB pages (model/hugepages.py)
            if caches is not None:
                return caches
        return [torch.zeros(shape, dtype=cache_dtype, device=device) for _ in range(num_layers)]
    if kind == "int8":
        return [Int8KVCache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
                for _ in range(num_layers)]
    if kind == "int4":
        return [Int4KVCache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, num_residual_blocks)
                for _ in range(num_layers)]
    raise ValueError(f"unknown kv cache dtype {kind!r}; use one of {', '.join(KV_CACHE_DTYPES)}")


def kv_bytes_per_token(kind: str, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       float_bytes: int) -> float:
    """KV bytes one token costs in the block pool (all layers), for a cache dtype ('auto' = the model dtype)."""
    if kind == "int8":
        per_layer = Int8KVCache.bytes_per_token(num_kv_heads, head_dim, block_size)
    elif kind == "int4":
        per_layer = Int4KVCache.bytes_per_token(num_kv_heads, head_dim, block_size)
    elif kind == "auto":
        per_layer = 2 * num_kv_heads * head_dim * float_bytes
    elif kind == "bfloat16":
        per_layer = 2 * num_kv_heads * head_dim * 2
    else:
        raise ValueError(f"unknown kv cache dtype {kind!r}; use one of {', '.join(KV_CACHE_DTYPES)}")
    return per_layer * num_layers
