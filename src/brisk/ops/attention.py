"""Attention over the paged KV cache, for a flattened batch of many sequences.

The cache of one layer is `kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]`; a token at logical
position p of a request lives in physical slot `block_table[p // block_size] * block_size + p % block_size`.

The runner lays the batch out decodes first and describes every sequence once per step (`AttentionMetadata`,
ops/metadata.py, shared by all layers).

Two ways to run it:
- the C++ kernel (ops/csrc/paged_attention.cpp) reads every sequence's K/V in place (a float32 or bfloat16
  cache, or the codes of an int8 / int4 one, widened a chunk at a time), walking its block table,
  in one call for the whole batch (decode and chunked prefill alike; a query token at position p sees p and
  before);
- the reference path (no compiler, BRISK_DISABLE_KERNELS=1, another device): decodes run as ONE batched SDPA
  over a gathered, padded copy of their contexts; prefills run one sequence at a time with a causal mask offset
  by the tokens already in the cache. Its gather indices are derived from the block tables once per step, on
  first use.
Every caller (the runner, evaluation, calibration, tests) builds the metadata with
`AttentionMetadata.for_sequences`; attention never writes into it. What attention measures for a KV policy (H2O's
attention mass) goes into a separate output, `AttentionStats`, which the metadata only points at.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from brisk.kvcache.quant import QuantizedKVCache
from brisk.ops import kernels
from brisk.ops.metadata import AttentionMetadata, AttentionStats, PrefillSeq, ReferenceIndices, causal_mask

__all__ = ["AttentionMetadata", "AttentionStats", "PrefillSeq", "causal_mask", "paged_attention"]

PREFILL_Q_TILE = 16  # query tokens per kernel work item: 16 x (h / kvh) rows share each K/V row read


KVCache = torch.Tensor | QuantizedKVCache  # float: [2, num_blocks, block_size, kvh, d]; or int8 / int4


def cache_block_size(kv_cache: KVCache) -> int:
    return kv_cache.block_size if isinstance(kv_cache, QuantizedKVCache) else kv_cache.shape[2]


def cache_num_kv_heads(kv_cache: KVCache) -> int:
    return kv_cache.num_kv_heads if isinstance(kv_cache, QuantizedKVCache) else kv_cache.shape[3]


def gather_kv(kv_cache: KVCache, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of `slots` [n] as 2 x [n, kvh, d] in `dtype`; a quantized cache dequantizes them here."""
    if isinstance(kv_cache, QuantizedKVCache):
        k, v = kv_cache.gather(slots)
        return k.to(dtype), v.to(dtype)
    k_flat, v_flat = flat_kv(kv_cache)
    return k_flat.index_select(0, slots).to(dtype), v_flat.index_select(0, slots).to(dtype)


def flat_kv(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's cache by slot: [2, num_blocks, block_size, kvh, d] -> 2 x [num_slots, kvh, d]."""
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    return kv_cache[0].view(num_slots, *kv_cache.shape[3:]), kv_cache[1].view(num_slots, *kv_cache.shape[3:])


def write_kv(kv_cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values. kv_cache: [2, num_blocks, block_size, kvh, d]; k, v: [T, kvh, d].

    A quantized cache quantizes them on the way in (kvcache/quant.py)."""
    if isinstance(kv_cache, QuantizedKVCache):
        kv_cache.write(k, v, slot_mapping)
        return
    k_flat, v_flat = flat_kv(kv_cache)
    k_flat.index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                  meta: AttentionMetadata, num_heads: int, num_kv_heads: int) -> bool:
    """RoPE on the q and k heads of a fused projection output, in place, and k, v into the cache: one C++ pass
    (ops/csrc/fused_ops.cpp `rope_cache`), bit-identical to `apply_rope` + `write_kv`. qkv: [T, (h + 2 kvh) d].

    A bfloat16 cache under float32 qkv (--kv-cache-dtype bfloat16) gets k, v rounded to nearest even, as
    write_kv's `.to(kv_cache.dtype)`. Returns False, having done nothing, where the kernel does not apply
    (quantized or evicting caches, other dtype pairs, no kernels): the caller then takes the reference path.
    """
    if (meta.evicting or isinstance(kv_cache, QuantizedKVCache) or not qkv.is_cpu
            or (qkv.dtype != kv_cache.dtype and kv_cache.dtype != torch.bfloat16)
            or cos.dtype != torch.float32 or not qkv.is_contiguous()):
        return False
    op = kernels.get_op("rope_cache")
    if op is None:
        return False
    op(qkv, cos, sin, kv_cache, meta.slot_mapping, num_heads, num_kv_heads)
    return True


def kernel_supports(q: torch.Tensor, kv_cache: KVCache) -> bool:
    """Whether the C++ kernel covers these tensors (the caller still checks that it built).

    A quantized cache (int8, int4) is read in place by `paged_attention_general`, as is any cache under
    StreamingLLM's sinks and window."""
    ok_dtypes = (torch.float32, torch.bfloat16)
    if isinstance(kv_cache, QuantizedKVCache):
        return (q.device.type == "cpu" and kv_cache.device.type == "cpu" and q.dtype in ok_dtypes
                and kv_cache.head_dim % 8 == 0 and q.stride(-1) == 1)
    return (q.device.type == "cpu" and kv_cache.device.type == "cpu" and q.dtype in ok_dtypes
            and kv_cache.dtype in ok_dtypes and q.shape[-1] % 8 == 0 and q.stride(-1) == 1
            and kv_cache.is_contiguous())


def paged_attention(
    q: torch.Tensor,  # [T, h, d]
    k: torch.Tensor,  # [T, kvh, d] this step's keys (already written to the cache)
    v: torch.Tensor,  # [T, kvh, d]
    kv_cache: KVCache,  # [2, num_blocks, block_size, kvh, d] or a quantized cache
    meta: AttentionMetadata,
    scale: float,
    use_kernels: bool | None = None,  # None: the C++ kernel when it built and fits, else the reference path
) -> torch.Tensor:  # [T, h, d]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    kernel_ok = use_kernels is not False and kernel_supports(q, kv_cache)
    general = kernels.get_op("paged_attention_general") if kernel_ok else None
    window = meta.sliding_window or 0
    if meta.evicting:
        # StreamingLLM (sinks + a window) on the kernel; H2O (no window, attention mass collected) on the reference
        if general is None or meta.sliding_window is None or meta.stats is not None:
            _sink_window_attention(out, q, kv_cache, meta, scale)
            return out
        assert meta.query_start_loc is not None and meta.block_tables is not None
        tensors, bits = _cache_tensors(kv_cache)
        general(out, q, tensors, bits, cache_block_size(kv_cache), meta.query_start_loc, meta.block_tables,
                meta.context_lens, scale, window, PREFILL_Q_TILE, _sink_queries(q, meta), meta.num_sink_tokens)
        return out
    assert meta.block_tables is not None, "build the metadata with AttentionMetadata.for_sequences"
    decode_only = meta.num_decodes == meta.block_tables.shape[0]
    op = None
    if kernel_ok and isinstance(kv_cache, QuantizedKVCache):
        if general is not None:
            general(out, q, kv_cache.kernel_tensors(), kv_cache.bits, kv_cache.block_size,
                    None if decode_only else meta.query_start_loc, meta.block_tables, meta.context_lens,
                    scale, window, PREFILL_Q_TILE)
            if meta.tree_masks:
                tree_attention_reference(out, q, kv_cache, meta, scale)
            return out
    elif kernel_ok:
        if meta.tree_masks and meta.sliding_window is None:  # token trees: each tree row sees its ancestors
            tree_op, bits = kernels.get_op("paged_tree_attention"), meta.tree_row_bits()
            if tree_op is not None and bits is not None:
                tree_op(out, q, kv_cache, meta.query_start_loc, meta.block_tables, meta.context_lens, scale,
                        PREFILL_Q_TILE, bits)
                return out
        op = kernels.get_op("paged_decode_attention" if decode_only else "paged_prefill_attention")
    if op is not None and decode_only:
        op(out, q, kv_cache, meta.block_tables, meta.context_lens, scale, window)
    elif op is not None:
        op(out, q, kv_cache, meta.query_start_loc, meta.block_tables, meta.context_lens, scale, window,
           PREFILL_Q_TILE)
    else:
        ref = meta.reference_indices(cache_block_size(kv_cache))
        if meta.num_decodes:
            _decode_reference(out, q, kv_cache, meta.num_decodes, ref, scale)
        _prefills_reference(out, q, k, v, kv_cache, ref.prefills, scale, meta.slot_mapping)
    if meta.tree_masks:
        tree_attention_reference(out, q, kv_cache, meta, scale)
    return out


def _cache_tensors(kv_cache: KVCache) -> tuple[list[torch.Tensor], int]:
    """A cache as paged_attention_general takes it: its tensors and code width (0: a float cache tensor)."""
    if isinstance(kv_cache, QuantizedKVCache):
        return kv_cache.kernel_tensors(), kv_cache.bits
    return [kv_cache], 0


def _sink_queries(q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[T, h, d] float32: each row's query rotated back by its evicted-token count E, which scores the sink keys
    as StreamingLLM's re-rotated cache would (see _sink_window_attention); q itself where there is no rotation."""
    if meta.sink_cos is None or not meta.num_sink_tokens:
        return q.float().contiguous()
    half = q.shape[-1] // 2
    c, s_ = meta.sink_cos.float()[:, None, :], meta.sink_sin.float()[:, None, :]  # [T, 1, d/2]
    x1, x2 = q[..., :half].float(), q[..., half:].float()
    return torch.cat([x1 * c + x2 * s_, x2 * c - x1 * s_], dim=-1)  # R(-E) q (rotate-half layout)


def tree_attention_reference(out: torch.Tensor, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                             scale: float) -> None:
    """Token-tree rows (meta.tree_masks): each row attends the sequence's earlier cache entries plus the rows of
    this step its mask names (its ancestors and itself), over K/V gathered from the paged cache. Overwrites those
    rows of `out`, which the causal path above filled first (so the other sequences keep their kernels)."""
    assert meta.tree_masks is not None and meta.block_tables is not None and meta.context_lens is not None
    assert meta.query_start_loc is not None
    assert meta.sliding_window is None and not meta.evicting, "token trees attend the whole context"
    bs = cache_block_size(kv_cache)
    group = q.shape[1] // cache_num_kv_heads(kv_cache)
    starts = meta.query_start_loc.tolist()
    for b, tree_mask in meta.tree_masks:
        first, q_len, ctx = starts[b], starts[b + 1] - starts[b], int(meta.context_lens[b])
        assert tree_mask.shape == (q_len, q_len), f"tree mask {tuple(tree_mask.shape)} for {q_len} rows"
        blocks = meta.block_tables[b, : (ctx + bs - 1) // bs].long()
        slots = (blocks.unsqueeze(1) * bs + torch.arange(bs)).view(-1)[:ctx]
        kp, vp = gather_kv(kv_cache, slots.to(q.device), q.dtype)  # [ctx, kvh, d]
        mask = torch.cat([torch.ones(q_len, ctx - q_len, dtype=torch.bool), tree_mask.cpu()], dim=1)
        qp = q[first:first + q_len].transpose(0, 1).unsqueeze(0)  # [1, h, q, d]
        o = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                                           attn_mask=mask.to(q.device), scale=scale, enable_gqa=group > 1)
        out[first:first + q_len] = o.squeeze(0).transpose(0, 1)


def _decode_reference(out: torch.Tensor, q: torch.Tensor, kv_cache: KVCache, num_decodes: int,
                      ref: ReferenceIndices, scale: float) -> None:
    """Rows [0, num_decodes): one batched SDPA over a padded, gathered copy of every decode's context."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = cache_num_kv_heads(kv_cache)
    group = num_heads // num_kv_heads
    slots = ref.decode_context_slots  # [Bd, L]
    bd, lmax = slots.shape
    qd = q[:num_decodes].reshape(bd, num_kv_heads, group, head_dim)  # [Bd, kvh, g, d]
    kc, vc = gather_kv(kv_cache, slots.view(-1), q.dtype)  # [Bd * L, kvh, d]
    kc = kc.view(bd, lmax, num_kv_heads, head_dim).transpose(1, 2)
    vc = vc.view(bd, lmax, num_kv_heads, head_dim).transpose(1, 2)
    # kc, vc: [Bd, kvh, L, d]; the query group attends as a short "sequence" of g rows per kv head
    od = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=ref.decode_mask, scale=scale)
    out[:num_decodes] = od.reshape(bd, num_heads, head_dim)


def _prefills_reference(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kv_cache: KVCache, prefills: list[PrefillSeq], scale: float,
                        slot_mapping: torch.Tensor) -> None:
    """One SDPA per sequence: against this step's k/v when there is no prior context, else the gathered cache.

    A quantized cache, or one of another dtype than q (bfloat16 under a float32 model), is always read back,
    even for a prompt's own tokens, so that a prefill sees the same K/V as every later decode of it."""
    if not prefills:
        return
    num_heads = q.shape[1]
    num_kv_heads = cache_num_kv_heads(kv_cache)
    group = num_heads // num_kv_heads
    for p in prefills:
        rows = slice(p.query_start, p.query_start + p.query_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, h, q, d]
        if p.context_slots is None and not isinstance(kv_cache, QuantizedKVCache) and kv_cache.dtype == q.dtype:
            kp, vp = k[rows], v[rows]  # [q, kvh, d]
        else:
            # no prior context: the context is this step's rows, whose slots are slot_mapping[rows]
            slots = slot_mapping[rows] if p.context_slots is None else p.context_slots
            kp, vp = gather_kv(kv_cache, slots, q.dtype)  # [L, kvh, d]
        kp = kp.transpose(0, 1).unsqueeze(0)  # [1, kvh, L, d]
        vp = vp.transpose(0, 1).unsqueeze(0)
        if p.mask is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=group > 1)
        out[rows] = o.squeeze(0).transpose(0, 1)


def _sink_window_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                           scale: float) -> None:
    """Attention under an evicting policy: sinks [0, S) plus the window (p - W, p] of each query p.

    Only kept positions are gathered (evicted blocks are -1 in the tables and never read). RoPE: keys are cached
    post-RoPE at their original positions and never re-rotated. StreamingLLM wants scores that depend on cache
    positions, where the E evicted tokens (E = max(0, p - W - S + 1)) are closed up:

        window key j:  cache pos j - E,  query cache pos p - E  ->  distance p - j : the original one, so the
                       plain query q_p = R(p) q scores it exactly as the paper does;
        sink key j:    cache pos j,      query cache pos p - E  ->  distance p - E - j : so the query is rotated
                       back by E for the sink columns:  R(-E) R(p) q = R(p - E) q,  and scores R(j) k as the
                       paper's re-rotated cache would.

    Rotations compose exactly, so this equals the paper's "re-rotate every cached key by its cache position"
    without touching the cache (and without the drift of repeated in-place re-rotation, the HF SinkCache bug).
    """
    assert meta.block_tables is not None and meta.context_lens is not None and meta.query_start_loc is not None
    window = meta.sliding_window  # None: every cached key (H2O's compacted cache), causal within the step
    sinks = meta.num_sink_tokens if window is not None else 0
    bs = cache_block_size(kv_cache)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = cache_num_kv_heads(kv_cache)
    group = num_heads // num_kv_heads
    starts = meta.query_start_loc.tolist()
    lens = meta.context_lens.tolist()
    for b in range(len(starts) - 1):
        rows = slice(starts[b], starts[b + 1])
        q_len, ctx = starts[b + 1] - starts[b], lens[b]
        first = ctx - q_len  # position of the first query row
        num_sinks = min(sinks, ctx)
        # first window position any row of this chunk sees
        lo = num_sinks if window is None else max(num_sinks, first - window + 1)
        key_pos = torch.cat([torch.arange(num_sinks), torch.arange(lo, ctx)])  # [L]
        table = meta.block_tables[b].long()
        slots = table[key_pos // bs] * bs + key_pos % bs  # [L]
        assert bool((table[key_pos // bs] >= 0).all()), "a kept position lies in an evicted block"
        k, v = gather_kv(kv_cache, slots, q.dtype)  # [L, kvh, d]
        qb = q[rows].view(q_len, num_kv_heads, group, head_dim)  # [q, kvh, g, d]
        scores = torch.einsum("qhgd,khd->hgqk", qb.float(), k.float()) * scale  # [kvh, g, q, L]
        if num_sinks and meta.sink_cos is not None:
            # rotate each row back by its E: apply_rope with -sin rotates by -E (rotate-half layout)
            half = head_dim // 2
            cos, sin = meta.sink_cos[rows].float(), meta.sink_sin[rows].float()  # [q, d/2]
            x1, x2 = q[rows, :, :half].float(), q[rows, :, half:].float()  # [q, h, d/2]
            c, s_ = cos[:, None, :], sin[:, None, :]
            q_back = torch.cat([x1 * c + x2 * s_, x2 * c - x1 * s_], dim=-1)  # R(-E) q: [q, h, d]
            q_back = q_back.view(q_len, num_kv_heads, group, head_dim)
            scores[..., :num_sinks] = torch.einsum("qhgd,khd->hgqk", q_back, k[:num_sinks].float()) * scale
        pos = torch.arange(first, ctx).unsqueeze(1)  # [q, 1]
        kp = key_pos.unsqueeze(0)  # [1, L]
        mask = kp <= pos  # [q, L]
        if window is not None:
            mask &= (kp < sinks) | (kp > pos - window)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)  # [kvh, g, q, L]
        stats = meta.stats
        if stats is not None and stats.key_mass is not None:
            stats.key_mass[b][key_pos] += probs.sum(dim=(0, 1, 2))  # [L]: mass each key received
        if stats is not None and stats.row_mass is not None:
            stats.row_mass[b][:, key_pos] += probs.sum(dim=(0, 1))  # [q, L]: from each query row
        o = torch.einsum("hgqk,khd->qhgd", probs, v.float())  # [q, kvh, g, d]
        out[rows] = o.reshape(q_len, num_heads, head_dim).to(out.dtype)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Plain causal attention for one sequence (the oracle for tests). q: [L, h, d], k, v: [L, kvh, d]."""
    seq_len, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    mask = causal_mask(seq_len, seq_len, sliding_window)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)
