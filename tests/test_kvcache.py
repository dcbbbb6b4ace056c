"""Block pool and KV cache manager: exact expectations on tiny cases, then a randomized invariant check."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from brisk.engine.request import Request
from brisk.kvcache.block_pool import BlockPool
from brisk.kvcache.manager import KVCacheManager, PrefixCacheStats, hash_block_tokens


def make_request(req_id: str, token_ids, num_computed_tokens: int = 0) -> Request:
    request = Request(req_id, list(token_ids), sampling_params=None)
    request.num_computed_tokens = num_computed_tokens
    return request


def block_hashes(token_ids, block_size: int = 4) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`, computed independently of the manager."""
    hashes: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


def pool_state(pool: BlockPool):
    return ([(b.ref_cnt, b.block_hash) for b in pool.blocks], pool.free_block_ids(), pool.cached_block_map())


# ---- block pool ------------------------------------------------------------------------------------------

def test_pool_hands_out_blocks_in_order_and_counts_references():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.get_num_free_blocks() == 1
    assert pool.get_usage() == 0.75

    pool.touch([blocks[0]])  # a second holder
    pool.free_blocks([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert pool.free_block_ids() == [3]  # still held: not free

    pool.free_blocks([blocks[2], blocks[0]])
    assert pool.free_block_ids() == [3, 2, 0]  # freed blocks go to the tail, in the order given
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.get_new_blocks(2)
    assert pool.free_block_ids() == [0]  # the refused request popped nothing


def test_pool_evicts_cached_free_blocks_least_recently_freed_first():
    pool = BlockPool(4)
    b = pool.get_new_blocks(4)
    pool.cache_full_block(b[0], 100)
    pool.cache_full_block(b[1], 101)
    pool.free_blocks([b[1], b[0], b[3], b[2]])
    assert pool.free_block_ids() == [1, 0, 3, 2]
    assert pool.get_num_free_blocks() == 4  # cached-but-unreferenced blocks count as free
    assert pool.get_cached_block(101) is b[1]  # free, yet still a hit

    (reused,) = pool.get_new_blocks(1)
    assert reused is b[1] and reused.block_hash is None and reused.ref_cnt == 1
    assert pool.get_cached_block(101) is None  # evicted on reuse
    assert pool.get_cached_block(100) is b[0]

    pool.touch([b[0]])  # a hit revives a free block from the middle of the queue
    assert b[0].ref_cnt == 1 and b[0].block_hash == 100
    assert pool.free_block_ids() == [3, 2]
    pool.free_blocks([b[0]])
    assert pool.free_block_ids() == [3, 2, 0]
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [3, 2, 0]
    assert pool.cached_block_map() == {}


def test_pool_keeps_the_first_block_registered_under_a_hash():
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    pool.cache_full_block(a, 7)
    pool.cache_full_block(b, 7)  # same prefix computed twice: the map keeps the first copy
    assert pool.get_cached_block(7) is a and b.block_hash is None
    pool.cache_full_block(a, 7)  # re-registering the same block is a no-op
    with pytest.raises(AssertionError):
        pool.cache_full_block(a, 8)  # a full block never changes contents


def test_pool_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_block(blocks[0], 5)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(5) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(5) is None and blocks[0].block_hash is None


def test_pool_with_caching_disabled_never_caches():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, 5)
    assert block.block_hash is None and pool.get_cached_block(5) is None


# ---- hashing ---------------------------------------------------------------------------------------------

def test_hash_chain_covers_the_whole_prefix():
    root = hash_block_tokens(None, [1, 2, 3, 4])
    assert root == hash_block_tokens(None, (1, 2, 3, 4))  # deterministic, any sequence type
    assert root != hash_block_tokens(None, [1, 2, 3, 5])
    other_root = hash_block_tokens(None, [9, 9, 9, 9])
    # Same block tokens after different prefixes: different hashes.
    assert hash_block_tokens(root, [5, 6, 7, 8]) != hash_block_tokens(other_root, [5, 6, 7, 8])
    # A first block never hashes like a later block with the same tokens.
    assert hash_block_tokens(root, [1, 2, 3, 4]) != root


def test_same_block_tokens_after_a_different_prefix_do_not_hit():
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert m.allocate_slots(a, 9) == []
    a.num_computed_tokens = 9
    m.free(a)
    b = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert m.get_computed_blocks(b) == ([], 0)
    c = make_request("c", [1, 2, 3, 4, 7, 7, 7, 7, 0])
    blocks, num_hit = m.get_computed_blocks(c)
    assert [blk.block_id for blk in blocks] == [0] and num_hit == 4


# ---- allocation and prefix caching -----------------------------------------------------------------------

def test_allocate_caches_only_full_blocks_whose_tokens_are_known():
    m = KVCacheManager(num_blocks=8, block_size=4)
    pool = m.block_pool
    r = make_request("r", range(10))
    assert m.get_computed_blocks(r) == ([], 0)
    assert m.allocate_slots(r, 10) == []
    assert m.get_block_ids("r") == [0, 1, 2]
    h = block_hashes(list(range(12)))
    assert [b.block_hash for b in pool.blocks[:3]] == [h[0], h[1], None]  # block 2 is partial
    r.num_computed_tokens = 10

    r.append_output_token_ids(10)
    assert m.allocate_slots(r, 1) == []
    assert pool.blocks[2].block_hash is None  # 11 tokens: still partial
    r.num_computed_tokens = 11
    r.append_output_token_ids(11)
    assert m.allocate_slots(r, 1) == []
    assert pool.blocks[2].block_hash == h[2]
    assert m.get_block_ids("r") == [0, 1, 2]
    r.num_computed_tokens = 12
    r.append_output_token_ids(12)
    assert m.allocate_slots(r, 1) == []
    assert m.get_block_ids("r") == [0, 1, 2, 3] and m.get_num_blocks("r") == 4
    assert pool.blocks[3].block_hash is None


def test_chunked_prefill_and_lookahead_hash_only_scheduled_known_tokens():
    m = KVCacheManager(num_blocks=8, block_size=4)
    pool = m.block_pool
    r = make_request("r", range(10))
    assert m.allocate_slots(r, 5) == []  # first chunk: tokens 0..4
    h = block_hashes(list(range(10)))
    assert m.get_block_ids("r") == [0, 1]
    assert [pool.blocks[0].block_hash, pool.blocks[1].block_hash] == [h[0], None]
    r.num_computed_tokens = 5
    assert m.allocate_slots(r, 5) == []
    assert m.get_block_ids("r") == [0, 1, 2] and pool.blocks[1].block_hash == h[1]

    s = make_request("s", range(100, 107))
    assert m.allocate_slots(s, 7 + 3) == []  # 3 lookahead slots past the 7 known tokens
    assert m.get_block_ids("s") == [3, 4, 5]
    # Block 4 is covered by the allocation but its last slot is a draft, not a known token: not cached.
    assert [pool.blocks[i].block_hash for i in (3, 4, 5)] == [block_hashes(list(range(100, 107)))[0], None, None]


def test_free_returns_blocks_in_reverse_and_a_later_request_hits_the_prefix():
    m = KVCacheManager(num_blocks=6, block_size=4)
    pool = m.block_pool
    a = make_request("a", range(10))
    assert m.allocate_slots(a, 10) == []
    a.num_computed_tokens = 10
    m.free(a)
    assert pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    m.free(a)  # idempotent
    assert pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert m.get_block_ids("a") == []

    b = make_request("b", list(range(10)) + [99])
    hits, num_hit = m.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert [blk.ref_cnt for blk in hits] == [0, 0]  # lookup takes no references
    assert m.allocate_slots(b, 3, hits, num_hit) == []
    assert m.get_block_ids("b") == [0, 1, 3]
    assert [pool.blocks[i].ref_cnt for i in (0, 1, 3)] == [1, 1, 1]
    assert pool.free_block_ids() == [4, 5, 2]
    assert m.prefix_cache_stats == PrefixCacheStats(requests=1, queries=11, hits=8)


def test_prefix_hit_never_covers_the_last_token():
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(8))
    assert m.allocate_slots(a, 8) == []
    a.num_computed_tokens = 8
    m.free(a)
    same = make_request("same", range(8))
    hits, num_hit = m.get_computed_blocks(same)
    assert [b.block_id for b in hits] == [0] and num_hit == 4  # 7 tokens at most, rounded down to blocks
    longer = make_request("longer", range(9))
    hits, num_hit = m.get_computed_blocks(longer)
    assert [b.block_id for b in hits] == [0, 1] and num_hit == 8
    short = make_request("short", range(4))
    assert m.get_computed_blocks(short) == ([], 0)


def test_hits_on_a_running_request_share_its_blocks():
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(10))
    assert m.allocate_slots(a, 10) == []
    a.num_computed_tokens = 10
    b = make_request("b", list(range(8)) + [50, 51])
    hits, num_hit = m.get_computed_blocks(b)
    assert m.allocate_slots(b, 2, hits, num_hit) == []
    assert m.get_block_ids("b") == [0, 1, 3]
    assert [m.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    m.free(a)
    assert [m.block_pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert m.block_pool.free_block_ids() == [4, 5, 6, 7, 2]


def test_cached_free_blocks_are_evicted_tail_of_prefix_first():
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(9))
    assert m.allocate_slots(a, 9) == []  # blocks 0, 1 cached, 2 partial
    a.num_computed_tokens = 9
    m.free(a)
    assert m.block_pool.free_block_ids() == [3, 2, 1, 0]
    c = make_request("c", range(100, 106))
    assert m.allocate_slots(c, 6) == []
    assert m.get_block_ids("c") == [3, 2]
    d = make_request("d", range(200, 203))
    assert m.allocate_slots(d, 3) == []
    assert m.get_block_ids("d") == [1]  # evicts the tail of a's prefix, keeps its head
    again = make_request("again", range(9))
    hits, num_hit = m.get_computed_blocks(again)
    assert [b.block_id for b in hits] == [0] and num_hit == 4


def test_hits_evicted_between_lookup_and_allocation_are_caught():
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(9))
    assert m.allocate_slots(a, 9) == []
    a.num_computed_tokens = 9
    m.free(a)
    b = make_request("b", range(9))
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8
    assert m.allocate_slots(make_request("c", range(50, 66)), 16) == []  # takes all 4 blocks, evicting
    with pytest.raises(AssertionError, match="evicted before use"):
        m.allocate_slots(b, 1, hits, num_hit)


def test_lookup_stats_count_once_per_admission():
    m = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", range(9))
    assert m.allocate_slots(a, 9) == []
    a.num_computed_tokens = 9
    b = make_request("b", range(9))
    m.get_computed_blocks(b)
    m.get_computed_blocks(b)  # still waiting (e.g. no room this step): not counted again
    assert m.prefix_cache_stats == PrefixCacheStats(requests=1, queries=9, hits=8)
    m.free(b)  # left the engine (or was preempted); a new admission is a new lookup
    m.get_computed_blocks(b)
    stats = m.reset_prefix_cache_stats()
    assert stats == PrefixCacheStats(requests=2, queries=18, hits=16) and stats.hit_rate == 16 / 18
    assert m.prefix_cache_stats == PrefixCacheStats()


def test_allocate_returns_none_and_changes_nothing_when_out_of_blocks():
    m = KVCacheManager(num_blocks=4, block_size=4)
    pool = m.block_pool
    a = make_request("a", range(9))
    assert m.allocate_slots(a, 9) == []
    a.num_computed_tokens = 9
    m.free(a)
    b = make_request("b", list(range(8)) + list(range(50, 62)))  # 20 tokens
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8
    before = pool_state(pool)
    # 2 hits (both in the free queue) + 3 fresh blocks > 4 blocks.
    assert m.allocate_slots(b, 12, hits, num_hit) is None
    assert pool_state(pool) == before and m.get_block_ids("b") == []
    assert [blk.ref_cnt for blk in hits] == [0, 0]
    assert m.allocate_slots(b, 8, hits, num_hit) == []  # 2 hits + 2 fresh fits
    assert m.get_block_ids("b") == [0, 1, 3, 2]
    b.num_computed_tokens = 16
    before = pool_state(pool)
    assert m.allocate_slots(b, 4) is None  # a running request that needs a 5th block
    assert pool_state(pool) == before and m.get_block_ids("b") == [0, 1, 3, 2]


def test_fork_shares_blocks_and_copies_on_write():
    m = KVCacheManager(num_blocks=8, block_size=4)
    pool = m.block_pool
    parent = make_request("p", range(6))
    assert m.allocate_slots(parent, 6) == []
    parent.num_computed_tokens = 6
    child = make_request("c", range(6), num_computed_tokens=6)
    m.fork(parent, child)
    assert m.get_block_ids("p") == m.get_block_ids("c") == [0, 1]
    assert [pool.blocks[0].ref_cnt, pool.blocks[1].ref_cnt] == [2, 2]

    parent.append_output_token_ids(100)
    assert m.allocate_slots(parent, 1) == [(1, 2)]  # copy block 1 into block 2, then write token 6
    assert m.get_block_ids("p") == [0, 2] and m.get_block_ids("c") == [0, 1]
    assert [pool.blocks[i].ref_cnt for i in range(3)] == [2, 1, 1]
    parent.num_computed_tokens = 7
    child.append_output_token_ids(200)
    assert m.allocate_slots(child, 1) == []  # the child is now block 1's only holder: write in place
    child.num_computed_tokens = 7

    parent.append_output_token_ids(101)
    child.append_output_token_ids(201)
    assert m.allocate_slots(parent, 1) == [] and m.allocate_slots(child, 1) == []
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    assert pool.blocks[0].block_hash == h0
    assert pool.blocks[2].block_hash == hash_block_tokens(h0, [4, 5, 100, 101])
    assert pool.blocks[1].block_hash == hash_block_tokens(h0, [4, 5, 200, 201])
    m.free(parent)
    assert [pool.blocks[i].ref_cnt for i in range(3)] == [1, 1, 0]
    m.free(child)
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]


def test_fork_at_a_block_boundary_needs_no_copy():
    m = KVCacheManager(num_blocks=4, block_size=4)
    parent = make_request("p", range(8))
    assert m.allocate_slots(parent, 8) == []
    parent.num_computed_tokens = 8
    child = make_request("c", range(8), num_computed_tokens=8)
    m.fork(parent, child)
    parent.append_output_token_ids(1)
    assert m.allocate_slots(parent, 1) == []  # token 8 starts a new block: nothing shared is written
    assert m.get_block_ids("p") == [0, 1, 2] and m.get_block_ids("c") == [0, 1]


def test_copy_on_write_covers_every_shared_block_the_step_writes():
    m = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p", range(7))
    assert m.allocate_slots(parent, 7 + 3) == []  # 3 lookahead slots reach into block 2
    parent.num_computed_tokens = 7
    child = make_request("c", range(7), num_computed_tokens=7)
    m.fork(parent, child)
    parent.append_output_token_ids(7)
    # Token 7 plus 3 drafts land in blocks 1 and 2, both shared: both are copied, in table order.
    assert m.allocate_slots(parent, 1 + 3) == [(1, 3), (2, 4)]
    assert m.get_block_ids("p") == [0, 3, 4] and m.get_block_ids("c") == [0, 1, 2]
    assert [m.block_pool.blocks[i].ref_cnt for i in range(5)] == [2, 1, 1, 1, 1]


def test_copy_on_write_needs_a_free_block():
    m = KVCacheManager(num_blocks=2, block_size=4)
    parent = make_request("p", range(6))
    assert m.allocate_slots(parent, 6) == []
    parent.num_computed_tokens = 6
    child = make_request("c", range(6), num_computed_tokens=6)
    m.fork(parent, child)
    parent.append_output_token_ids(100)
    before = pool_state(m.block_pool)
    assert m.allocate_slots(parent, 1) is None
    assert pool_state(m.block_pool) == before and m.get_block_ids("p") == [0, 1]


def test_kv_utilization_counts_shared_slots_once():
    m = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p", range(6))
    assert m.allocate_slots(parent, 6) == []
    assert (m.num_slots_in_use(), m.num_slots_allocated()) == (0, 8)  # allocated, not yet computed
    parent.num_computed_tokens = 6
    assert (m.num_slots_in_use(), m.num_slots_allocated()) == (6, 8)
    assert m.kv_utilization() == 0.75 and m.usage == 2 / 8 and m.num_free_blocks == 6
    child = make_request("c", range(6), num_computed_tokens=6)
    m.fork(parent, child)
    assert (m.num_slots_in_use(), m.num_slots_allocated()) == (6, 8)
    parent.append_output_token_ids(100)
    assert m.allocate_slots(parent, 1) == [(1, 2)]
    parent.num_computed_tokens = 7
    # block 0: 4 (shared), block 1: child's 2, block 2: parent's 3
    assert (m.num_slots_in_use(), m.num_slots_allocated()) == (9, 12)
    m.free(parent)
    assert (m.num_slots_in_use(), m.num_slots_allocated()) == (6, 8)
    m.free(child)
    assert (m.num_slots_in_use(), m.num_slots_allocated(), m.kv_utilization()) == (0, 0, 0.0)


def test_manager_with_caching_disabled():
    m = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    a = make_request("a", range(9))
    assert m.allocate_slots(a, 9) == []
    a.num_computed_tokens = 9
    assert all(b.block_hash is None for b in m.block_pool.blocks)
    m.free(a)
    b = make_request("b", range(9))
    assert m.get_computed_blocks(b) == ([], 0)
    assert m.prefix_cache_stats == PrefixCacheStats()


def test_reset_prefix_cache_is_refused_while_blocks_are_held():
    m = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request("a", range(9))
    assert m.allocate_slots(a, 9) == []
    a.num_computed_tokens = 9
    assert m.reset_prefix_cache() is False
    m.free(a)
    assert m.reset_prefix_cache() is True
    assert m.get_computed_blocks(make_request("b", range(9))) == ([], 0)


# ---- randomized invariants -------------------------------------------------------------------------------

BS = 4
NUM_BLOCKS = 24
VOCAB = 40
MAX_TOKENS = 44


class Simulation:
    """Drives the manager like a scheduler would and keeps a shadow KV cache: slot -> (token, position).

    Every computed token of every live request must be readable through its block table, so hits that
    served the wrong prefix, writes into a shared block without a copy, or a block handed out twice
    all show up as a shadow mismatch.
    """

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.m = KVCacheManager(NUM_BLOCKS, BS)
        self.kv: dict[int, tuple[int, int]] = {}
        self.live: dict[str, Request] = {}
        self.running: set[str] = set()
        self.prefix_of_hash: dict[int, tuple[int, ...]] = {}  # every block hash seen -> the prefix it covers
        self.bases = [[self.rng.randrange(VOCAB) for _ in range(28)] for _ in range(3)]
        self.next_id = 0
        self.counts: Counter[str] = Counter()

    # -- operations --

    def add(self) -> None:
        if self.rng.random() < 0.7:
            base = self.rng.choice(self.bases)
            prompt = base[:self.rng.randint(1, len(base))]
            prompt += [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(0, 5))]
        else:
            prompt = [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(1, 30))]
        req = make_request(f"r{self.next_id}", prompt)
        self.next_id += 1
        self.live[req.request_id] = req

    def admit(self) -> None:
        waiting = sorted(set(self.live) - self.running)
        if not waiting:
            return
        req = self.live[self.rng.choice(waiting)]
        hits, num_hit = self.m.get_computed_blocks(req)
        assert num_hit == len(hits) * BS and num_hit <= req.num_tokens - 1
        self.check_readable(req, [b.block_id for b in hits], num_hit)
        # Longest match: the next block (if allowed by the cap) is not in the cache.
        expected = block_hashes(req.all_token_ids[:req.num_tokens - 1])
        if len(hits) < len(expected):
            assert self.m.block_pool.get_cached_block(expected[len(hits)]) is None
        self.counts["hit_tokens"] += num_hit
        if self.schedule(req, hits, num_hit):
            self.running.add(req.request_id)

    def step(self) -> None:
        if not self.running:
            return
        req = self.live[self.rng.choice(sorted(self.running))]
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens >= MAX_TOKENS:
                self.finish(req)
                return
            req.append_output_token_ids(self.rng.randrange(VOCAB))  # the token sampled last step
        if not self.schedule(req, [], 0):
            victim = self.live[self.rng.choice(sorted(self.running))]  # preempt someone to make room
            self.preempt(victim)

    def schedule(self, req: Request, hits, num_hit: int) -> bool:
        start = req.num_computed_tokens + num_hit
        num_new = self.rng.randint(1, req.num_tokens - start)
        # Lookahead (draft) slots only when the request is caught up, as with speculative decoding.
        num_lookahead = self.rng.randint(0, 3) if start + num_new == req.num_tokens else 0
        before = self.snapshot()
        copies = self.m.allocate_slots(req, num_new + num_lookahead, hits, num_hit)
        if copies is None:
            assert self.snapshot() == before, "a refused allocation changed state"
            self.counts["refused"] += 1
            return False
        block_ids = self.m.get_block_ids(req.request_id)
        assert len(block_ids) * BS >= start + num_new + num_lookahead
        for src, dst in copies:  # the runner copies before writing this step's KV
            self.counts["copies"] += 1
            for j in range(BS):
                if src * BS + j in self.kv:
                    self.kv[dst * BS + j] = self.kv[src * BS + j]
                else:
                    self.kv.pop(dst * BS + j, None)
        for pos in range(start, start + num_new + num_lookahead):
            token = req.all_token_ids[pos] if pos < req.num_tokens else -1  # -1: a draft, maybe rejected
            self.kv[block_ids[pos // BS] * BS + pos % BS] = (token, pos)
        req.num_computed_tokens = start + num_new
        return True

    def fork(self) -> None:
        if not self.running:
            return
        parent = self.live[self.rng.choice(sorted(self.running))]
        child = make_request(f"r{self.next_id}", parent.all_token_ids, parent.num_computed_tokens)
        self.next_id += 1
        self.m.fork(parent, child)
        self.live[child.request_id] = child
        self.running.add(child.request_id)
        self.counts["forks"] += 1

    def finish(self, req: Request | None = None) -> None:
        if req is None:
            if not self.live:
                return
            req = self.live[self.rng.choice(sorted(self.live))]
        self.m.free(req)
        if self.rng.random() < 0.2:
            self.m.free(req)  # idempotent
        del self.live[req.request_id]
        self.running.discard(req.request_id)

    def preempt(self, req: Request | None = None) -> None:
        if req is None:
            if not self.running:
                return
            req = self.live[self.rng.choice(sorted(self.running))]
        self.m.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.running.discard(req.request_id)
        self.counts["preemptions"] += 1

    # -- checks --

    def snapshot(self):
        return pool_state(self.m.block_pool), {rid: self.m.get_block_ids(rid) for rid in self.live}

    def check_readable(self, req: Request, block_ids: list[int], num_tokens: int) -> None:
        for pos in range(num_tokens):
            slot = block_ids[pos // BS] * BS + pos % BS
            assert self.kv.get(slot) == (req.all_token_ids[pos], pos), (req, pos, slot)

    def check_invariants(self) -> None:
        pool = self.m.block_pool
        free_ids = pool.free_block_ids()
        assert len(set(free_ids)) == len(free_ids)
        tables = {rid: self.m.get_block_ids(rid) for rid in self.live}
        holders: Counter[int] = Counter()
        for rid, ids in tables.items():
            assert len(set(ids)) == len(ids), f"{rid} holds a block twice"
            holders.update(ids)
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], block
            assert (block.ref_cnt == 0) == (block.block_id in set(free_ids)), block
        assert len(free_ids) + len(holders) == NUM_BLOCKS, "a block leaked"

        for req in self.live.values():
            for h, end in zip(block_hashes(req.all_token_ids), range(BS, req.num_tokens + 1, BS), strict=True):
                prefix = tuple(req.all_token_ids[:end])
                assert self.prefix_of_hash.setdefault(h, prefix) == prefix, "hash collision"
            ids = tables[req.request_id]
            if req.request_id in self.running:
                assert len(ids) * BS >= req.num_computed_tokens
                self.check_readable(req, ids, req.num_computed_tokens)
            else:
                assert ids == [] and req.num_computed_tokens == 0

        cached = pool.cached_block_map()
        assert sum(b.block_hash is not None for b in pool.blocks) == len(cached)
        for h, block in cached.items():
            assert block.block_hash == h
            prefix = self.prefix_of_hash[h]
            for j in range(BS):  # the cached block really holds the last BS tokens of its prefix
                pos = len(prefix) - BS + j
                assert self.kv.get(block.block_id * BS + j) == (prefix[pos], pos)

        filled: dict[int, int] = {}
        for rid, ids in tables.items():
            n = self.live[rid].num_computed_tokens
            for i, block_id in enumerate(ids[:-(-n // BS)]):
                filled[block_id] = max(filled.get(block_id, 0), min(BS, n - i * BS))
        assert self.m.num_slots_in_use() == sum(filled.values())
        assert self.m.num_slots_allocated() == len(holders) * BS


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_invariants(seed):
    sim = Simulation(seed)
    ops = [sim.add, sim.admit, sim.step, sim.fork, sim.finish, sim.preempt]
    weights = [12, 20, 50, 4, 8, 6]
    for _ in range(3000):
        op = sim.rng.choices(ops, weights)[0]
        if op == sim.add and len(sim.live) >= 10:
            op = sim.finish
        op()
        sim.check_invariants()
    # The run must have exercised the interesting paths, or it proves little.
    assert sim.counts["copies"] > 0 and sim.counts["refused"] > 0 and sim.counts["preemptions"] > 0
    assert sim.counts["hit_tokens"] > 0 and sim.counts["forks"] > 0
