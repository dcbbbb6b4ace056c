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
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError

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


# ---------------------------------------------------------------------------------------------- field types
def _integral(value: Any) -> Any:
    """12.0 -> 12: JSON Schema counts an integral number as an integer however it is written, and vLLM accepts
    it; 12.5, "12" and true are left as they are, for the strict int to refuse."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_INTEGRAL = BeforeValidator(_integral)  # on every integer field of a request, after its bounds (for the schema)
TokenId = Annotated[int, Field(ge=0), _INTEGRAL]
def _off(value: bool) -> bool:
    if value:
        raise ValueError("not supported")
    return value


NonEmptyStr = Annotated[str, Field(min_length=1)]
NonBlankStr = Annotated[str, Field(pattern=r"\S")]  # holds a character other than whitespace

# JSON Schema of the request rules across fields (a model's `allOf`); the handler's checks enforce each one
_NULL = {"type": "null"}  # under `properties`: the field is absent or null


def _when_given(field: str, then: dict[str, Any], description: str) -> dict[str, Any]:
    """The request matches `then` whenever `field` is given (not null)."""
    return {"description": description, "anyOf": [{"properties": {field: _NULL}}, then]}


def _with_rules(schema: dict[str, Any], model: type[BaseModel]) -> None:
    rules = model.schema_rules()  # type: ignore[attr-defined]
    if rules:
        schema["allOf"] = rules


# ---------------------------------------------------------------------------------------------- requests
class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(alias="schema", description="The JSON schema the output follows")
    strict: bool | None = None  # brisk always enforces the schema, strict or not


class TextResponseFormat(_Strict):
    type: Literal["text"]


class JsonObjectResponseFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextResponseFormat | JsonObjectResponseFormat | JsonSchemaResponseFormat,
                           Field(discriminator="type")]


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar or json_object (true).
    A field it does not know is refused (a misspelt constraint would otherwise be dropped without a word)."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=lambda s, _: s.update(_ONE_KIND))

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json", description="A JSON schema, or its text")
    regex: NonBlankStr | None = None
    choice: list[NonEmptyStr] | None = Field(None, min_length=1)
    grammar: NonBlankStr | None = Field(None, description="A Lark or a GBNF grammar")
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    # vLLM's fields that pick or tune a backend: brisk has one (llguidance), so they are accepted and change nothing
    backend: str | None = None
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    whitespace_flexible: bool | None = None

    def to_params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams.from_dict(self.model_dump(by_alias=True, exclude_none=True))


_KIND_GIVEN = {"json": {"anyOf": [{"type": "object"}, {"type": "string"}, {"const": True}]},
               "json_object": {"const": True}}
_KIND_UNSET = {"json": {"enum": [None, False]}, "json_object": {"enum": [None, False]}}
_ONE_KIND = {"anyOf": [{"required": [kind], "properties": {
    kind: _KIND_GIVEN.get(kind, {"not": _NULL}), **{k: _KIND_UNSET.get(k, _NULL) for k in KINDS if k != kind}}}
    for kind in KINDS]}

# vLLM's guided_decoding_backend names; brisk has one grammar engine (llguidance), which serves them all
GuidedBackend = Literal["auto", "llguidance", "guidance", "xgrammar", "outlines", "lm-format-enforcer"]
GUIDED_BACKENDS: tuple[str, ...] = get_args(GuidedBackend)
class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions. None = the default (clients send nulls).

    What JSON Schema can say about a field is said by its type and `Field`; the rules across fields are in
    `schema_rules()` (published as the model's `allOf`) and checked by `check()`. Two rules are only described:
    at most one output constraint (response_format other than text, structured_outputs, a guided_* field; in a
    chat, tools with tool_choice other than none count too), and best_of equal to n. JSON Schema can state them,
    but only as so many alternatives that a schema-driven generator gives up on the request.)"""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_with_rules)

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), _INTEGRAL] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # OpenAI's range
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Annotated[int, Field(ge=-1), _INTEGRAL] | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: Annotated[int, Field(ge=-_INT64, lt=_INT64), _INTEGRAL] | None = None
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream true")
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="Not supported: only {} or null")
    # vLLM extensions, sent by the openai client through `extra_body`
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = False
    min_tokens: Annotated[int, Field(ge=0), _INTEGRAL] | None = Field(
        None, description="At most max_tokens (or its default)")
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # structured outputs, at most one: OpenAI's response_format, vLLM's structured_outputs, its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = Field(None, description="A JSON schema, or its text")
    guided_regex: NonBlankStr | None = None
    guided_choice: list[NonEmptyStr] | None = Field(None, min_length=1)
    guided_grammar: NonBlankStr | None = Field(None, description="A Lark or a GBNF grammar")
    guided_decoding_backend: GuidedBackend | None = None
    guided_whitespace_pattern: str | None = None  # accepted and ignored: JSON whitespace is fixed (docs)
    # more of vLLM's fields: honoured, harmless, or refused by name unless they ask for nothing
    truncate_prompt_tokens: Literal[-1] | Annotated[int, Field(ge=1), _INTEGRAL] | None = Field(
        None, description="Keep only the prompt's last k tokens (-1: the context's length)")
    spaces_between_special_tokens: bool | None = Field(
        True, description="Has no effect: brisk's (fast) tokenizers decode special tokens as they are, as vLLM's do")
    length_penalty: float | None = Field(None, description="Has no effect: it weighs beam search, which brisk "
                                                           "does not do")
    request_id: str | None = Field(None, description="Has no effect: brisk names each response itself")
    use_beam_search: Annotated[bool, Field(json_schema_extra={"const": False}), AfterValidator(_off)] | None = Field(
        False, description="Not supported: false or null only")
    return_tokens_as_token_ids: Annotated[bool, Field(json_schema_extra={"const": False}),
                                          AfterValidator(_off)] | None = Field(
        False, description="Not supported: false or null only")
    priority: Annotated[int, Field(ge=0, le=0), _INTEGRAL] | None = Field(
        None, description="Not supported: 0 or null only (brisk schedules first come, first served)")
    prompt_logprobs: None = Field(None, description="Not supported: null only")
    allowed_token_ids: None = Field(None, description="Not supported: null only")
    bad_words: list[str] | None = Field(None, max_length=0, description="Not supported: only [] or null")

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        """The rules across fields, as JSON Schema; `check()` and the handler enforce them."""
        return [
            _when_given("stream_options", {"required": ["stream"], "properties": {"stream": {"const": True}}},
                        "stream_options needs stream true"),
        ]

    def structured_request(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """(the constraint the request asks for, the field to name in its errors); ClientError for a bad one."""
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
                if isinstance(rf, JsonSchemaResponseFormat):
                    param = "response_format.json_schema.schema"
                    return StructuredOutputsParams(json=rf.json_schema.json_schema), param
                return StructuredOutputsParams(json_object=True), "response_format"
            if source == "structured_outputs":
                assert self.structured_outputs is not None
                so = self.structured_outputs.to_params()
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
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    # None = OpenAI's default of 16, clamped to the context
    max_tokens: Annotated[int, Field(ge=1), _INTEGRAL] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _INTEGRAL] | None = None
    echo: Annotated[bool, Field(json_schema_extra={"const": False}), AfterValidator(_off)] | None = Field(
        False, description="Not supported: false or null only")
    suffix: str | None = Field(None, max_length=0, description="Not supported: '' or null only")
    best_of: Annotated[int, Field(ge=1, le=MAX_N), _INTEGRAL] | None = Field(
        None, description="Equal to n when given: brisk returns every sample")
    add_special_tokens: bool | None = Field(True, description="Add the tokenizer's special tokens (BOS) to a text "
                                                              "prompt")

    def check(self) -> None:
        self.check_common()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ClientError("best_of is not supported by this server (only best_of == n)", param="best_of",
                              code="unsupported_parameter")


class TextPart(_Strict):
    type: Literal["text"]  # the only kind of content part brisk takes
    text: str


Content = str | list[TextPart]


class FunctionCall(_Strict):
    name: str
    arguments: str = Field(description="JSON text, as OpenAI sends it")


class ToolCallIn(_Strict):
    """An earlier call in an assistant message of the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


_NO_TOOL_CALLS = Field(None, max_length=0, description="Only assistant messages call tools")


class SystemMessage(_Strict):
    role: Literal["system", "developer"]  # developer is read as system
    content: Content
    name: str | None = None
    tool_calls: list[Any] | None = _NO_TOOL_CALLS


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content
    name: str | None = None
    tool_calls: list[Any] | None = _NO_TOOL_CALLS


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Content | None = None  # may be left out, e.g. by a turn that only called tools
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content  # the tool's result
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = _NO_TOOL_CALLS


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]
ROLES = ("system", "developer", "user", "assistant", "tool")


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


# Names chat_template_kwargs may not use: the renderer's own variables, which the request sets with its own fields
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                            "chat_template", "tokenize")


class _ChatTemplateFields(_Strict):
    """How a conversation becomes a prompt (vLLM's fields), for chat completions and /tokenize."""

    tools: list[ToolDef] | None = None
    add_generation_prompt: bool | None = Field(
        True, description="End the prompt with the assistant's turn opened (default true; false with "
                          "continue_final_message)")
    continue_final_message: bool | None = Field(
        False, description="Leave the last message open for the model to continue (its text is cut off after "
                           "the message's content); not with add_generation_prompt true")
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's special tokens (BOS) on top of what the template writes "
                          "(default false for messages, true for a /tokenize prompt)")
    documents: list[dict[str, str]] | None = Field(
        None, description="Documents for templates that render them (retrieval); others ignore them")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Variables for the chat template, e.g. {\"enable_thinking\": false} for Qwen3; not the "
                          f"names {', '.join(RESERVED_TEMPLATE_KWARGS)} (the request's own fields)",
        json_schema_extra={"propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}}})
    chat_template: None = Field(None, description="Not supported: null only (the model's own template is used)")

    @classmethod
    def template_rules(cls) -> list[dict[str, Any]]:
        return [{"description": "continue_final_message true needs add_generation_prompt false or left out",
                 "anyOf": [{"properties": {"continue_final_message": {"enum": [None, False]}}},
                           {"properties": {"add_generation_prompt": {"enum": [None, False]}}}]}]

    def check_template(self) -> None:
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            raise ClientError("continue_final_message continues the last message, add_generation_prompt opens a new "
                              "one: send add_generation_prompt false (or leave it out) with continue_final_message "
                              "true", param="add_generation_prompt", code="invalid_value")
        for name in self.chat_template_kwargs or {}:
            if name in RESERVED_TEMPLATE_KWARGS:
                raise ClientError(f"chat_template_kwargs may not set {name!r}: the request's own field "
                                  f"{name!r} does that", param=f"chat_template_kwargs.{name}", code="invalid_value")

    @property
    def generation_prompt(self) -> bool:
        return not self.continue_final_message and self.add_generation_prompt is not False

    def template_kwargs(self) -> dict[str, Any]:
        """The template's variables besides messages, tools and add_generation_prompt."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            kwargs["documents"] = self.documents
        return kwargs


class ChatCompletionRequest(_SamplingRequest, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1), _INTEGRAL] | None = None  # deprecated OpenAI name
    max_completion_tokens: Annotated[int, Field(ge=1), _INTEGRAL] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _INTEGRAL] | None = Field(
        None, description="Only with logprobs true")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Other than none, it needs tools, and a named function must be one of them; auto (the "
                          "default with tools) needs a server started with --enable-auto-tool-choice")
    parallel_tool_calls: bool | None = True
    echo: Annotated[bool, Field(json_schema_extra={"const": False}), AfterValidator(_off)] | None = Field(
        False, description="Not supported: false or null only")
    # reasoning models (serve/reasoning.py, --reasoning-parser)
    include_reasoning: bool | None = Field(True, description="false: leave the reasoning out of the answer")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="Passed to the chat template as the variable reasoning_effort (templates that know it "
                          "use it; the others ignore it)")
    thinking_token_budget: None = Field(None, description="Not supported: null only")

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = super().template_kwargs()
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        return [*super().schema_rules(), *cls.template_rules(),
                _when_given("top_logprobs", {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
                            "top_logprobs needs logprobs true"),
                {"description": "tool_choice other than none needs tools", "anyOf": [
                    {"properties": {"tool_choice": {"enum": [None, "none"]}}},
                    {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}]}]

    def check(self) -> None:
        self.check_common()
        self.check_template()
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
            if isinstance(m, AssistantMessage):
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
            if m.content is None:  # an assistant turn may be empty (e.g. it only called tools); the schema says so
                content = ""
            elif isinstance(m.content, str):
                content = m.content
            else:
                content = "".join(part.text for part in m.content)
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
            if m.name is not None:
                msg["name"] = m.name
            calls = m.tool_calls if isinstance(m, AssistantMessage) else None
            if native_tools:
                if calls:
                    msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                        "name": c.function.name, "arguments": _arguments(c.function.arguments, i, j)}}
                        for j, c in enumerate(calls)]
                if isinstance(m, ToolMessage) and m.tool_call_id is not None:
                    msg["tool_call_id"] = m.tool_call_id
            else:
                if calls:
                    rendered = "\n".join(render_call(c.function.name, c.function.arguments) for c in calls)
                    msg["content"] = f"{content}\n{rendered}" if content else rendered
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


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's /tokenize: a text `prompt`, or chat `messages` rendered as /v1/chat/completions renders them."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_with_rules)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    return_token_strs: bool | None = Field(False, description="Also return each token's string")

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        return [{"description": "exactly one of prompt and messages", "anyOf": [
            {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": _NULL}},
            {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": _NULL}}]},
            *cls.template_rules()]

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            given = "both" if self.prompt is not None else "neither"
            raise ClientError(f"give either 'prompt' (a text) or 'messages' (a chat), got {given}",
                              param="prompt" if self.prompt is None else "messages",
                              code="missing_required_parameter" if given == "neither" else "invalid_value")
        self.check_template()

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request whose prompt this one asks about (its fields are the same, already validated)."""
        fields = set(_ChatTemplateFields.model_fields) | {"model", "messages"}
        return ChatCompletionRequest.model_validate(self.model_dump(include=fields, exclude_unset=True))


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: token ids back to text (special tokens written out)."""

    model: str | None = None
    tokens: list[TokenId]


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


def _absent_if_none(value: Any) -> bool:
    return value is None


# A reasoning model's reasoning (serve/reasoning.py): left out of the JSON when there is none
def _reasoning_field(description: str) -> Any:
    return Field(None, exclude_if=_absent_if_none, description=description)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)
    reasoning_content: str | None = _reasoning_field("The model's reasoning (--reasoning-parser)")
    reasoning: str | None = _reasoning_field("reasoning_content, by its newer name")


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
    reasoning_content: str | None = _reasoning_field("The model's reasoning (--reasoning-parser)")
    reasoning: str | None = _reasoning_field("reasoning_content, by its newer name")


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


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(None, description="Only with return_token_strs true")


class DetokenizeResponse(BaseModel):
    prompt: str


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


# ---------------------------------------------------------------------------------------------- the Responses API
# POST /v1/responses: serve/responses_api.py turns a request into the chat request /v1/chat/completions serves, and
# the chat answer into a response object. Items and formats are told apart by `type`; the tags carry brackets so
# that an error's location names the real path (input.2.content, not input.2.message.content).
def _by_type(default: str | None) -> Any:
    def kind(value: Any) -> str | None:
        found = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        found = found if found is not None else default
        return f"[{found}]" if isinstance(found, str) else None

    return kind


class ResponseInputText(_Strict):
    type: Literal["input_text", "output_text"]  # an earlier answer's text comes back as output_text
    text: str


class ResponseInputMessage(_Strict):
    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]  # developer is read as system
    content: str | list[ResponseInputText]


class ResponseFunctionCallInput(_Strict):
    """An earlier answer's call (a function_call output item, sent back)."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str = Field(description="JSON text")


class ResponseFunctionCallOutputInput(_Strict):
    """A call's result."""

    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str


class ResponseReasoningInput(_Strict):
    """An earlier answer's reasoning, sent back with its output: it is left out of the prompt."""

    type: Literal["reasoning"]


_ITEM_TYPES = "message (or no type), function_call, function_call_output or reasoning"
ResponseInputItem = Annotated[
    Annotated[ResponseInputMessage, Tag("[message]")] | Annotated[ResponseFunctionCallInput, Tag("[function_call]")]
    | Annotated[ResponseFunctionCallOutputInput, Tag("[function_call_output]")]
    | Annotated[ResponseReasoningInput, Tag("[reasoning]")],
    Discriminator(_by_type("message"), custom_error_type="invalid_item",
                  custom_error_message=f"an input item's type is {_ITEM_TYPES}")]


class ResponseFunctionTool(_Strict):
    type: Literal["function"]  # the only kind of tool brisk serves
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None = no arguments
    strict: bool | None = None  # brisk enforces the schema whenever it constrains (tool_choice required / named)


class ResponseToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class ResponseTextFormatText(_Strict):
    type: Literal["text"]


class ResponseTextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class ResponseTextFormatJsonSchema(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(alias="schema", description="The JSON schema the output follows")
    strict: bool | None = None  # brisk always enforces the schema, strict or not


class ResponseTextConfig(_Strict):
    format: Annotated[
        Annotated[ResponseTextFormatText, Tag("[text]")] | Annotated[ResponseTextFormatJsonObject, Tag("[json_object]")]
        | Annotated[ResponseTextFormatJsonSchema, Tag("[json_schema]")],
        Discriminator(_by_type(None), custom_error_type="invalid_format",
                      custom_error_message="text.format's type is text, json_object or json_schema")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Has no effect")


class ResponseReasoningConfig(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="Passed to the chat template as the variable reasoning_effort")
    summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="Has no effect")


class ResponsesRequest(_Strict):
    """OpenAI's Responses API (POST /v1/responses), served as a chat completion (serve/responses_api.py)."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_with_rules)

    model: str | None = None
    input: str | Annotated[list[ResponseInputItem], Field(min_length=1)]
    instructions: str | None = Field(None, description="A system message in front of the conversation")
    previous_response_id: str | None = Field(
        None, description="Continue a stored response's conversation (this server keeps the latest ones in memory)")
    store: bool | None = Field(True, description="Keep the response for GET /v1/responses/{id} and "
                                                 "previous_response_id")
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseToolChoiceFunction | None = Field(
        None, description="Other than none, it needs tools, and a named function must be one of them; auto (the "
                          "default with tools) needs a server started with --enable-auto-tool-choice")
    parallel_tool_calls: bool | None = True
    text: ResponseTextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1), _INTEGRAL] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    reasoning: ResponseReasoningConfig | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16)
    stream: bool | None = False
    user: str | None = None
    background: Annotated[bool, Field(json_schema_extra={"const": False}), AfterValidator(_off)] | None = Field(
        False, description="Not supported: false or null only")
    truncation: Literal["disabled"] | None = Field(
        None, description="Not supported other than disabled: a conversation too long for the context is refused")
    conversation: None = Field(None, description="Not supported: null only (use previous_response_id)")
    top_logprobs: None = Field(None, description="Not supported: null only")

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        reasoning = {"type": "object", "required": ["type"], "properties": {"type": {"const": "reasoning"}}}
        return [{"description": "tool_choice other than none needs tools", "anyOf": [
            {"properties": {"tool_choice": {"enum": [None, "none"]}}},
            {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}]},
            {"description": "something to answer: instructions, a previous response, or an input item other than "
                            "reasoning", "anyOf": [
                {"properties": {"input": {"type": "string"}}},
                {"properties": {"input": {"contains": {"not": reasoning}}}},
                {"required": ["instructions"], "properties": {"instructions": {"type": "string"}}},
                {"required": ["previous_response_id"], "properties": {"previous_response_id": {"type": "string"}}}]}]


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ResponseReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponseMessageItem(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[ResponseOutputText]


class ResponseFunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


class ResponseReasoningItem(BaseModel):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ResponseReasoningText]
    status: ItemStatus


ResponseOutputItem = Annotated[ResponseMessageItem | ResponseFunctionCallItem | ResponseReasoningItem,
                               Field(discriminator="type")]


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseErrorInfo | None = None
    incomplete_details: ResponseIncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[ResponseOutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None  # the request's reasoning object
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


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
    errors = err.errors(include_url=False)
    # Of a union's branches, the one the value has the type of says more ("at least 1 item") than the others'
    # "should be a string": take the first bad field's first error that is not a mere type mismatch, if any.
    same_field = [e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]]
    first = next((e for e in same_field if not e["type"].endswith("_type")), errors[0])
    kind = first["type"]
    loc = list(first["loc"])
    role = None
    # a discriminated union puts its tag into the location: messages.<i>.<role>..., response_format.<type>...
    if kind not in _TAG_ERRORS:
        if len(loc) > 2 and loc[0] == "messages" and isinstance(loc[1], int) and loc[2] in ROLES:
            role = str(loc.pop(2))
        elif len(loc) > 1 and loc[0] == "response_format":
            loc.pop(1)
    # Union branches appear in the location as type names ('str', 'list[int]'); keep only the real path.
    path = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS))]
    if kind in _TAG_ERRORS:  # the discriminator itself: messages.<i>.role, response_format.type
        path.append(str(first.get("ctx", {}).get("discriminator", "")).strip("'\""))
    param = ".".join(path) or None
    field = path[-1] if path and not path[-1].isdigit() else (path[-2] if len(path) > 1 else None)
    where = f"messages[{path[1]}] ({role})" if role is not None else ""
    if kind in ("missing", "union_tag_not_found"):
        if field == "content" and role is not None:
            return ClientError(f"{where} needs a 'content'" + (": the tool's result" if role == "tool" else ""),
                               param=param, code="missing_required_parameter")
        param, message = _MISSING_HINTS.get(param or "", (param, f"'{param}' is required"))
        return ClientError(message, param=param, code="missing_required_parameter")
    if path and path[0] in _UNSUPPORTED and not kind.endswith("_type"):  # the schema allows only their "off" value
        return ClientError(f"{path[0]} is not supported by this server", param=path[0], code="unsupported_parameter")
    if kind == "extra_forbidden":  # structured_outputs: a misspelt constraint must not be dropped silently
        parent = ".".join(path[:-1])
        return ClientError(f"'{parent}' has an unknown field {path[-1]!r}; it takes one of {', '.join(KINDS)}",
                           param=param, code="invalid_value")
    if field == "tool_calls" and role is not None:
        return ClientError(f"{where} has tool_calls; only assistant messages call tools", param=param,
                           code="invalid_value")
    if len(path) > 3 and path[0] == "messages" and path[-3] == "content" and path[-1] == "type" and \
            kind == "literal_error":
        return ClientError(f"messages[{path[1]}].content[{path[-2]}] is of type {_short_repr(first.get('input'))}; "
                           "this server only takes text content parts ({'type': 'text', 'text': ...})", param=param,
                           code="unsupported_parameter")
    if kind == "string_too_short" and path[-1].isdigit() and field in _NON_EMPTY_ITEMS:
        param = ".".join(path[:-1])
        return ClientError(f"'{param}' must hold non-empty strings, got an empty string", param=param,
                           code="invalid_value")
    if kind == "too_short" and field in _NON_EMPTY_ITEMS:
        return ClientError(f"'{param}' must be a non-empty list of non-empty strings (got [])", param=param,
                           code="invalid_value")
    shape = _FIELD_SHAPES.get(field or "")
    if shape is not None and kind.endswith("_type"):
        message = f"'{param}' must be {shape}"
    elif kind in ("too_short", "string_too_short") and first.get("ctx", {}).get("min_length") == 1:
        message = f"'{param}' is empty: {first['msg']}"
    else:
        message = f"invalid '{param}': {first['msg']}"
    if "input" in first:
        message += f" (got {_short_repr(first['input'])})"
    return ClientError(message, param=param, code="invalid_value")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "literal", "NamedToolChoice",
              "constrained-str"}
_TAG_ERRORS = ("union_tag_invalid", "union_tag_not_found")
# OpenAI's and vLLM's features brisk refuses by name
_UNSUPPORTED = {"echo", "suffix", "logit_bias", "use_beam_search", "return_tokens_as_token_ids", "priority",
                "prompt_logprobs", "allowed_token_ids", "bad_words", "chat_template", "thinking_token_budget",
                "background"}
_NON_EMPTY_ITEMS = {"stop", "guided_choice", "choice"}  # lists of non-empty strings: an empty one names the list
# a required field whose absence deserves more than "is required": param -> (param to name, message)
_MISSING_HINTS = {"response_format.json_schema": (
    "response_format.json_schema.schema",
    "response_format of type 'json_schema' needs json_schema: {'name': ..., 'schema': {...}}")}


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(value), type(value).__name__)


def _short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
