"""The pool of physical KV-cache blocks: reference counts, the free queue, and the prefix-cache map.

A block is one fixed-size page of the KV cache (`block_size` token slots in every layer). The pool knows
nothing about tokens or requests; it only hands blocks out, takes them back, and remembers which full
blocks hold which prefix (by hash) so that a later request with the same prefix can reuse them.

A block is in exactly one of two states:
  referenced  ref_cnt > 0, held by one or more block tables, not in the free queue;
  free        ref_cnt == 0, in the free queue. A free block may still carry a hash: its KV is intact
              and it is still a prefix-cache hit until it is popped for reuse (evicted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set when the block is full and cached (prefix caching)


class BlockPool:
    """Fixed set of `num_blocks` blocks with LRU reuse of freed (possibly still cached) blocks."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free queue. Three operations must be O(1): pop the head (allocate: least recently freed first,
        # so the cached block that has been unused longest is the one evicted), push to the tail (free),
        # and remove from the middle (a prefix-cache hit revives a free block). A plain list makes the
        # middle removal O(n); an OrderedDict keyed by block id gives all three in O(1) (its internal
        # doubly linked list) while keeping insertion order, without a hand-written linked list.
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        # Prefix-cache map: hash of a full block (covering its whole prefix) -> the block holding that KV.
        # One block per hash: if two requests compute the same block concurrently, the second copy is
        # simply not registered (see cache_full_block).
        self._cached: dict[int, KVBlock] = {}
        # Called with each cached block about to be evicted by get_new_blocks, while its KV is still intact (the
        # disk tier, kvcache/offload.py, copies it out here). Not called by uncache: that KV was never computed.
        self.on_evict: Callable[[KVBlock], None] | None = None

    # ---- queries -------------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, including cached-but-unreferenced ones (they are evicted on demand)."""
        return len(self._free_queue)

    def get_usage(self) -> float:
        """Fraction of blocks held by at least one request."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    def get_num_cached_blocks(self) -> int:
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be handed out) first. For tests and debugging."""
        return list(self._free_queue)

    def cached_block_map(self) -> dict[int, KVBlock]:
        """A copy of the prefix-cache map (hash -> block). For tests and debugging."""
        return dict(self._cached)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        if not self.enable_caching:
            return None
        return self._cached.get(block_hash)

    # ---- allocation ----------------------------------------------------------------------------------

    def get_new_blocks(self, num: int) -> list[KVBlock]:
        """Pop `num` blocks from the head of the free queue, evicting any cached hash they still carry."""
        if num > len(self._free_queue):
            raise ValueError(f"asked for {num} blocks but only {len(self._free_queue)} are free; "
                             "check get_num_free_blocks() before allocating")
        blocks = []
        for _ in range(num):
            _, block = self._free_queue.popitem(last=False)
            assert block.ref_cnt == 0, f"block {block.block_id} in the free queue has ref_cnt {block.ref_cnt}"
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; a block reaching 0 goes to the tail of the free queue.

        It keeps its hash, so it stays a prefix-cache hit until it reaches the head and is reused. Callers
        pass a request's blocks in reverse so that a prefix's tail is evicted before its head (a head block
        is shared by more prefixes and is worth more).
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"freeing block {block.block_id} which has ref_cnt {block.ref_cnt}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit that was free leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    # ---- prefix cache --------------------------------------------------------------------------------

    def cache_full_block(self, block: KVBlock, block_hash: int) -> None:
        """Register a full, computed block under `block_hash` (no-op when caching is off).

        If another block already holds this hash (two requests with the same prefix computed it in the
        same window), this one stays unregistered: it is freed like any uncached block, and the map keeps
        pointing at the first copy.
        """
        if not self.enable_caching:
            return
        if block.block_hash is not None:
            assert block.block_hash == block_hash, (
                f"block {block.block_id} is cached under another hash; a full block's contents never change")
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use, because running
        requests' tables would then disagree with the map about which of their blocks are cached."""
        if len(self._free_queue) != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def uncache(self, block: KVBlock) -> None:
        """Withdraw a block from the prefix cache (its KV turned out never to be computed)."""
        self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        assert self._cached.get(block.block_hash) is block, f"block {block.block_id} has a stale hash"
        del self._cached[block.block_hash]
        block.block_hash = None
