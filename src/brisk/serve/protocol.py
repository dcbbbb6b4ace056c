"""Pydantic models of the OpenAI HTTP protocol (the subset brisk serves), and their validation messages.

Requests are validated in strict mode: `"temperature": "0.5"` or `"stream": "yes"` is a client bug that
deserves a 400 naming the field, not a silent coercion. Unknown fields are ignored (as vLLM does), but
known OpenAI features that brisk does not implement (echo, suffix, logit_bias, tools, ...) are rejected
with a message that says so, rather than quietly producing something the client did not ask for.
"""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from brisk.engine.sampling_defaults import SamplingDefaults
from brisk.engine.sampling_params import MAX_LOGPROBS, SamplingParams

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

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ClientError("stream_options is only allowed when stream is true", param="stream_options")
        if self.logit_bias:
            raise ClientError("logit_bias is not supported by this server", param="logit_bias",
                              code="unsupported_parameter")

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, defaults: SamplingDefaults) -> SamplingParams:
        """The request's fields over the server's sampling defaults (a field sent as null counts as omitted).
        Raises ValueError (SamplingParams' own checks) for combinations pydantic cannot see."""
        return defaults.sampling_params(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=bool(self.ignore_eos), min_tokens=self.min_tokens,
            max_tokens=max_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=bool(self.include_stop_str_in_output))


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


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated OpenAI name
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True  # vLLM extension

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise ClientError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.tools:
            raise ClientError("tools (function calling) are not supported by this server", param="tools",
                              code="unsupported_parameter")
        if self.tool_choice not in (None, "none"):
            raise ClientError("tool_choice is not supported by this server", param="tool_choice",
                              code="unsupported_parameter")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ClientError("response_format other than {'type': 'text'} is not supported by this server",
                              param="response_format", code="unsupported_parameter")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """Messages as the chat template wants them: plain-string content, 'developer' read as 'system'."""
        out = []
        for i, m in enumerate(self.messages):
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
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        return out


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


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


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


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


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


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal"}


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
