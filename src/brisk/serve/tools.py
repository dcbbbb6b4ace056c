"""OpenAI tool calling: the tools' prompt, the constraint behind `tool_choice`, and the Hermes tool-call parser
(every family's parser, and `--tool-call-parser`: serve/tool_parsers.py).

    tool_choice   prompt                               generation                 answer
    none          the tools are not rendered            free                      content
    auto          the template renders the tools (or    free                      the family's calls (hermes:
                  a system prompt in the parser's        (needs --enable-auto-     <tool_call> blocks) parsed into
                  format lists them when it cannot)      tool-choice)              tool_calls; the text before: content
    required      as auto                               a JSON array of calls     every call of the array
                                                        (one schema per tool)
    {function}    as auto                               that function's           one call, its arguments the text
                                                        parameters schema

Hermes format (NousResearch Hermes 2 Pro, Qwen2.5, SmolLM2's tool-calling data): every call is one JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`; a tool's answer goes back as a
`tool` message, which templates without tool support see as `<tool_response>...</tool_response>` from the user.

`required` and a named function are constrained to JSON whichever the parser (a grammar for each family's own
syntax is not built): the answer is read as JSON, so they work with every family.

An answer cut short (max_tokens, or a stop string inside a `required` array) keeps what was written of the call it
cut, as OpenAI does: that call is in tool_calls with the arguments' JSON text so far (not parsable), the calls
before it whole, content holds no tool-call syntax, and finish_reason is "length" (not "tool_calls"). A call cut
before its name was complete is left out (there is nothing to call). Streamed or not, the answer is the same.
"""

from __future__ import annotations

import json
import re
from typing import Any

from brisk.serve.tool_parsers import (
    PARSER_NAMES,
    HermesParser,
    ToolCall,
    ToolStreamer,
    call_from_json,
    cut_call,
    new_call_id,
    skip_space,
)
from brisk.structured.params import StructuredOutputsParams

__all__ = ["ToolCall", "cut_call", "new_call_id", "HermesStreamer", "parse_hermes", "required_calls", "parse_required"]

TOOL_CALL_PARSERS = PARSER_NAMES  # serve/tool_parsers.py; `--tool-call-parser auto` reads the chat template
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


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
def parse_hermes(text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's answer: content is the text before the first <tool_call> (None when that is
    blank), calls the blocks that hold a JSON call (an unclosed last block counts: generation may stop at its end).
    Without any parsable call the whole text is the content.

    cut: generation was cut (max_tokens): an unclosed last block is a call cut short (cut_call), never content,
    and neither is a tail that begins `<tool_call>`. (The other families: serve/tool_parsers.py.)"""
    return HermesParser().parse(text, cut)


def required_calls(text: str) -> tuple[list[ToolCall], bool]:
    """(calls, complete) of a `required` answer, whole or cut short: every whole call of the array, then the one
    being written when it was cut (cut_call); complete says the array closed."""
    decoder = json.JSONDecoder()
    i, n = skip_space(text, 0), len(text)
    if not text.startswith("[", i):
        return [], False
    calls: list[ToolCall] = []
    i += 1
    while True:
        i = skip_space(text, i)
        if i >= n:
            return calls, False
        if text[i] == "]":
            return calls, not text[i + 1:].strip()
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            call = cut_call(text[i:])
            return calls + ([call] if call is not None else []), False
        call = call_from_json(item, "parameters")
        if call is None:  # not a call (the constraint makes every item one)
            return calls, False
        calls.append(call)
        i = skip_space(text, i)
        if text.startswith(",", i):
            i += 1


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a complete `required` answer (a JSON array of {"name", "parameters"}); [] if it does not parse
    (generation cut by max_tokens: required_calls reads what was written)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    if not isinstance(items, list):
        return []
    calls = [call_from_json(item, "parameters") for item in items]
    return [c for c in calls if c is not None] if all(calls) else []


class HermesStreamer(ToolStreamer):
    """The streamed counterpart of parse_hermes: content deltas and whole calls that reassemble to it (content as
    it comes but for a tail that could begin `<tool_call>`; each call once its block closes)."""

    def __init__(self) -> None:
        super().__init__(HermesParser())
