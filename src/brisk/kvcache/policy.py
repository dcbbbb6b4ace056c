"""KV eviction policies: which cached tokens a request keeps, and which of its blocks go back to the pool.

A policy answers two questions, both from plain ints, so it is tested with no model:
  * `is_kept(key_pos, query_pos)`: does the query at `query_pos` attend to the key at `key_pos`? (the mask)
  * `evictable_blocks(num_computed, num_blocks, block_size)`: logical blocks no present or future query needs;
    the manager drops its reference to them (kvcache/manager.py), so an unshared block returns to the pool.

StreamingLLM's eviction never writes into a block: it only drops a reference. A block shared with another table
(prefix cache, n > 1 forks) therefore stays intact for its other holders; that is why eviction cannot corrupt a
shared prefix. H2O (below) does write, when it compacts; it first swaps any shared or prefix-cached destination
block for a private one, so the same holds.

StreamingLLM (Xiao et al., 2024): keep the first `sink_tokens` tokens (attention sinks) and the most recent
`budget - sink_tokens` tokens (the window, the query's own token included):

    positions:  0 .. S-1  | S ............ t-W | t-W+1 .............. t |
                 sinks       evicted (E tokens)   window (W tokens)   query

Mask and eviction are token-exact; memory is block-granular: the sinks keep their first block(s), and a
window block is released once all its tokens fall before the window (at most one partly-used block at each
end). Positions (RoPE): see ops/attention.py `_sink_window_attention`: cached keys stay post-RoPE at their
original positions; scores then depend only on cache positions, as in the paper, with no key ever re-rotated.

Window-only (`sink_tokens = 0`) is the same policy without sinks: the contrast the paper shows.

A policy that scores attention (H2O) also takes part in each engine step through hooks the runner calls
(engine/model_runner.py): `begin_step` hands in the statistics buffers attention should fill, `end_step` reads them
and names the entries to keep, and `on_move_kv` / `on_copy_blocks` / `on_free` follow the cache's changes. They
are no-ops for full and streaming. Such a policy holds per-request state: one instance serves one engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from brisk.kvcache.h2o import H2OScores, h2o_keep
from brisk.ops.metadata import AttentionStats

__all__ = ["H2OPolicy", "KVPolicy", "ScheduledSeq", "StreamingPolicy", "h2o_keep", "make_policy"]


class ScheduledSeq(Protocol):
    """What the step hooks read of a scheduled request (engine/scheduler.py `ScheduledRequest`)."""

    req_id: str
    token_ids: list[int]  # this step's tokens: one row each
    num_computed_tokens: int
    cache_len: int | None  # cache entries before this step when they differ from num_computed_tokens (H2O)
    block_ids: list[int]
    num_samples: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVPolicy:
    """Keep everything (the default)."""

    name = "full"

    @property
    def evicts(self) -> bool:
        return False

    def is_kept(self, key_pos: int, query_pos: int) -> bool:
        return key_pos <= query_pos

    def evictable_blocks(self, num_computed: int, num_blocks: int, block_size: int) -> range:
        return range(0)

    # ---- step hooks (engine/model_runner.py), in the order the runner calls them ----

    def on_free(self, req_ids: Sequence[str]) -> None:
        """These requests finished or were preempted: forget what is kept about them."""

    def on_move_kv(self, dst_slots: list[int], block_size: int) -> None:
        """A compaction moved K/V into these slots (before this step's forward)."""

    def on_copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block dst now holds a copy of block src, for each (src, dst)."""

    def begin_step(self, seqs: Sequence[ScheduledSeq], context_lens: list[int],
                   device: torch.device) -> AttentionStats | None:
        """The statistics this step's attention should collect (seqs in row order, each with its cache entries
        after the step); None: none, and the forward may take any attention path."""
        return None

    def end_step(self, seqs: Sequence[ScheduledSeq], stats: AttentionStats | None,
                 block_size: int) -> dict[str, list[int]]:
        """After the forward, with the statistics `begin_step` asked for: req_id -> the cache entries it keeps
        (ascending), for each request the manager should compact."""
        return {}


@dataclass(frozen=True)
class StreamingPolicy(KVPolicy):
    budget: int  # tokens kept per query: sinks + window
    sink_tokens: int = 4

    name = "streaming"

    def __post_init__(self) -> None:
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.budget <= self.sink_tokens:
            raise ValueError(f"the KV budget ({self.budget}) must exceed the sink tokens ({self.sink_tokens}): "
                             "the window needs at least the query's own token")

    @property
    def evicts(self) -> bool:
        return True

    @property
    def window(self) -> int:
        return self.budget - self.sink_tokens

    def is_kept(self, key_pos: int, query_pos: int) -> bool:
        return key_pos <= query_pos and (key_pos < self.sink_tokens or key_pos > query_pos - self.window)

    def num_evicted(self, query_pos: int) -> int:
        """E: tokens between the sinks and the window of the query at `query_pos`."""
        return max(0, query_pos - self.window - self.sink_tokens + 1)

    def evictable_blocks(self, num_computed: int, num_blocks: int, block_size: int) -> range:
        """Blocks holding no sink and no token any query from `num_computed` on still sees.

        The next query sits at position num_computed, so the first window token still needed is
        lo = num_computed - window + 1; block i (tokens [i bs, (i+1) bs)) goes when i bs >= S and (i+1) bs <= lo.
        """
        first = _cdiv(self.sink_tokens, block_size)  # blocks before `first` hold a sink
        lo = num_computed - self.window + 1
        end = min(num_blocks, max(0, lo) // block_size)
        return range(first, max(first, end))


@dataclass(frozen=True)
class H2OPolicy(KVPolicy):
    """H2O (Zhang et al., 2023): keep the `recent` newest cache entries plus the heavy hitters (largest accumulated
    attention) among the older ones.

    Simplifications, because a block table is shared by every layer and head: one kept set per request, chosen
    by attention mass summed over all layers, heads and queries (H2O keeps a set per head). Block-aware
    eviction = compaction: the kept entries' K/V are copied, in cache order, into the first slots of the
    request's blocks and the blocks past them are freed, so the cache stays dense and attention over it is plain
    causal attention in cache order. Keys keep their original RoPE positions (they are post-RoPE), as H2O does;
    a cache index is therefore no longer a token position.

    When it compacts: after a step whose cache holds more than `keep` = budget - 1 entries, the request is cut to
    `keep` (recent + heavy hitters, `h2o_keep`), so every decode query sees at most `budget` entries, itself
    included (StreamingLLM's bound); a prefill chunk of C tokens sees at most budget - 1 + C. This is
    `brisk eval ppl --long --mode h2o` (eval/longppl.py) with chunk 1, which cuts to budget - chunk.

    In the engine (kvcache/h2o.py, kvcache/manager.py `_compact`): the step hooks accumulate the scores and pick
    the kept entries after the forward; the manager compacts the table before the request's next allocation.
    Compaction writes into blocks, so a destination block that is shared (ref_cnt > 1) or registered in the
    prefix cache is first replaced by a private one (its contents stay intact for the other holders), and a
    compacted request registers nothing more in the prefix cache.
    """

    budget: int
    recent: int
    # the engine's scores per request and block (kvcache/h2o.py), driven by the step hooks below
    _scores: H2OScores = field(init=False, repr=False, compare=False)

    name = "h2o"

    def __post_init__(self) -> None:
        if self.recent <= 0:
            raise ValueError(f"h2o needs a positive recent window, got {self.recent}")
        if self.budget <= self.recent:
            raise ValueError(f"the h2o KV budget ({self.budget}) must exceed the recent window ({self.recent}): "
                             "the rest of the budget holds the heavy hitters")
        object.__setattr__(self, "_scores", H2OScores(self.recent, self.keep))  # frozen: the rule; this: state

    @property
    def evicts(self) -> bool:
        return True

    @property
    def keep(self) -> int:
        """Entries left after a compaction: one slot of the budget stays free for the next decode query."""
        return self.budget - 1

    def on_free(self, req_ids: Sequence[str]) -> None:
        self._scores.free(req_ids)

    def on_move_kv(self, dst_slots: list[int], block_size: int) -> None:
        self._scores.moved_into(dst_slots, block_size)

    def on_copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self._scores.copy_blocks(copies)

    def begin_step(self, seqs: Sequence[ScheduledSeq], context_lens: list[int],
                   device: torch.device) -> AttentionStats | None:
        return AttentionStats(row_mass=self._scores.row_buffers(seqs, context_lens, device))

    def end_step(self, seqs: Sequence[ScheduledSeq], stats: AttentionStats | None,
                 block_size: int) -> dict[str, list[int]]:
        assert stats is not None and stats.row_mass is not None, "h2o's end_step needs the stats of its begin_step"
        return self._scores.choose(seqs, stats.row_mass, block_size)


def make_policy(name: str, budget: int | None = None, sink_tokens: int = 4, recent: int | None = None) -> KVPolicy:
    """full | streaming (budget, sink_tokens) | h2o (budget, recent: default budget // 2)."""
    if name == "full":
        return KVPolicy()
    if budget is None:
        raise ValueError(f"kv policy {name!r} needs a budget (--kv-budget N tokens)")
    if name == "streaming":
        return StreamingPolicy(budget, sink_tokens)
    if name == "h2o":
        return H2OPolicy(budget, budget // 2 if recent is None else recent)
    raise ValueError(f"unknown kv policy {name!r}; use full, streaming or h2o")
