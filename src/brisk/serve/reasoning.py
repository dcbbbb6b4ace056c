"""Reasoning models: the text a model writes between `<think>` and `</think>` is its reasoning, sent to the client
as `message.reasoning_content` (and `message.reasoning`, the newer name) and never as `content` (vLLM's
`--reasoning-parser`).

    parser        reasoning                                                 no `</think>` in the answer
    deepseek_r1   everything before the first `</think>`; a `<think>` the    all reasoning (cut by max_tokens)
                  model writes first is dropped (the template may have
                  opened it in the prompt: DeepSeek-R1, QwQ, Qwen3-Thinking)
    qwen3         as deepseek_r1                                            all reasoning; all content when the
                                                                            request sent chat_template_kwargs
                                                                            {"enable_thinking": false}

A prompt whose generation prompt already closed the reasoning (it ends with `</think>`, as Qwen3's template writes
`<think>\\n\\n</think>\\n\\n` when thinking is off) has no reasoning to parse: the whole answer is content. Streamed
or not, the answer is split the same way (ReasoningStreamer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = THINK_OPEN
    end: str = THINK_CLOSE

    def __post_init__(self) -> None:
        if self.name not in REASONING_PARSERS:
            raise ValueError(f"unknown --reasoning-parser {self.name!r}; brisk parses {', '.join(REASONING_PARSERS)}")

    def active(self, template_kwargs: dict[str, Any] | None, prompt: str) -> bool:
        """Whether a request's answer starts with reasoning: not when the prompt closed it already, nor (qwen3)
        when the request turned thinking off."""
        if self.name == "qwen3" and (template_kwargs or {}).get("enable_thinking", True) is False:
            return False
        return not prompt.rstrip().endswith(self.end)

    def _body(self, text: str) -> str:
        """The text without a leading start tag (and the whitespace before it)."""
        stripped = text.lstrip()
        return stripped[len(self.start):] if stripped.startswith(self.start) else text

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; an answer without the end tag is all reasoning (it was cut)."""
        body = self._body(text)
        reasoning, closed, content = body.partition(self.end)
        if not closed:
            return body or None, None
        return reasoning or None, content or None


class ReasoningStreamer:
    """Cuts one streamed choice's growing text into reasoning deltas and the content so far, so that the deltas
    join to what ReasoningParser.split makes of the final text. Held back while undecided: leading text that may
    still become the start tag, and a tail that may be the beginning of the end tag."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.sent = 0  # characters of reasoning sent
        self.answering = False  # the end tag came: the rest is the answer

    def update(self, text: str, finished: bool) -> tuple[str, str | None]:
        """(the reasoning delta, the content so far: None while the reasoning goes on)."""
        p = self.parser
        body = p._body(text)
        reasoning, closed, content = body.partition(p.end)
        if closed or finished:
            stable = len(reasoning)
        elif p.start.startswith(text.lstrip()):  # "" or "<th": the start tag may be coming
            stable = 0
        else:
            stable = len(reasoning) - _overlap(reasoning, p.end)
        delta = reasoning[self.sent:stable] if stable > self.sent else ""
        self.sent = max(self.sent, stable)
        self.answering = bool(closed)
        return delta, (content if closed else None)


def _overlap(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the beginning of `tag` (0 if none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
