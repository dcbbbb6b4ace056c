"""Tool-call parsers, one per model family's call syntax (vLLM's `--tool-call-parser` names).

    hermes        <tool_call>{"name": "f", "arguments": {...}}</tool_call>        Hermes 2 Pro, Qwen2.5, SmolLM2
    llama3_json   <|python_tag|>{"name": "f", "parameters": {...}}; {...}        Llama 3.1 / 3.2 / 3.3
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]           Mistral 7B v0.3, Nemo, Small
                  [TOOL_CALLS]f[ARGS]{...}                                        (the newer tokenizers)
    qwen3_coder   <tool_call><function=f><parameter=p>value</parameter>          Qwen3-Coder
                  </function></tool_call>
    pythonic      [f(a=1, b="x"), g()]                                            Llama 3.2 / 4 pythonic, ToolACE
    phi4_mini     functools[{"name": "f", "arguments": {...}}, ...]               Phi-4-mini
    gemma         ```tool_code\\nprint(f(a=1))\\n```, [f(a=1)] or                 Gemma (as Google's docs prompt it)
                  {"name": "f", "parameters": {...}}

Every parser reads a model's answer the same way: the text before the first call syntax is the content (None when
blank), then the calls; an answer without any parsable call is all content (malformed output never raises).
Python-style calls are read with `ast`, literals only: nothing is evaluated.

A parser is the marker that opens its calls (`start`), the tail that could still be a marker's beginning (`hold`)
and a scan of the calls from there (`scan`); `parse` (a whole answer) and `ToolStreamer` (a growing one) are built
on those three for every family, so that a streamed answer's deltas reassemble to the parsed one: content goes out
as it comes except for a tail that may begin a marker (and the whitespace before it), each call once it is whole.

An answer cut by max_tokens (cut=True): a call being written is kept with the arguments' JSON text so far (the
JSON families; see serve/tools.py), an unfinished call section is never content.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

# ---------------------------------------------------------------------------------------------- calls


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)


# The start of a call object cut short: its name whole, then (maybe) the arguments' text so far.
_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*'
                       r'(?:,(?:\s*"(?:arguments|parameters)"\s*:\s*(?P<args>.*)|.*))?\Z', re.DOTALL)


def call_from_json(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """The call a JSON object {"name": ..., "arguments" (or "parameters"): {...}} holds; None if it is none."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("parameters", {}) if args_key == "arguments" else {})
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], text)


def cut_call(text: str) -> ToolCall | None:
    """The call a JSON object cut short begins (`{"name": "f", "arguments": {"city": "Os`): its name and the
    arguments' text as far as written ("" before they start); None until the name is whole."""
    m = _CUT_CALL.match(text)
    if m is None:
        return None
    try:
        name = json.loads(m.group(1))
    except ValueError:
        return None
    return ToolCall(name, m.group("args") or "")


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def _literal_tail(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the beginning of `marker` (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _pattern_tail(text: str, opener: str, partial: re.Pattern[str]) -> int:
    """Characters at the end of `text`, from its last `opener`, that `partial` says may grow into a marker."""
    i = text.rfind(opener)
    return len(text) - i if i >= 0 and partial.fullmatch(text, i) else 0


# ---------------------------------------------------------------------------------------------- parsers
class ToolParser(ABC):
    """One family's call syntax. Subclasses set `name`, `markers` (literal openers) and `example`, and may
    override `start`/`hold` (pattern openers) and must implement `scan`."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()
    example: ClassVar[str] = ""  # one call as the family writes it, for the tools' system prompt

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = {t["function"]["name"]: t["function"] for t in tools or [] if "function" in t}

    def start(self, text: str) -> int:
        """Where the first call syntax begins (-1: none yet)."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else -1

    def hold(self, text: str) -> int:
        """How many characters at the end of `text` could be the beginning of a marker."""
        return max((_literal_tail(text, m) for m in self.markers), default=0)

    @abstractmethod
    def scan(self, text: str, start: int, final: bool, cut: bool) -> tuple[list[ToolCall], bool]:
        """(calls, unfinished) of the call syntax from `start`. Not final: only the calls already whole (a later
        scan of the longer text begins with the same ones). unfinished: the text ends inside a call."""

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer; cut: max_tokens ended it."""
        start = self.start(text)
        if start < 0:
            k = self.hold(text) if cut else 0
            return (text[:len(text) - k].rstrip() or None, []) if k else (text, [])
        calls, unfinished = self.scan(text, start, True, cut)
        if calls or (cut and unfinished):
            return text[:start].rstrip() or None, calls
        return text, []

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self)

    def system_prompt(self, tools: list[dict]) -> str:
        """The system prompt that lists the tools for a template that has no place for them."""
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("You can call functions to answer the user. The functions you may call are listed, one JSON "
                f"signature a line, between <tools> and </tools>:\n<tools>\n{listing}\n</tools>\n"
                f"To call a function, answer with {self.example}\n"
                "Use only the listed functions, and fill in only values the conversation gives you.")


class ToolStreamer:
    """Cuts one streamed choice's growing text into content deltas and whole tool calls, so that the deltas
    reassemble to what the parser's `parse` makes of the final text.

    Content goes out as it comes, except for a tail that could still begin a marker and the whitespace before it
    (parse strips it in front of a call). A call goes out in one delta once it is whole. If the answer ends without
    any parsable call, whatever was held back goes out as content.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent = 0  # characters of content sent
        self.calls: list[ToolCall] = []

    def update(self, text: str, finished: bool, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """(content delta, new calls) for the text so far; `cut` (with finished): max_tokens ended it."""
        start = self.parser.start(text)
        if start < 0:
            k = self.parser.hold(text)
            if finished and not (cut and k):
                return self._content(text, len(text)), []
            return self._content(text, len(text[:len(text) - k].rstrip())), []
        content = self._content(text, len(text[:start].rstrip()))
        calls, unfinished = self.parser.scan(text, start, finished, cut and finished)
        new = calls[len(self.calls):]
        self.calls.extend(new)
        if finished and not self.calls and not (cut and unfinished):  # no call after all: the rest is content
            content += self._content(text, len(text))
        return content, new

    def _content(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        out = text[self.sent:end]
        self.sent = end
        return out


# ------------------------------------------------------------------ JSON families
def _json_items(text: str, i: int, final: bool, cut: bool, args_key: str = "arguments",
                sep: str = ",", end: str | None = "]", again: str | None = None) -> tuple[list[ToolCall], bool]:
    """Calls written as JSON objects from `i`, separated by `sep`, until `end` (None: the text's end); `again` (a
    marker) may open another run. A cut object is kept as cut_call when `cut`."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    while True:
        i = skip_space(text, i)
        if i >= len(text):
            return calls, True
        if end is not None and text.startswith(end, i):
            i = skip_space(text, i + len(end))
            if again and text.startswith(again, i):
                i = _open_array(text, i + len(again))
                if i < 0:
                    return calls, i == -1
                continue
            return calls, False
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            if final and cut and (call := cut_call(text[i:])) is not None:
                calls.append(call)
            return calls, True
        call = call_from_json(item, args_key)
        if call is None:
            return calls, False
        calls.append(call)
        i = skip_space(text, i)
        if text.startswith(sep, i):
            i += len(sep)
        elif again and text.startswith(again, i):
            i += len(again)
            if end is not None:
                i = _open_array(text, i)
                if i < 0:
                    return calls, i == -1
        elif i >= len(text):
            return calls, True
        elif end is None or not text.startswith(end, i):
            return calls, False


def _open_array(text: str, i: int) -> int:
    """The index after the `[` that opens an array at `i` (after space); -1 when the text ends first or it is not
    one (-2)."""
    i = skip_space(text, i)
    if i >= len(text):
        return -1
    return i + 1 if text[i] == "[" else -2


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    example = ('a JSON object holding its name and its arguments between <tool_call> and </tool_call>, one block '
               'per call:\n<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>')
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def scan(self, text: str, start: int, final: bool, cut: bool) -> tuple[list[ToolCall], bool]:
        calls: list[ToolCall] = []
        unfinished = False
        for m in self._BLOCK.finditer(text, start):
            closed = m.group(0).endswith("</tool_call>")
            if not (closed or final):
                return calls, True
            unfinished = not closed
            call = _json_call(m.group(1))
            if call is None and cut and not closed:
                call = cut_call(m.group(1))
            if call is not None:
                calls.append(call)
        return calls, unfinished


def _json_call(body: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(body))
    except ValueError:
        return None


_NAME_OBJECT = re.compile(r'\{\s*"name"\s*:')
_NAME_OBJECT_PARTIAL = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?')


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)
    example = ('a JSON object holding its name and its parameters, several separated by ";":\n'
               '{"name": "<function name>", "parameters": {<arguments as JSON>}}')
    TAG = "<|python_tag|>"

    def start(self, text: str) -> int:
        m = _NAME_OBJECT.search(text)
        found = [i for i in (text.find(self.TAG), m.start() if m else -1) if i >= 0]
        return min(found) if found else -1

    def hold(self, text: str) -> int:
        return max(_literal_tail(text, self.TAG), _pattern_tail(text, "{", _NAME_OBJECT_PARTIAL))

    def scan(self, text: str, start: int, final: bool, cut: bool) -> tuple[list[ToolCall], bool]:
        i = start + len(self.TAG) if text.startswith(self.TAG, start) else start
        return _json_items(text, i, final, cut, "parameters", sep=";", end=None, again=self.TAG)


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    example = ('[TOOL_CALLS] followed by a JSON array of the calls, each its name and its arguments:\n'
               '[TOOL_CALLS][{"name": "<function name>", "arguments": {<arguments as JSON>}}]')
    TAG = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]*\s*)?\[ARGS\]")

    def scan(self, text: str, start: int, final: bool, cut: bool) -> tuple[list[ToolCall], bool]:
        i = skip_space(text, start + len(self.TAG))
        if i >= len(text):
            return [], True
        if text[i] == "[" and not text.startswith("[ARGS]", i):
            return _json_items(text, i + 1, final, cut, "arguments", again=self.TAG)
        return self._named(text, i, final, cut)

    def _named(self, text: str, i: int, final: bool, cut: bool) -> tuple[list[ToolCall], bool]:
        """The newer form: name[ARGS]{...}, each call after its own [TOOL_CALLS]."""
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        while True:
            m = self._NAMED.match(text, i)
            if m is None:
                return calls, _could_grow(text[i:])
            j = skip_space(text, m.end())
            try:
                args, i = decoder.raw_decode(text, j)
            except ValueError:
                if final and cut and j < len(text):
                    calls.append(ToolCall(m.group(1), text[j:]))
                elif final and cut:
                    calls.append(ToolCall(m.group(1), ""))
                return calls, True
            calls.append(ToolCall(m.group(1), args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
            i = skip_space(text, i)
            if i >= len(text):
                return calls, False
            if not text.startswith(self.TAG, i):
                return calls, False
            i += len(self.TAG)


_NAMED_PARTIAL = re.compile(r"\s*[A-Za-z_][\w.\-]*\s*(?:\[[A-Z_]*\]?\s*[A-Za-z0-9]*)*")


def _could_grow(tail: str) -> bool:
    """Whether `tail` is blank or could still become `name[ARGS]` (a rough test: an unfinished name)."""
    return not tail.strip() or _NAMED_PARTIAL.fullmatch(tail) is not None


class Phi4MiniParser(ToolParser):
    name = "phi4_mini"
    markers = ("functools[",)
    example = ('functools followed by a JSON array of the calls, each its name and its arguments:\n'
               'functools[{"name": "<function name>", "arguments": {<arguments as JSON>}}]')

    def scan(self, text: str, start: int, final: bool, cut: bool) -> tuple[list[ToolCall], bool]:
        return _json_items(text, start + len(self.markers[0]), final, cut, "arguments")


# ------------------------------------------------------------------ XML (Qwen3-Coder)
class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<tool_call>", "<function=")
    example = ("one block per call, each parameter in its own tag:\n<tool_call>\n<function=<function name>>\n"
               "<parameter=<parameter name>>\n<value>\n</parameter>\n</function>\n</tool_call>")
    _FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(</function>|\Z)", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|\Z)",
                            re.DOTALL)

    def scan(self, text: str, start: int, final: bool, cut: bool) -> tuple[list[ToolCall], bool]:
        calls: list[ToolCall] = []
        matches = list(self._FUNCTION.finditer(text, start))
        for m in matches:
            closed = bool(m.group(3))
            if not (closed or final):
                return calls, True
            name = m.group(1).strip()
            if not name:
                continue
            if closed or not cut:
                calls.append(ToolCall(name, json.dumps(self._arguments(name, m.group(2)), ensure_ascii=False)))
            else:  # cut inside the call: the parameters written whole, as JSON text still open
                body = m.group(2)
                whole = body[:body.rfind("</parameter>") + len("</parameter>")] if "</parameter>" in body else ""
                calls.append(ToolCall(name, json.dumps(self._arguments(name, whole), ensure_ascii=False)[:-1]))
        return calls, not matches or not matches[-1].group(3)

    def _arguments(self, name: str, body: str) -> dict[str, Any]:
        props = self.tools.get(name, {}).get("parameters", {}) or {}
        props = props.get("properties", {}) if isinstance(props, dict) else {}
        args: dict[str, Any] = {}
        for p in self._PARAMETER.finditer(body):
            key, value = p.group(1).strip(), p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _typed(value, props.get(key, {}) if isinstance(props.get(key), dict) else {})
        return args


def _typed(value: str, schema: dict[str, Any]) -> Any:
    """A Qwen3-Coder parameter's text as its schema's type (JSON when the schema says nothing and it parses)."""
    kind = schema.get("type")
    if kind == "string" or (kind is None and "enum" in schema and all(isinstance(e, str) for e in schema["enum"])):
        return value
    text = value.strip()
    if kind is None or kind in ("integer", "number", "boolean", "object", "array", "null"):
        try:
            return json.loads(text)
        except ValueError:
            pass
        if text in ("True", "False", "None"):
            return {"True": True, "False": False, "None": None}[text]
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return value
    return value


# ------------------------------------------------------------------ Python-style calls
_PY_LIST = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_PY_LIST_PARTIAL = re.compile(r"\[\s*(?:[A-Za-z_][\w.]*\s*)?")
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.expr) -> Any:
    """A call argument's value: Python literals (and JSON's true, false, null), nothing evaluated."""
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[arg-type]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)


def _call_of(node: ast.expr) -> ToolCall | None:
    """`f(a=1, b="x")` as a call; None when it is not one with keyword literals only."""
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        return None
    try:
        name = ast.unparse(node.func)
        if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
            return None
        args = {k.arg: _literal(k.value) for k in node.keywords}
        return ToolCall(name, json.dumps(args, ensure_ascii=False))
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None


def _python_list(text: str, start: int) -> tuple[list[ToolCall] | None, int]:
    """The calls of the first `[f(...), ...]` from `start` that parses whole, and the index after it (None, -1:
    none closes yet)."""
    j = start
    while (j := text.find("]", j + 1)) >= 0:
        try:
            tree = ast.parse(text[start:j + 1], mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        if not isinstance(tree, ast.List):
            return [], j + 1
        calls = [_call_of(e) for e in tree.elts]
        return ([c for c in calls if c is not None] if all(calls) else []), j + 1
    return None, -1


class PythonicParser(ToolParser):
    name = "pythonic"
    example = ('a Python list of the calls, keyword arguments only:\n'
               '[func_name1(param1=value1, param2=value2), func_name2(param=value)]')

    def start(self, text: str) -> int:
        m = _PY_LIST.search(text)
        return m.start() if m else -1

    def hold(self, text: str) -> int:
        return _pattern_tail(text, "[", _PY_LIST_PARTIAL)

    def scan(self, text: str, start: int, final: bool, cut: bool) -> tuple[list[ToolCall], bool]:
        calls, _ = _python_list(text, start)
        if calls is not None:
            return calls, False
        if final and cut:  # the calls written whole before the cut (Python arguments have no JSON text so far)
            return _whole_python_calls(text, start), True
        return [], True


def _whole_python_calls(text: str, start: int) -> list[ToolCall]:
    """The calls a Python list cut short holds whole: the longest prefix closing at a `)` that parses."""
    j = len(text)
    while (j := text.rfind(")", start, j)) >= 0:
        calls, _ = _python_list(text[:j + 1] + "]", start)
        if calls:
            return calls
    return []


class GemmaParser(ToolParser):
    name = "gemma"
    markers = ("```tool_code",)
    example = ('a tool_code block that prints the call:\n```tool_code\nprint(<function name>(<param>=<value>))\n```')
    FENCE = "```tool_code"

    def start(self, text: str) -> int:
        py, obj = _PY_LIST.search(text), _NAME_OBJECT.search(text)
        found = [i for i in (text.find(self.FENCE), py.start() if py else -1, obj.start() if obj else -1) if i >= 0]
        return min(found) if found else -1

    def hold(self, text: str) -> int:
        return max(_literal_tail(text, self.FENCE), _pattern_tail(text, "[", _PY_LIST_PARTIAL),
                   _pattern_tail(text, "{", _NAME_OBJECT_PARTIAL))

    def scan(self, text: str, start: int, final: bool, cut: bool) -> tuple[list[ToolCall], bool]:
        if text.startswith("{", start):
            return _json_items(text, start, final, cut, "parameters", sep=";", end=None)
        if text.startswith("[", start):
            return PythonicParser().scan(text, start, final, cut)
        calls: list[ToolCall] = []
        i = start
        while text.startswith(self.FENCE, i):
            body_start = i + len(self.FENCE)
            close = text.find("```", body_start)
            if close < 0 and not final:
                return calls, True
            body = text[body_start:] if close < 0 else text[body_start:close]
            found = _code_calls(body)
            if found is None and close < 0 and cut:
                found = _code_calls(body[:body.rfind("\n") + 1]) if "\n" in body else []
            calls.extend(found or [])
            if close < 0:
                return calls, True
            i = skip_space(text, close + 3)
        return calls, False


def _code_calls(code: str) -> list[ToolCall] | None:
    """The calls of a tool_code block: one statement a call, `f(...)`, `print(f(...))` or a list of calls."""
    try:
        tree = ast.parse(code.strip())
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    calls: list[ToolCall | None] = []
    for stmt in tree.body:
        if not isinstance(stmt, ast.Expr):
            return None
        node = stmt.value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print" \
                and len(node.args) == 1 and not node.keywords:
            node = node.args[0]
        calls.extend([_call_of(e) for e in node.elts] if isinstance(node, ast.List) else [_call_of(node)])
    return [c for c in calls if c is not None] if calls and all(calls) else None


# ---------------------------------------------------------------------------------------------- registry
PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3JsonParser, MistralParser, Qwen3CoderParser, PythonicParser, Phi4MiniParser, GemmaParser)}
PARSER_NAMES = tuple(PARSERS)

# What in a chat template tells its family, checked in this order (Qwen3-Coder's template also writes <tool_call>).
_DETECT: tuple[tuple[str, str], ...] = (
    ("<function=", "qwen3_coder"),
    ("<parameter=", "qwen3_coder"),
    ("[TOOL_CALLS]", "mistral"),
    ("functools[", "phi4_mini"),
    ("<|tool|>", "phi4_mini"),
    ("tool_code", "gemma"),
    ("[func_name1(", "pythonic"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters": dictionary of argument name', "llama3_json"),
)


def detect_parser(chat_template: str | None) -> str:
    """The parser a chat template's text calls for (`--tool-call-parser auto`); hermes when nothing tells."""
    for needle, name in _DETECT:
        if chat_template and needle in chat_template:
            return name
    return "hermes"


def resolve_parser(name: str | None, chat_template: str | None) -> str:
    """--tool-call-parser's value as a parser name: None is hermes, auto reads the chat template."""
    if name is None:
        return "hermes"
    if name == "auto":
        return detect_parser(chat_template)
    if name not in PARSERS:
        raise ValueError(f"unknown --tool-call-parser {name!r}; brisk parses {', '.join(PARSER_NAMES)} (or auto)")
    return name


def get_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    return PARSERS[name](tools)
