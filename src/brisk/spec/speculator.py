"""The engine's side of speculative decoding: before each step, draft for the requests that are decoding; after
it, learn from what the verifier accepted. Everything in between is ordinary scheduling (drafts are a
request's extra tokens, see Scheduler.schedule) and one batched forward (ModelRunner verifies k + 1 rows)."""

from __future__ import annotations

from dataclasses import dataclass

from brisk.engine.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from brisk.ops.linear import MAX_SMALL_M
from brisk.spec.adaptive import AdaptiveGamma, StepCostModel
from brisk.spec.proposer import Proposer


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

    def propose(self, scheduler: Scheduler) -> None:
        live = scheduler.requests
        gone = {r for r in self.proposer.live_ids() | self.gamma.live_ids() if r not in live}
        if gone:
            self.proposer.free(gone)
            self.gamma.forget(gone)
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
            if self.proposer.tree:  # a tree's size is its own (the static tree's best nodes), not a chain's γ
                k = 0 if busy else min(self.gamma.max_gamma, room)
            else:
                k = 0 if busy else min(self.gamma.gamma(req.request_id, cost), room)
            if k > 0:
                reqs.append(req)
                ks.append(k)
        if reqs:
            drafts = self.proposer.propose(reqs, ks)
            if self.proposer.forward_seconds > 0.0:  # a draft model's forward, catch-up prefill excluded
                self.costs.observe_draft(self.proposer.forward_seconds)
            for req, draft in zip(reqs, drafts, strict=True):
                req.spec_token_ids = draft.token_ids
                req.spec_draft_probs = draft.probs
                req.spec_tree_parents = draft.parents
        self.costs.start()  # the target step that follows: schedule, forward, verify

    def observe(self, sched: SchedulerOutput, result: RunnerOutput, scheduler: Scheduler) -> None:
        # Only decode/verify steps teach the cost model: a prefill chunk's tokens are far cheaper per token
        # (one GEMM over many rows), and mixing them in made the fitted per-token cost so small that drafts
        # looked free at batch 8, where verification is in fact compute-bound on a CPU.
        if all(len(s.token_ids) == 1 + s.num_draft_tokens for s in sched.scheduled):
            self.costs.stop(sched.num_batched_tokens)
        else:
            self.costs.cancel()
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
        finished = {s.req_id for s in sched.scheduled
                    if (req := scheduler.requests.get(s.req_id)) is None or req.is_finished}
        if finished:  # free a draft model's KV now rather than at the next step
            self.proposer.free(finished)
            self.gamma.forget(finished)

    def reset_stats(self) -> SpecStats:
        stats, self.stats = self.stats, SpecStats()
        return stats
