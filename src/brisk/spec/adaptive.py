"""Adaptive γ: per request, draft as many tokens as pay off given its recent acceptance rate.

With per-draft acceptance rate α, a step with γ drafts emits E(γ) = (1 - α^(γ+1)) / (1 - α) tokens
(Leviathan et al., eq. 1) and costs 1 + γ·c target-decode-steps, c = the draft cost of one token plus the
extra cost of verifying it in the target's forward. γ = argmax E(γ) / (1 + γ·c) over 0..max (γ = 0: plain
decoding, ratio 1). α is estimated from the request's own history as a decayed Bernoulli rate: a step that
accepts a of k drafts contributes a successes out of a + (1 if a < k) trials (the trials it actually made).
A request at γ = 0 probes with one draft every `probe_every` steps, so a text that turns repetitive later is
noticed.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens one verification step emits (accepted drafts + 1)."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


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


class AdaptiveGamma:
    def __init__(self, max_gamma: int, cost_per_draft: float, adaptive: bool = True, prior_alpha: float = 0.6,
                 prior_weight: float = 2.0, decay: float = 0.8, probe_every: int = 8) -> None:
        self.max_gamma = max_gamma
        self.cost_per_draft = cost_per_draft
        self.adaptive = adaptive
        self.prior = (prior_alpha * prior_weight, prior_weight)
        self.decay = decay
        self.probe_every = probe_every
        self._est: dict[str, _Estimate] = {}

    def alpha(self, req_id: str) -> float:
        est = self._est.get(req_id)
        return self.prior[0] / self.prior[1] if est is None else est.successes / est.trials

    def gamma(self, req_id: str) -> int:
        if not self.adaptive:
            return self.max_gamma
        gamma = best_gamma(self.alpha(req_id), self.cost_per_draft, self.max_gamma)
        if gamma == 0:
            est = self._est.setdefault(req_id, _Estimate(*self.prior))
            est.steps_at_zero += 1
            if est.steps_at_zero >= self.probe_every:
                est.steps_at_zero = 0
                return 1
        return gamma

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
