"""Iteration-level continuous batching over the paged KV cache.

Messages to the runner and back are plain data (ids, ints, lists): `SchedulerOutput`, `RunnerOutput`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from brisk.engine.config import SchedulerConfig
from brisk.engine.pooling import PoolingParams
from brisk.engine.request import Request, RequestStatus
from brisk.kvcache.manager import KVCacheManager


@dataclass
class ScheduledRequest:
    req_id: str
    token_ids: list[int]  # tokens to compute this step: all_token_ids[num_computed_tokens : + len]
    num_computed_tokens: int  # position of token_ids[0]
    block_ids: list[int]  # the request's whole block table after allocation
    num_samples: int  # tokens to sample from the last row: 0 for a prefill chunk short of the end; n at a fork
    # speculative drafts at the end of token_ids: the last num_draft_tokens + 1 rows are verified together
    num_draft_tokens: int = 0
    # entries in the request's cache before this step, where token_ids[0]'s K/V goes: num_computed_tokens
    # (None) unless an H2O compaction dropped some (kvcache/manager.py)
    cache_len: int | None = None
    # the drafts form a token tree (engine/token_tree.py): each draft's parent, an index into the drafts or -1 for the
    # last real token; None = a chain
    tree_parents: list[int] | None = None
    # a prefill-only request (engine/pooling.py): what the runner pools of its rows; None for every other request
    pooling: PoolingParams | None = None
    pool_end: bool = False  # (pooling) this chunk ends the prompt: the request's result is made this step


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before the step
    preempted_req_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    # H2O compactions (kvcache/manager.py _compact): K/V of every layer moved src -> dst slot, before the copies
    kv_moves: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    # requests whose blocks were freed since the last step (finished, aborted, preempted): the runner drops
    # any per-request state it keeps (H2O scores)
    freed_req_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)  # req_id -> new tokens
    logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # req_id -> one dict per token
    # req_id -> the target's argmax after each prefix of the verified drafts (len(drafts) + 1 tokens, penalties
    # applied): what lookahead decoding's Jacobi iteration continues from (spec/lookahead.py)
    draft_predictions: dict[str, list[int]] = field(default_factory=dict)
    # H2O: req_id -> cache entries to keep (ascending), for requests whose cache outgrew the policy's keep
    kept_entries: dict[str, list[int]] = field(default_factory=dict)
    # jump-forward decoding (structured/runner.py): req_id -> tokens appended after its sampled ones with no forward
    # pass; their KV is computed by the next step, as a multi-token chunk
    forced_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # prefill-only requests whose last token was computed this step: req_id -> the embedding, or [P(yes)]
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    kv_usage: float = 0.0  # fraction of blocks referenced
    kv_slots_used: int = 0  # token slots holding computed KV
    kv_slots_allocated: int = 0  # token slots in allocated blocks
    prefix_queries: int = 0
    prefix_hits: int = 0
    kv_offload: dict[str, int] | None = None  # the disk tier's counters (kvcache/offload.py), None: no tier


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # n > 1: samples 1..n-1 wait here until their parent's prompt is computed, then fork from it
        self.pending_forks: dict[str, list[Request]] = {}
        self.num_preemptions = 0
        self._freed_req_ids: list[str] = []

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request, forks: list[Request] | None = None) -> None:
        self.requests[request.request_id] = request
        if forks:
            self.pending_forks[request.request_id] = forks
            for child in forks:
                self.requests[child.request_id] = child
        if self.config.policy == "priority":
            self._insert_by_priority(request)
        else:
            self.waiting.append(request)

    def _insert_by_priority(self, request: Request) -> None:
        key = (request.priority, request.arrival_time)
        for i, other in enumerate(self.waiting):
            if key < (other.priority, other.arrival_time):
                self.waiting.insert(i, request)
                return
        self.waiting.append(request)

    def finish_request(self, req_id: str, status: RequestStatus) -> None:
        """Finish (abort, or stop on a stop string) a request wherever it is; frees its blocks at once."""
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self._freed_req_ids.append(req_id)
        for child in self.pending_forks.pop(req_id, []):  # samples not yet forked die with their parent
            child.status = status

    def remove_finished(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.requests.pop(req_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Spend one token budget: running requests first, then waiting ones.

        Every request just has tokens not yet computed (num_tokens - num_computed_tokens): a whole prompt, the
        rest of a chunked prompt, one decode token, or everything again after preemption. Giving each request
        min(that, what is left of the budget) yields chunked prefill; prefix-cache hits simply start a waiting
        request with num_computed_tokens > 0. When blocks run out, the lowest-priority (latest-arrived) running
        request is preempted by recompute: its blocks are freed and it goes back to the front of the queue.
        Speculative drafts are just more tokens of a running request's chunk: they take budget and slots like
        any other token, and are dropped (never preempting anyone) when either runs short. An H2O compaction due
        after the last step is done by the request's allocation (kvcache/manager.py), its K/V moves carried to
        the runner in `kv_moves`.
        """
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted_now = False

        copies_of: dict[str, list[tuple[int, int]]] = {}
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            assert num_new > 0, f"{req} is running with nothing to compute"
            num_drafts = self._num_drafts(req, num_new, budget)
            copies = self.kv.allocate_slots(req, num_new + num_drafts)
            if copies is None and num_drafts:
                num_drafts = 0
                copies = self.kv.allocate_slots(req, num_new)
            while copies is None:
                victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
                victim_index = self.running.index(victim)
                self._preempt(victim, out)
                preempted_now = True
                dropped = scheduled.pop(victim.request_id, None)
                copies_of.pop(victim.request_id, None)
                if dropped is not None:
                    budget += len(dropped.token_ids)
                if victim is req:
                    break
                if victim_index < i:
                    i -= 1
                copies = self.kv.allocate_slots(req, num_new)
            if copies is None:  # the request itself was preempted; self.running shrank at index i
                continue
            copies_of[req.request_id] = copies
            scheduled[req.request_id] = self._scheduled(req, req.num_computed_tokens, num_new, num_drafts)
            budget -= num_new + num_drafts
            i += 1

        # Waiting requests join only if nothing was preempted this step (it would just be preempted again).
        while self.waiting and budget > 0 and not preempted_now and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit_blocks, num_hit = [], 0
            if req.num_computed_tokens == 0 and req.pooling is None:  # pooling reads every row's hidden state
                hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            copies = self.kv.allocate_slots(req, num_new, hit_blocks, num_hit)
            if copies is None:
                break
            self.waiting.popleft()
            if req.status == RequestStatus.WAITING:
                req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self.running.append(req)
            copies_of[req.request_id] = copies
            scheduled[req.request_id] = self._scheduled(req, num_hit, num_new)
            budget -= num_new

        out.scheduled = list(scheduled.values())
        out.block_copies = [c for copies in copies_of.values() for c in copies]
        out.num_batched_tokens = sum(len(s.token_ids) for s in out.scheduled)
        out.kv_moves = self.kv.take_kv_moves()
        out.freed_req_ids, self._freed_req_ids = self._freed_req_ids, []
        return out

    def _num_drafts(self, req: Request, num_new: int, budget: int) -> int:
        """How many of the request's drafts ride along with this chunk: only a chunk that reaches the end of
        its tokens, within the budget, and never more than could be emitted before max_tokens/max_model_len
        (a step emits up to num_drafts + 1 tokens)."""
        if not req.spec_token_ids or req.num_computed_tokens + num_new != req.num_tokens or req.pooling is not None:
            return 0
        if req.request_id in self.pending_forks:
            return 0
        room = self.config.max_model_len - req.num_tokens - 1
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - req.num_output_tokens - 1)
        return max(0, min(len(req.spec_token_ids), budget - num_new, room))

    def _scheduled(self, req: Request, start: int, num_new: int, num_drafts: int = 0) -> ScheduledRequest:
        reaches_end = start + num_new == req.num_tokens
        num_samples = 0
        if reaches_end and req.pooling is None:
            num_samples = 1 + len(self.pending_forks.get(req.request_id, ()))
        token_ids = req.all_token_ids[start:start + num_new] + req.spec_token_ids[:num_drafts]
        # a tree cut to its first num_drafts nodes stays a tree: parents come before their children
        parents = req.spec_tree_parents[:num_drafts] if num_drafts and req.spec_tree_parents is not None else None
        return ScheduledRequest(req.request_id, token_ids, start, self.kv.get_block_ids(req.request_id), num_samples,
                                num_drafts, self.kv.get_num_cache_entries(req), parents, req.pooling,
                                req.pooling is not None and reaches_end)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        self._freed_req_ids.append(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.spec_draft_probs = None
        victim.spec_tree_parents = None
        victim.spec_hidden = None
        victim.pool_state = None  # recomputed from the first row
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_req_ids.append(victim.request_id)
        if self.config.policy == "priority":
            self._insert_by_priority(victim)
        else:
            self.waiting.appendleft(victim)

    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, fork n > 1 samples, finish and free what is done.

        Returns the requests that received tokens or finished this step (forked samples included).
        """
        touched: list[Request] = []
        for s in sched.scheduled:
            req = self.requests.get(s.req_id)
            if req is None or req.is_finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += len(s.token_ids) - s.num_draft_tokens
            kept = result.kept_entries.get(s.req_id)
            if kept is not None:  # H2O: compacted before the request's next allocation
                self.kv.schedule_compaction(req, kept)
            if req.pooling is not None:  # prefill-only: done (and its blocks freed) once its last token ran
                pooled = result.pooled.get(s.req_id)
                if pooled is not None:
                    req.pooled = pooled
                    self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                    touched.append(req)
                continue
            tokens = result.sampled_token_ids.get(s.req_id)
            if not tokens:
                continue
            logprobs = result.logprobs.get(s.req_id)
            if s.num_draft_tokens:
                self._append_verified(req, tokens, logprobs)
                self._append_forced(req, result.forced_token_ids.get(s.req_id))
                touched.append(req)
                continue
            forks = self.pending_forks.pop(s.req_id, [])
            for k, child in enumerate(forks, start=1):
                if child.is_finished:  # this sample was aborted before its prompt finished
                    continue
                child.all_token_ids = list(req.all_token_ids)
                child.num_computed_tokens = req.num_computed_tokens
                child.num_cached_tokens = req.num_cached_tokens
                child.status = RequestStatus.RUNNING
                self.kv.fork(req, child)
                self._append(child, tokens[k], logprobs[k] if logprobs else None)
                self.running.append(child)
                self._append_forced(child, result.forced_token_ids.get(child.request_id))
                touched.append(child)
            self._append(req, tokens[0], logprobs[0] if logprobs else None)
            self._append_forced(req, result.forced_token_ids.get(s.req_id))
            touched.append(req)
        for req in touched:
            if req.status == RequestStatus.RUNNING:
                self._check_stop(req)
        return touched

    def _append_verified(self, req: Request, tokens: list[int], logprobs: list[dict[int, float]] | None) -> None:
        """A verification step emitted the accepted drafts and one more token.

            before:  | computed | last token | d_1 ... d_k |      (KV written for all of them this step)
            after:   | computed + last + accepted d_1..d_a | new token |   (KV of d_a+1..d_k is garbage)

        The accepted drafts' KV is valid, so they count as computed; the rejected ones' slots are simply
        overwritten by later tokens, and blocks past the new last token are freed. None of those blocks was
        ever registered in the prefix cache (only blocks full of real tokens are). Tokens are appended one by
        one with the stop check after each, so an EOS among the accepted drafts ends the request there.
        """
        req.spec_token_ids = []
        req.spec_draft_probs = None
        req.spec_tree_parents = None
        req.num_computed_tokens += len(tokens) - 1
        for j, token in enumerate(tokens):
            self._append(req, token, logprobs[j] if logprobs else None)
            self._check_stop(req)
            if req.is_finished:
                return
        self.kv.free_blocks_beyond(req, req.num_tokens)

    def _append_forced(self, req: Request, forced: list[int] | None) -> None:
        """Jump-forward tokens after the sampled one: appended one by one with the stop check after each (so
        max_tokens caps them), not computed (the next step's chunk computes their KV)."""
        if not forced or req.status != RequestStatus.RUNNING:
            return
        self._check_stop(req)
        for token in forced:
            if req.is_finished:
                return
            req.append_output_token_ids(token)
            self._check_stop(req)

    def _append(self, req: Request, token: int, logprobs: dict[int, float] | None) -> None:
        req.append_output_token_ids(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)

    def _check_stop(self, req: Request) -> None:
        params = req.sampling_params
        token = req.output_token_ids[-1]
        status = None
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif params.stop_token_ids and token in params.stop_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
        if status is None and ((params.max_tokens is not None and req.num_output_tokens >= params.max_tokens)
                               or req.num_tokens >= self.config.max_model_len):
            status = RequestStatus.FINISHED_LENGTH_CAPPED
        if status is not None:
            self.finish_request(req.request_id, status)

    def stats(self) -> SchedulerStats:
        q = self.kv.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_preemptions=self.num_preemptions,
            kv_usage=self.kv.usage, kv_slots_used=self.kv.num_slots_in_use(),
            kv_slots_allocated=self.kv.num_slots_allocated(), prefix_queries=q.queries, prefix_hits=q.hits)
