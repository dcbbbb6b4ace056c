"""The proposer interface: something that drafts the next few tokens of running requests, cheaply."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from brisk.engine.request import Request


@dataclass
class Draft:
    token_ids: list[int]
    # [len(token_ids), V] the processed distributions q each token was drawn from; None = point masses
    # (a deterministic proposer, or greedy drafting for a greedy request: the verifier ignores q there)
    probs: torch.Tensor | None = None
    # a token tree (engine/token_tree.py): each token's parent, an index into token_ids or -1 for the request's last
    # token (parents first); None = a chain. Trees are verified greedily, so only greedy requests get them.
    parents: list[int] | None = None
    # a tree's estimate, per node, of the probability that the target accepts the path to it (non-increasing, so
    # every first n nodes form a tree): the speculator sizes each tree from these (spec/adaptive.py TreeSizer)
    node_probs: list[float] | None = None


class Proposer(ABC):
    """Drafts up to num_drafts[j] tokens after requests[j].all_token_ids (fewer, or none, is fine).

    `draft_cost` is one drafted token's cost relative to one target decode step: the adaptive γ controller's
    cost model (0 for prompt lookup; ~0.2-0.5 for a draft model).
    """

    name = "proposer"
    tree = False  # drafts token trees: the draft size is the tree's node count, not chosen by adaptive γ
    draft_cost = 0.0
    forward_seconds = 0.0  # a draft model's last steady-state forward (measured cost for adaptive γ); 0 = none

    @abstractmethod
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[Draft]:
        raise NotImplementedError

    def observe(self, request: Request, draft: Sequence[int], predictions: Sequence[int],  # noqa: B027
                emitted: Sequence[int]) -> None:
        """After a step verified `draft` for `request`: the target's argmax after each prefix of it
        (len(draft) + 1), and the tokens emitted (already appended). A no-op unless the proposer learns."""

    def free(self, req_ids: Iterable[str]) -> None:  # noqa: B027 - a no-op default, not abstract
        """Forget requests that left the engine (finished, aborted); proposers with per-request state free it."""

    def live_ids(self) -> set[str]:
        """Requests this proposer holds state for (freed once they leave the engine)."""
        return set()
