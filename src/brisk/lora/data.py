"""Fine-tuning data: chat-formatted JSONL with the loss on the assistant turns only (plain text: train/data.py).

One JSON object per line, OpenAI's / HF's chat format:

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}

Each conversation is rendered with the model's own chat template. The tokens of assistant message i are those
that rendering messages[:i + 1] adds to rendering messages[:i] with the generation prompt: the reply and the
template's end-of-turn token, exactly what the model must produce when served with the same template. Examples
are cut to seq_len tokens and padded at the end; every row of a batch starts at position 0, as the training
forward wants.

A row is one int64 tensor that carries the labels in its sign: token t >= 0 is a target (its logit at the position
before it is scored); -1 - t is the token t given as context only (user and system turns, the template's
markup, padding). lora/train.py `decode_labels` undoes it. The draw order is train/data.py's: a pure function of
(seed, step), so resumed runs see the batches of uninterrupted ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from brisk.model.tokenizer import Tokenizer
from brisk.train.data import TextWindows, TrainDataError


def encode_conversation(tokenizer: Tokenizer, messages: list[dict], seq_len: int) -> list[int] | None:
    """One conversation -> the signed ids of data.py's encoding (at most seq_len), or None if nothing is labelled."""
    ids = tokenizer.encode_chat(messages, add_generation_prompt=False)
    labelled = [False] * len(ids)
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        before = tokenizer.encode_chat(messages[:i], add_generation_prompt=True) if i else []
        through = tokenizer.encode_chat(messages[:i + 1], add_generation_prompt=False)
        if through[:len(before)] != before or ids[:len(through)] != through:
            raise TrainDataError("the chat template does not render a conversation as the concatenation of its "
                                 "turns, so the assistant tokens cannot be told apart; use plain text data")
        for j in range(len(before), len(through)):
            labelled[j] = True
    ids, labelled = ids[:seq_len], labelled[:seq_len]
    if not any(labelled[1:]):
        return None
    return [t if lab else -1 - t for t, lab in zip(ids, labelled, strict=True)]


class ChatExamples(TextWindows):
    """Chat conversations as fixed-length signed rows (module docstring); batches as TextWindows draws them."""

    num_labelled: int = 0

    @classmethod
    def from_jsonl(cls, path: str | Path, tokenizer: Tokenizer, seq_len: int, seed: int) -> ChatExamples:
        path = Path(path)
        if not path.is_file():
            raise TrainDataError(f"training data {path} does not exist; pass --data with a .jsonl or text file")
        pad = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
        rows, skipped, labelled = [], 0, 0
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                messages = obj["messages"]
                assert isinstance(messages, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                          for m in messages)
            except (json.JSONDecodeError, KeyError, TypeError, AssertionError):
                raise TrainDataError(f"{path}:{n}: expected a JSON object with a \"messages\" list of "
                                     "{\"role\": ..., \"content\": ...} entries") from None
            row = encode_conversation(tokenizer, messages, seq_len)
            if row is None:
                skipped += 1
                continue
            labelled += sum(1 for t in row[1:] if t >= 0)
            rows.append(row + [-1 - pad] * (seq_len - len(row)))
        if not rows:
            raise TrainDataError(f"{path} has no conversation with an assistant turn within {seq_len} tokens"
                                 + (f" ({skipped} skipped)" if skipped else ""))
        out = cls(windows=torch.tensor(rows, dtype=torch.long), seed=seed, source=path.name)
        out.num_labelled = labelled
        return out


def load_training_data(path: str | Path, tokenizer: Tokenizer, seq_len: int, seed: int) -> TextWindows:
    """A .jsonl file: chat conversations (assistant turns labelled); anything else: plain text in packed windows
    (every token labelled)."""
    if str(path).endswith(".jsonl"):
        return ChatExamples.from_jsonl(path, tokenizer, seq_len, seed)
    return TextWindows.from_file(path, tokenizer, seq_len, seed)
