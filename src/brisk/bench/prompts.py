"""Benchmark prompts: token windows of real text (the bundled evaluation text; see brisk/data/README.md)."""

from __future__ import annotations

import random
from functools import cache

from brisk.data import evaluation_text_path

# Lines 10-739 of the evaluation text (chapter 1 into chapter 5): the same 40 kB every benchmark has drawn its
# prompts from, so figures taken before and after stay comparable, and tokenizing it stays quick.
BENCH_LINES = slice(9, 739)


@cache
def bench_text() -> str:
    """The benchmark prompt text: the start of the evaluation text (never the calibration one)."""
    lines = evaluation_text_path().read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(lines[BENCH_LINES])


def text_token_ids(tokenizer) -> list[int]:  # noqa: ANN001 - brisk.model.tokenizer.Tokenizer
    """The bundled text as one stream of ids (no special tokens); prompts are windows of it."""
    return tokenizer.encode(bench_text(), add_special_tokens=False)


def token_window(ids: list[int], start: int, length: int) -> list[int]:
    """`length` ids from `start`, wrapping around the end of the text (for prompts longer than it)."""
    if not ids:
        raise ValueError("the benchmark text encoded to no tokens")
    return [ids[(start + i) % len(ids)] for i in range(length)]


def make_prompt(tokenizer, ids: list[int], start: int, length: int) -> list[int]:  # noqa: ANN001
    """A prompt of exactly `length` ids, starting with BOS when the tokenizer adds one as real ones do."""
    if length < 1:
        raise ValueError(f"prompt length must be at least 1, got {length}")
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token else []
    return bos[:length] + token_window(ids, start, length - len(bos[:length]))


def sample_prompts(tokenizer, num_prompts: int, min_len: int, max_len: int,  # noqa: ANN001
                   seed: int) -> list[list[int]]:
    """`num_prompts` prompts with lengths uniform in [min_len, max_len], each from a random place in the text.

    Seeded, so brisk and a baseline (or two runs on different days) see the same prompts.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {num_prompts}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= input-len-min <= input-len-max, got {min_len} and {max_len}")
    ids = text_token_ids(tokenizer)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(min_len, max_len)
        prompts.append(make_prompt(tokenizer, ids, rng.randrange(len(ids)), length))
    return prompts
