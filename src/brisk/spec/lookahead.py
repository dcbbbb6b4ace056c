"""Lookahead decoding (Fu et al., "Break the Sequential Dependency of LLM Inference Using Lookahead Decoding",
ICML 2024): Jacobi iterations generate n-grams, an n-gram pool keeps them, and the pool's n-grams that start with
the last token are verified as drafts. No second model.

Jacobi decoding guesses the next W tokens and runs them through the target in one forward; row i's prediction
is the next iterate of position i + 1. Positions whose guess equalled the target's prediction are final (that is
ordinary greedy verification), and the rest of the predictions become the next step's guesses, which converge
as the context firms up. Lookahead decoding keeps the n-grams that appear along these trajectories in a pool
and verifies, each step, pool n-grams that start with the current token.

Here both branches ride in the engine's ordinary verification forward (the request's draft tokens, causal
within the request; spec/speculator.py), as one chain of `k` drafts:

    draft position   1 ........ N-1 | N ................. k
    token            pool n-gram    | Jacobi guesses for those positions
                     for the last   | (the previous step's predictions,
                     token, if any  |  or pool continuations to fill)

Row i of the verify forward predicts the token after draft position i. After the step (`observe`):
  * the emitted tokens are what the verifier accepted (exact: greedy equality, or rejection sampling with
    point-mass drafts for sampled requests, engine/verify.py);
  * the predictions past the accepted prefix are the Jacobi update: they become the guesses for the positions
    after the new last token;
  * every n-gram (chain[i-N+2 .. i], prediction i) of the chain [last token, drafts] with the predictions is
    added to the pool (keyed by its first token, at most `pool_size` per key, newest first), so are the n-grams
    of the tokens actually emitted.

Differences from the paper, on purpose: the paper runs a 2D window (W positions x N-1 past iterations) and G
candidate n-grams as separate branches of one forward with a custom attention mask; brisk's verification forward
is causal per request (the same rows serve draft models and prompt lookup), so the lookahead window and the
verification candidate share one causal chain: the guesses after a candidate are conditioned on it, and are
scored (and refreshed) whether or not it is accepted. On a CPU at batch 1 the extra rows are not free (unlike
the idle FLOPs of a GPU that the paper spends), so the chain is short (num_speculative_tokens) and adaptive γ
applies as for every proposer.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from brisk.engine.request import Request
from brisk.spec.proposer import Draft, Proposer


@dataclass
class _State:
    pool: dict[int, OrderedDict[tuple[int, ...], None]] = field(default_factory=dict)  # key -> n-grams (LRU)
    guess: list[int] = field(default_factory=list)  # Jacobi guesses for the positions after `guess_at` tokens
    guess_at: int = -1  # len(all_token_ids) the guesses continue
    last_chain: list[int] = field(default_factory=list)  # [last token] + the drafts of the step in flight
    last_at: int = -1


class LookaheadProposer(Proposer):
    name = "lookahead"
    draft_cost = 0.0

    def __init__(self, ngram_size: int = 4, pool_size: int = 8, seed: int = 0) -> None:
        if ngram_size < 2:
            raise ValueError(f"lookahead ngram_size must be >= 2, got {ngram_size}")
        if pool_size < 1:
            raise ValueError(f"lookahead pool_size must be >= 1, got {pool_size}")
        self.n = ngram_size
        self.pool_size = pool_size
        self.rng = random.Random(seed)
        self.states: dict[str, _State] = {}

    # ------------------------------------------------------------------ pool

    def _add(self, state: _State, gram: Sequence[int]) -> None:
        key, rest = gram[0], tuple(gram[1:])
        entries = state.pool.setdefault(key, OrderedDict())
        entries.pop(rest, None)
        entries[rest] = None  # newest last
        while len(entries) > self.pool_size:
            entries.popitem(last=False)

    def _lookup(self, state: _State, token: int) -> list[int]:
        entries = state.pool.get(token)
        return list(next(reversed(entries))) if entries else []

    def _add_all(self, state: _State, tokens: Sequence[int]) -> None:
        for i in range(len(tokens) - self.n + 1):
            self._add(state, tokens[i:i + self.n])

    # ------------------------------------------------------------------ proposer

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[Draft]:
        out = []
        for req, k in zip(requests, num_drafts, strict=True):
            tokens = req.all_token_ids
            state = self.states.get(req.request_id)
            if state is None:
                state = self.states[req.request_id] = _State()
                self._add_all(state, tokens)  # the prompt's own n-grams seed the pool
            guess = state.guess if state.guess_at == len(tokens) else []
            draft = self._lookup(state, tokens[-1])[:k]
            # Jacobi guesses for the positions after the candidate: the previous step's predictions, else a
            # chain of pool continuations, else tokens of the context (the paper initialises from the prompt)
            while len(draft) < k:
                pos = len(draft)
                if pos < len(guess):
                    draft.append(guess[pos])
                    continue
                cont = self._lookup(state, draft[-1] if draft else tokens[-1])
                if cont:
                    draft.extend(cont[: k - len(draft)])
                else:
                    draft.append(tokens[self.rng.randrange(len(tokens))])
            state.last_chain = [tokens[-1], *draft]
            state.last_at = len(tokens)
            out.append(Draft(draft))
        return out

    def observe(self, req: Request, draft: Sequence[int], predictions: Sequence[int], emitted: Sequence[int]
                ) -> None:
        """After a verify step: `predictions[i]` is the target's argmax after draft[:i] (len(draft) + 1 of them),
        `emitted` the tokens the verifier emitted (already appended to the request)."""
        state = self.states.get(req.request_id)
        if state is None or state.last_at + len(emitted) != len(req.all_token_ids):
            return  # a step this proposer did not draft for (or a preemption in between): no trajectory
        chain = [state.last_chain[0], *draft]
        assert len(predictions) == len(chain)
        # the n-grams of the Jacobi trajectory: chain[i - n + 2 .. i] followed by its prediction
        for i in range(self.n - 2, len(chain)):
            self._add(state, [*chain[i - self.n + 2:i + 1], predictions[i]])
        # the tokens really emitted, with the context before them
        tail = req.all_token_ids[-(len(emitted) + self.n - 1):]
        self._add_all(state, tail)
        accepted = len(emitted) - 1
        state.guess = list(predictions[accepted + 1:])  # the next iterate of the positions past the new token
        state.guess_at = len(req.all_token_ids)

    def free(self, req_ids: Iterable[str]) -> None:
        for r in req_ids:
            self.states.pop(r, None)

    def live_ids(self) -> set[str]:
        return set(self.states)
