"""Per-request block tables over the block pool: allocation, prefix-cache lookup, copy-on-write after fork.

Slot arithmetic: cache entry i of a request lives in physical slot
    block_ids[i // block_size] * block_size + i % block_size
of the flat KV cache (`k_cache.view(num_blocks * block_size, ...)`). Entry i is token position i, except under
H2O once a request has compacted (`_compact`): then its cache holds `get_num_cache_entries` entries, the kept
tokens in order, and the runner takes positions from the request and slots from the cache length. The manager
only decides which block ids each request holds; the runner turns them into slot mappings and block tables.

Prefix caching: a full block is identified by a hash chained over every token up to its end, so equal
block hashes mean equal prefixes (not just equal block contents). Blocks are registered when their
tokens are scheduled (see allocate_slots); a request admitted in the same step can already hit them,
which is safe because the runner writes every scheduled token's K/V into the cache of a layer before any
attention of that layer reads it.

State is keyed by request id; call `free(request)` for every request that leaves the engine (finished,
aborted, or preempted), whether or not it was ever allocated — it is idempotent.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from brisk.kvcache.block_pool import BlockPool, KVBlock
from brisk.kvcache.policy import H2OPolicy, KVPolicy

if TYPE_CHECKING:
    from brisk.engine.request import Request
    from brisk.kvcache.offload import KVOffload

# Seed of a chain. 13 bytes, while a parent digest is 32: the two kinds of hashed input differ in length
# modulo 8 (tokens are 8 bytes each), so a first block can never hash like a later one.
_NO_PARENT = b"brisk-kv-root"


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one block's tokens chained to the hash of everything before it.

    SHA-256 rather than Python's `hash()`: a 64-bit non-cryptographic hash can be made to collide on
    purpose, and a collision here would serve one user's KV to another prompt.
    """
    h = hashlib.sha256(_NO_PARENT if parent_hash is None else parent_hash.to_bytes(32, "little"))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


@dataclass
class PrefixCacheStats:
    requests: int = 0  # lookups (one per request admission; repeats while it waits are not counted)
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 policy: KVPolicy | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.policy = policy or KVPolicy()
        # A request's block table, by logical block. An evicting policy (kvcache/policy.py) replaces the blocks
        # it no longer needs by None: the logical index of every later block is unchanged, so slot arithmetic
        # stays p // block_size, and the runner reads only kept positions.
        self._req_to_blocks: dict[str, list[KVBlock | None]] = {}
        self._num_evicted_blocks: dict[str, int] = {}  # leading logical blocks already checked for eviction
        # Content hashes of the request's full blocks, computed lazily and kept: tokens are append-only,
        # so a hash never goes stale. Whether a block was *registered* is tracked separately below.
        self._req_to_block_hashes: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already offered to the cache map
        self._requests: dict[str, Request] = {}  # live requests holding a table (for KV utilisation)
        # H2O: tokens compacted out of the request's cache (cache entries = num_computed_tokens - dropped), the
        # entries to keep at its next allocation (chosen by the runner), and the data moves of compactions done
        # this schedule, (src_slots, dst_slots), for the runner to perform before the step's forward.
        self._num_dropped: dict[str, int] = {}
        self._pending_keep: dict[str, list[int]] = {}
        self._pending_moves: dict[str, tuple[list[int], list[int]]] = {}
        self._stats_recorded: set[str] = set()
        self.prefix_cache_stats = PrefixCacheStats()
        self.offload: KVOffload | None = None  # the disk tier under the prefix cache (set_offload)

    def set_offload(self, offload: KVOffload) -> None:
        """Put a disk tier under the prefix cache: evicted cached blocks go to it, lookups continue into it."""
        assert self.enable_caching and not self.policy.evicts, "the disk tier needs prefix caching, full policy"
        self.offload = offload
        offload.manager = self
        self.block_pool.on_evict = offload.on_evict

    # ---- prefix cache --------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Prefix-cache lookup for a request about to be admitted from the waiting queue.

        Returns the longest chain of cached full blocks matching the start of `request.all_token_ids`
        and the number of tokens they cover. At least one token is always left to compute (the last
        token's logits are needed), so the hit is capped at `num_tokens - 1` rounded down to full
        blocks. Reference counts are not changed here; `allocate_slots` takes the references.
        """
        if not self.enable_caching:
            return [], 0
        assert request.num_computed_tokens == 0, (
            f"prefix lookup for {request.request_id}, which has {request.num_computed_tokens} computed")
        max_hit_blocks = max(0, request.num_tokens - 1) // self.block_size
        if isinstance(self.policy, H2OPolicy):  # a hit is held whole until the first compaction: keep it in bound
            max_hit_blocks = min(max_hit_blocks, self.policy.keep // self.block_size)
        hashes = self._get_block_hashes(request, max_hit_blocks)
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.offload is not None and len(hits) < max_hit_blocks:
            hits += self._load_offloaded(request, hashes[:max_hit_blocks], hits)
        num_hit_tokens = len(hits) * self.block_size
        if request.request_id not in self._stats_recorded:
            self._stats_recorded.add(request.request_id)
            self.prefix_cache_stats.requests += 1
            self.prefix_cache_stats.queries += request.num_tokens
            self.prefix_cache_stats.hits += num_hit_tokens
        return hits, num_hit_tokens

    def _load_offloaded(self, request: Request, hashes: list[int], hits: list[KVBlock]) -> list[KVBlock]:
        """The chain past the RAM hits, continued from the disk tier: each block found there is read into a fresh
        block and registered like a computed one (a block still in RAM is taken as it is). The returned blocks are
        unreferenced cached blocks, as RAM hits are; allocate_slots references them. Loads stop short of the
        blocks the rest of the request needs, so that loading never leaves it unable to run."""
        assert self.offload is not None
        pool, bs = self.block_pool, self.block_size
        first_lookup = request.request_id not in self._stats_recorded
        held = list(hits)
        pool.touch(held)  # the blocks taken for loads must not evict this request's own hits
        found: list[KVBlock] = []
        try:
            for block_hash in hashes[len(hits):]:
                block = pool.get_cached_block(block_hash)
                if block is None:
                    if not self.offload.contains(block_hash):
                        if first_lookup and not found:
                            self.offload.stats.misses += 1
                        break
                    if pool.get_num_free_blocks() - 1 < _cdiv(request.num_tokens, bs) - len(held) - 1:
                        break
                    block = pool.get_new_blocks(1)[0]
                    if not self.offload.load(block_hash, block.block_id):
                        pool.free_blocks([block])
                        break
                    pool.cache_full_block(block, block_hash)
                else:
                    pool.touch([block])
                held.append(block)
                found.append(block)
        finally:
            pool.free_blocks(reversed(held))
        return found

    def reset_prefix_cache_stats(self) -> PrefixCacheStats:
        """Return the stats gathered so far and start counting afresh."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block hash; refused (False) while any block is held by a request."""
        return self.block_pool.reset_prefix_cache()

    # ---- allocation ----------------------------------------------------------------------------------

    #  Token positions of one request, and the blocks that hold them, after allocate_slots:
    #
    #  (positions are cache entries: under H2O, after a compaction, num_computed_tokens - dropped of them)
    #  0              num_computed_tokens   num_computed                    num_total
    #  |---- computed ----|---- prefix hit ----|------------ new ------------|
    #  [ existing blocks  ][   hit blocks      ][ CoW ][    fresh blocks     ]
    #                                           ^ block holding the first new token: if it is shared
    #                                             (ref_cnt > 1, after a fork) it is replaced by a copy
    #
    #  num_computed = num_computed_tokens + num_new_computed_tokens; num_total = num_computed + num_new_tokens
    #  Hits only come with a fresh admission (num_computed_tokens == 0, no existing blocks), so at most one
    #  of "existing" and "hit" is non-empty; hits are whole blocks, so the first new token then starts a
    #  fresh block. "new" may run past request.num_tokens (lookahead slots, e.g. speculative drafts).
    #  Blocks fully inside min(num_total, num_tokens) get hashed and registered in the prefix cache.
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_new_computed_tokens: int = 0,
    ) -> list[tuple[int, int]] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones and the prefix hits.

        Returns the copy-on-write copies (src_block_id, dst_block_id) the runner must perform before
        writing this step's KV (empty if none), or None when there are not enough free blocks — in which
        case nothing changed (no partial allocation, hits not referenced), except that an H2O compaction
        due before it may have been done (the table is consistent either way; see `_compact`).
        """
        assert num_new_tokens >= 0, f"num_new_tokens must be >= 0, got {num_new_tokens}"
        bs = self.block_size
        req_id = request.request_id
        hits = new_computed_blocks or []
        assert num_new_computed_tokens == len(hits) * bs, (
            f"{num_new_computed_tokens} prefix-hit tokens but {len(hits)} hit blocks of {bs}")
        req_blocks = self._req_to_blocks.get(req_id, [])
        if hits:
            assert not req_blocks and request.num_computed_tokens == 0, (
                f"prefix hits for {req_id}, which already holds {len(req_blocks)} blocks")
            # The hits must still be what the lookup found: nothing may be allocated between the lookup
            # and this call (a popped hit would have been evicted and handed to someone else).
            hashes = self._get_block_hashes(request, len(hits))
            for block, block_hash in zip(hits, hashes[:len(hits)], strict=True):
                assert block.block_hash == block_hash, f"hit block {block.block_id} was evicted before use"

        if req_id in self._pending_keep:
            if not self._compact(request, req_blocks, self._pending_keep[req_id]):
                return None
            del self._pending_keep[req_id]
        elif self.policy.evicts and req_blocks:
            self._evict(request, req_blocks)
        num_computed = self.get_num_cache_entries(request) + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        num_existing = len(req_blocks) + len(hits)
        num_fresh = max(0, _cdiv(num_total, bs) - num_existing)
        # Existing blocks that this step writes into and that another table also holds: copy-on-write.
        # Normally just the last, partial block; more only if lookahead blocks were allocated before a fork.
        cow_idx: list[int] = []
        if num_new_tokens > 0:
            write_end = min(len(req_blocks), _cdiv(num_total, bs))
            cow_idx = [i for i in range(num_computed // bs, write_end) if req_blocks[i].ref_cnt > 1]
        num_revived = sum(1 for block in hits if block.ref_cnt == 0)  # hits that sit in the free queue
        if num_fresh + len(cow_idx) + num_revived > self.block_pool.get_num_free_blocks():
            return None

        # Commit. Hits are referenced first so that get_new_blocks cannot pop (evict) them.
        self.block_pool.touch(hits)
        req_blocks = self._req_to_blocks.setdefault(req_id, [])
        req_blocks.extend(hits)
        self._requests[req_id] = request
        new_blocks = self.block_pool.get_new_blocks(len(cow_idx) + num_fresh)
        copies: list[tuple[int, int]] = []
        shared: list[KVBlock] = []
        for i, new_block in zip(cow_idx, new_blocks[:len(cow_idx)], strict=True):
            shared.append(req_blocks[i])
            copies.append((req_blocks[i].block_id, new_block.block_id))
            req_blocks[i] = new_block
        self.block_pool.free_blocks(shared)  # each still held by the other table(s)
        req_blocks.extend(new_blocks[len(cow_idx):])

        # A compacted cache no longer follows the token-hash chain: nothing more of it is registered.
        if self.enable_caching and not self._num_dropped.get(req_id):
            num_cached = max(self._num_cached_blocks.get(req_id, 0), len(hits))
            num_full = min(num_total, request.num_tokens) // bs
            if num_full > num_cached:
                hashes = self._get_block_hashes(request, num_full)
                for i in range(num_cached, num_full):
                    block = req_blocks[i]
                    if block is not None:
                        self.block_pool.cache_full_block(block, hashes[i])
            self._num_cached_blocks[req_id] = max(num_cached, num_full)
        return copies

    def _evict(self, request: Request, req_blocks: list[KVBlock | None]) -> None:
        """Drop the blocks the policy no longer needs (see kvcache/policy.py); a shared one stays with its
        other holders, untouched. Freed in reverse, like `free`, so older blocks are reused last."""
        req_id = request.request_id
        evictable = self.policy.evictable_blocks(request.num_computed_tokens, len(req_blocks), self.block_size)
        start = max(evictable.start, self._num_evicted_blocks.get(req_id, 0))
        dropped = []
        for i in range(start, evictable.stop):
            block = req_blocks[i]
            if block is not None:
                dropped.append(block)
                req_blocks[i] = None
        if evictable.stop > start:
            self._num_evicted_blocks[req_id] = evictable.stop
        self.block_pool.free_blocks(reversed(dropped))

    # ---- H2O compaction ------------------------------------------------------------------------------------

    def schedule_compaction(self, request: Request, kept: list[int]) -> None:
        """After a step: keep only cache entries `kept` (ascending) of the request, compacted at its next
        allocation. The policy chose them after the step and already cut its scores to them (kvcache/h2o.py)."""
        assert isinstance(self.policy, H2OPolicy), f"compaction under the {self.policy.name} policy"
        assert kept == sorted(set(kept)) and kept[-1] < self.get_num_cache_entries(request), (
            f"bad kept entries for {request.request_id}: {kept[:8]}...")
        self._pending_keep[request.request_id] = list(kept)

    #  Compaction of one request's table (kept entries -> the first slots, in cache order):
    #
    #  before:  [ b0 (shared) ][ b1 ][ b2 (cached) ][ b3 ][ b4 ]      ctx entries
    #  after:   [ b4' <- spare][ b1 ][ fresh       ]                   keep entries in cdiv(keep, bs) blocks
    #
    #  A destination block must be writable: ref_cnt 1 and not registered in the prefix cache. The others are
    #  swapped for (in this order) a writable block of the request past the kept range, a fresh pool block, or
    #  the request's own cached ref-1 block past the kept range (its hash withdrawn). The swapped-out blocks
    #  are only dereferenced, never written: their other holders and the prefix cache keep valid contents.
    #  The runner gathers every source slot of the step's moves before it scatters any (runner.move_kv), so a
    #  block may be both a source and a destination, and blocks freed here may be reused in the same schedule.
    def _compact(self, request: Request, req_blocks: list[KVBlock | None], kept: list[int]) -> bool:
        """Returns False (nothing changed) when the pool cannot supply the destination blocks."""
        bs = self.block_size
        req_id = request.request_id
        num_entries = self.get_num_cache_entries(request)
        assert all(b is not None for b in req_blocks), "h2o tables have no evicted holes"
        old: list[KVBlock] = list(req_blocks)  # type: ignore[arg-type]
        num_dst = _cdiv(len(kept), bs)

        def writable(block: KVBlock) -> bool:
            return block.ref_cnt == 1 and block.block_hash is None

        need = [i for i in range(num_dst) if not writable(old[i])]
        spare = [b for b in old[num_dst:] if writable(b)]
        own_cached = [b for b in old[num_dst:] if b.ref_cnt == 1 and b.block_hash is not None]
        num_fresh = min(max(0, len(need) - len(spare)), self.block_pool.get_num_free_blocks())
        if len(spare) + num_fresh + len(own_cached) < len(need):
            return False
        for block in own_cached[:max(0, len(need) - len(spare) - num_fresh)]:
            self.block_pool.uncache(block)
            spare.append(block)
        fresh = self.block_pool.get_new_blocks(num_fresh)
        new = old[:num_dst]
        for i, block in zip(need, spare + fresh, strict=False):
            new[i] = block
        kept_set = {id(b) for b in new}
        released = [b for b in old if id(b) not in kept_set]
        # cache entry e sits in slot table[e // bs] * bs + e % bs; entry kept[j] goes to entry j
        src = [old[e // bs].block_id * bs + e % bs for e in kept]
        dst = [new[j // bs].block_id * bs + j % bs for j in range(len(kept))]
        moves = [(a, b) for a, b in zip(src, dst, strict=True) if a != b]
        self._pending_moves[req_id] = ([a for a, _ in moves], [b for _, b in moves])
        req_blocks[:] = new
        self.block_pool.free_blocks(reversed(released))
        self._num_dropped[req_id] = self._num_dropped.get(req_id, 0) + num_entries - len(kept)
        return True

    def take_kv_moves(self) -> tuple[list[int], list[int]]:
        """The compactions' (src_slots, dst_slots) since the last call, for the runner (then forgotten)."""
        src: list[int] = []
        dst: list[int] = []
        for req_src, req_dst in self._pending_moves.values():
            src += req_src
            dst += req_dst
        self._pending_moves.clear()
        return src, dst

    def get_num_cache_entries(self, request: Request) -> int:
        """Entries in the request's cache: its computed tokens less those an H2O compaction dropped."""
        return request.num_computed_tokens - self._num_dropped.get(request.request_id, 0)

    def free(self, request: Request) -> None:
        """Release the request's blocks and forget it. Idempotent.

        Blocks go back in reverse order, so that a prefix's tail sits nearer the head of the free queue
        and is evicted before its head (which more prompts share).
        """
        req_id = request.request_id
        num_entries = self.get_num_cache_entries(request)
        table = self._req_to_blocks.pop(req_id, None)
        self._num_evicted_blocks.pop(req_id, None)
        self._num_dropped.pop(req_id, None)
        self._pending_keep.pop(req_id, None)
        # its destinations were its own private blocks, now free: a move into them would clobber a new holder
        self._pending_moves.pop(req_id, None)
        if table:
            # Blocks are registered in the cache when scheduled, before their KV is written. A request
            # preempted after being scheduled in the same step never computes them: withdraw those hashes
            # (blocks past num_computed_tokens that no one else holds) so no later lookup trusts them.
            for block in table[num_entries // self.block_size:]:
                if block is not None and block.ref_cnt == 1 and block.block_hash is not None:
                    self.block_pool.uncache(block)
            self.block_pool.free_blocks(reversed([b for b in table if b is not None]))
        self._req_to_block_hashes.pop(req_id, None)
        self._num_cached_blocks.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._stats_recorded.discard(req_id)

    def free_blocks_beyond(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past the first cdiv(num_tokens, block_size): lookahead slots (rejected
        speculative drafts) that turned out not to be needed. Such blocks lie past request.num_tokens when
        they were allocated, so they were never hashed into the prefix cache."""
        blocks = self._req_to_blocks.get(request.request_id)
        keep = _cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        assert all(b.block_hash is None or b.ref_cnt > 1 for b in tail), "a freed lookahead block was cached"
        self.block_pool.free_blocks(reversed(tail))

    def fork(self, parent: Request, child: Request) -> None:
        """Share the parent's whole block table with `child` (n > 1 sampling); writes copy on demand.

        `child` must carry the same tokens as the parent and the same num_computed_tokens.
        """
        assert child.request_id not in self._req_to_blocks, f"fork into {child.request_id}, which has blocks"
        blocks = self._req_to_blocks.get(parent.request_id, [])
        num_cached = self._num_cached_blocks.get(parent.request_id, 0)
        num_hashed_tokens = num_cached * self.block_size
        assert child.all_token_ids[:num_hashed_tokens] == parent.all_token_ids[:num_hashed_tokens], (
            f"fork of {parent.request_id} into {child.request_id}: the cached prefixes differ")
        self.block_pool.touch([b for b in blocks if b is not None])
        self._req_to_blocks[child.request_id] = list(blocks)
        if parent.request_id in self._num_evicted_blocks:
            self._num_evicted_blocks[child.request_id] = self._num_evicted_blocks[parent.request_id]
        self._num_cached_blocks[child.request_id] = num_cached
        if parent.request_id in self._num_dropped:  # h2o: the child's cache is the parent's, compacted alike
            self._num_dropped[child.request_id] = self._num_dropped[parent.request_id]
        if parent.request_id in self._pending_keep:
            self._pending_keep[child.request_id] = list(self._pending_keep[parent.request_id])
        parent_hashes = self._req_to_block_hashes.get(parent.request_id, [])
        self._req_to_block_hashes[child.request_id] = parent_hashes[:num_cached]
        self._requests[child.request_id] = child

    # ---- queries -------------------------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> list[int]:
        """Physical block ids by logical block; an evicted block reads as -1 (attention never gathers it)."""
        return [-1 if block is None else block.block_id for block in self._req_to_blocks.get(request_id, ())]

    def get_num_blocks(self, request_id: str) -> int:
        """Blocks the request holds (evicted ones not counted)."""
        return sum(1 for block in self._req_to_blocks.get(request_id, ()) if block is not None)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def num_slots_allocated(self) -> int:
        """Token slots in blocks held by any request, each shared block counted once."""
        return (self.block_pool.num_blocks - self.block_pool.get_num_free_blocks()) * self.block_size

    def num_slots_in_use(self) -> int:
        """Token slots holding computed KV, each shared slot counted once.

        Per request the computed span is min(num_computed_tokens, num_blocks * block_size); a block's
        filled slots are the most any of its holders has computed in it.
        """
        bs = self.block_size
        filled: dict[int, int] = {}  # block_id -> slots holding computed tokens
        for req_id, blocks in self._req_to_blocks.items():
            num_computed = min(self.get_num_cache_entries(self._requests[req_id]), len(blocks) * bs)
            for i in range(_cdiv(num_computed, bs)):
                if blocks[i] is None:  # evicted
                    continue
                block_id = blocks[i].block_id
                filled[block_id] = max(filled.get(block_id, 0), min(bs, num_computed - i * bs))
        return sum(filled.values())

    def kv_utilization(self) -> float:
        """Slots holding computed KV / slots in allocated blocks (0.0 when nothing is allocated)."""
        num_allocated = self.num_slots_allocated()
        return self.num_slots_in_use() / num_allocated if num_allocated else 0.0

    def _get_block_hashes(self, request: Request, num_blocks: int) -> list[int]:
        """Chained hashes of the request's first `num_blocks` full blocks (memoized per request)."""
        bs = self.block_size
        assert num_blocks * bs <= request.num_tokens, (
            f"hashing {num_blocks} blocks of {bs} over only {request.num_tokens} tokens")
        hashes = self._req_to_block_hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        # a LoRA request's chain starts from its adapter's key: the same tokens under another adapter have other KV
        key = getattr(request, "lora_key", None)  # 32 bytes: hashed as four int64 "tokens", far beyond any vocabulary
        root = None if key is None else hash_block_tokens(None, list(struct.unpack("<4q", key)))
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else root, tokens[i * bs:(i + 1) * bs]))
        return hashes
