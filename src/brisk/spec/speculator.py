"""The engine's side of speculative decoding: before each step, draft for the requests that are decoding; after
it, learn from what the verifier accepted. Everything in between is ordinary scheduling (drafts are a
request's extra tokens, see Scheduler.schedule) and one batched forward (ModelRunner verifies k + 1 rows)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from brisk.engine.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from brisk.ops.linear import MAX_SMALL_M
from brisk.spec.adaptive import AdaptiveGamma, StepCostModel, TreeSizer, follow_low
from brisk.spec.proposer import Draft, Proposer

if TYPE_CHECKING:
    from brisk.engine.request import Request


@dataclass
class SpecStats:
    num_verify_steps: int = 0  # request-steps that verified at least one draft
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens emitted by verify steps (accepted + one each)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        """Accepted drafts per verifying request-step (the tokens emitted per step are this plus one)."""
        return self.num_accepted_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


STEP_DECAY = 0.9  # of the whole-step sums that compare tree steps with plain ones: about the last ten steps


class Speculator:
    def __init__(self, proposer: Proposer, max_gamma: int, adaptive: bool = True,
                 verify_cost: float = 0.08, disable_by_batch_size: int | None = None) -> None:
        """`verify_cost`: a static estimate of one more verified token's cost relative to a one-token decode step
        (0.05-0.08 measured at batch 1 on the default model on CPU); only a fallback, since propose() passes the
        measured, batch-aware cost of StepCostModel."""
        self.proposer = proposer
        self.gamma = AdaptiveGamma(max_gamma, proposer.draft_cost + verify_cost, adaptive)
        self.costs = StepCostModel(split=MAX_SMALL_M)
        self.stats = SpecStats()
        self.disable_by_batch_size = disable_by_batch_size
        # token trees (tree proposers): per-request drafting and tree sizes from measured acceptance and step costs
        self.trees = TreeSizer()
        self.tree_draft_seconds = 0.0  # drafting seconds per request-tree (decayed mean of measured propose calls)
        self._node_probs: dict[str, list[float]] = {}  # each request's verified tree's node probabilities
        # whole decode steps as measured, per number of decoding requests, with trees and without: decayed sums of
        # (seconds, emitted tokens) from the start of drafting to the end of verification (everything a tree step
        # costs, whatever the step model leaves out, against plain steps timed the same way)
        self.whole_steps: dict[bool, dict[int, tuple[float, float]]] = {True: {}, False: {}}
        self._cycle: tuple[float, int, bool] | None = None  # (start, decoding requests, trees?) of the step under way

    def tree_losing(self, num_decoding: int) -> bool:
        """Whether tree steps at this batch size measured slower per token than plain ones (both measured):
        seconds per token as the ratio of the decayed sums (a mean of per-step ratios would weigh a rejected
        tree's one-token step far above an accepted tree's several)."""
        tree, plain = self.whole_steps[True].get(num_decoding), self.whole_steps[False].get(num_decoding)
        return tree is not None and plain is not None and tree[0] / tree[1] > plain[0] / plain[1]

    def propose(self, scheduler: Scheduler) -> None:
        started = time.perf_counter()
        self._cycle = None
        live = scheduler.requests
        gone = {r for r in self.proposer.live_ids() | self.gamma.live_ids() | self.trees.live_ids() if r not in live}
        if gone:
            self._forget(gone)
        reqs, ks = [], []
        ready = [r for r in scheduler.running if r.num_computed_tokens == r.num_tokens - 1]
        busy = (self.disable_by_batch_size is not None
                and len(scheduler.running) + len(scheduler.waiting) > self.disable_by_batch_size)
        # several requests decoding, and no plain step of that size timed yet: run one first, so that drafting is
        # priced against a measured plain step (adaptive.StepCostModel.cost_per_draft)
        if len(ready) > 1 and self.gamma.adaptive and not self.costs.knows(len(ready)):
            busy = True
        # measured cost of one more draft per decoding request (batch-aware: see adaptive.StepCostModel);
        # until a draft model has been timed, its static estimate stands in for its share
        cost = self.costs.cost_per_draft(max(1, len(ready)))
        if self.costs.draft_seconds == 0.0:
            cost += self.proposer.draft_cost
        for req in scheduler.running:
            req.spec_token_ids = []
            req.spec_draft_probs = None
            req.spec_tree_parents = None
            if req.num_computed_tokens != req.num_tokens - 1:
                continue  # still in prefill: it has no last token to continue from yet
            params = req.sampling_params
            room = scheduler.config.max_model_len - req.num_tokens - 1
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - req.num_output_tokens - 1)
            if self.proposer.tree:  # a tree's size is chosen after drafting (TreeSizer), not a chain's γ
                most = min(self.gamma.max_gamma, room)
                wants = not self.gamma.adaptive or self.trees.wants(
                    req.request_id, self.costs, len(ready), self.tree_draft_seconds, most,
                    self.tree_losing(len(ready)))
                k = 0 if busy or not wants else (self.trees.draft_size(req.request_id, most) if self.gamma.adaptive
                                                 else most)
            else:
                k = 0 if busy else min(self.gamma.gamma(req.request_id, cost), room)
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if reqs and self.proposer.tree and self.gamma.adaptive:
            chosen = set(self.trees.choose([r.request_id for r in reqs], self.costs, len(ready)))
            pairs = [(r, k) for r, k in zip(reqs, ks, strict=True) if r.request_id in chosen]
            reqs, ks = [r for r, _ in pairs], [k for _, k in pairs]
        if reqs:
            t0 = time.perf_counter()
            drafts = self.proposer.propose(reqs, ks)
            if self.proposer.forward_seconds > 0.0:  # a draft model's forward, catch-up prefill excluded
                self.costs.observe_draft(self.proposer.forward_seconds)
            if self.proposer.tree:
                self._size_trees(reqs, drafts, len(ready), time.perf_counter() - t0)
            for req, draft in zip(reqs, drafts, strict=True):
                req.spec_token_ids = draft.token_ids
                req.spec_draft_probs = draft.probs
                req.spec_tree_parents = draft.parents
        if self.proposer.tree and ready:
            self._cycle = (started, len(ready), bool(reqs))  # drafted: a tree step, even one cut to no nodes
        self.costs.start()  # the target step that follows: schedule, forward, verify

    def _size_trees(self, reqs: list[Request], drafts: list[Draft], num_decoding: int, seconds: float) -> None:
        """Cut each drafted tree to the nodes that pay (TreeSizer.sizes) and time the drafting."""
        self.tree_draft_seconds = follow_low(self.tree_draft_seconds, seconds / len(reqs))
        sized = [j for j, d in enumerate(drafts) if d.node_probs is not None and d.token_ids]
        if not self.gamma.adaptive or not sized:
            for j in sized:
                self._node_probs[reqs[j].request_id] = drafts[j].node_probs
            return
        counts = self.trees.sizes([reqs[j].request_id for j in sized], [drafts[j].node_probs for j in sized],
                                  self.costs, num_decoding)
        for j, n in zip(sized, counts, strict=True):
            d, rid = drafts[j], reqs[j].request_id
            d.token_ids, d.parents, d.node_probs = d.token_ids[:n], d.parents[:n], d.node_probs[:n]
            if n == 0:  # drafted, but no node pays: counts as a tree step that gained nothing
                self.trees.update(rid, 0, 0, 0.0)
            self._node_probs[rid] = d.node_probs

    def observe(self, sched: SchedulerOutput, result: RunnerOutput, scheduler: Scheduler) -> None:
        # Only decode/verify steps teach the cost model: a prefill chunk's tokens are far cheaper per token
        # (one GEMM over many rows), and mixing them in made the fitted per-token cost so small that drafts
        # looked free at batch 8, where verification is in fact compute-bound on a CPU.
        decode_only = all(len(s.token_ids) == 1 + s.num_draft_tokens for s in sched.scheduled)
        if decode_only:
            self.costs.stop(sched.num_batched_tokens)
        else:
            self.costs.cancel()
        if self._cycle is not None and decode_only:  # a whole decode step: its seconds per emitted token
            started, b, trees = self._cycle
            emitted = sum(len(result.sampled_token_ids.get(s.req_id, ())) for s in sched.scheduled)
            if emitted:
                seconds, tokens = self.whole_steps[trees].get(b, (0.0, 0.0))
                self.whole_steps[trees][b] = (STEP_DECAY * seconds + time.perf_counter() - started,
                                               STEP_DECAY * tokens + emitted)
        self._cycle = None
        for s in sched.scheduled:
            if not s.num_draft_tokens or s.req_id not in result.sampled_token_ids:
                continue
            tokens = result.sampled_token_ids[s.req_id]
            emitted = len(tokens)
            req = scheduler.requests.get(s.req_id)
            if req is not None and s.req_id in result.draft_predictions:
                self.proposer.observe(req, s.token_ids[len(s.token_ids) - s.num_draft_tokens:],
                                      result.draft_predictions[s.req_id], tokens)
            self.stats.num_verify_steps += 1
            self.stats.num_draft_tokens += s.num_draft_tokens
            self.stats.num_accepted_tokens += emitted - 1
            self.stats.num_emitted_tokens += emitted
            self.gamma.update(s.req_id, s.num_draft_tokens, emitted - 1)
            probs = self._node_probs.pop(s.req_id, None)
            if s.tree_parents is not None and probs is not None:
                self.trees.update(s.req_id, s.num_draft_tokens, emitted - 1, sum(probs[:s.num_draft_tokens]))
        finished = {s.req_id for s in sched.scheduled
                    if (req := scheduler.requests.get(s.req_id)) is None or req.is_finished}
        if finished:  # free a draft model's KV now rather than at the next step
            self._forget(finished)

    def _forget(self, req_ids: set[str]) -> None:
        """Free what the requests held; tree steps are timed anew for the requests that remain (whether trees pay
        depends on whose trees they are: a request that drafts well should not inherit one that did not)."""
        self.proposer.free(req_ids)
        self.gamma.forget(req_ids)
        self.trees.forget(req_ids)
        for r in req_ids:
            self._node_probs.pop(r, None)
        self.whole_steps[True].clear()

    def reset_stats(self) -> SpecStats:
        stats, self.stats = self.stats, SpecStats()
        return stats
