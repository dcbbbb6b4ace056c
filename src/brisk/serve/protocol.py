"""Pydantic models of the OpenAI HTTP protocol (the subset brisk serves), and their validation messages.

Requests are validated in strict mode: `"temperature": "0.5"` or `"stream": "yes"` is a client bug that
deserves a 400 naming the field, not a silent coercion. Unknown fields are ignored (as vLLM does), but
known OpenAI features that brisk does not implement (echo, suffix, logit_bias, ...) are rejected with a
message that says so, rather than quietly producing something the client did not ask for.

Structured outputs come in four spellings, at most one per request: OpenAI's `response_format`, vLLM's
`structured_outputs` object, and vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
fields (`structured_request` below). Tools: `tools` + `tool_choice` (serve/tools.py).
"""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from brisk.engine.sampling_defaults import SamplingDefaults
from brisk.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from brisk.structured.params import KINDS, StructuredOutputError, StructuredOutputsParams

# Most samples one request may ask for. OpenAI allows 128; on a CPU engine 16 already fills a batch, and
# the server also caps n x prompts by its admission capacity (see app._Server.check_capacity).
MAX_N = 16
_INT64 = 2**63

M = TypeVar("M", bound=BaseModel)


class ClientError(ValueError):
    """Something in the request is wrong; answered as a 4xx OpenAI error object."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status_code: int = 400, err_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status_code = status_code
        self.err_type = err_type


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


# ---------------------------------------------------------------------------------------------- requests
class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # brisk always enforces the schema, strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# vLLM's guided_decoding_backend names; brisk has one grammar engine (llguidance), which serves them all
GUIDED_BACKENDS = ("auto", "llguidance", "guidance", "xgrammar", "outlines", "lm-format-enforcer")


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions. None = the default (clients send nulls)."""

    model: str | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # OpenAI's range
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions, sent by the openai client through `extra_body`
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(None, ge=0)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None  # accepted and ignored: JSON whitespace is fixed (docs)

    def structured_request(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the constraint the request asks for, the field to name in its errors); ClientError for a bad one."""
        if self.guided_decoding_backend is not None and self.guided_decoding_backend not in GUIDED_BACKENDS:
            raise ClientError(f"unknown guided_decoding_backend {self.guided_decoding_backend!r}; use one of "
                              f"{', '.join(GUIDED_BACKENDS)} (brisk enforces every one with llguidance)",
                              param="guided_decoding_backend", code="invalid_value")
        sources = []
        if self.response_format is not None and self.response_format.type != "text":
            sources.append("response_format")
        if self.structured_outputs is not None:
            sources.append("structured_outputs")
        sources += [f"guided_{k}" for k in ("json", "regex", "choice", "grammar")
                    if getattr(self, f"guided_{k}") is not None]
        if not sources:
            return None, None
        if len(sources) > 1:
            raise ClientError(f"give one output constraint, got {' and '.join(sources)}", param=sources[1],
                              code="invalid_value")
        source = sources[0]
        param = source
        try:
            if source == "response_format":
                rf = self.response_format
                assert rf is not None
                if rf.type == "json_object":
                    return StructuredOutputsParams(json_object=True), "response_format"
                param = "response_format.json_schema.schema"
                if rf.json_schema is None or rf.json_schema.json_schema is None:
                    raise ClientError("response_format of type 'json_schema' needs json_schema: {'name': ..., "
                                      "'schema': {...}}", param=param, code="missing_required_parameter")
                return StructuredOutputsParams(json=rf.json_schema.json_schema), param
            if source == "structured_outputs":
                so = StructuredOutputsParams.from_dict(self.structured_outputs)  # type: ignore[arg-type]
                return so, f"structured_outputs.{so.kind}"
            kind = source.removeprefix("guided_")
            return StructuredOutputsParams(**{kind: getattr(self, source)}), source
        except StructuredOutputError as e:
            if source == "structured_outputs" and e.param in KINDS:
                param = f"structured_outputs.{e.param}"
            elif source == "structured_outputs" and e.param:
                param = e.param
            raise ClientError(f"{param}: {e.message}", param=param, code="invalid_value") from None

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ClientError("stream_options is only allowed when stream is true", param="stream_options")
        if self.logit_bias:
            raise ClientError("logit_bias is not supported by this server", param="logit_bias",
                              code="unsupported_parameter")

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, defaults: SamplingDefaults,
                           structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's fields over the server's sampling defaults (a field sent as null counts as omitted).
        Raises ValueError (SamplingParams' own checks) for combinations pydantic cannot see."""
        return defaults.sampling_params(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=bool(self.ignore_eos), min_tokens=self.min_tokens,
            max_tokens=max_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=bool(self.include_stop_str_in_output), structured_outputs=structured)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)  # None = OpenAI's default of 16, clamped to the context
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise ClientError("echo is not supported by this server", param="echo", code="unsupported_parameter")
        if self.suffix:
            raise ClientError("suffix is not supported by this server", param="suffix", code="unsupported_parameter")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ClientError("best_of is not supported by this server (only best_of == n)", param="best_of",
                              code="unsupported_parameter")


class ContentPart(_Strict):
    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Strict):
    """An earlier call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    tool_call_id: str | None = None  # tool


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None = no arguments
    strict: bool | None = None  # brisk enforces the schema whenever it constrains (tool_choice required / named)


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated OpenAI name
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool | None = True  # vLLM extension

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise ClientError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ClientError("tool_choice needs a non-empty 'tools' list to choose from", param="tool_choice",
                              code="invalid_value")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ClientError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                                  f"among the tools {names}", param="tool_choice.function.name", code="invalid_value")
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise ClientError(f"messages[{i}] ({m.role}) has tool_calls; only assistant messages call tools",
                                  param=f"messages.{i}.tool_calls", code="invalid_value")
            for j, c in enumerate(m.tool_calls or []):
                _arguments(c.function.arguments, i, j)

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named (OpenAI: with tools, tool_choice defaults to auto)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if self.tool_choice is None:
            return "auto"
        return "named" if isinstance(self.tool_choice, NamedToolChoice) else str(self.tool_choice)

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self, native_tools: bool = True) -> list[dict[str, Any]]:
        """Messages as the chat template wants them: plain-string content, 'developer' read as 'system'.

        Earlier tool calls and results: with a template that renders tools (native_tools), an assistant's
        `tool_calls` go in with their arguments as objects (transformers' convention) and `tool` messages keep
        their `tool_call_id`; otherwise the calls are written into the assistant's text in the Hermes format and
        each result becomes a user turn holding <tool_response>...</tool_response>."""
        from brisk.serve.tools import render_call

        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            if m.content is None and m.role == "tool":
                raise ClientError(f"messages[{i}] (tool) needs a 'content': the tool's result",
                                  param=f"messages.{i}.content", code="missing_required_parameter")
            if m.content is None:
                if m.role != "assistant":  # an assistant turn may be empty (e.g. it only called tools)
                    raise ClientError(f"messages[{i}] ({m.role}) needs a 'content'", param=f"messages.{i}.content",
                                      code="missing_required_parameter")
                content = ""
            elif isinstance(m.content, str):
                content = m.content
            else:
                texts = []
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise ClientError(f"messages[{i}].content[{j}] is of type {part.type!r}; this server only "
                                          "takes text content parts ({'type': 'text', 'text': ...})",
                                          param=f"messages.{i}.content.{j}.type", code="unsupported_parameter")
                    texts.append(part.text)
                content = "".join(texts)
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            if native_tools:
                if m.tool_calls:
                    msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                        "name": c.function.name, "arguments": _arguments(c.function.arguments, i, j)}}
                        for j, c in enumerate(m.tool_calls)]
                if m.tool_call_id is not None:
                    msg["tool_call_id"] = m.tool_call_id
            else:
                if m.tool_calls:
                    calls = "\n".join(render_call(c.function.name, c.function.arguments) for c in m.tool_calls)
                    msg["content"] = f"{content}\n{calls}" if content else calls
                if m.role == "tool":
                    msg = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
            out.append(msg)
        return out


def _arguments(text: str, i: int, j: int) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError:
        raise ClientError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {text[:60]!r}",
                          param=f"messages.{i}.tool_calls.{j}.function.arguments", code="invalid_value") from None


# ---------------------------------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class SamplingDefaultsInfo(BaseModel):
    """The values a request's omitted sampling fields take (engine/sampling_defaults.py), and their source."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    max_tokens: int | None  # None: 16 for /v1/completions, the rest of the context for chat
    source: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "brisk"
    max_model_len: int
    sampling_defaults: SamplingDefaultsInfo


class HealthStatus(BaseModel):
    status: Literal["ok"] = "ok"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- validation
# What a field may be, for union-typed fields whose raw pydantic errors list every branch of the union.
_FIELD_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {'role': ..., 'content': ...} objects",
    "content": "a string or a list of {'type': 'text', 'text': ...} parts",
    "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
    "guided_json": "a JSON schema (an object, or its JSON text)",
}


def parse_request(model: type[M], body: Any) -> M:
    """Validate a decoded JSON body into `model`; raise ClientError naming the first bad field."""
    if not isinstance(body, dict):
        raise ClientError(f"the request body must be a JSON object, got a JSON {_json_type(body)}")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _client_error(e) from None


def _client_error(err: ValidationError) -> ClientError:
    first = err.errors(include_url=False)[0]
    # Union branches appear in the location as type names ('str', 'list[int]'); keep only the real path.
    path = [str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    param = ".".join(path) or None
    field = path[-1] if path and not path[-1].isdigit() else (path[-2] if len(path) > 1 else None)
    if first["type"] == "missing":
        return ClientError(f"'{param}' is required", param=param, code="missing_required_parameter")
    shape = _FIELD_SHAPES.get(field or "")
    if shape is not None and first["type"] not in ("too_short", "literal_error"):
        message = f"'{param}' must be {shape}"
    else:
        message = f"invalid '{param}': {first['msg']}"
    if "input" in first and first["type"] != "missing":
        message += f" (got {_short_repr(first['input'])})"
    return ClientError(message, param=param, code="invalid_value")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal", "NamedToolChoice"}


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
