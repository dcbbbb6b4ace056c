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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    In the engine (kvcache/manager.py `_compact`, engine/model_runner.py): the runner accumulates the scores and
    picks the kept entries after the forward; the manager compacts the table before the request's next
    allocation. Compaction writes into blocks, so a destination block that is shared (ref_cnt > 1) or registered
    in the prefix cache is first replaced by a private one (its contents stay intact for the other holders), and
    a compacted request registers nothing more in the prefix cache.
    """

    budget: int
    recent: int

    name = "h2o"

    def __post_init__(self) -> None:
        if self.recent <= 0:
            raise ValueError(f"h2o needs a positive recent window, got {self.recent}")
        if self.budget <= self.recent:
            raise ValueError(f"the h2o KV budget ({self.budget}) must exceed the recent window ({self.recent}): "
                             "the rest of the budget holds the heavy hitters")

    @property
    def evicts(self) -> bool:
        return True

    @property
    def keep(self) -> int:
        """Entries left after a compaction: one slot of the budget stays free for the next decode query."""
        return self.budget - 1


def h2o_keep(scores: list[float] | torch.Tensor, recent: int, keep: int) -> list[int]:
    """Indices (ascending) of the `keep` cache entries H2O keeps: the last `recent`, then the highest accumulated
    `scores` among the others (ties: the older entry). scores: one per cached token, in cache order."""
    scores = torch.as_tensor(scores, dtype=torch.float64)
    n = scores.shape[0]
    if n <= keep:
        return list(range(n))
    recent = min(recent, keep)
    num_heavy = keep - recent
    older = scores[: n - recent].tolist()
    # stable sort by descending score: equal scores keep cache order, so the older token wins a tie
    order = sorted(range(len(older)), key=lambda i: (-older[i], i))
    heavy = sorted(order[:num_heavy])
    return heavy + list(range(n - recent, n))


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
