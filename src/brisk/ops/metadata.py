"""The inputs of one step's attention (`AttentionMetadata`, built by `AttentionMetadata.for_sequences`) and its
statistics output (`AttentionStats`), shared by every layer; ops/attention.py reads them.

Flattened batch, decodes first (the runner's layout):

    rows:  | decode 0 | decode 1 | ... | prefill 0 rows ... | prefill 1 rows ... |      T rows in all
    query_start_loc [B + 1]: first row of each sequence;  block_tables [B, max_blocks];  context_lens [B]

The metadata is never written by the forward: a KV policy that wants statistics (H2O's attention mass) hands in
an `AttentionStats` when the metadata is built, attention adds into it, and the policy reads it afterwards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    """One sequence with q_len > 1 in this step, as the reference path runs it (`build_reference_indices`)."""

    query_start: int  # first row of this sequence's tokens in the flattened batch
    query_len: int
    context_len: int  # tokens in cache after this step (num_computed + query_len)
    # context slots [context_len] to gather, or None when the whole context is this step's tokens (no prior KV)
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # [query_len, context_len] bool (True = attend), None = plain causal


@dataclass
class ReferenceIndices:
    """Gather indices of the reference path, derived from the block tables (once per step)."""

    decode_context_slots: torch.Tensor | None  # [Bd, Lmax] int64 slot of each context position (0-padded)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Lmax] bool: True where a real (attendable) position
    prefills: list[PrefillSeq]


@dataclass
class AttentionStats:
    """What attention measures during a forward, for a KV policy: the attention mass each cached key receives
    (probabilities summed over heads and queries), added layer after layer. An output, filled by the evicting
    path (ops/attention.py `_sink_window_attention`) and read after the forward; None lists are not collected."""

    # per sequence float32 [context_len]: mass per key, summed over this step's queries too (eval/longppl.py)
    key_mass: list[torch.Tensor] | None = None
    # per sequence float32 [query_len, context_len]: mass per key from each query row (kvcache/h2o.py)
    row_mass: list[torch.Tensor] | None = None


@dataclass
class AttentionMetadata:
    """Everything attention needs about the batch layout: the step's inputs, built once per step (normally by
    `for_sequences`), shared by all layers and never written by the forward.

    Flattened batch: `| decodes (1 row each) | prefill 0 rows | prefill 1 rows | ... |`, T rows in all.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot receiving each token's K/V
    num_decodes: int = 0  # the first num_decodes rows are single-token sequences
    query_start_loc: torch.Tensor | None = None  # [B + 1] int64: rows of sequence b = [qsl[b], qsl[b + 1])
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32 (padding columns are never read)
    context_lens: torch.Tensor | None = None  # [B] int32: tokens in the cache including this step's
    sliding_window: int | None = None  # a query at position p sees keys (p - window, p]
    # StreamingLLM (kvcache/policy.py): with a window, keys [0, num_sink_tokens) are seen by every query too
    num_sink_tokens: int = 0
    # an evicting policy is on: the tables hold -1 for evicted blocks; attention gathers only kept positions
    evicting: bool = False
    # [T, d/2] cos / sin of each row's evicted count E (`sink_rotation`): the query scores the sink keys rotated
    # back by E (ops/attention.py _sink_window_attention)
    sink_cos: torch.Tensor | None = None
    sink_sin: torch.Tensor | None = None
    # where attention adds the statistics a KV policy asked for (an output buffer, not an input); None: none
    stats: AttentionStats | None = None
    # rows of the flattened batch whose logits are needed (last token of each sequence, or several for
    # speculative verification); None = all rows
    logits_indices: torch.Tensor | None = None
    # token-tree verification (engine/token_tree.py): (sequence b, [query_len, query_len] bool) — among this step's
    # rows of sequence b, which ones each row attends (its ancestors and itself) instead of the causal triangle;
    # every row still sees all of the sequence's earlier cache entries. Run by the paged_tree_attention kernel (masks as
    # `tree_row_bits`), or ops/attention.py `tree_attention_reference`.
    tree_masks: list[tuple[int, torch.Tensor]] | None = None
    _reference: ReferenceIndices | None = field(default=None, repr=False)
    _tree_bits: torch.Tensor | None = field(default=None, repr=False)
    # the same step under other windows (`with_sliding_window`: gemma3's local and global layers), built once
    _windows: dict[int | None, AttentionMetadata] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def reference_indices(self, block_size: int) -> ReferenceIndices:
        """The reference path's gather indices, derived from the inputs by the first layer that needs them and
        reused by the rest (a memo, not an output)."""
        if self._reference is None:
            self._reference = build_reference_indices(self, block_size)
        return self._reference

    def tree_row_bits(self) -> torch.Tensor | None:
        """[T] int64, the tree masks as the paged_tree_attention kernel takes them: for a row of a tree sequence,
        bit j set where it sees the sequence's in-step row j; -1 for every other row. None where a tree sequence
        has more than 64 rows (the reference path takes those). Built by the first layer that asks, then reused."""
        if self._tree_bits is None and self.tree_masks:
            assert self.query_start_loc is not None
            starts = self.query_start_loc.tolist()
            bits = torch.full((self.num_tokens,), -1, dtype=torch.int64)
            for b, mask in self.tree_masks:
                q_len = starts[b + 1] - starts[b]
                if q_len > 64:
                    return None
                # bit j's weight; bit 63's is the sign bit (int64 two's complement)
                weights = torch.tensor([1 << j if j < 63 else -(1 << 63) for j in range(q_len)], dtype=torch.int64)
                bits[starts[b]:starts[b + 1]] = (mask.cpu().to(torch.int64) * weights).sum(dim=1)
            self._tree_bits = bits
        return self._tree_bits

    @classmethod
    def for_sequences(
        cls,
        query_lens: list[int],  # [B] tokens of each sequence in this step, decodes (1) first
        context_lens: list[int],  # [B] cache entries of each sequence after this step (earlier ones + query)
        block_ids: list[list[int]],  # per sequence its blocks in cache order (at least ceil(ctx / block_size))
        block_size: int,
        *,
        positions: torch.Tensor | None = None,  # [T] token positions; needed only for the sink rotation
        sliding_window: int | None = None,
        num_sink_tokens: int = 0,
        evicting: bool = False,
        cos_sin: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,  # RoPE table lookup
        stats: AttentionStats | None = None,
        logits_indices: list[int] | None = None,  # None: every row
        tree_masks: list[tuple[int, torch.Tensor]] | None = None,  # token trees: (sequence, in-step mask)
        device: torch.device | str | None = None,
    ) -> AttentionMetadata:
        """The metadata of one step over the paged cache, from plain ints; the one constructor of it.

        Per sequence:  | cache entries before this step | query_len new ones |  = context_len entries
        cache entry i lives in slot  block_ids[i // block_size] * block_size + i % block_size; this step's tokens
        take entries [context_len - query_len, context_len). Rows are laid out sequence after sequence, so
        decodes must come first (the layout of the module docstring). StreamingLLM with sinks also needs the
        rows' `positions` and the RoPE lookup `cos_sin` (see `sink_rotation`).
        """
        bs = block_size
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        assert all(q > 1 for q in query_lens[num_decodes:]), "decodes (query_len 1) must come first"
        slots: list[int] = []
        query_start_loc = [0]
        tables: list[list[int]] = []
        for q_len, ctx, ids in zip(query_lens, context_lens, block_ids, strict=True):
            if q_len == 1:  # the common case at batch 1, kept to one lookup: prepare runs every step
                slots.append(ids[(ctx - 1) // bs] * bs + (ctx - 1) % bs)
            else:
                slots.extend(ids[i // bs] * bs + i % bs for i in range(ctx - q_len, ctx))
            query_start_loc.append(query_start_loc[-1] + q_len)
            tables.append(ids[: (ctx + bs - 1) // bs])
        max_blocks = max((len(t) for t in tables), default=0)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        # None when every row is sampled, in order (decode-only steps): no gather before the head
        if logits_indices is not None and logits_indices == list(range(len(slots))):
            logits_indices = None
        meta = cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decodes=num_decodes,
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64),
            block_tables=block_tables,  # [B, max_blocks]
            context_lens=torch.tensor(context_lens, dtype=torch.int32),  # [B]
            sliding_window=sliding_window,
            num_sink_tokens=num_sink_tokens,
            evicting=evicting,
            stats=stats,
            logits_indices=None if logits_indices is None else torch.tensor(logits_indices, dtype=torch.int64),
            tree_masks=tree_masks or None,
        )
        if device is not None and torch.device(device).type != "cpu":
            for name in ("slot_mapping", "query_start_loc", "block_tables", "context_lens", "logits_indices"):
                if getattr(meta, name) is not None:
                    setattr(meta, name, getattr(meta, name).to(device, non_blocking=True))
        if evicting and num_sink_tokens and sliding_window is not None:
            assert positions is not None and cos_sin is not None, "StreamingLLM's sinks need positions and RoPE"
            if device is not None:
                positions = positions.to(device)
            meta.sink_cos, meta.sink_sin = sink_rotation(positions, sliding_window, num_sink_tokens, cos_sin)
        return meta


def with_sliding_window(meta: AttentionMetadata, sliding_window: int | None) -> AttentionMetadata:
    """The same step's metadata with another attention window (None: full causal), for models whose layers have
    windows of their own (gemma3: local and global layers). Built once per step and window, then reused by every
    layer with that window, so each variant derives its reference-path indices once."""
    if meta.sliding_window == sliding_window:
        return meta
    variant = meta._windows.get(sliding_window)
    if variant is None:
        assert not meta.evicting, "an evicting KV policy brings its own window"
        variant = dataclasses.replace(meta, sliding_window=sliding_window, _reference=None, _windows={})
        meta._windows[sliding_window] = variant
    return variant


def sink_rotation(positions: torch.Tensor, sliding_window: int, num_sink_tokens: int,
                  cos_sin: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """StreamingLLM: cos / sin [T, d/2] of each row's evicted count E = max(0, p - W - S + 1), by which its query
    is rotated back for the sink keys (ops/attention.py _sink_window_attention)."""
    evicted = (positions - sliding_window - num_sink_tokens + 1).clamp(min=0)  # [T]
    return cos_sin(evicted)


def build_reference_indices(meta: AttentionMetadata, block_size: int) -> ReferenceIndices:
    assert meta.block_tables is not None and meta.context_lens is not None and meta.query_start_loc is not None
    window = meta.sliding_window
    nd = meta.num_decodes
    lens = meta.context_lens.long()
    arange_block = torch.arange(block_size)
    decode_slots = decode_mask = None
    if nd:
        lmax = int(lens[:nd].max())
        nblocks = (lmax + block_size - 1) // block_size
        tables = meta.block_tables[:nd, :nblocks].long()  # [Bd, nblocks]
        decode_slots = (tables.unsqueeze(2) * block_size + arange_block).view(nd, -1)[:, :lmax]  # [Bd, Lmax]
        key = torch.arange(lmax).unsqueeze(0)  # [1, Lmax]
        mask = key < lens[:nd].unsqueeze(1)
        if window is not None:
            mask &= key >= (lens[:nd] - window).unsqueeze(1)
        decode_slots = decode_slots.masked_fill(~mask, 0)  # padding -> slot 0, masked out anyway
        decode_mask = mask[:, None, None, :]  # [Bd, 1, 1, Lmax]
    prefills = []
    starts = meta.query_start_loc.tolist()
    for b in range(nd, len(starts) - 1):
        q_len, ctx = starts[b + 1] - starts[b], int(lens[b])
        blocks = meta.block_tables[b, : (ctx + block_size - 1) // block_size].long()
        slots = (blocks.unsqueeze(1) * block_size + arange_block).view(-1)[:ctx]  # [ctx]
        prior = ctx > q_len
        needs_mask = prior or window is not None
        prefills.append(PrefillSeq(query_start=starts[b], query_len=q_len, context_len=ctx,
                                   context_slots=slots if prior else None,
                                   mask=causal_mask(q_len, ctx, window) if needs_mask else None))
    return ReferenceIndices(decode_slots, decode_mask, prefills)


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
