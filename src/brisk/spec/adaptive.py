"""Adaptive γ: per request, draft as many tokens as pay off given its recent acceptance rate.

With per-draft acceptance rate α, a step with γ drafts emits E(γ) = (1 - α^(γ+1)) / (1 - α) tokens
(Leviathan et al., eq. 1) and costs 1 + γ·c target-decode-steps, c = the draft cost of one token plus the
extra cost of verifying it in the target's forward. γ = argmax E(γ) / (1 + γ·c) over 0..max (γ = 0: plain
decoding, ratio 1). α is estimated from the request's own history as a decayed Bernoulli rate: a step that
accepts a of k drafts contributes a successes out of a + (1 if a < k) trials (the trials it actually made).
A request at γ = 0 probes with one draft after `probe_every` steps, so a text that turns repetitive later is
noticed; each probe that does not bring drafting back doubles the wait (up to `max_probe_every`), and the wait
is the longest one when even drafts that are always accepted could not pay (`max_speedup` below
`min_probe_speedup`: a layer-skip draft that runs 29 of 30 layers costs as much as the step it saves). Probes
cost a draft forward and a verified row; rare ones still re-measure the draft's cost.

c is not a constant: on a CPU the target step is memory-bound at batch 1 (four more tokens cost ~20% more) but
compute-bound at batch 8 (each verified token costs nearly a decode token's share). `StepCostModel` fits the
engine's measured step time as a + b * (tokens in the step) online, one line up to the small-M kernels' 8 rows and
one past them; with B requests decoding, one more draft per request costs (step(2B) - step(B)) / step(B) of a
plain step, and a draft model adds its own measured forward. With several requests decoding, the speculator first
runs one plain step of that size, so step(B) is measured, not extrapolated.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


def follow_low(current: float, sample: float) -> float:
    """A decayed mean of measured seconds that follows lower times faster than higher ones (noise on a shared CPU
    only ever adds time); 0 = nothing measured yet, so the sample stands."""
    if current == 0.0:
        return sample
    w = 0.5 if sample < current else 0.2
    return (1.0 - w) * current + w * sample


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens one verification step emits (accepted drafts + 1)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def max_speedup(cost_per_draft: float, max_gamma: int) -> float:
    """The best E(γ) / (1 + γ c) any acceptance rate could give: every draft accepted (α = 1)."""
    return max((gamma + 1.0) / (1.0 + gamma * cost_per_draft) for gamma in range(max_gamma + 1))


def best_gamma(alpha: float, cost_per_draft: float, max_gamma: int) -> int:
    """argmax over γ in [0, max_gamma] of E(γ) / (1 + γ c); ties go to the smaller γ."""
    best, best_ratio = 0, 1.0
    for gamma in range(1, max_gamma + 1):
        ratio = expected_tokens(alpha, gamma) / (1.0 + gamma * cost_per_draft)
        if ratio > best_ratio + 1e-9:
            best, best_ratio = gamma, ratio
    return best


@dataclass
class _Estimate:
    successes: float
    trials: float
    steps_at_zero: int = 0
    probe_every: int = 0  # steps at γ = 0 before the next probe (0: not set yet)


class AdaptiveGamma:
    def __init__(self, max_gamma: int, cost_per_draft: float, adaptive: bool = True, prior_alpha: float = 0.6,
                 prior_weight: float = 2.0, decay: float = 0.8, probe_every: int = 8, max_probe_every: int = 64,
                 min_probe_speedup: float = 1.1) -> None:
        self.max_gamma = max_gamma
        self.cost_per_draft = cost_per_draft
        self.adaptive = adaptive
        self.prior = (prior_alpha * prior_weight, prior_weight)
        self.decay = decay
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.min_probe_speedup = min_probe_speedup
        self._est: dict[str, _Estimate] = {}

    def alpha(self, req_id: str) -> float:
        est = self._est.get(req_id)
        return self.prior[0] / self.prior[1] if est is None else est.successes / est.trials

    def gamma(self, req_id: str, cost_per_draft: float | None = None) -> int:
        """γ for this request's next step; cost_per_draft overrides the fixed cost (the measured one)."""
        if not self.adaptive:
            return self.max_gamma
        cost = self.cost_per_draft if cost_per_draft is None else cost_per_draft
        gamma = best_gamma(self.alpha(req_id), cost, self.max_gamma)
        est = self._est.get(req_id)
        if gamma > 0:
            if est is not None:  # drafting pays again: the next stretch at zero starts probing early
                est.probe_every = self.probe_every
            return gamma
        if est is None:
            est = self._est[req_id] = _Estimate(*self.prior)
        est.probe_every = est.probe_every or self.probe_every
        if max_speedup(cost, self.max_gamma) < self.min_probe_speedup:
            # even drafts that are always accepted would not pay at this cost: probe only at the longest
            # interval, which keeps a measured draft cost from freezing (one slow forward must not end drafting)
            est.probe_every = self.max_probe_every
        est.steps_at_zero += 1
        if est.steps_at_zero >= est.probe_every:
            est.steps_at_zero = 0
            est.probe_every = min(2 * est.probe_every, self.max_probe_every)  # until a probe brings drafts back
            return 1
        return 0

    def update(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        est = self._est.setdefault(req_id, _Estimate(*self.prior))
        trials = num_accepted + (1 if num_accepted < num_drafted else 0)
        est.successes = self.decay * est.successes + num_accepted
        est.trials = self.decay * est.trials + trials

    def forget(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._est.pop(req_id, None)

    def live_ids(self) -> set[str]:
        return set(self._est)


class StepCostModel:
    """Online least squares of step seconds = a + b * num_batched_tokens, with exponential forgetting.

    With `split` = S, steps of more than S tokens get a line of their own: on a CPU the small-M kernels
    (memory-bound, S = ops.linear.MAX_SMALL_M rows) and the GEMMs past them (compute-bound) are two regimes, and
    one line fitted across both extrapolates neither (measured at 8 requests: a plain 8-row step 64 ms, while the
    line through the verification steps put it at 106 ms, which made drafting look half as dear as it was)."""

    def __init__(self, prior_fixed: float = 1.0, prior_per_token: float = 0.04, prior_weight: float = 4.0,
                 decay: float = 0.98, split: int | None = None) -> None:
        # sufficient statistics of (x = tokens, y = seconds); the prior is two virtual points on the line
        self.decay = decay
        self._n = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._scale = None  # seconds of a one-token step, set by the first observation (the prior is relative)
        self._prior = (prior_fixed, prior_per_token, prior_weight)
        self.draft_seconds = 0.0  # EMA of one draft-model forward (0 for model-free proposers, and until timed)
        self._drafts_seen = 0
        self._t0: float | None = None
        self.split = split
        self._large = StepCostModel(prior_fixed, prior_per_token, prior_weight, decay) if split else None
        self._num_large = 0  # steps past the split observed
        self._seen: set[int] = set()  # token counts of the steps observed

    def _add(self, x: float, y: float, w: float = 1.0) -> None:
        self._n += w
        self._sx += w * x
        self._sy += w * y
        self._sxx += w * x * x
        self._sxy += w * x * y

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self._seen.add(num_tokens)
        if self._large is not None and num_tokens > self.split:
            self._large.observe_step(num_tokens, seconds)
            self._num_large += 1
            return
        if self._scale is None:
            fixed, per_token, weight = self._prior
            self._scale = seconds / (fixed + per_token * num_tokens)
            for x in (1.0, 64.0):  # two virtual points pin the prior line until real spread arrives
                self._add(x, self._scale * (fixed + per_token * x), weight / 2)
        for name in ("_n", "_sx", "_sy", "_sxx", "_sxy"):
            setattr(self, name, getattr(self, name) * self.decay)
        self._add(float(num_tokens), seconds)

    def observe_draft(self, seconds_per_forward: float) -> None:
        """One steady-state draft forward's seconds. The first is dropped (it pays one-time costs: page faults
        in the draft's fresh KV pool, scratch buffers; measured at several target steps here, which priced the
        draft out for good), and the estimate follows lower times faster than higher ones (noise on a shared
        CPU only ever adds time)."""
        self._drafts_seen += 1
        if self._drafts_seen == 1:
            return
        self.draft_seconds = follow_low(self.draft_seconds, seconds_per_forward)

    def line(self) -> tuple[float, float]:
        """(a, b) in seconds; b >= 0 and a > 0 (a step always costs something fixed)."""
        if self._scale is None:
            fixed, per_token, _ = self._prior
            return fixed, per_token
        mean_x, mean_y = self._sx / self._n, self._sy / self._n
        var = self._sxx / self._n - mean_x * mean_x
        b = max(0.0, (self._sxy / self._n - mean_x * mean_y) / var) if var > 1e-9 else 0.0
        a = max(mean_y - b * mean_x, 1e-6)
        return a, b

    def knows(self, num_tokens: int) -> bool:
        """Whether a step of exactly this many tokens has been timed."""
        return num_tokens in self._seen

    def step_seconds(self, num_tokens: int) -> float:
        """A step of this many tokens: the large-step line past the split once it has two steps, else this one."""
        if self._large is not None and num_tokens > self.split and self._num_large >= 2:
            return self._large.step_seconds(num_tokens)
        a, b = self.line()
        return a + b * num_tokens

    def cost_per_draft(self, num_decoding: int) -> float:
        """Cost of one more draft for each of `num_decoding` requests, relative to a plain step of them:
        (step(2B) - step(B) + one draft forward) / step(B); on one line that is (b B + draft) / (a + b B)."""
        plain = self.step_seconds(num_decoding)
        extra = max(0.0, self.step_seconds(2 * num_decoding) - plain)
        return (extra + self.draft_seconds) / plain

    # timing helpers around one engine step
    def start(self) -> None:
        self._t0 = time.perf_counter()

    def cancel(self) -> None:
        """Drop the step being timed (it is not one the model should learn from)."""
        self._t0 = None

    def stop(self, num_tokens: int) -> None:
        if self._t0 is not None and num_tokens > 0:
            self.observe_step(num_tokens, time.perf_counter() - self._t0)
        self._t0 = None


@dataclass
class _TreeEstimate:
    accepted: float  # decayed sum of accepted drafts over this request's tree steps
    predicted: float  # decayed sum of what the drafts' node probabilities predicted for those nodes
    drafts: float  # decayed sum of drafts verified
    steps: float  # decayed count of tree steps
    steps_at_zero: int = 0
    probe_every: int = 0


def _hopeless(costs: StepCostModel, num_decoding: int, rows: int, draft_seconds: float) -> bool:
    """Whether no tree of 1..`rows` nodes could pay for its rows and drafting at this batch size even if every node
    were accepted (each accepted node saves a plain step's share per request)."""
    plain = costs.step_seconds(num_decoding)
    per_token = plain / num_decoding
    return all(n * per_token <= costs.step_seconds(num_decoding + n) - plain + draft_seconds
               for n in range(1, rows + 1))


class TreeSizer:
    """Adaptive token trees: whether a request drafts a tree this step, and how many of its nodes are verified.

    A tree proposer gives each node an estimate p_i of the probability that the target accepts the path to it
    (the product of its heads' probabilities of the candidates down the path: EAGLE-2's draft confidence),
    non-increasing in node order, so any first n nodes form a tree and verifying them
    yields sum_{i<n} p_i accepted drafts in expectation. Per request the estimates are calibrated by what
    verification measured: c = (decayed accepted) / (decayed predicted), starting at 1.

    Sizes: over the B requests decoding, the m nodes of highest c * p (a prefix of each request's tree) are kept
    for the m that maximizes tokens per second, (B + sum of their c * p) / step(B + m), with step() the engine's
    measured step time (StepCostModel, one line up to the small-row kernels' 8 rows and one past them). m = 0 is
    plain decoding: a tree that cannot pay for its rows is dropped whole.

    Drafting at all: a request drafts while its measured accepted drafts per tree step, a, would have saved more
    time than its last trees' rows and its share of the drafting cost: a * step(B) / B > step(B + n) - step(B) +
    draft seconds per request. Otherwise it decodes plainly and probes with one tree after `probe_every` steps,
    the wait doubling (up to `max_probe_every`) while probes do not bring drafting back, as AdaptiveGamma does; no
    probe at all while not even trees accepted whole could pay for their rows at this batch size (nor a first
    tree). Where whole tree steps, drafting and all, measure slower per token than plain steps, requests pause
    whatever the estimates say (costs the step model does not see). A request's first tree and its probes
    (`exploring`) are sized at face value (calibration 1) and verify at least their first node, within the
    small-row kernels' rows: the calibration learns only from verified nodes, and estimates that start too low
    would otherwise never be corrected.
    """

    def __init__(self, decay: float = 0.8, prior_weight: float = 2.0, probe_every: int = 8,
                 max_probe_every: int = 64) -> None:
        self.decay = decay
        self.prior_weight = prior_weight
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self._est: dict[str, _TreeEstimate] = {}
        self._probing: set[str] = set()

    def exploring(self, req_id: str) -> bool:
        """Whether this request's tree is verified whole: it has no measured tree step yet, or it is probing."""
        est = self._est.get(req_id)
        return est is None or est.steps < 1e-9 or req_id in self._probing

    def draft_size(self, req_id: str, most: int) -> int:
        """Nodes to draft: twice the recent verified size plus two (room to grow; a dynamic tree's drafting costs
        rounds per node), all `most` while exploring."""
        est = self._est.get(req_id)
        if self.exploring(req_id) or est is None:
            return most
        return min(most, 2 + math.ceil(2.0 * est.drafts / est.steps))

    def calibration(self, req_id: str) -> float:
        est = self._est.get(req_id)
        if est is None:
            return 1.0
        return (est.accepted + self.prior_weight) / (est.predicted + self.prior_weight)

    def wants(self, req_id: str, costs: StepCostModel, num_decoding: int, draft_seconds: float, most: int = 8,
              losing: bool = False) -> bool:
        """Whether this request drafts a tree for the next step (see the class docstring). `most`: the most nodes
        its tree may have; `losing`: tree steps at this batch size measured slower per token than plain ones
        (Speculator.tree_losing), which overrides the estimate: the request pauses and probes."""
        self._probing.discard(req_id)
        est = self._est.get(req_id)
        b = max(1, num_decoding)
        if est is None or est.steps < 1e-9:
            # a first tree, unless no tree of up to `most` nodes could pay even if all were accepted (as measured:
            # until steps past the small-row kernels are timed, their line extends the small steps' one)
            return not _hopeless(costs, b, max(1, most), draft_seconds)
        plain = costs.step_seconds(b)
        rows = max(1, round(est.drafts / est.steps))
        saved = est.accepted / est.steps * plain / b
        spent = max(0.0, costs.step_seconds(b + rows) - plain) + draft_seconds
        if saved > spent and not losing:
            est.steps_at_zero = 0
            est.probe_every = self.probe_every
            return True
        est.probe_every = est.probe_every or self.probe_every
        if _hopeless(costs, b, rows, draft_seconds):
            # not even trees accepted whole would pay at this batch size: no probe either (each would cost a dear
            # step); probing resumes once the batch is small enough for a tree to pay
            est.steps_at_zero = 0
            return False
        est.steps_at_zero += 1
        if est.steps_at_zero >= est.probe_every:
            est.steps_at_zero = 0
            est.probe_every = min(2 * est.probe_every, self.max_probe_every)
            self._probing.add(req_id)
            return True
        return False

    def choose(self, req_ids: list[str], costs: StepCostModel, num_decoding: int) -> list[str]:
        """Of the requests that want a tree this step (`wants`), those that draft one. Each decides alone, but
        their rows add up: where a row past the small-row kernels cannot pay (as measured) and the batch leaves
        room for fewer first nodes than there are trees, only that many draft, those that accepted most per tree
        step first (a request not measured yet counts one); the others' drafting would be spent on nodes that
        `sizes` then drops."""
        b = max(1, num_decoding)
        if costs.split is None or b > costs.split or len(req_ids) <= costs.split - b \
                or not _hopeless(costs, costs.split, 1, 0.0):
            return req_ids
        return sorted(req_ids, key=lambda r: -self._accepted_per_step(r))[:costs.split - b]

    def _accepted_per_step(self, req_id: str) -> float:
        est = self._est.get(req_id)
        return est.accepted / est.steps if est is not None and est.steps > 1e-9 else 1.0

    def sizes(self, req_ids: list[str], node_probs: list[list[float]], costs: StepCostModel,
              num_decoding: int) -> list[int]:
        """How many of each tree's first nodes to verify (see the class docstring); an exploring request's tree at
        least its first node, at face value."""
        exploring = [self.exploring(r) for r in req_ids]
        b = max(1, num_decoding)
        # exploring trees: their estimates at face value (no calibration yet, or a probe), at least their first
        # node, and no more nodes than keep the step within the small-row kernels (past them a row costs several
        # times more): the calibration needs verified nodes, not a dear step
        cap = max(1, ((costs.split or 1 << 30) - b) // max(1, sum(exploring)))
        first = [1 if e and probs else 0 for probs, e in zip(node_probs, exploring, strict=True)]
        values = sorted(((p if e else self.calibration(r) * p, j)
                         for j, (r, probs, e) in enumerate(zip(req_ids, node_probs, exploring, strict=True))
                         for p in probs[first[j]:(cap if e else len(probs))]),
                        key=lambda vj: -vj[0])  # stable: a tree's nodes stay in order
        rows = b + sum(first)
        tokens = b + sum(probs[0] for probs, f in zip(node_probs, first, strict=True) if f)
        best_m, best = 0, tokens / costs.step_seconds(rows)
        for m, (v, _) in enumerate(values, start=1):
            tokens += v
            rate = tokens / costs.step_seconds(rows + m)
            if rate > best * (1.0 + 1e-9):
                best_m, best = m, rate
        counts = first
        for _, j in values[:best_m]:
            counts[j] += 1
        return counts

    def update(self, req_id: str, num_drafted: int, num_accepted: int, predicted: float) -> None:
        est = self._est.setdefault(req_id, _TreeEstimate(0.0, 0.0, 0.0, 0.0))
        d = self.decay
        est.accepted = d * est.accepted + num_accepted
        est.predicted = d * est.predicted + predicted
        est.drafts = d * est.drafts + num_drafted
        est.steps = d * est.steps + 1.0

    def forget(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            self._est.pop(req_id, None)
            self._probing.discard(req_id)

    def live_ids(self) -> set[str]:
        return set(self._est)
