"""Prompt lookup decoding (apoorvumang/prompt-lookup-decoding; HF `prompt_lookup_num_tokens`, vLLM ngram).

No model: for n = prompt_lookup_max down to prompt_lookup_min, take the last n tokens, find their most recent
earlier occurrence in prompt + output, and propose the tokens that followed it. Pays off when the output
copies from the input (quoting, extraction, editing code) or repeats itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from brisk.engine.request import Request
from brisk.spec.proposer import Draft, Proposer


def find_continuation(tokens: np.ndarray, max_n: int, min_n: int, k: int) -> list[int]:
    """The up-to-k tokens after the latest earlier occurrence of the longest matching suffix (n in [min_n, max_n]).

        tokens:  ... a b c [x y z] ... a b c          suffix "a b c" (n = 3) matched at i; propose x y z
                           ^ i + n
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # windows starting at 0 .. length - n - 1: every earlier occurrence, not the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer(Proposer):
    name = "ngram"
    draft_cost = 0.0

    def __init__(self, prompt_lookup_max: int = 4, prompt_lookup_min: int = 1) -> None:
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[Draft]:
        return [Draft(find_continuation(np.asarray(r.all_token_ids, dtype=np.int64), self.max_n, self.min_n, k))
                for r, k in zip(requests, num_drafts, strict=True)]
