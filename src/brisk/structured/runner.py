"""The model runner's side of structured outputs: mask the logits rows of constrained sequences, advance their
matchers with the sampled tokens, and find the tokens jump-forward decoding appends without a forward pass.

Masking happens once per step for the whole batch: every constrained row's bitmask is written into one
[R, W] int32 array, unpacked to a bool [R, V] mask and applied to the R rows in one masked_fill; rows of
unconstrained sequences are not touched (a batch without constrained rows costs one `any` over its requests).

Jump-forward (`jump_forward` setting, per request on its StructuredState):

    step t:   sample x_t under the mask -> the grammar forces bytes b (e.g. `", "order_total": `)
              -> append x_t and the tokens of b at once; they enter the KV cache with step t+1's forward,
                 which is then a multi-token chunk (like a prefill chunk) that samples from its last row.

    "auto": only tokens that are the single token the mask allows (and EOS once the grammar is complete), for
            greedy and unseeded requests without logprobs. Plain constrained greedy decoding must pick exactly
            those tokens, so the output is identical; it rarely fires inside JSON, where a key's bytes can be
            split into tokens in several ways.
    "on":   llguidance's forced tokens: the canonical tokenization of every forced byte, re-tokenized together
            with the sampled token at the boundary (`"` + `name": ` -> `"name": ` as the tokenizer would write it).
            The text is the same as plain constrained decoding's up to that point, but the model might have split
            the forced bytes differently, and what it generates afterwards can then differ.
    "off":  plain constrained decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from brisk.structured.backend import StructuredState, unpack_bitmask

if TYPE_CHECKING:
    from brisk.engine.request import Request

JUMP_FORWARD_MODES = ("auto", "on", "off")


def mask_logits(logits: torch.Tensor, states: Sequence[StructuredState | None]) -> torch.Tensor:
    """Set the logits of tokens the grammar forbids to -inf, in place, on every row i with states[i].

    logits: [B, V] float32; states: [B], None for unconstrained rows.
    """
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    bitmask = np.empty((len(rows), (vocab + 31) // 32), dtype=np.int32)  # [R, W]
    for k, i in enumerate(rows):
        states[i].fill_bitmask(bitmask[k])  # type: ignore[union-attr]
    allowed = torch.from_numpy(unpack_bitmask(bitmask, vocab))  # [R, V] bool
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed.to(logits.device),
                                                                                 float("-inf")))
    return logits


def sync_states(requests: Sequence[Request]) -> list[StructuredState | None]:
    """Each request's state, brought in line with its outputs (a no-op in the normal course of things)."""
    states = [r.structured for r in requests]
    for r, s in zip(requests, states, strict=True):
        if s is not None:
            s.sync(r.output_token_ids)
    return states


def advance(requests: Sequence[Request], sampled: list[int]) -> dict[str, list[int]]:
    """Feed each constrained request its sampled token; return req_id -> the tokens jump-forward appends after
    it. `sampled[i]` may be replaced in place, when re-tokenizing the boundary merges it with forced bytes."""
    forced: dict[str, list[int]] = {}
    for i, req in enumerate(requests):
        state = req.structured
        if state is None:
            continue
        token = sampled[i]
        ok = state.accept([token])
        assert ok, (f"{req.request_id}: the sampler chose token {token}, which its grammar forbids (the mask was "
                    "not applied, or every token was masked)")
        if token in req.eos_token_ids or state.jump_forward == "off":
            continue
        first, extra = jump_forward(state, req, token)
        sampled[i] = first
        if extra:
            forced[req.request_id] = extra
    return forced


def accept_verified(requests: Sequence[Request], emitted: Sequence[list[int]]) -> dict[str, list[int]]:
    """After verification: feed each constrained request its emitted tokens (accepted drafts + one), then
    jump forward from the last of them (whose list entry may be replaced by re-tokenization)."""
    forced: dict[str, list[int]] = {}
    for req, tokens in zip(requests, emitted, strict=True):
        state = req.structured
        if state is None or not tokens:
            continue
        ok = state.accept(tokens)
        assert ok, f"{req.request_id}: verification emitted {tokens}, which its grammar forbids"
        last = tokens[-1]
        if any(t in req.eos_token_ids for t in tokens) or state.jump_forward == "off":
            continue
        first, extra = jump_forward(state, req, last)
        tokens[-1] = first
        if extra:
            forced[req.request_id] = extra
    return forced


def mask_draft_rows(logits: torch.Tensor, requests: Sequence[Request], drafts: Sequence[list[int]]) -> None:
    """Mask the verification rows of constrained requests: row i of request j is masked by its grammar after
    drafts[j][:i]. A draft the grammar forbids has target probability 0 after masking, so the verifier rejects it
    (and emits a token the grammar allows); rows past it are never read, so they are left as they are.
    Masking the target before the acceptance test keeps speculative sampling exact for the masked distribution,
    whatever distribution the draft came from (Leviathan et al. 2023: any q works)."""
    start = 0
    for req, draft in zip(requests, drafts, strict=True):
        n = len(draft) + 1
        state = req.structured
        if state is not None:
            num_ok = state.validate(draft)  # drafts[:num_ok] are allowed; row num_ok is the last one read
            consumed = 0
            rows_states: list[StructuredState | None] = []
            for i in range(num_ok + 1):
                if i > 0:
                    state.accept([draft[i - 1]])
                    consumed += 1
                rows_states.append(_Snapshot(state))
            view = logits[start:start + num_ok + 1]
            mask_logits(view, rows_states)  # type: ignore[arg-type]
            state.rollback(consumed)
        start += n


class _Snapshot:
    """A state's bitmask taken now (the matcher moves on before the rows are masked together)."""

    def __init__(self, state: StructuredState) -> None:
        self.row = np.empty((state.compiler.vocab_size + 31) // 32, dtype=np.int32)
        state.fill_bitmask(self.row)

    def fill_bitmask(self, out: np.ndarray) -> None:
        out[:] = self.row


def jump_forward(state: StructuredState, req: Request, token: int) -> tuple[int, list[int]]:
    """(the token to emit in place of `token`, the tokens forced after it); the state has consumed `token`."""
    params = req.sampling_params
    eos = [] if params.ignore_eos or not req.eos_token_ids else [req.eos_token_ids[0]]
    forced: list[int] = []
    if state.jump_forward == "on":
        extra = state.forced_tokens()
        if extra:
            token, extra = _retokenize_boundary(state, token, extra)
            assert state.accept(extra), "llguidance's forced tokens were refused by its own matcher"
            forced.extend(extra)
    else:  # auto: single allowed tokens only
        for _ in range(64):
            if state.is_stopped:
                break
            allowed = np.flatnonzero(state.allowed())
            if len(allowed) != 1 or int(allowed[0]) in req.eos_token_ids:
                break
            assert state.accept([int(allowed[0])])
            forced.append(int(allowed[0]))
    # a complete grammar allows only EOS: end now rather than spend a forward pass on sampling it
    if eos and state.is_stopped and req.num_output_tokens + 2 + len(forced) >= params.min_tokens:
        forced.append(eos[0])
    return token, forced


def _retokenize_boundary(state: StructuredState, token: int, extra: list[int]) -> tuple[int, list[int]]:
    """Tokenize the sampled token's bytes and the forced bytes together, as the model's tokenizer would write the
    text; keep the original split where the grammar does not accept the merged one."""
    tok = state.compiler.ll_tokenizer
    text = tok.decode_bytes([token, *extra])
    merged = [int(t) for t in tok.tokenize_bytes(text)]
    if merged == [token, *extra] or not merged or tok.decode_bytes(merged) != text:
        return token, extra
    state.rollback(1)
    if state.validate(merged) == len(merged):
        assert state.accept(merged[:1])
        return merged[0], merged[1:]
    assert state.accept([token])
    return token, extra
