"""Scheduler without a model: a fake runner with a shadow KV cache, exact expectations, a randomized property test.

The fake runner stands in for the model as far as the scheduler can tell: the "KV" it writes at position p is
a hash chained over the KV at p - 1 (read from the cache, like attention would) and token p, and the token it
samples is a hash of the last position's KV. So a block that holds the wrong tokens, a missed copy-on-write, a
prefix-cache hit on a block that was never computed, or a token computed twice in one step changes the output
or trips an assert, and "the same tokens as the request run alone" is an exact oracle.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Mapping

import pytest

from brisk.engine.config import SchedulerConfig
from brisk.engine.request import Request, RequestStatus
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from brisk.kvcache.manager import KVCacheManager

ROOT = -1  # KV "before" position 0
_MASK = (1 << 61) - 1


def kv_value(prev: int, token: int) -> int:
    # hash() of a tuple of ints is deterministic (PYTHONHASHSEED only salts str/bytes)
    return hash((prev, token)) & _MASK


def sample_token(kv: int, k: int, vocab_size: int) -> int:
    """Sample k (0 for a plain decode, 0..n-1 at a fork) drawn from the logits of a position whose KV is kv."""
    return hash((kv, -1 - k)) % vocab_size


def kv_chain(token_ids: list[int]) -> list[int]:
    values, prev = [], ROOT
    for token in token_ids:
        prev = kv_value(prev, token)
        values.append(prev)
    return values


class FakeRunner:
    """Executes a SchedulerOutput against a shadow KV cache (slot -> chained hash) and checks it on the way."""

    def __init__(self, block_size: int, vocab_size: int = 1000) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv: dict[int, int] = {}

    def slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def check_computed(self, req: Request, block_ids: list[int], num_computed: int) -> None:
        """Tokens [0, num_computed) of `req` must have their KV, and only theirs, in the request's blocks."""
        expected = kv_chain(req.all_token_ids[:num_computed])
        for pos in range(num_computed):
            got = self.kv.get(self.slot(block_ids, pos))
            assert got == expected[pos], (
                f"{req.request_id}: KV at position {pos} (block {block_ids[pos // self.block_size]}) is not the KV "
                f"of its tokens: stale or missing ({req})")

    def execute(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> RunnerOutput:
        bs = self.block_size
        for src, dst in sched.block_copies:  # copy-on-write happens before anything is written
            for j in range(bs):
                if src * bs + j in self.kv:
                    self.kv[dst * bs + j] = self.kv[src * bs + j]
                else:
                    self.kv.pop(dst * bs + j, None)
        written: set[int] = set()
        out = RunnerOutput()
        for s in sched.scheduled:
            req = requests[s.req_id]
            start, end = s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)
            assert s.token_ids and s.token_ids == req.all_token_ids[start:end], f"{s.req_id}: wrong tokens scheduled"
            assert len(s.block_ids) * bs >= end, f"{s.req_id}: {len(s.block_ids)} blocks cannot hold {end} tokens"
            self.check_computed(req, s.block_ids, start)
            prev = self.kv[self.slot(s.block_ids, start - 1)] if start else ROOT
            for pos, token in enumerate(s.token_ids, start):
                slot = self.slot(s.block_ids, pos)
                assert slot not in written, f"{s.req_id}: slot {slot} written twice in one step"
                written.add(slot)
                prev = kv_value(prev, token)
                self.kv[slot] = prev
            if s.num_samples:
                out.sampled_token_ids[s.req_id] = [sample_token(prev, k, self.vocab_size)
                                                   for k in range(s.num_samples)]
        return out


class ScriptedRunner:
    """Returns tokens the test chose: req_id -> the tokens it will sample, in order (n = 1 only)."""

    def __init__(self, script: dict[str, list[int]]) -> None:
        self.script = {req_id: list(tokens) for req_id, tokens in script.items()}

    def execute(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> RunnerOutput:
        out = RunnerOutput()
        for s in sched.scheduled:
            if s.num_samples:
                assert s.num_samples == 1
                out.sampled_token_ids[s.req_id] = [self.script[s.req_id].pop(0)]
        return out


def make_scheduler(*, num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_num_seqs: int = 16,
                   max_model_len: int = 64, chunked: bool = True, policy: str = "fcfs",
                   caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             enable_chunked_prefill=chunked, policy=policy)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, caching))


def add(sched: Scheduler, req_id: str, prompt: list[int], *, arrival: float, priority: int = 0,
        eos: tuple[int, ...] = (), **params) -> list[Request]:
    """Adds one user request the way LLMEngine.add_request does: sample 0 is `req_id`, forks are `req_id#k`."""
    sp = SamplingParams(temperature=0.0, **params)
    samples = [Request(req_id if k == 0 else f"{req_id}#{k}", prompt, sp, eos_token_ids=eos, arrival_time=arrival,
                       priority=priority, parent_id=None if k == 0 else req_id, sample_index=k)
               for k in range(sp.n)]
    sched.add_request(samples[0], samples[1:])
    return samples


def step(sched: Scheduler, runner: FakeRunner | ScriptedRunner) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, runner.execute(out, sched.requests))
    return out


def summary(out: SchedulerOutput) -> list[tuple[str, int, int, int]]:
    """(req_id, num_computed_tokens, number of tokens scheduled, num_samples) per scheduled request."""
    return [(s.req_id, s.num_computed_tokens, len(s.token_ids), s.num_samples) for s in out.scheduled]


def ids(requests: Iterable[Request]) -> list[str]:
    return [r.request_id for r in requests]


def prompt(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


# ---- token budget ------------------------------------------------------------------------------------------

def test_budget_goes_to_decodes_first_and_the_rest_chunks_a_prompt():
    sched = make_scheduler(budget=10)
    runner = FakeRunner(4)
    add(sched, "A", prompt(3), arrival=0, max_tokens=10)
    add(sched, "B", prompt(3, 200), arrival=1, max_tokens=10)
    assert summary(step(sched, runner)) == [("A", 0, 3, 1), ("B", 0, 3, 1)]
    c = add(sched, "C", prompt(20, 300), arrival=2, max_tokens=10)[0]

    out = step(sched, runner)
    assert summary(out) == [("A", 3, 1, 1), ("B", 3, 1, 1), ("C", 0, 8, 0)]
    assert out.scheduled[2].token_ids == c.prompt_token_ids[:8]
    assert out.num_batched_tokens == 10
    assert summary(step(sched, runner)) == [("A", 4, 1, 1), ("B", 4, 1, 1), ("C", 8, 8, 0)]
    out = step(sched, runner)
    assert summary(out) == [("A", 5, 1, 1), ("B", 5, 1, 1), ("C", 16, 4, 1)]  # the last chunk samples
    assert out.num_batched_tokens == 6
    assert c.num_computed_tokens == 20 and c.num_output_tokens == 1
    assert summary(step(sched, runner)) == [("A", 6, 1, 1), ("B", 6, 1, 1), ("C", 20, 1, 1)]


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits_and_blocks_the_queue():
    sched = make_scheduler(budget=10, max_model_len=10, chunked=False)
    runner = FakeRunner(4)
    add(sched, "A", prompt(3), arrival=0, max_tokens=2)
    add(sched, "B", prompt(3, 200), arrival=1, max_tokens=2)
    add(sched, "C", prompt(9, 300), arrival=2, max_tokens=1)
    add(sched, "D", prompt(2, 400), arrival=3, max_tokens=1)  # would fit, but FCFS: it stays behind C
    assert summary(step(sched, runner)) == [("A", 0, 3, 1), ("B", 0, 3, 1)]
    assert summary(step(sched, runner)) == [("A", 3, 1, 1), ("B", 3, 1, 1)]  # 8 left, C needs 9
    assert ids(sched.waiting) == ["C", "D"] and not sched.running  # A and B hit max_tokens
    assert summary(step(sched, runner)) == [("C", 0, 9, 1)]  # whole, unchunked; D does not fit behind it
    assert summary(step(sched, runner)) == [("D", 0, 2, 1)]
    assert not sched.has_unfinished()


def test_chunked_prefill_off_needs_a_budget_that_holds_any_prompt():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=10, enable_chunked_prefill=False)


# ---- queue order -------------------------------------------------------------------------------------------

def test_running_before_waiting_fcfs_admission_and_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(4)
    add(sched, "A", prompt(4), arrival=0, max_tokens=1)
    add(sched, "B", prompt(4, 200), arrival=1, max_tokens=3)
    add(sched, "C", prompt(4, 300), arrival=2, max_tokens=3)
    add(sched, "D", prompt(4, 400), arrival=3, max_tokens=3)
    assert summary(step(sched, runner)) == [("A", 0, 4, 1), ("B", 0, 4, 1)]  # max_num_seqs = 2
    assert ids(sched.running) == ["B"] and ids(sched.waiting) == ["C", "D"]  # A finished at max_tokens=1
    assert summary(step(sched, runner)) == [("B", 4, 1, 1), ("C", 0, 4, 1)]  # the running decode comes first
    assert ids(sched.running) == ["B", "C"]


def test_running_requests_spend_the_budget_before_any_waiting_one_is_admitted():
    sched = make_scheduler(budget=6)
    runner = FakeRunner(4)
    add(sched, "A", prompt(6), arrival=0, max_tokens=5)
    add(sched, "B", prompt(6, 200), arrival=1, max_tokens=5)
    assert summary(step(sched, runner)) == [("A", 0, 6, 1)]
    assert summary(step(sched, runner)) == [("A", 6, 1, 1), ("B", 0, 5, 0)]


def test_priority_policy_orders_waiting_by_priority_then_arrival():
    sched = make_scheduler(policy="priority", max_num_seqs=2)
    runner = FakeRunner(4)
    add(sched, "A", prompt(4), arrival=0, priority=2, max_tokens=2)
    add(sched, "B", prompt(4, 200), arrival=1, priority=0, max_tokens=2)
    add(sched, "C", prompt(4, 300), arrival=2, priority=1, max_tokens=2)
    add(sched, "D", prompt(4, 400), arrival=3, priority=0, max_tokens=2)
    add(sched, "E", prompt(4, 500), arrival=-1, priority=1, max_tokens=2)  # arrived earliest: first among prio 1
    assert ids(sched.waiting) == ["B", "D", "E", "C", "A"]
    assert [s.req_id for s in step(sched, runner).scheduled] == ["B", "D"]


def test_fcfs_policy_ignores_priority():
    sched = make_scheduler(policy="fcfs")
    add(sched, "A", prompt(4), arrival=0, priority=5)
    add(sched, "B", prompt(4, 200), arrival=1, priority=0)
    assert ids(sched.waiting) == ["A", "B"]


# ---- blocks and the prefix cache ---------------------------------------------------------------------------

def test_scheduled_block_ids_are_the_kv_managers_table():
    sched = make_scheduler(num_blocks=8, block_size=4, caching=False)
    runner = FakeRunner(4)
    add(sched, "A", prompt(10), arrival=0, max_tokens=8)
    add(sched, "B", prompt(5, 200), arrival=1, max_tokens=8)
    expected_a = [[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2, 5], [0, 1, 2, 5]]  # position 12 opens block 5
    expected_b = [[3, 4], [3, 4], [3, 4], [3, 4], [3, 4, 6]]  # position 8 opens block 6
    for want_a, want_b in zip(expected_a, expected_b, strict=True):
        out = sched.schedule()
        tables = {s.req_id: s.block_ids for s in out.scheduled}
        assert tables == {"A": want_a, "B": want_b}
        assert tables == {r: sched.kv.get_block_ids(r) for r in ("A", "B")}
        sched.update(out, runner.execute(out, sched.requests))
    assert sched.kv.num_free_blocks == 1


def test_prefix_cache_hit_skips_the_shared_full_blocks():
    sched = make_scheduler(num_blocks=16, block_size=16, budget=256, max_model_len=128)
    runner = FakeRunner(16)
    shared = prompt(40)
    a = add(sched, "A", shared, arrival=0, max_tokens=4)[0]
    step(sched, runner)
    a_blocks = sched.kv.get_block_ids("A")

    b = add(sched, "B", shared + [7, 8, 9], arrival=1, max_tokens=4)[0]
    out = step(sched, runner)
    assert summary(out) == [("A", 40, 1, 1), ("B", 32, 11, 1)]  # 40 // 16 = 2 full blocks hit
    assert out.scheduled[1].token_ids == b.prompt_token_ids[32:]
    assert sched.kv.get_block_ids("B")[:2] == a_blocks[:2]
    assert [sched.kv.block_pool.blocks[i].ref_cnt for i in a_blocks] == [2, 2, 1]
    assert b.num_cached_tokens == 32 and a.num_cached_tokens == 0

    while sched.has_unfinished():
        step(sched, runner)
    # Same 40 tokens again after both finished: the cached blocks are revived from the free queue.
    c = add(sched, "C", shared, arrival=2, max_tokens=1)[0]
    out = step(sched, runner)
    assert summary(out) == [("C", 32, 8, 1)]
    assert out.scheduled[0].block_ids[:2] == a_blocks[:2]
    assert c.num_cached_tokens == 32


def test_prefix_cache_hit_on_blocks_scheduled_in_the_same_step():
    sched = make_scheduler(num_blocks=16, block_size=16, budget=256, max_model_len=128)
    runner = FakeRunner(16)
    shared = prompt(40)
    add(sched, "A", shared, arrival=0, max_tokens=2)
    add(sched, "B", shared + [1], arrival=1, max_tokens=2)
    out = step(sched, runner)  # the runner writes A's KV before B reads it, so B may use A's fresh blocks
    assert summary(out) == [("A", 0, 40, 1), ("B", 32, 9, 1)]
    assert out.scheduled[1].block_ids[:2] == out.scheduled[0].block_ids[:2]


def test_no_prefix_hits_when_caching_is_off():
    sched = make_scheduler(num_blocks=16, block_size=16, budget=256, max_model_len=128, caching=False)
    runner = FakeRunner(16)
    add(sched, "A", prompt(40), arrival=0, max_tokens=1)
    step(sched, runner)
    add(sched, "B", prompt(40), arrival=1, max_tokens=1)
    assert summary(step(sched, runner)) == [("B", 0, 40, 1)]


# ---- preemption --------------------------------------------------------------------------------------------

def _fill_pool(sched: Scheduler, runner: FakeRunner, a: dict, b: dict) -> tuple[Request, Request]:
    """A and B (params `a`, `b`), 7-token prompts, take 2 of the 4 blocks each; next step both need a third."""
    req_a = add(sched, "A", prompt(7), arrival=0, **a)[0]
    req_b = add(sched, "B", prompt(7, 200), arrival=1, **b)[0]
    # sorted: under the priority policy B may be admitted first
    assert sorted(summary(step(sched, runner))) == [("A", 0, 7, 1), ("B", 0, 7, 1)]
    assert sorted(summary(step(sched, runner))) == [("A", 7, 1, 1), ("B", 7, 1, 1)]  # position 7: block 2 of 2
    assert sched.kv.num_free_blocks == 0
    return req_a, req_b


def test_preemption_takes_the_latest_arrival_and_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_blocks=4, block_size=4, caching=False)
    runner = FakeRunner(4)
    a, b = _fill_pool(sched, runner, a={"max_tokens": 3}, b={"max_tokens": 4})
    b_tokens = list(b.all_token_ids)
    assert len(b_tokens) == 9

    out = sched.schedule()  # A needs a block for position 8: B (arrived last) is preempted by recompute
    assert out.preempted_req_ids == ["B"]
    assert summary(out) == [("A", 8, 1, 1)]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.kv.get_block_ids("B") == [] and sched.kv.num_free_blocks == 1
    assert ids(sched.waiting) == ["B"] and ids(sched.running) == ["A"]
    sched.update(out, runner.execute(out, sched.requests))
    assert a.is_finished  # max_tokens=3: its blocks are back

    out = step(sched, runner)  # B comes back and recomputes its prompt and its two outputs
    assert summary(out) == [("B", 0, 9, 1)]
    assert out.scheduled[0].token_ids == b_tokens
    assert b.status == RequestStatus.RUNNING and b.num_output_tokens == 3
    assert sched.num_preemptions == 1


def test_preempted_request_goes_to_the_front_of_the_waiting_queue():
    sched = make_scheduler(num_blocks=4, block_size=4, caching=False)
    runner = FakeRunner(4)
    _fill_pool(sched, runner, a={"max_tokens": 8}, b={"max_tokens": 8})
    add(sched, "C", prompt(2, 300), arrival=2, max_tokens=1)
    out = sched.schedule()
    assert out.preempted_req_ids == ["B"]
    assert ids(sched.waiting) == ["B", "C"]


def test_priority_preemption_takes_the_lowest_priority_even_if_it_arrived_first():
    sched = make_scheduler(num_blocks=4, block_size=4, caching=False, policy="priority")
    runner = FakeRunner(4)
    a, b = _fill_pool(sched, runner, a={"priority": 1, "max_tokens": 8}, b={"priority": 0, "max_tokens": 3})
    add(sched, "C", prompt(3, 300), arrival=2, priority=0, max_tokens=1)  # fits in the block A frees

    out = sched.schedule()
    assert out.preempted_req_ids == ["A"]
    assert summary(out) == [("B", 8, 1, 1)]  # and C is not admitted in a step that preempted
    assert a.status == RequestStatus.PREEMPTED and sched.kv.num_free_blocks == 1
    assert ids(sched.waiting) == ["C", "A"]  # priority order, not the front
    sched.update(out, runner.execute(out, sched.requests))

    assert summary(step(sched, runner)) == [("C", 0, 3, 1), ("A", 0, 9, 1)]  # B finished; C first by priority


def test_preempting_an_already_scheduled_request_refunds_its_budget():
    # Priority: A (low priority) runs ahead of B in the running list, so A is scheduled before B runs out
    # of blocks; A is then preempted and its tokens leave the batch.
    sched = make_scheduler(num_blocks=4, block_size=4, caching=False, policy="priority", budget=64)
    runner = FakeRunner(4)
    a = add(sched, "A", prompt(6), arrival=0, priority=1, max_tokens=8)[0]
    assert summary(step(sched, runner)) == [("A", 0, 6, 1)]  # blocks 0, 1
    add(sched, "B", prompt(8, 200), arrival=1, priority=0, max_tokens=8)
    assert summary(step(sched, runner)) == [("A", 6, 1, 1), ("B", 0, 8, 1)]  # B: blocks 2, 3
    out = sched.schedule()  # A: position 7 fits in block 1; B: position 8 needs a block -> A goes
    assert out.preempted_req_ids == ["A"]
    assert summary(out) == [("B", 8, 1, 1)] and out.num_batched_tokens == 1
    assert a.num_computed_tokens == 0 and sched.kv.num_free_blocks == 1


def test_preempted_request_that_was_scheduled_in_the_same_step_leaves_no_uncomputed_block_in_the_prefix_cache():
    """A request preempted after it was scheduled in the same step never runs that step's chunk, so the
    blocks that chunk filled must not be prefix-cache hits afterwards (they hold no KV).

    X (n = 2) forks after its prompt, so its second sample lands in the running list behind Y, which
    arrived later. Next step Y's last prompt chunk (positions 4..9) is scheduled and fills Y's block 3; then
    X#1 needs a block, Y (the latest arrival) is preempted and its chunk dropped. When Y comes back its
    prefix lookup must not count positions 4..7 as computed.
    """
    sched = make_scheduler(num_blocks=5, block_size=4, budget=8, max_model_len=32)
    runner = FakeRunner(4)
    add(sched, "X", [1, 2, 3, 4], arrival=0, n=2, max_tokens=2)
    y = add(sched, "Y", prompt(10), arrival=1, max_tokens=1)[0]
    assert summary(step(sched, runner)) == [("X", 0, 4, 2), ("Y", 0, 4, 0)]
    assert ids(sched.running) == ["X", "Y", "X#1"]
    out = step(sched, runner)
    assert out.preempted_req_ids == ["Y"]
    assert summary(out) == [("X", 4, 1, 1), ("X#1", 4, 1, 1)]
    assert not sched.running  # X and X#1 reached max_tokens=2

    out = sched.schedule()
    assert [s.req_id for s in out.scheduled] == ["Y"]
    assert out.scheduled[0].num_computed_tokens == 4, (
        "Y was re-admitted with positions 4..7 counted as cached, but the chunk that would have computed them "
        "was dropped when Y was preempted in the step that scheduled it")
    runner.execute(out, sched.requests)  # the shadow cache agrees: nothing stale is read
    assert y.status == RequestStatus.RUNNING


# ---- n > 1 -------------------------------------------------------------------------------------------------

def test_fork_shares_the_prompt_blocks_and_copies_the_partial_last_block_on_write():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=4)
    runner = FakeRunner(4)
    x, x1, x2 = add(sched, "X", prompt(6), arrival=0, n=3, max_tokens=4)
    assert summary(step(sched, runner)) == [("X", 0, 4, 0)]  # a chunk short of the end samples nothing
    assert x1.status == RequestStatus.WAITING and not sched.kv.get_block_ids("X#1")
    out = sched.schedule()
    assert summary(out) == [("X", 4, 2, 3)]  # the chunk that completes the prompt samples all n
    result = runner.execute(out, sched.requests)
    touched = sched.update(out, result)
    assert ids(touched) == ["X#1", "X#2", "X"]
    assert [r.output_token_ids for r in (x, x1, x2)] == [[t] for t in result.sampled_token_ids["X"]]
    assert ids(sched.running) == ["X", "X#1", "X#2"]
    assert all(r.status == RequestStatus.RUNNING and r.num_computed_tokens == 6 for r in (x1, x2))
    assert [sched.kv.get_block_ids(r) for r in ("X", "X#1", "X#2")] == [[0, 1]] * 3
    assert [sched.kv.block_pool.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]

    out = sched.schedule()  # position 6 is written into block 1 by all three
    assert out.block_copies == [(1, 2), (1, 3)]  # X and X#1 copy; X#2 then holds block 1 alone
    assert [s.block_ids for s in out.scheduled] == [[0, 2], [0, 3], [0, 1]]
    assert [sched.kv.block_pool.blocks[i].ref_cnt for i in range(4)] == [3, 1, 1, 1]
    sched.update(out, runner.execute(out, sched.requests))
    assert step(sched, runner).block_copies == []  # nothing shared is written any more


def test_fork_at_a_block_boundary_needs_no_copy():
    sched = make_scheduler(num_blocks=16, block_size=4)
    runner = FakeRunner(4)
    add(sched, "X", prompt(8), arrival=0, n=2, max_tokens=4)
    assert summary(step(sched, runner)) == [("X", 0, 8, 2)]
    out = step(sched, runner)
    assert out.block_copies == []
    assert [s.block_ids for s in out.scheduled] == [[0, 1, 2], [0, 1, 3]]


def test_max_num_seqs_limits_admission_but_forks_may_exceed_it():
    # Admission checks len(running) < max_num_seqs, forked samples included; forks join in update() without
    # a check, so a group admitted as the max_num_seqs-th request takes the running list to max + n - 1.
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(4)
    add(sched, "A", prompt(4), arrival=0, max_tokens=2)
    add(sched, "X", prompt(4, 200), arrival=1, n=3, max_tokens=3)
    add(sched, "W", prompt(4, 300), arrival=2, max_tokens=1)
    assert summary(step(sched, runner)) == [("A", 0, 4, 1), ("X", 0, 4, 3)]
    assert ids(sched.running) == ["A", "X", "X#1", "X#2"]  # 4 > max_num_seqs
    assert [s.req_id for s in step(sched, runner).scheduled] == ["A", "X", "X#1", "X#2"]  # W waits
    assert ids(sched.running) == ["X", "X#1", "X#2"]  # A finished: still 3 >= 2
    assert [s.req_id for s in step(sched, runner).scheduled] == ["X", "X#1", "X#2"]
    assert summary(step(sched, runner)) == [("W", 0, 4, 1)]


# ---- finishing ---------------------------------------------------------------------------------------------

def test_abort_frees_blocks_wherever_the_request_is():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=8)
    runner = FakeRunner(4)
    add(sched, "A", prompt(6), arrival=0, max_tokens=8)
    x = add(sched, "X", prompt(12, 200), arrival=1, n=3, max_tokens=8)  # chunked: forks still pending
    w = add(sched, "W", prompt(4, 300), arrival=2, max_tokens=8)[0]
    assert summary(step(sched, runner)) == [("A", 0, 6, 1), ("X", 0, 2, 0)]
    assert ids(sched.waiting) == ["W"]

    sched.finish_request("W", RequestStatus.FINISHED_ABORTED)
    assert w.status == RequestStatus.FINISHED_ABORTED and not sched.waiting

    sched.finish_request("X", RequestStatus.FINISHED_ABORTED)  # its pending samples die with it
    assert [r.status for r in x] == [RequestStatus.FINISHED_ABORTED] * 3
    assert not sched.pending_forks and ids(sched.running) == ["A"]
    assert sched.kv.num_free_blocks == 16 - 2

    sched.finish_request("A", RequestStatus.FINISHED_ABORTED)
    assert sched.kv.num_free_blocks == 16 and not sched.has_unfinished()
    assert sched.schedule().is_empty
    sched.finish_request("A", RequestStatus.FINISHED_STOPPED)  # finishing twice changes nothing
    assert sched.requests["A"].status == RequestStatus.FINISHED_ABORTED


def test_aborting_a_forked_parent_leaves_its_samples_running_on_the_shared_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4)
    runner = FakeRunner(4)
    x, x1 = add(sched, "X", prompt(6), arrival=0, n=2, max_tokens=8)
    step(sched, runner)
    sched.finish_request("X", RequestStatus.FINISHED_ABORTED)
    assert x1.status == RequestStatus.RUNNING and ids(sched.running) == ["X#1"]
    assert [sched.kv.block_pool.blocks[i].ref_cnt for i in sched.kv.get_block_ids("X#1")] == [1, 1]
    assert sched.kv.num_free_blocks == 14
    out = step(sched, runner)
    assert summary(out) == [("X#1", 6, 1, 1)] and out.block_copies == []


def test_aborting_one_pending_sample_keeps_it_finished_when_its_parent_forks():
    """finish_request works "wherever the request is", including a sample still waiting for its parent's
    prompt: when the parent completes it must not be forked back to life."""
    sched = make_scheduler(budget=4)
    runner = FakeRunner(4)
    x, x1, x2 = add(sched, "X", prompt(6), arrival=0, n=3, max_tokens=3)
    step(sched, runner)  # prompt chunk 0..3: the samples are still pending
    sched.finish_request("X#1", RequestStatus.FINISHED_ABORTED)
    assert x1.status == RequestStatus.FINISHED_ABORTED
    step(sched, runner)  # the prompt completes and X forks
    assert x1.status == RequestStatus.FINISHED_ABORTED and x1.output_token_ids == []
    assert ids(sched.running) == ["X", "X#2"]


def test_abort_while_the_step_runs_drops_its_result():
    sched = make_scheduler()
    runner = FakeRunner(4)
    a = add(sched, "A", prompt(5), arrival=0, max_tokens=8)[0]
    out = sched.schedule()
    result = runner.execute(out, sched.requests)
    sched.finish_request("A", RequestStatus.FINISHED_ABORTED)
    assert sched.update(out, result) == []
    assert a.output_token_ids == [] and sched.kv.num_free_blocks == 64


EOS = 2


def _run_scripted(tokens: list[int], *, max_model_len: int = 64, **params) -> Request:
    sched = make_scheduler(max_model_len=max_model_len)
    runner = ScriptedRunner({"R": tokens})
    req = add(sched, "R", prompt(8), arrival=0, eos=(EOS,), **params)[0]
    while sched.has_unfinished():
        step(sched, runner)
    assert sched.kv.num_free_blocks == 64
    return req


@pytest.mark.parametrize(("tokens", "params", "outputs", "status", "stop_reason"), [
    ([5, EOS, 6], {}, [5, EOS], RequestStatus.FINISHED_STOPPED, None),
    ([5, EOS, 6, 7], {"ignore_eos": True, "max_tokens": 4}, [5, EOS, 6, 7], RequestStatus.FINISHED_LENGTH_CAPPED,
     None),
    ([5, 9, 6], {"stop_token_ids": [9]}, [5, 9], RequestStatus.FINISHED_STOPPED, 9),
    ([5, 9, 6], {"stop_token_ids": [9], "ignore_eos": True}, [5, 9], RequestStatus.FINISHED_STOPPED, 9),
    ([5, 6, 7, 8], {"max_tokens": 3}, [5, 6, 7], RequestStatus.FINISHED_LENGTH_CAPPED, None),
    # min_tokens: a stop token ends the request only once it has min_tokens outputs, counting the stop token
    # itself (vLLM's check; the sampler bans stop tokens before that, so a real run never sees the first EOS)
    ([EOS, 5, 6, 7], {"min_tokens": 3}, [EOS, 5, 6, 7], RequestStatus.FINISHED_LENGTH_CAPPED, None),
    ([EOS, 5, EOS, 6], {"min_tokens": 3}, [EOS, 5, EOS], RequestStatus.FINISHED_STOPPED, None),
    ([EOS, EOS, 6], {"min_tokens": 2}, [EOS, EOS], RequestStatus.FINISHED_STOPPED, None),
    ([9, 9, 5], {"min_tokens": 2, "stop_token_ids": [9]}, [9, 9], RequestStatus.FINISHED_STOPPED, 9),
    ([EOS, 6], {"max_tokens": 1}, [EOS], RequestStatus.FINISHED_STOPPED, None),  # both: the stop wins
])
def test_stop_conditions(tokens, params, outputs, status, stop_reason):
    params.setdefault("max_tokens", 4)
    req = _run_scripted(tokens, **params)
    assert req.output_token_ids == outputs
    assert req.status == status and req.stop_reason == stop_reason


def test_max_model_len_caps_prompt_plus_outputs():
    req = _run_scripted([5, 6, 7, 8], max_model_len=10, max_tokens=None)
    assert req.output_token_ids == [5, 6] and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


# ---- randomized property test ------------------------------------------------------------------------------

VOCAB = 32
RANDOM_EOS = 1


def reference_outputs(req: Request, max_model_len: int) -> tuple[list[int], RequestStatus]:
    """What the fake runner produces for one sample run alone, with the stop rules written out again."""
    params = req.sampling_params
    kv = kv_chain(req.prompt_token_ids)[-1]
    token = sample_token(kv, req.sample_index, VOCAB)  # the fork draws sample k from the prompt's last row
    outputs: list[int] = []
    while True:
        outputs.append(token)
        n = len(outputs)
        if n >= params.min_tokens and ((not params.ignore_eos and token in req.eos_token_ids)
                                       or token in params.stop_token_ids):
            return outputs, RequestStatus.FINISHED_STOPPED
        if (params.max_tokens is not None and n >= params.max_tokens) or req.num_prompt_tokens + n >= max_model_len:
            return outputs, RequestStatus.FINISHED_LENGTH_CAPPED
        kv = kv_value(kv, token)
        token = sample_token(kv, 0, VOCAB)


def check_pool(sched: Scheduler) -> None:
    """Every block is free xor referenced, ref counts equal the number of tables holding it, nothing leaks."""
    kv = sched.kv
    pool = kv.block_pool
    tables = kv._req_to_blocks  # the manager's own tables: the only complete list of who holds what
    holders = Counter(block.block_id for blocks in tables.values() for block in blocks)
    free = set(pool.free_block_ids())
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}: ref_cnt != number of holders"
        assert (block.block_id in free) == (block.ref_cnt == 0), f"block {block.block_id} free and referenced"
    assert len(free) + len(holders) == pool.num_blocks
    assert set(tables) == {r.request_id for r in sched.running}, "a request that is not running holds blocks"


def run_random_workload(seed: int) -> int:
    """Random arrivals, aborts and limits against one scheduler; checks invariants every step. Returns steps."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    max_model_len = rng.randint(12, 40)
    chunked = rng.random() < 0.75
    budget = rng.randint(3, 24) if chunked else rng.randint(max_model_len, max_model_len + 10)
    max_num_seqs = rng.randint(1, 6)
    min_blocks = -(-max_model_len // bs)  # the pool must hold one request of max_model_len tokens
    num_blocks = min_blocks + rng.randint(0, min_blocks)
    sched = make_scheduler(num_blocks=num_blocks, block_size=bs, budget=budget, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len, chunked=chunked, policy=rng.choice(["fcfs", "priority"]),
                           caching=rng.random() < 0.8)
    runner = FakeRunner(bs, VOCAB)
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, max_model_len - 2))] for _ in range(3)]
    num_requests = 30
    groups: list[list[Request]] = []
    cut_short: set[str] = set()  # finished by the test (abort, stop string): outputs are a prefix
    step_no = 0
    max_steps = 3000

    def abort_group(group: list[Request]) -> None:
        """Abort a whole user request as LLMEngine.abort_request does: the first sample, then its forks."""
        for r in group:
            cut_short.add(r.request_id)
            sched.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)

    while len(groups) < num_requests or sched.has_unfinished():
        step_no += 1
        assert step_no <= max_steps, f"seed {seed}: no end after {max_steps} steps (starvation or livelock)"
        for _ in range(rng.choice([0, 0, 0, 1, 2])):
            if len(groups) == num_requests:
                break
            length = rng.randint(1, max_model_len - 1)
            if rng.random() < 0.6:
                head = rng.choice(prefixes)[:length]
                tokens = head + [rng.randrange(VOCAB) for _ in range(length - len(head))]
            else:
                tokens = [rng.randrange(VOCAB) for _ in range(length)]
            min_tokens = rng.choice([0, 0, 0, 2])
            max_tokens = rng.choice([None, rng.randint(max(1, min_tokens), 12)])
            groups.append(add(sched, f"r{len(groups)}", tokens, arrival=step_no + 0.1 * len(groups),
                              priority=rng.randint(0, 3), eos=(RANDOM_EOS,), n=rng.choice([1, 1, 2, 3]),
                              max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=rng.random() < 0.2,
                              stop_token_ids=rng.choice([None, [rng.randrange(VOCAB)]])))
        if rng.random() < 0.03:
            live = [g for g in groups if not all(r.is_finished for r in g)]
            if live:
                abort_group(rng.choice(live))
        talking = [r for r in sched.running if r.num_output_tokens]  # the engine detokenizes only these
        if rng.random() < 0.03 and talking:  # one sample matched a stop string
            r = rng.choice(talking)
            cut_short.add(r.request_id)
            sched.finish_request(r.request_id, RequestStatus.FINISHED_STOPPED)

        was_running = {r.request_id for r in sched.running}
        had_work = sched.has_unfinished()
        out = sched.schedule()
        assert out.scheduled or not had_work, f"seed {seed}: empty step with requests waiting"
        assert out.num_batched_tokens == sum(len(s.token_ids) for s in out.scheduled) <= budget
        scheduled_ids = [s.req_id for s in out.scheduled]
        assert len(set(scheduled_ids)) == len(scheduled_ids)
        assert not set(out.preempted_req_ids) & set(scheduled_ids)
        admitted = [s for s in out.scheduled if s.req_id not in was_running]
        if out.preempted_req_ids:
            assert not admitted, "a waiting request was admitted in a step that preempted"
        if admitted:
            assert len(sched.running) <= max_num_seqs
        if not chunked:
            for s in admitted:
                assert s.num_computed_tokens + len(s.token_ids) == sched.requests[s.req_id].num_tokens
        for s in out.scheduled:
            assert s.block_ids == sched.kv.get_block_ids(s.req_id)
        result = runner.execute(out, sched.requests)
        if rng.random() < 0.02 and out.scheduled:  # aborted while the step ran
            victim = sched.requests[rng.choice(out.scheduled).req_id]
            abort_group(groups[int((victim.parent_id or victim.request_id)[1:])])
        sched.update(out, result)

        check_pool(sched)
        running_ids = {r.request_id for r in sched.running}
        assert len(running_ids) == len(sched.running) and not running_ids & {r.request_id for r in sched.waiting}
        # max_num_seqs is checked at admission only; forks join the running list in update() without a check,
        # so the rule is: requests that are not forked samples never exceed max_num_seqs.
        assert sum(1 for r in sched.running if r.parent_id is None) <= max_num_seqs
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
            assert r.num_computed_tokens < r.num_tokens <= max_model_len
            assert sched.kv.get_num_blocks(r.request_id) * bs >= r.num_computed_tokens
            runner.check_computed(r, sched.kv.get_block_ids(r.request_id), r.num_computed_tokens)
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and r.num_computed_tokens == 0

    assert sched.kv.num_free_blocks == num_blocks
    assert not sched.running and not sched.waiting and not sched.pending_forks
    for group in groups:
        for r in group:
            want, status = reference_outputs(r, max_model_len)
            if r.request_id in cut_short:
                assert r.is_finished and r.output_token_ids == want[:r.num_output_tokens], f"seed {seed}: {r}"
            else:
                assert (r.output_token_ids, r.status) == (want, status), f"seed {seed}: {r} differs from alone"
    return step_no


@pytest.mark.parametrize("first_seed", range(0, 160, 20))
def test_random_workload_keeps_invariants_and_outputs(first_seed):
    # ~20 workloads of ~150 steps each per case (~0.4 s): some 20,000 steps in all, with thousands of
    # preemptions, prefix hits and forks. A failure names its seed: rerun run_random_workload(seed) alone.
    for seed in range(first_seed, first_seed + 20):
        try:
            run_random_workload(seed)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
