"""Attention over the paged KV cache, for a flattened batch of many sequences.

The cache of one layer is `kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]`; a token at logical
position p of a request lives in physical slot `block_table[p // block_size] * block_size + p % block_size`.
The runner precomputes every slot index once per step (`AttentionMetadata`), so each layer only does
`index_copy_` (write the new K/V) and `index_select` (read a sequence's context) with ready-made indices.

Sequences are split in two groups:
- decodes (one query token each) run as ONE batched attention: queries [B, kvh, group, d] against their padded
  contexts [B, kvh, L, d], padding masked out;
- prefills and chunks of prefills (several query tokens; also multi-token verification) run one sequence at a
  time with a causal mask offset by the tokens already in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    """One sequence with q_len > 1 in this step."""

    query_start: int  # first row of this sequence's tokens in the flattened batch
    query_len: int
    context_len: int  # tokens in cache after this step (num_computed + query_len)
    # context slots [context_len] to gather, or None when the whole context is this step's tokens (no prior KV)
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [query_len, context_len] bool (True = attend), None = plain causal


@dataclass
class AttentionMetadata:
    """Everything attention needs about the batch layout; built once per step by the runner, shared by layers.

    Flattened batch: `| seq0 tokens | seq1 tokens | ... |`, T rows in all.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot receiving each token's K/V
    # decode group (query_len == 1)
    decode_token_idx: torch.Tensor | None = None  # [Bd] int64 rows of the flattened batch
    decode_context_slots: torch.Tensor | None = None  # [Bd, Lmax] int64 slot of each context position (0-padded)
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, Lmax] bool: True where a real (attendable) position
    prefills: list[PrefillSeq] = field(default_factory=list)
    # rows of the flattened batch whose logits are needed (last token of each sequence, or several for
    # speculative verification); None = all rows
    logits_indices: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values. kv_cache: [2, num_blocks, block_size, kvh, d]; k, v: [T, kvh, d]."""
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    k_flat = kv_cache[0].view(num_slots, *kv_cache.shape[3:])  # [num_slots, kvh, d]
    v_flat = kv_cache[1].view(num_slots, *kv_cache.shape[3:])
    k_flat.index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def paged_attention(
    q: torch.Tensor,  # [T, h, d]
    k: torch.Tensor,  # [T, kvh, d] this step's keys (already written to the cache)
    v: torch.Tensor,  # [T, kvh, d]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kvh, d]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, h, d]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    k_flat = kv_cache[0].view(num_slots, num_kv_heads, head_dim)
    v_flat = kv_cache[1].view(num_slots, num_kv_heads, head_dim)
    out = torch.empty_like(q)

    if meta.decode_token_idx is not None:
        idx = meta.decode_token_idx
        slots = meta.decode_context_slots  # [Bd, L]
        bd, lmax = slots.shape
        qd = q.index_select(0, idx).view(bd, num_kv_heads, group, head_dim)  # [Bd, kvh, g, d]
        kc = k_flat.index_select(0, slots.view(-1)).view(bd, lmax, num_kv_heads, head_dim).transpose(1, 2)
        vc = v_flat.index_select(0, slots.view(-1)).view(bd, lmax, num_kv_heads, head_dim).transpose(1, 2)
        # kc, vc: [Bd, kvh, L, d]; the query group attends as a short "sequence" of g rows per kv head
        od = F.scaled_dot_product_attention(qd, kc.to(q.dtype), vc.to(q.dtype), attn_mask=meta.decode_mask,
                                            scale=scale)
        out.index_copy_(0, idx, od.reshape(bd, num_heads, head_dim))

    for p in meta.prefills:
        rows = slice(p.query_start, p.query_start + p.query_len)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, h, q, d]
        if p.context_slots is None:
            kp, vp = k[rows], v[rows]  # [q, kvh, d]
        else:
            kp = k_flat.index_select(0, p.context_slots).to(q.dtype)  # [L, kvh, d]
            vp = v_flat.index_select(0, p.context_slots).to(q.dtype)
        kp = kp.transpose(0, 1).unsqueeze(0)  # [1, kvh, L, d]
        vp = vp.transpose(0, 1).unsqueeze(0)
        if p.mask is None:
            o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=group > 1)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out


def causal_mask(query_len: int, context_len: int, sliding_window: int | None = None) -> torch.Tensor:
    """[query_len, context_len] bool; the queries are the last `query_len` positions of the context.

    query i sits at absolute position  pos_i = context_len - query_len + i  and sees keys j with
    j <= pos_i  (and  j > pos_i - sliding_window  with a window).
    """
    pos = torch.arange(context_len - query_len, context_len).unsqueeze(1)  # [q, 1]
    key = torch.arange(context_len).unsqueeze(0)  # [1, L]
    mask = key <= pos
    if sliding_window is not None:
        mask &= key > pos - sliding_window
    return mask


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
