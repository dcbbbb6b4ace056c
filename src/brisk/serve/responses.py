"""Engine outputs -> OpenAI response bodies and server-sent events.

Choice indices follow OpenAI: with several prompts and n samples each, choice `prompt_index * n + sample`.
A streamed choice gets one chunk per engine step that added text or tokens to it, and its finish_reason
exactly once; the stream ends with `data: [DONE]`. The streamed text of a choice always equals its
non-streamed text (see _Cursor).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import BaseModel

from brisk.engine.outputs import CompletionOutput, RequestOutput
from brisk.model.tokenizer import Tokenizer
from brisk.serve import tools
from brisk.serve.async_engine import ClientDisconnected, EngineError, RequestStream
from brisk.serve.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    FunctionCallOut,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from brisk.serve.reasoning import ReasoningParser, ReasoningStreamer
from brisk.serve.tool_parsers import HermesParser, ToolParser


@dataclass
class Context:
    """What every chunk of one response repeats."""

    request_id: str
    created: int
    model: str
    tokenizer: Tokenizer
    n: int
    # Characters of text to hold back while a choice is unfinished: a stop string may be completing there,
    # and the final text is cut before it. (len(longest stop) - 1; 0 without stop strings.)
    holdback: int = 0
    tool_mode: str = "none"  # none | auto | required | named (serve/tools.py)
    tool_name: str | None = None  # the function of tool_choice "named"
    tool_parser: ToolParser | None = None  # the family's call syntax for "auto" (serve/tool_parsers.py); None: hermes
    reasoning: ReasoningParser | None = None  # splits the reasoning off the answer (serve/reasoning.py)
    include_reasoning: bool = True  # false: the reasoning is split off and left out


class _Cursor:
    """What each streamed choice has been sent so far: characters of its text, and tokens.

    Deltas are cut from the cumulative `text` / `token_ids` (outputs may coalesce; see RequestStream).
    The text is held back by `holdback` characters while the choice runs: the engine's text_delta goes out
    as soon as it is decoded, so the first characters of a stop string could be sent before the string
    completes, and the final text, cut before the stop string, would not start with what was streamed.
    """

    def __init__(self, holdback: int) -> None:
        self.holdback = holdback
        self.num_chars: dict[int, int] = {}
        self.num_tokens: dict[int, int] = {}

    def text(self, choice: int, c: CompletionOutput) -> str:
        start = self.num_chars.get(choice, 0)
        end = len(c.text) if c.finished else max(start, len(c.text) - self.holdback)
        self.num_chars[choice] = end
        return c.text[start:end]

    def tokens(self, choice: int, c: CompletionOutput) -> tuple[list[int], list[dict[int, float]]]:
        start = self.num_tokens.get(choice, 0)
        self.num_tokens[choice] = len(c.token_ids)
        return c.token_ids[start:], (c.logprobs or [])[start:]


def _usage(outputs: dict[int, RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs.values())
    completion = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _finish_reason(c: CompletionOutput) -> str | None:
    # "abort" only happens when the client is gone; nobody reads it, but keep the OpenAI vocabulary anyway
    return None if c.finish_reason is None else ("stop" if c.finish_reason == "abort" else c.finish_reason)


# ---------------------------------------------------------------------------------------------- logprobs
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, char -> byte: printable bytes stand for themselves, the other 68
    bytes for the code points 256, 257, ... in byte order (so that no piece contains a control or space)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_bytes(tok: Tokenizer, token_id: int) -> bytes | None:
    """The raw bytes of a token that is only part of a UTF-8 character, when the vocabulary says them."""
    piece = tok.convert_ids_to_tokens([token_id])[0]
    if piece is None:
        return None
    if m := _BYTE_FALLBACK.fullmatch(piece):  # SentencePiece byte fallback: <0xE2>
        return bytes([int(m.group(1), 16)])
    if all(c in _BYTE_LEVEL for c in piece):  # byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2)
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return None


def _token_text(tok: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """(token string, its UTF-8 bytes) as OpenAI reports them.

    A token holding part of a multi-byte character decodes to U+FFFD; OpenAI then names it by its bytes
    ("bytes:\\xe2\\x80") so that distinct tokens stay distinct and a client can rejoin the bytes.
    """
    text = tok.decode([token_id], skip_special_tokens=False)
    if "\ufffd" in text and (raw := _token_bytes(tok, token_id)) is not None:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)
    return text, list(text.encode())


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    # the engine's dict holds the top k plus the sampled token when it is not among them
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(tok: Tokenizer, token_ids: list[int], entries: list[dict[int, float]], k: int,
                        text_offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=True):
        text, _ = _token_text(tok, token_id)
        out.tokens.append(text)
        out.token_logprobs.append(entry[token_id])
        out.top_logprobs.append({_token_text(tok, t)[0]: lp for t, lp in _top(entry, k)})
        out.text_offset.append(text_offset)
        text_offset += len(text)  # offsets of the token strings as reported (vLLM's convention)
    return out


def chat_logprobs(tok: Tokenizer, token_ids: list[int], entries: list[dict[int, float]], k: int) -> ChatChoiceLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text, raw = _token_text(tok, token_id)
        top = [TopLogprob(token=t_text, logprob=lp, bytes=t_raw)
               for t, lp in _top(entry, k) for t_text, t_raw in [_token_text(tok, t)]]
        content.append(ChatTokenLogprob(token=text, logprob=entry[token_id], bytes=raw, top_logprobs=top))
    return ChatChoiceLogprobs(content=content)


# ---------------------------------------------------------------------------------------------- completions
def completion_response(outputs: dict[int, RequestOutput], ctx: Context, logprobs: int | None) -> CompletionResponse:
    choices = []
    for index in sorted(outputs):
        for c in outputs[index].outputs:
            lp = None
            if logprobs is not None:
                lp = completion_logprobs(ctx.tokenizer, c.token_ids, c.logprobs or [], logprobs, 0)
            choices.append(CompletionChoice(index=index * ctx.n + c.index, text=c.text, logprobs=lp,
                                            finish_reason=_finish_reason(c)))
    return CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices,
                              usage=_usage(outputs))


async def completion_events(stream: RequestStream, ctx: Context, logprobs: int | None,
                            include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return _sse(CompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices,
                                       usage=usage))

    offsets: dict[int, int] = {}
    done: set[int] = set()
    last: dict[int, RequestOutput] = {}
    cursor = _Cursor(ctx.holdback)
    try:
        async for index, out in stream:
            last[index] = out
            choices = []
            for c in out.outputs:
                ci = index * ctx.n + c.index
                if ci in done:
                    continue
                text = cursor.text(ci, c)
                ids, entries = cursor.tokens(ci, c)
                if not (text or ids or c.finished):
                    continue
                lp = None
                if logprobs is not None and ids:
                    lp = completion_logprobs(ctx.tokenizer, ids, entries, logprobs, offsets.get(ci, 0))
                    offsets[ci] = lp.text_offset[-1] + len(lp.tokens[-1])
                choices.append(CompletionChoice(index=ci, text=text, logprobs=lp,
                                                finish_reason=_finish_reason(c)))
                if c.finished:
                    done.add(ci)
            if choices:
                yield chunk(choices)
        if include_usage:
            yield chunk([], _usage(last))
        yield "data: [DONE]\n\n"
    except ClientDisconnected:
        return
    except (EngineError, ValueError) as e:
        yield _sse_error(e)
        yield "data: [DONE]\n\n"
    finally:
        stream.close()


# ---------------------------------------------------------------------------------------------- chat
def _tool_calls_out(calls: list[tools.ToolCall]) -> list[ToolCallOut]:
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]


def _message(ctx: Context, c: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
    """A finished choice's message and finish_reason: its reasoning split off (with a reasoning parser), its tool
    calls parsed out."""
    if ctx.reasoning is None:
        return _answer(ctx, c, c.text)
    reasoning, text = ctx.reasoning.split(c.text)
    message, finish = _answer(ctx, c, text)
    if text is None:  # max_tokens cut the reasoning: there is no answer yet
        message = ChatResponseMessage(content=None)
    if ctx.include_reasoning and reasoning is not None:
        message.reasoning_content = message.reasoning = reasoning
    return message, finish


def _answer(ctx: Context, c: CompletionOutput, text: str | None) -> tuple[ChatResponseMessage, str | None]:
    """The message and finish_reason of the answer `text` (OpenAI's finish_reason is "tool_calls" when the model
    chose to call, "stop" when tool_choice named the function, "length" when max_tokens cut the answer: the call it
    cut is kept with its arguments so far, see serve/tools.py)."""
    finish = _finish_reason(c)
    cut = c.finish_reason == "length"
    if text is None:
        return ChatResponseMessage(content=None), finish
    if ctx.tool_mode == "auto":
        content, calls = (ctx.tool_parser or HermesParser()).parse(text, cut=cut)
        complete = not cut
    elif ctx.tool_mode == "required":
        calls, complete = tools.required_calls(text)
        content = None
    elif ctx.tool_mode == "named":
        return ChatResponseMessage(content=None, tool_calls=_tool_calls_out(
            [tools.ToolCall(ctx.tool_name or "", text)])), finish
    else:
        return ChatResponseMessage(content=text), finish
    if calls:
        return ChatResponseMessage(content=content, tool_calls=_tool_calls_out(calls)), \
            "tool_calls" if complete else finish
    return ChatResponseMessage(content=content), finish


def chat_response(outputs: dict[int, RequestOutput], ctx: Context, top_logprobs: int | None) -> ChatCompletionResponse:
    choices = []
    for index in sorted(outputs):
        for c in outputs[index].outputs:
            lp = None
            if top_logprobs is not None:
                lp = chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs or [], top_logprobs)
            message, finish = _message(ctx, c)
            choices.append(ChatChoice(index=index * ctx.n + c.index, message=message, logprobs=lp,
                                      finish_reason=finish))
    return ChatCompletionResponse(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices,
                                  usage=_usage(outputs))


async def chat_events(stream: RequestStream, ctx: Context, top_logprobs: int | None,
                      include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return _sse(ChatCompletionChunk(id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices,
                                        usage=usage))

    done: set[int] = set()
    last: dict[int, RequestOutput] = {}
    cursor = _Cursor(ctx.holdback)
    streamers: dict[int, _ToolStreamer] = {}
    thinkers: dict[int, ReasoningStreamer] = {}
    answered: dict[int, int] = {}  # characters of the answer (after the reasoning) sent as content, per choice
    try:
        # OpenAI opens every choice with the role, before any content
        yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(ctx.n)])
        async for index, out in stream:
            last[index] = out
            choices = []
            for c in out.outputs:
                ci = index * ctx.n + c.index
                if ci in done:
                    continue
                text = cursor.text(ci, c)
                ids, entries = cursor.tokens(ci, c)
                if not (text or ids or c.finished):
                    continue
                lp = None
                if top_logprobs is not None and ids:
                    lp = chat_logprobs(ctx.tokenizer, ids, entries, top_logprobs)
                finish = _finish_reason(c)
                delta = DeltaMessage(content=text or None)
                shown = c.text[:cursor.num_chars[ci]]  # what the stop strings let out so far
                thought = ""
                if ctx.reasoning is not None:  # the reasoning's deltas; what follows it is the answer so far
                    thought, answer = thinkers.setdefault(ci, ReasoningStreamer(ctx.reasoning)).update(shown,
                                                                                                      c.finished)
                    shown = answer or ""
                    if ctx.tool_mode == "none":
                        delta = DeltaMessage(content=shown[answered.get(ci, 0):] or None)
                        answered[ci] = len(shown)
                if ctx.tool_mode != "none" and (ctx.reasoning is None or thinkers[ci].answering):
                    streamer = streamers.setdefault(ci, _ToolStreamer(ctx))
                    delta, called = streamer.update(shown, c.finished, c.finish_reason == "length")
                    if c.finished and called:
                        finish = "tool_calls"
                elif ctx.tool_mode != "none":
                    delta = DeltaMessage()
                if thought and ctx.include_reasoning:
                    delta.reasoning_content = delta.reasoning = thought
                choices.append(ChatStreamChoice(index=ci, delta=delta, logprobs=lp, finish_reason=finish))
                if c.finished:
                    done.add(ci)
            if choices:
                yield chunk(choices)
        if include_usage:
            yield chunk([], _usage(last))
        yield "data: [DONE]\n\n"
    except ClientDisconnected:
        return
    except (EngineError, ValueError) as e:
        yield _sse_error(e)
        yield "data: [DONE]\n\n"
    finally:
        stream.close()


class _ToolStreamer:
    """One streamed choice's deltas with tools: what reassembles to _message's answer for the final text.

    auto: content as it comes, each call in one delta once it is whole (tool_parsers.ToolStreamer);
    named: the call's id and name first, then its arguments as the text grows; required: the calls at the end
    (the array parses only once complete). A call cut by max_tokens goes out as _message reports it."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.hermes = (ctx.tool_parser or HermesParser()).streamer()
        self.sent = 0
        self.num_calls = 0

    def update(self, text: str, finished: bool, cut: bool = False) -> tuple[DeltaMessage, bool]:
        """(the delta, whether the answer is tool calls: its finish_reason is then tool_calls); cut: max_tokens
        ended it."""
        mode = self.ctx.tool_mode
        if mode == "named":
            head = self.sent == 0 and self.num_calls == 0
            args, self.sent = text[self.sent:], len(text)
            self.num_calls = 1
            call = DeltaToolCall(index=0, id=tools.new_call_id() if head else None, type="function" if head else None,
                                 function=DeltaFunctionCall(name=self.ctx.tool_name if head else None,
                                                            arguments=args))
            return DeltaMessage(tool_calls=[call] if head or args else None), False
        if mode == "required":
            if not finished:
                return DeltaMessage(), False
            calls, complete = tools.required_calls(text)
            return DeltaMessage(tool_calls=self._deltas(calls) or None), bool(calls) and complete
        content, calls = self.hermes.update(text, finished, cut)
        return (DeltaMessage(content=content or None, tool_calls=self._deltas(calls) or None),
                bool(self.hermes.calls) and not cut)

    def _deltas(self, calls: list[tools.ToolCall]) -> list[DeltaToolCall]:
        out = []
        for call in calls:
            out.append(DeltaToolCall(index=self.num_calls, id=call.id, type="function",
                                     function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
            self.num_calls += 1
        return out


# ---------------------------------------------------------------------------------------------- SSE
def _sse(body: BaseModel) -> str:
    return f"data: {body.model_dump_json()}\n\n"


def _sse_error(e: Exception) -> str:
    """A failure after the 200 went out can only be told in-band (as vLLM does): an error event."""
    is_engine = isinstance(e, EngineError)
    info = ErrorInfo(message=str(e), type="internal_error" if is_engine else "invalid_request_error",
                     code="engine_error" if is_engine else "invalid_value")
    return _sse(ErrorResponse(error=info))
