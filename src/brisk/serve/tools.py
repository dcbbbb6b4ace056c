"""OpenAI tool calling: the tools' prompt, the constraint behind `tool_choice`, and the Hermes tool-call parser.

    tool_choice   prompt                               generation                 answer
    none          the tools are not rendered            free                      content
    auto          the template renders the tools (or    free                      <tool_call>{...}</tool_call> blocks
                  a Hermes-style system prompt lists     (needs --enable-auto-     parsed into tool_calls;
                  them when the template cannot)         tool-choice)              the text before them is content
    required      as auto                               a JSON array of calls     every call of the array
                                                        (one schema per tool)
    {function}    as auto                               that function's           one call, its arguments the text
                                                        parameters schema

Hermes format (NousResearch Hermes 2 Pro, Qwen2.5, SmolLM2's tool-calling data): every call is one JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`; a tool's answer goes back as a
`tool` message, which templates without tool support see as `<tool_response>...</tool_response>` from the user.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from brisk.structured.params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes",)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders the `tools` variable itself (as transformers' templates with tool use do)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def hermes_system_prompt(tools: list[dict]) -> str:
    """The system prompt that lists the tools for a template that has no place for them."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You can call functions to answer the user. The functions you may call are listed, one JSON signature a "
            f"line, between <tools> and </tools>:\n<tools>\n{listing}\n</tools>\n"
            "To call a function, answer with a JSON object holding its name and its arguments between <tool_call> "
            "and </tool_call>, one block per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>\n'
            "Use only the listed functions, and fill in only values the conversation gives you.")


def render_call(name: str, arguments: str) -> str:
    """An assistant's earlier call as the model writes it (for templates without tool support)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return f"{CALL_OPEN}\n" + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + f"\n{CALL_CLOSE}"


# ---------------------------------------------------------------------------------------------- constraints
def function_schema(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def required_constraint(tools: list[dict], parallel: bool) -> StructuredOutputsParams:
    """tool_choice "required": a non-empty JSON array of {"name": one of the tools, "parameters": its schema}
    (vLLM's form; `parallel_tool_calls: false` makes it exactly one call)."""
    items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                "parameters": function_schema(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def named_constraint(tool: dict) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=function_schema(tool))


# ---------------------------------------------------------------------------------------------- parsing
@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)


def _call_from_json(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters", {}) if args_key == "arguments" else {})
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's answer: content is the text before the first <tool_call> (None when that is
    blank), calls the blocks that hold a JSON call (an unclosed last block counts: generation may stop at its end).
    Without any parsable call the whole text is the content."""
    calls = [c for m in _BLOCK.finditer(text) for c in [_parse_block(m.group(1))] if c is not None]
    if not calls:
        return text, []
    return text[:text.index(CALL_OPEN)].rstrip() or None, calls


def _parse_block(body: str) -> ToolCall | None:
    try:
        return _call_from_json(json.loads(body))
    except ValueError:
        return None


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a `required` answer (a JSON array of {"name", "parameters"}); [] if it does not parse
    (generation cut by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = [_call_from_json(item, "parameters") for item in items]
    return [c for c in calls if c is not None] if all(calls) else []


class HermesStreamer:
    """Cuts one streamed choice's growing text into content deltas and whole tool calls, so that the deltas
    reassemble to what parse_hermes makes of the final text.

    Content goes out as it comes, except for a tail that could still be the start of `<tool_call>` and trailing
    whitespace (parse_hermes strips it in front of a call). Once a block is closed its call goes out in one delta.
    If the answer ends without any parsable call, whatever was held back goes out as content.
    """

    def __init__(self) -> None:
        self.sent = 0  # characters of content sent
        self.calls: list[ToolCall] = []
        self._blocks_seen = 0  # closed blocks examined

    def update(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        start = text.find(CALL_OPEN)
        if start < 0:
            if finished:
                return self._content(text, len(text)), []
            end = len(text)
            for k in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):  # a tail that may begin a tag
                if CALL_OPEN.startswith(text[-k:]):
                    end = len(text) - k
                    break
            return self._content(text, len(text[:end].rstrip())), []
        content = self._content(text, len(text[:start].rstrip()))
        new: list[ToolCall] = []
        blocks = list(_BLOCK.finditer(text, start))
        for i, m in enumerate(blocks):
            closed = m.group(0).endswith(CALL_CLOSE)
            if i < self._blocks_seen or not (closed or finished):
                continue
            self._blocks_seen = i + 1
            call = _parse_block(m.group(1))
            if call is not None:
                new.append(call)
        self.calls.extend(new)
        if finished and not self.calls:  # no call after all: the rest is content
            content += self._content(text, len(text))
        return content, new

    def _content(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        out = text[self.sent:end]
        self.sent = end
        return out
