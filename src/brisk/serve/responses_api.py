"""OpenAI's Responses API (POST /v1/responses), served as the chat completion /v1/chat/completions serves.

A request becomes a ChatCompletionRequest: `instructions` a system message in front, then the conversation of
`previous_response_id` (kept in memory, the latest STORE_SIZE responses), then `input`: messages, earlier
`function_call` items as an assistant's tool_calls, `function_call_output` items as tool messages (reasoning items
sent back are left out, as chat templates leave earlier reasoning out). `tools` and `tool_choice` become the chat
fields of the same names, `text.format` the response_format, `max_output_tokens` max_completion_tokens,
`reasoning.effort` reasoning_effort. The chat path checks, renders and runs it (tools, structured outputs, the
reasoning parser); its answer becomes output items: a `reasoning` item (with --reasoning-parser), a `message` with
its `output_text`, a `function_call` per tool call. An answer cut by max_output_tokens is `incomplete`.

Streamed, the chat path's chunks become the Responses events, in the order OpenAI sends them: response.created,
response.in_progress, then per item output_item.added, (content_part.added, the text's deltas, its .done,
content_part.done), output_item.done, and response.completed (response.incomplete when cut). The final response
is the same as the non-streamed one, and the deltas join to its texts.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from brisk.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClientError,
    ResponseDeleted,
    ResponseFunctionCallInput,
    ResponseFunctionCallOutputInput,
    ResponseInputMessage,
    ResponseObject,
    ResponsesRequest,
    ResponseTextFormatJsonObject,
    ResponseTextFormatJsonSchema,
    ResponseToolChoiceFunction,
    parse_request,
)

STORE_SIZE = 256  # responses kept for previous_response_id and GET /v1/responses/{id}, least recently used out


@dataclass
class Stored:
    response: dict[str, Any]  # the response object, as answered
    messages: list[dict[str, Any]]  # its conversation as chat messages, the answer included, the instructions not


class ResponseStore:
    """The latest responses in memory (an LRU of `capacity`); lost when the server stops."""

    def __init__(self, capacity: int = STORE_SIZE) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def pop(self, response_id: str) -> Stored | None:
        return self._items.pop(response_id, None)

    def lookup(self, response_id: str, param: str = "response_id") -> Stored:
        stored = self.get(response_id)
        if stored is None:
            raise ClientError(f"no response with id {response_id!r} is stored on this server (it keeps the latest "
                              f"{self.capacity} responses sent with store true, in memory)", param=param,
                              code="response_not_found", status_code=404, err_type="not_found_error")
        return stored


# chat request fields -> the Responses fields they come from, for the errors of the chat path
_RENAMES = [("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
            ("max_completion_tokens", "max_output_tokens"), ("tool_choice.function.name", "tool_choice.name"),
            ("reasoning_effort", "reasoning.effort"), ("messages", "input")]


def _rename(text: str) -> str:
    for chat, ours in _RENAMES:
        text = text.replace(chat, ours)
    if text.startswith("tools.") and text.endswith(".function.parameters"):
        text = text.removesuffix(".function.parameters") + ".parameters"
    return text


@contextlib.contextmanager
def responses_errors() -> Iterator[None]:
    """The chat path's errors, naming the Responses request's fields."""
    try:
        yield
    except ClientError as e:
        param = None if e.param is None else _rename(e.param)
        raise ClientError(_rename(e.message).replace(".function.parameters", ".parameters"), param=param,
                          code=e.code, status_code=e.status_code, err_type=e.err_type) from None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as chat messages: consecutive calls join one assistant turn (after its text, if it had any)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(req.input):
        if isinstance(item, ResponseInputMessage):
            out.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, ResponseFunctionCallInput):
            try:
                json.loads(item.arguments)
            except ValueError:
                raise ClientError(f"input[{i}].arguments is not valid JSON: {item.arguments[:60]!r}",
                                  param=f"input.{i}.arguments", code="invalid_value") from None
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and i > 0 and \
                    not isinstance(req.input[i - 1], ResponseFunctionCallOutputInput):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, ResponseFunctionCallOutputInput):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        # reasoning items: left out
    return out


def _assistant_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the assistant turn of the conversation a continuation renders."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


@dataclass
class _Output:
    """The output items of one answer, built up as it streams (or all at once)."""

    items: list[dict[str, Any]] = field(default_factory=list)
    open: bool = False  # the last item is still being written
    cut: bool = False  # max_output_tokens cut the answer: its last item is incomplete

    def current(self, kind: str) -> dict[str, Any] | None:
        return self.items[-1] if self.open and self.items[-1]["type"] == kind else None


class Turn:
    """One Responses request: the chat request it is served as, and its answer as a response object."""

    def __init__(self, req: ResponsesRequest, store: ResponseStore, sampling_defaults: dict[str, Any]) -> None:
        self.req = req
        self.store = store
        self.id = _new_id("resp")
        self.created = int(time.time())
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = list(store.lookup(req.previous_response_id, "previous_response_id").messages)
        self.conversation = [*history, *_input_messages(req)]
        self.defaults = sampling_defaults
        self.chat = self._chat_request()

    def _chat_request(self) -> ChatCompletionRequest:
        req = self.req
        body: dict[str, Any] = {"messages": ([{"role": "system", "content": req.instructions}]
                                             if req.instructions is not None else []) + self.conversation}
        for name in ("model", "temperature", "top_p", "user", "parallel_tool_calls"):
            if getattr(req, name) is not None:
                body[name] = getattr(req, name)
        if req.max_output_tokens is not None:
            body["max_completion_tokens"] = req.max_output_tokens
        if req.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in req.tools]
        if isinstance(req.tool_choice, ResponseToolChoiceFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
        elif req.tool_choice is not None:
            body["tool_choice"] = req.tool_choice
        fmt = req.text.format if req.text is not None else None
        if isinstance(fmt, ResponseTextFormatJsonSchema):
            body["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
                by_alias=True, exclude={"type"}, exclude_none=True)}
        elif isinstance(fmt, ResponseTextFormatJsonObject):
            body["response_format"] = {"type": "json_object"}
        if req.reasoning is not None and req.reasoning.effort is not None:
            body["reasoning_effort"] = req.reasoning.effort
        with responses_errors():
            return parse_request(ChatCompletionRequest, body)

    # ------------------------------------------------------------------ the response object
    def response(self, model: str, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None, error: dict[str, str] | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        tool_choice: Any = req.tool_choice.model_dump() if isinstance(req.tool_choice, ResponseToolChoiceFunction) \
            else (req.tool_choice or ("auto" if req.tools else "none"))
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": None if req.reasoning is None else req.reasoning.model_dump(),
            "store": req.store is not False,
            "temperature": req.temperature if req.temperature is not None else self.defaults.get("temperature"),
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p if req.top_p is not None else self.defaults.get("top_p"),
            "truncation": "disabled", "usage": usage, "metadata": req.metadata or {}, "user": req.user,
        }

    def _finish(self, model: str, output: _Output, cut: bool, usage: dict[str, Any] | None) -> dict[str, Any]:
        if not output.items:  # an empty answer is an empty message
            output.items.append(_message_item(""))
        for item in output.items:
            item["status"] = "completed"
        if cut:
            output.items[-1]["status"] = "incomplete"
        response = self.response(model, "incomplete" if cut else "completed", output.items, _usage(usage))
        if self.req.store is not False:
            self.store.put(self.id, Stored(response, [*self.conversation, _assistant_message(output.items)]))
        return response

    def answer(self, chat: ChatCompletionResponse) -> dict[str, Any]:
        """The non-streamed response to the chat path's answer."""
        choice = chat.choices[0]
        message = choice.message
        output = _Output()
        if message.reasoning_content:
            output.items.append(_reasoning_item(message.reasoning_content))
        if message.content:
            output.items.append(_message_item(message.content))
        for call in message.tool_calls:
            output.items.append(_call_item(call.id, call.function.name, call.function.arguments))
        return self._finish(chat.model, output, choice.finish_reason == "length", chat.usage.model_dump())

    # ------------------------------------------------------------------ streaming
    async def events(self, chunks: AsyncIterator[str], model: str) -> AsyncIterator[str]:
        """The Responses events of the chat path's stream (its `data: {chunk}` lines, usage in the last one)."""
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            body = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

        output = _Output()

        def close() -> Iterator[str]:
            if not output.open:
                return
            output.open = False
            i, item = len(output.items) - 1, output.items[-1]
            item["status"] = "incomplete" if output.cut else "completed"
            where = {"item_id": item["id"], "output_index": i}
            if item["type"] == "message":
                part = item["content"][0]
                yield event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
                yield event("response.content_part.done", **where, content_index=0, part=part)
            elif item["type"] == "reasoning":
                part = item["content"][0]
                yield event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
                yield event("response.content_part.done", **where, content_index=0, part=part)
            else:
                yield event("response.function_call_arguments.done", **where, arguments=item["arguments"])
            yield event("response.output_item.done", output_index=i, item=item)

        def open_item(item: dict[str, Any]) -> Iterator[str]:
            yield from close()
            output.items.append(item)
            output.open = True
            i = len(output.items) - 1
            added = {**item, "status": "in_progress"}
            if item["type"] in ("message", "reasoning"):
                part = dict(item["content"][0])
                yield event("response.output_item.added", output_index=i, item={**added, "content": []})
                yield event("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
                            part=part)
            else:
                yield event("response.output_item.added", output_index=i, item={**added, "arguments": ""})

        def text(kind: str, delta: str) -> Iterator[str]:
            item = output.current(kind)
            if item is None:
                item = _message_item("") if kind == "message" else _reasoning_item("")
                yield from open_item(item)
            item["content"][0]["text"] += delta
            where = {"item_id": item["id"], "output_index": len(output.items) - 1, "content_index": 0}
            if kind == "message":
                yield event("response.output_text.delta", **where, delta=delta, logprobs=[])
            else:
                yield event("response.reasoning_text.delta", **where, delta=delta)

        yield event("response.created", response=self.response(model, "in_progress", []))
        yield event("response.in_progress", response=self.response(model, "in_progress", []))
        usage, calls = None, set()
        try:
            async for line in chunks:
                data = line.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # the engine failed after the 200: told in-band
                    error = chunk["error"]
                    yield event("error", code=error.get("code"), message=error["message"], param=error.get("param"))
                    failed = self.response(model, "failed", output.items,
                                            error={"code": "server_error", "message": error["message"]})
                    yield event("response.failed", response=failed)
                    return
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    for kind, piece in (("reasoning", delta.get("reasoning_content")),
                                        ("message", delta.get("content"))):
                        if piece:
                            for out in text(kind, piece):
                                yield out
                    for call in delta.get("tool_calls") or []:
                        fn = call.get("function") or {}
                        if call["index"] not in calls:
                            calls.add(call["index"])
                            for out in open_item(_call_item(call.get("id") or _new_id("call"), fn.get("name") or "",
                                                            "")):
                                yield out
                        args = fn.get("arguments") or ""
                        item = output.current("function_call")
                        if args and item is not None:
                            item["arguments"] += args
                            yield event("response.function_call_arguments.delta", item_id=item["id"],
                                        output_index=len(output.items) - 1, delta=args)
                    output.cut = output.cut or choice.get("finish_reason") == "length"
            if not output.items:
                for out in open_item(_message_item("")):
                    yield out
            for out in close():
                yield out
            response = self._finish(model, output, output.cut, usage)
            yield event("response.incomplete" if output.cut else "response.completed", response=response)
        finally:
            await chunks.aclose()  # type: ignore[attr-defined]


def _message_item(text: str) -> dict[str, Any]:
    return {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str) -> dict[str, Any]:
    return {"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": _new_id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": "completed"}


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


__all__ = ["STORE_SIZE", "ResponseDeleted", "ResponseObject", "ResponseStore", "ResponsesRequest", "Stored", "Turn",
           "responses_errors"]
