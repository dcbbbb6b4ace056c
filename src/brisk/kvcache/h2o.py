"""H2O's bookkeeping in the engine: accumulated attention mass per cache entry, and the choice of kept entries.

The policy (kvcache/policy.py `H2OPolicy`) owns one `H2OScores` and drives it from its step hooks, which the
runner calls (engine/model_runner.py):

    begin_step  -> `row_buffers`: a zero float32 [query_len, context_len] per sequence; attention adds each
                   query row's probability mass per key into it, layer after layer (ops/attention.py
                   `_sink_window_attention`, summed over heads)
    end_step    -> `choose`: add the step's mass to each request's scores (summed over layers, heads and queries,
                   as `brisk eval ppl --long --mode h2o` does); where a cache outgrew `keep`, return the kept
                   entries (`h2o_keep`); the manager compacts them before the request's next allocation
                   (kvcache/manager.py `_compact`) and the runner moves their K/V at the start of the next step
    on_move_kv, on_copy_blocks, on_free -> keep the per-block and per-request state in step with the cache.

Scoring needs the attention probabilities, which the C++ paged kernels do not return, so under H2O every request
takes the PyTorch attention path (one sequence at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from brisk.kvcache.policy import ScheduledSeq


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


class H2OScores:
    """Per request its accumulated mass per cache entry; per block the mass of its rows (for prefix-cache hits).

    A prefix-cache hit never ran its prefix's queries, yet its scores must hold their mass, or its kept set (and
    output) would depend on what happened to be cached. The mass that the queries of block j give to keys
    [0, (j + 1) bs) depends only on the tokens up to the block's end (while the writer had not compacted, cache
    entry = position), exactly what the block's prefix hash names; so each block carries it, as
    block_mass[block_id] [(j + 1) bs], filled as its rows are computed. A hit's scores start as the sum over its
    hit blocks. A block gets new contents when its first row is written (then its mass restarts), when it is a
    copy-on-write target (the source's mass is copied) or compacted into (dropped).
    """

    def __init__(self, recent: int, keep: int) -> None:
        self.recent = recent
        self.keep = keep
        self.scores: dict[str, torch.Tensor] = {}  # req_id -> float32 [cache entries], in cache order
        self.block_mass: dict[int, torch.Tensor] = {}  # block_id -> its rows' mass (see the class docstring)

    def row_buffers(self, seqs: Sequence[ScheduledSeq], context_lens: list[int],
                    device: torch.device) -> list[torch.Tensor]:
        """Zero float32 [query_len, context_len] per sequence, in the batch's row order."""
        return [torch.zeros(len(s.token_ids), ctx, device=device) for s, ctx in zip(seqs, context_lens, strict=True)]

    def _record_block_mass(self, s: ScheduledSeq, rows: torch.Tensor, block_size: int) -> None:
        """rows: [q, ctx] this step's mass per query row of an uncompacted request (cache entry = position)."""
        bs = block_size
        q_len, ctx = rows.shape
        first = ctx - q_len
        for j in range(first // bs, -(-ctx // bs)):
            block_id = s.block_ids[j]
            lo, hi = max(first, j * bs), min(ctx, (j + 1) * bs)  # rows of this step in block j
            mass = rows[lo - first:hi - first, :(j + 1) * bs].sum(0)  # [min(ctx, (j + 1) bs)]
            if lo == j * bs or block_id not in self.block_mass:
                self.block_mass[block_id] = torch.zeros((j + 1) * bs, device=rows.device)
            self.block_mass[block_id][:mass.shape[0]] += mass

    def choose(self, seqs: Sequence[ScheduledSeq], row_mass: list[torch.Tensor],
               block_size: int) -> dict[str, list[int]]:
        """Add this step's mass to each request's scores; where a cache outgrew `keep`, choose the kept entries and
        keep only their scores. n > 1: the forks start from a copy. Returns req_id -> kept entries (ascending)."""
        bs = block_size
        for s, rows in zip(seqs, row_mass, strict=True):
            if s.cache_len is None or s.cache_len == s.num_computed_tokens:
                self._record_block_mass(s, rows, bs)
            else:  # a compacted cache: its blocks no longer hold a prefix
                for j in range(s.cache_len // bs, -(-rows.shape[1] // bs)):
                    self.block_mass.pop(s.block_ids[j], None)
        kept_entries: dict[str, list[int]] = {}
        for s, rows in zip(seqs, row_mass, strict=True):
            cache_start = rows.shape[1] - rows.shape[0]
            scores = rows.sum(0)  # [ctx]
            prev = self.scores.get(s.req_id)
            if prev is not None:
                assert prev.shape[0] == cache_start, f"{s.req_id}: {prev.shape[0]} scores for {cache_start} entries"
                scores[:cache_start] += prev
            else:  # a fresh start; cache_start > 0 is a prefix-cache hit of whole blocks
                for j in range(cache_start // bs):
                    mass = self.block_mass.get(s.block_ids[j])
                    assert mass is not None, f"{s.req_id} hit block {s.block_ids[j]}, which carries no h2o mass"
                    scores[:mass.shape[0]] += mass
            if scores.shape[0] > self.keep:
                kept = h2o_keep(scores, self.recent, self.keep)
                kept_entries[s.req_id] = kept
                scores = scores[torch.tensor(kept, device=scores.device)]
            self.scores[s.req_id] = scores
            for k in range(1, s.num_samples):
                self.scores[f"{s.req_id}#{k}"] = scores.clone()
        return kept_entries

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write targets carry their source's mass."""
        for src, dst in copies:
            if src in self.block_mass:
                self.block_mass[dst] = self.block_mass[src].clone()

    def moved_into(self, dst_slots: list[int], block_size: int) -> None:
        """A compaction wrote into these slots: their blocks no longer hold a prefix."""
        for block_id in {d // block_size for d in dst_slots}:
            self.block_mass.pop(block_id, None)

    def free(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self.scores.pop(req_id, None)
