"""Verification of drafted tokens: exact speculative sampling (Leviathan et al., ICML 2023, Algorithm 1;
Chen et al. 2023) and its greedy special case.

A request with γ drafts x_1..x_γ gets γ + 1 target rows from one forward: row i is p_i(·), the target's
distribution for the token after x_1..x_{i-1}. With q_i the draft distribution that x_i was drawn from:

    for i = 1..γ:
        r ~ U(0, 1)
        if r < p_i(x_i) / q_i(x_i):  accept x_i, continue                  (probability min(1, p/q))
        else:                        emit y ~ norm(max(0, p_i - q_i)), stop  (the residual distribution)
    all γ accepted:                  emit y ~ p_{γ+1}                      (the bonus token)

Each emitted token is then distributed exactly as p (Leviathan et al., Theorem 3.5). A proposer with no
distribution (prompt lookup, layer skip at greedy) proposes a point mass: q_i = one-hot(x_i), so the
acceptance probability is p_i(x_i) and the residual is p_i with x_i removed, renormalised.

Greedy rows accept while x_i == argmax p_i and emit argmax p_i at the first mismatch (or p_{γ+1}'s argmax),
which is token-for-token plain greedy decoding.

p and q must be the *processed* distributions the engine samples from — min_tokens ban, penalties,
temperature, min_p, top-k, top-p, in the sampler's order — or the result is not exact. `processed_logits`
and `probs_from_processed` below apply that pipeline; proposers that keep q call them with the same
SamplingMetadata rows (one per drafted position) as the verifier. Row i's penalties see the output tokens
plus x_1..x_{i-1}, exactly as a plain decode at that position would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from brisk.engine.sampler import (
    SamplingMetadata,
    apply_min_p,
    apply_min_tokens_mask,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    gather_logprobs,
    random_sample,
)
from brisk.engine.sampling_params import SAMPLING_EPS

if TYPE_CHECKING:
    from brisk.engine.request import Request


def position_metadata(requests: Sequence[Request], num_positions: Sequence[int], drafts: Sequence[list[int]],
                      *, vocab_size: int, device: torch.device | str = "cpu") -> SamplingMetadata:
    """Sampling rows for `num_positions[j]` consecutive positions of request j, drafts[j] filling the gaps.

    Row i of request j samples the token after output_token_ids + drafts[j][:i]: its penalties and min_tokens
    count see those drafts as already generated, as a plain decode at that position would.
    """
    params, outputs, prompts, gens, eos = [], [], [], {}, []
    for req, n, draft in zip(requests, num_positions, drafts, strict=True):
        assert n <= len(draft) + 1, f"{n} positions but only {len(draft)} drafts for {req.request_id}"
        for i in range(n):
            if req.generator is not None:
                gens[len(params)] = req.generator
            params.append(req.sampling_params)
            outputs.append(req.output_token_ids + draft[:i])
            prompts.append(req.prompt_token_ids)
            eos.append(req.eos_token_ids)
    return SamplingMetadata.from_params(params, outputs, prompts, gens, vocab_size=vocab_size, eos_token_ids=eos,
                                        device=device)


def processed_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Raw logits [R, V] -> after the min_tokens ban and penalties: greedy rows take their argmax here."""
    logits = logits.float()
    if meta.min_tokens_banned:
        logits = apply_min_tokens_mask(logits, meta.min_tokens_banned)
    if not meta.no_penalties:
        logits = apply_penalties(logits, meta.prompt_token_ids, meta.output_token_ids, meta.presence_penalty,
                                 meta.frequency_penalty, meta.repetition_penalty)
    return logits


def probs_from_processed(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalized logits [R, V] -> the distribution a random row samples from: temperature, min_p, top-k/p."""
    logits = apply_temperature(logits, meta.temperature)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return torch.softmax(logits, dim=-1)


def uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def draw_token(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [V] distribution, by the engine's own sampler (exponential race)."""
    row = probs.unsqueeze(0).clone()  # [1, V]; random_sample divides in place
    return int(random_sample(row, {0: generator} if generator is not None else {})[0])


def accept_greedy(draft_token_ids: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Greedy verification: the accepted drafts, then the target's own token at the first mismatch (or the
    bonus argmax). target_argmax has len(draft_token_ids) + 1 entries."""
    assert len(target_argmax) == len(draft_token_ids) + 1
    out: list[int] = []
    for x, best in zip(draft_token_ids, target_argmax, strict=False):
        if x != best:
            break
        out.append(x)
    out.append(int(target_argmax[len(out)]))
    return out


def accept(draft_token_ids: Sequence[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
           generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling for one request: the emitted tokens (accepted drafts + one more), 1..γ+1 of them.

    draft_probs: [γ, V] the q_i each draft was drawn from, or None for point-mass drafts.
    target_probs: [γ + 1, V] the processed target distributions p_1..p_{γ+1}.
    """
    num_drafts = len(draft_token_ids)
    assert target_probs.shape[0] == num_drafts + 1, (
        f"{num_drafts} drafts need {num_drafts + 1} target rows, got {target_probs.shape[0]}")
    out: list[int] = []
    for i, x in enumerate(draft_token_ids):
        p = target_probs[i]
        px = float(p[x])
        qx = 1.0 if draft_probs is None else float(draft_probs[i, x])
        # r < p/q  <=>  r * q < p; a draft the proposer could not have drawn (q = 0) is never accepted
        if qx > 0.0 and uniform(generator) * qx < px:
            out.append(x)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min_(0.0)
        # Zero residual mass means p <= q everywhere, i.e. p == q: then x was accepted with probability 1
        # unless numerics said otherwise; sampling from p itself is the exact limit.
        out.append(draw_token(residual if float(residual.sum()) > 0.0 else p, generator))
        return out
    out.append(draw_token(target_probs[num_drafts], generator))
    return out


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per request: accepted drafts + one (correction or bonus)
    logprobs: list[list[dict[int, float]] | None]  # per request, per emitted token, when asked
    predictions: list[list[int]]  # per request, the argmax of each verified row (penalties applied)


def verify(logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[list[int]],
           draft_probs: Sequence[torch.Tensor | None]) -> VerifyOutput:
    """Verify a batch: logits [R, V] hold len(drafts[j]) + 1 consecutive rows per request j, in order."""
    num_rows = [len(d) + 1 for d in drafts]
    assert logits.shape[0] == sum(num_rows), f"{logits.shape[0]} logits rows for {sum(num_rows)} positions"
    meta = position_metadata(requests, num_rows, drafts, vocab_size=logits.shape[1], device=logits.device)
    penalized = processed_logits(logits, meta)  # [R, V]
    greedy = penalized.argmax(dim=-1).tolist()  # greedy rows' tokens; every row's Jacobi prediction
    probs = probs_from_processed(penalized, meta) if not meta.all_greedy else None
    temps = meta.temperature.tolist()
    tokens: list[list[int]] = []
    start = 0
    for req, draft, q, n in zip(requests, drafts, draft_probs, num_rows, strict=True):
        if temps[start] < SAMPLING_EPS:
            tokens.append(accept_greedy(draft, greedy[start:start + n]))
        else:
            tokens.append(accept(draft, q, probs[start:start + n], req.generator))
        start += n
    logprobs: list[list[dict[int, float]] | None] = [None] * len(requests)
    if meta.max_num_logprobs is not None:
        # the raw model logprobs of each emitted token at its own row (rows of one request are consecutive)
        rows, sampled, wanted = [], [], []
        start = 0
        for toks, n, req in zip(tokens, num_rows, requests, strict=True):
            rows.extend(range(start, start + len(toks)))
            sampled.extend(toks)
            wanted.extend([req.sampling_params.logprobs] * len(toks))
            start += n
        raw = torch.log_softmax(logits.float().index_select(0, torch.tensor(rows)), dim=-1)
        lps = gather_logprobs(raw, torch.tensor(sampled), wanted, meta.max_num_logprobs)
        at = 0
        for j, toks in enumerate(tokens):
            if requests[j].sampling_params.logprobs is not None:
                logprobs[j] = [d for d in lps[at:at + len(toks)] if d is not None]
            at += len(toks)
    predictions, start = [], 0
    for n in num_rows:
        predictions.append(greedy[start:start + n])
        start += n
    return VerifyOutput(tokens, logprobs, predictions)
