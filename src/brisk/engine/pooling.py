"""Prefill-only requests: an embedding (the final-norm hidden states pooled over the prompt's rows) or a yes/no
score, computed by the engine's own steps and finished at the end of the prompt, without sampling.

A pooling request is scheduled as any prompt (chunked, batched with the other requests of the step) but:

    scheduler   never starts from a prefix-cache hit (every row's hidden state is needed), samples nothing,
                and finishes the request (its KV blocks freed at once) in the step that computes its last token
    runner      the executor hands back the final hidden state of the rows each pooling request needs
                (executor.pool_rows), which accumulate on the request across chunks (mean: their sum; cls: the
                first row; last: the last one); a score request's last row gets logits like a sampled one
    output      RequestOutput.pooled: the vector (L2-normalised when asked), or [P(yes)] for a score request
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from brisk.model.pooling import POOLING_TYPES


@dataclass(frozen=True)
class PoolingParams:
    """What a pooling request returns. pooling: last | mean | cls over the prompt's rows; normalize: L2-normalise
    the vector. score_token_ids (yes, no): instead of a vector, softmax over those two tokens' logits at the last
    row, [P(yes)] (a decoder LLM as reranker, as Qwen3-Reranker scores)."""

    pooling: str = "last"
    normalize: bool = True
    score_token_ids: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}; got {self.pooling!r}")

    def rows(self, start: int, num: int, reaches_end: bool) -> list[int]:
        """Of a chunk of `num` rows starting at position `start`, the ones this pooling reads."""
        if self.score_token_ids is not None:
            return []  # the last row's logits, not its hidden state
        if self.pooling == "mean":
            return list(range(num))
        if self.pooling == "cls":
            return [0] if start == 0 else []
        return [num - 1] if reaches_end else []


def accumulate(params: PoolingParams, state: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """The request's running pooled state after a chunk's rows [n, hidden] (float32): the sum (mean), the first
    row (cls), the last row (last)."""
    if not rows.shape[0]:
        return state
    rows = rows.float()
    if params.pooling == "mean":
        total = rows.sum(0)
        return total if state is None else state + total
    if params.pooling == "cls":
        return rows[0].clone() if state is None else state
    return rows[-1].clone()


def finish(params: PoolingParams, state: torch.Tensor, num_tokens: int) -> list[float]:
    """The embedding of a request whose last token was just computed."""
    vec = state / num_tokens if params.pooling == "mean" else state
    if params.normalize:
        vec = torch.nn.functional.normalize(vec, dim=-1)
    return vec.tolist()


def yes_probability(logits: torch.Tensor, yes_no: tuple[int, int]) -> float:
    """softmax over the logits of the yes and no tokens: P(yes)."""
    pair = logits.float()[list(yes_no)]
    return float(torch.softmax(pair, dim=-1)[0])


# A decoder LLM as reranker (Qwen3-Reranker's recipe): the query and a document in a chat the model answers with
# "yes" or "no"; the score is P(yes) from those two tokens' logits at the last prompt position.
RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                 'Note that the answer can only be "yes" or "no".')
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# (Qwen3-Reranker's own user turn is "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"; small
# chat models judge better asked plainly, so this is the default; --rerank-template gives the exact one)
RERANK_USER = "Query: {query}\nDocument: {document}\nDoes the document answer the query? Answer yes or no."
# without a chat template, or as the default of --rerank-template's placeholders
PLAIN_RERANK_TEMPLATE = RERANK_SYSTEM + "\n" + RERANK_USER + "\nAnswer (yes or no):"


class YesNoScorer:
    """Prompts and the (yes, no) token pair of yes/no-logit scoring for one tokenizer. `template`: a text with
    {query} and {document} (and optionally {instruction}) tokenized as it is; None: the model's chat template over
    RERANK_SYSTEM + RERANK_USER with the generation prompt (PLAIN_RERANK_TEMPLATE where the model has none)."""

    def __init__(self, tokenizer: Any, template: str | None = None, instruction: str = RERANK_INSTRUCTION) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.instruction = instruction
        yes = tokenizer.encode("yes", add_special_tokens=False)
        no = tokenizer.encode("no", add_special_tokens=False)
        self.token_ids: tuple[int, int] | None = (yes[0], no[0]) if yes and no and yes[0] != no[0] else None

    def prompt_ids(self, query: str, document: str) -> list[int]:
        fields = {"instruction": self.instruction, "query": query, "document": document}
        tok = self.tokenizer
        if self.template is not None:
            return tok.encode(self.template.format(**fields))
        if tok.chat_template is None:
            return tok.encode(PLAIN_RERANK_TEMPLATE.format(**fields))
        return tok.encode_chat([{"role": "system", "content": RERANK_SYSTEM},
                                {"role": "user", "content": RERANK_USER.format(**fields)}],
                               add_generation_prompt=True)

    def params(self) -> PoolingParams:
        if self.token_ids is None:
            raise ValueError("this model's tokenizer has no distinct single tokens starting 'yes' and 'no', which "
                             "yes/no scoring reads; score by embedding similarity instead (--task embed)")
        return PoolingParams(score_token_ids=self.token_ids)


def default_pooling(model_path: Any) -> str:
    """The pooling a model's files state (model/pooling.py), else last (as vLLM and llama.cpp pool causal LMs)."""
    from brisk.model.pooling import read_model_pooling

    return read_model_pooling(model_path).pooling or "last"


def cosine(a: list[float], b: list[float]) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0))
