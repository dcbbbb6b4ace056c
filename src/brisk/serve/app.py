"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncEngine.

Every request is validated here, before it reaches the engine: JSON and field types (protocol.py), the
model name, token ids, prompt length against the context, admission capacity. Anything a client can send
is answered with an OpenAI error object and a 4xx status; a 500 means a bug in brisk, never bad input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from brisk import __version__
from brisk.engine.config import parse_size
from brisk.engine.llm_engine import LLMEngine
from brisk.engine.sampling_defaults import SamplingDefaults
from brisk.engine.sampling_params import SamplingParams
from brisk.serve import responses, tool_parsers, tools
from brisk.serve.async_engine import (
    AsyncEngine,
    ClientDisconnected,
    EngineDeadError,
    EngineError,
    EngineRequest,
    RequestStream,
    ServerOverloadedError,
)
from brisk.serve.metrics import CONTENT_TYPE, ServerMetrics
from brisk.serve.openapi import AUTH_ERRORS, BODY_ERRORS, ServedFacts, install_openapi, ok_response, request_body
from brisk.serve.openapi import error as _error_doc
from brisk.serve.pooling import REQUEST_MODELS as POOLING_REQUEST_MODELS
from brisk.serve.pooling import PoolingSetup, install_pooling_routes
from brisk.serve.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ClientError,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    HealthStatus,
    ModelCard,
    ModelList,
    SamplingDefaultsInfo,
    TokenizeRequest,
    TokenizeResponse,
    parse_request,
)
from brisk.serve.reasoning import REASONING_PARSERS, ReasoningParser
from brisk.serve.responses_api import (
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
    ResponseStore,
    Turn,
    responses_errors,
)
from brisk.serve.security import AccessPolicy, RequestGuard
from brisk.structured.params import StructuredOutputError, StructuredOutputsParams

logger = logging.getLogger("brisk.serve")

# OpenAI's default max_tokens for /v1/completions; chat completions default to "until the context is full".
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Seconds a client told "overloaded" should wait before retrying (the openai client honours Retry-After).
RETRY_AFTER_S = 1
# What serve/security.py refuses before any route runs (documented on the POST routes, where a browser sends them)
GUARD_ERRORS = {403: _error_doc("A web page's request: an Origin not allowed (--allowed-origins), or a Host this "
                                "loopback server does not answer to (--allowed-hosts)"),
                415: _error_doc("The body was not sent as 'Content-Type: application/json'")}


@dataclass
class ServerConfig:
    served_model_name: str | None = None  # None = the model's own name
    api_key: str | None = None  # None = no authentication
    max_waiting: int = 128  # sequences admitted beyond the running batch; more get 503
    # Browsers (serve/security.py): the web origins besides the server's own whose pages may call it (CORS is
    # answered for them; "*" = any), and the Host names it answers to besides loopback ones and `host`, where it
    # is bound (a loopback-bound server refuses any other Host; "*" = any).
    allowed_origins: list[str] = field(default_factory=list)
    allowed_hosts: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"  # run_server sets the address it binds
    access: AccessPolicy = field(init=False, repr=False)  # the three above, checked
    max_request_bytes: int | str = "1MiB"
    lora_modules: dict[str, str] = field(default_factory=dict)  # --lora-modules name=path (needs --enable-lora)
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse the model's tool calls (serve/tools.py)
    tool_call_parser: str | None = None  # the model family's tool-call syntax (serve/tool_parsers.py); None = hermes
    reasoning_parser: str | None = None  # deepseek_r1 | qwen3: the answer's reasoning apart (serve/reasoning.py)
    # embeddings, rerank, score (serve/pooling.py): the task served (generate: generation, embeddings and yes/no
    # reranking; embed: embeddings, reranking by cosine similarity, no generation; rerank: yes/no reranking and
    # embeddings, no generation), the pooling (None: the model's files, else last), a rerank prompt template
    task: str = "generate"
    pooling: str | None = None
    rerank_template: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown --reasoning-parser {self.reasoning_parser!r}; brisk parses "
                             f"{', '.join(REASONING_PARSERS)}")
        tool_parsers.resolve_parser(self.tool_call_parser, None)  # an unknown name: ValueError
        if self.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {self.max_waiting}")
        self.max_request_bytes = parse_size(self.max_request_bytes)
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty; leave it out to serve without authentication")
        self.access = AccessPolicy(self.host, self.allowed_origins, self.allowed_hosts)  # bad entries: ValueError


class _Server:
    """What the routes share: the engine loop, the tokenizer, limits, metrics."""

    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.sampling_defaults = engine.sampling_defaults
        self.model_name = config.served_model_name or engine.loaded.name
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine.num_blocks)
        from brisk.serve.lora import LoRARegistry

        self.loras = LoRARegistry(engine, config.lora_modules, self.model_name)  # serve/lora.py
        self.engine = AsyncEngine(engine, max_waiting=config.max_waiting, metrics=self.metrics)
        self.llm_engine = engine
        self.native_tools = tools.template_supports_tools(engine.tokenizer.chat_template)
        self.tool_parser = tool_parsers.resolve_parser(config.tool_call_parser, engine.tokenizer.chat_template)
        self.reasoning = None if config.reasoning_parser is None else ReasoningParser(config.reasoning_parser)
        self.pooling = PoolingSetup.build(engine, config.task, config.pooling, config.rerank_template)

    def check_generation(self) -> None:
        """Completions are refused by a server started for embeddings or reranking (--task embed | rerank)."""
        if self.config.task != "generate":
            raise ClientError(f"this server was started with --task {self.config.task}: it serves "
                              "/v1/embeddings, /v1/rerank and /v1/score, not generation", code="task_not_served")

    # ------------------------------------------------------------------ request checks
    def check_model(self, model: str | None) -> str:
        if self.loras.get(model) is not None:
            return model  # type: ignore[return-value]
        if model is not None and model != self.model_name and self.loras.enabled:  # vLLM's answer: 404
            raise ClientError(f"the model {model!r} does not exist on this server; it serves {self.model_name!r} and "
                              f"the adapters {sorted(self.loras.adapters)} (see GET /v1/models)", param="model",
                              code="model_not_found", status_code=404, err_type="not_found_error")
        if model is not None and model != self.model_name:
            raise ClientError(f"the model {model!r} does not exist on this server; it serves {self.model_name!r} "
                              "(see GET /v1/models)", param="model", code="model_not_found")
        return self.model_name

    def check_prompt_ids(self, ids: list[int], param: str) -> list[int]:
        if not ids:
            raise ClientError(f"'{param}' is empty; give at least one token", param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ClientError(f"'{param}' has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                              param=param, code="invalid_value")
        return ids

    def max_tokens_for(self, ids: list[int], requested: int | None, default: int | None, param: str,
                       prompt_param: str) -> int:
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ClientError(f"the prompt has {len(ids)} tokens, which leaves no room to generate within this "
                              f"model's context of {self.max_model_len} tokens (max_model_len); shorten the prompt",
                              param=prompt_param, code="context_length_exceeded")
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise ClientError(f"'{param}'={requested} plus the prompt's {len(ids)} tokens exceeds this model's "
                              f"context of {self.max_model_len} tokens (max_model_len); ask for at most {room} "
                              "tokens or shorten the prompt", param=param, code="context_length_exceeded")
        return requested

    def check_capacity(self, num_seqs: int, param: str) -> None:
        """A request larger than the whole admission capacity could never be admitted: 400, not 503."""
        if num_seqs > self.engine.capacity:
            raise ClientError(f"this request needs {num_seqs} sequences (n x prompts) but the server admits at most "
                              f"{self.engine.capacity} at once; lower n or send fewer prompts per request",
                              param=param, code="invalid_value")

    def check_constraints(self, constraints: list[tuple[StructuredOutputsParams, str]]) -> None:
        """Compile each constraint (or find it in the engine's cache) before the request is admitted, so a schema,
        regex or grammar that cannot be enforced is a 400 naming the field, not an error after the 200."""
        if not constraints:
            return
        compiler = self.llm_engine.grammar_compiler()
        for params, param in constraints:
            try:
                compiler.compile(params)
            except StructuredOutputError as e:
                raise ClientError(f"{param}: {e.message}", param=param, code="invalid_value") from None

    def chat_constraints(self, req: ChatCompletionRequest) -> tuple[StructuredOutputsParams | None,
                                                                    list[tuple[StructuredOutputsParams, str]]]:
        """(what generation is constrained to, every constraint to check first) for a chat request."""
        structured, param = req.structured_request()
        mode = req.tool_mode
        if mode == "none":
            return structured, [(structured, param)] if structured is not None else []
        if structured is not None:
            raise ClientError(f"{param} cannot be combined with tools (tool_choice {mode!r}); leave one out, or send "
                              "tool_choice 'none'", param=param, code="invalid_value")
        if mode == "auto" and not self.config.enable_auto_tool_choice:
            raise ClientError("tool_choice 'auto' (the default when tools are given) needs a server started with "
                              "--enable-auto-tool-choice; send tool_choice 'required', a named function or 'none', "
                              "or restart the server with that flag", param="tool_choice",
                              code="unsupported_parameter")
        specs = req.tool_dicts()
        checks = [(tools.named_constraint(t), f"tools.{i}.function.parameters") for i, t in enumerate(specs)]
        if mode == "required":
            constraint = tools.required_constraint(specs, parallel=req.parallel_tool_calls is not False)
            checks.append((constraint, "tools"))
            return constraint, checks
        if mode == "named":
            name = req.tool_choice.function.name  # type: ignore[union-attr]
            i = next(i for i, t in enumerate(specs) if t["function"]["name"] == name)
            return checks[i][0], checks
        return None, checks

    # ------------------------------------------------------------------ request -> engine requests
    def completion_requests(self, req: CompletionRequest, request_id: str,
                            structured: StructuredOutputsParams | None = None) -> list[EngineRequest]:
        prompt = req.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):  # the schema has no empty prompt
            prompts: list[Any] = [prompt]
        else:
            prompts = list(prompt)
        self.check_capacity(len(prompts) * (req.n or 1), "n" if len(prompts) == 1 else "prompt")  # before tokenizing
        out = []
        for i, p in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
            ids = self.tokenizer.encode(p, add_special_tokens=req.add_special_tokens is not False) \
                if isinstance(p, str) else list(p)
            ids = self.check_prompt_ids(self.truncate(ids, req.truncate_prompt_tokens), param)
            max_tokens = self.max_tokens_for(ids, req.max_tokens,
                                             self.sampling_defaults.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS,
                                             "max_tokens", param)
            params = _sampling_params(req, max_tokens, req.logprobs, self.sampling_defaults, structured)
            out.append(EngineRequest(f"{request_id}-{i}", ids, params, self.loras.get(req.model)))
        return out

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as the context holds)."""
        if keep is None:
            return ids
        keep = self.max_model_len if keep == -1 else keep
        return ids[-keep:] if len(ids) > keep else ids

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[str, list[int]]:
        """(the rendered prompt, its token ids) of a conversation; ClientError when it cannot be rendered."""
        try:
            messages = req.template_messages(native_tools=self.native_tools)
            kwargs: dict[str, Any] = req.template_kwargs()
            if req.tool_mode != "none":
                if self.native_tools:
                    kwargs["tools"] = req.tool_dicts()
                else:  # the template has no place for tools: list them in the system prompt (serve/tools.py)
                    prompt = tool_parsers.get_parser(self.tool_parser).system_prompt(req.tool_dicts())
                    if messages[0]["role"] == "system":
                        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
                    else:
                        messages.insert(0, {"role": "system", "content": prompt})
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=req.generation_prompt,
                                                      **kwargs)
            if req.continue_final_message:
                text = _open_final_message(text, messages[-1]["content"])
        except ClientError:
            raise
        except ValueError as e:  # no chat template, or the template rejected the conversation
            raise ClientError(str(e), param="messages") from None
        return text, self.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))

    def reasoning_for(self, req: ChatCompletionRequest, prompt: str, constraint_param: str | None
                      ) -> ReasoningParser | None:
        """The parser that splits this request's answer, None when it has no reasoning to split. Constrained
        generation (structured outputs, tool_choice required or named) cannot start after the reasoning, so a
        request that would reason first is refused rather than have its reasoning constrained."""
        if self.reasoning is None or not self.reasoning.active(req.chat_template_kwargs, prompt):
            return None
        if constraint_param is not None:
            off = (" or send chat_template_kwargs {\"enable_thinking\": false}" if self.reasoning.name == "qwen3"
                   else "")
            raise ClientError(f"{constraint_param} cannot be combined with reasoning (--reasoning-parser "
                              f"{self.reasoning.name}): brisk would constrain the reasoning too, not only the answer "
                              f"after {self.reasoning.end}; leave {constraint_param} out{off}",
                              param=constraint_param, code="unsupported_parameter")
        return self.reasoning

    def chat_requests(self, req: ChatCompletionRequest, request_id: str,
                      structured: StructuredOutputsParams | None = None,
                      prompt_ids: list[int] | None = None) -> list[EngineRequest]:
        ids = self.chat_prompt(req)[1] if prompt_ids is None else prompt_ids
        ids = self.check_prompt_ids(self.truncate(ids, req.truncate_prompt_tokens), "messages")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens_for(ids, req.requested_max_tokens, self.sampling_defaults.max_tokens, param,
                                         "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        self.check_capacity(req.n or 1, "n")
        return [EngineRequest(f"{request_id}-0", ids,
                              _sampling_params(req, max_tokens, logprobs, self.sampling_defaults, structured),
                              self.loras.get(req.model))]

    async def open_chat(self, req: ChatCompletionRequest, request_id: str,
                        receive: Any) -> tuple[responses.Context, RequestStream]:
        """A chat request checked, rendered and admitted: its response context and its engine stream (what
        /v1/chat/completions answers from, and /v1/responses through serve/responses_api.py)."""
        req.check()
        ctx = responses.Context(request_id, int(time.time()), self.check_model(req.model), self.tokenizer,
                                req.n or 1, _holdback(req.stop), tool_mode=req.tool_mode)
        if req.tool_mode == "named":
            ctx.tool_name = req.tool_choice.function.name  # type: ignore[union-attr]
        elif req.tool_mode == "auto":
            ctx.tool_parser = tool_parsers.get_parser(self.tool_parser, req.tool_dicts())
        structured, checks = self.chat_constraints(req)
        prompt, ids = self.chat_prompt(req)
        constraint_param = None if structured is None else (
            "tool_choice" if req.tool_mode in ("required", "named") else req.structured_request()[1])
        ctx.reasoning = self.reasoning_for(req, prompt, constraint_param)
        ctx.include_reasoning = req.include_reasoning is not False
        engine_requests = self.chat_requests(req, ctx.request_id, structured, ids)
        if checks:
            await run_in_threadpool(self.check_constraints, checks)
        return ctx, self.engine.open_stream(engine_requests, receive)


def _open_final_message(text: str, content: str) -> str:
    """continue_final_message: the rendered conversation cut after the last message's content (as transformers
    does), so that the model goes on writing it."""
    content = content.strip()
    end = text.rfind(content)
    if end < 0:
        raise ClientError("continue_final_message: the last message's content does not appear in the prompt the "
                          "chat template wrote, so it cannot be left open", param="continue_final_message",
                          code="invalid_value")
    return text[:end + len(content)]


def _sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                     logprobs: int | None, defaults: SamplingDefaults,
                     structured: StructuredOutputsParams | None = None) -> SamplingParams:
    try:
        return req.to_sampling_params(max_tokens, logprobs, defaults, structured)
    except ValueError as e:  # SamplingParams' messages start with the field name ("top_p must be ...")
        name = str(e).split(" ", 1)[0]
        raise ClientError(str(e), param=name if name in type(req).model_fields else None,
                          code="invalid_value") from None


# ---------------------------------------------------------------------------------------------- errors
def _error_response(status: int, message: str, err_type: str, param: str | None = None,
                    code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


_HTTP_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                     413: "invalid_request_error"}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ClientError)
    async def client_error(_: Request, e: ClientError) -> JSONResponse:
        return _error_response(e.status_code, e.message, e.err_type, e.param, e.code)

    @app.exception_handler(ServerOverloadedError)
    async def overloaded(_: Request, e: ServerOverloadedError) -> JSONResponse:
        return _error_response(503, str(e), "server_overloaded", code="server_overloaded",
                               headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /v1/completions, /v1/chat/completions, "\
                      "/v1/models, /tokenize, /detokenize, /health, /metrics, /openapi.json"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(e.detail)
        return _error_response(e.status_code, message, _HTTP_ERROR_TYPES.get(e.status_code, "invalid_request_error"),
                               headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(400, f"invalid request: {e.errors()[0].get('msg')}", "invalid_request_error")

    @app.exception_handler(ClientDisconnected)
    async def disconnected(_: Request, e: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, e: EngineError) -> JSONResponse:
        if isinstance(e, EngineDeadError):
            return _error_response(503, str(e), "internal_error", code="engine_dead")
        return _error_response(500, str(e), "internal_error", code="engine_error")


class _CountRequests:
    """Pure ASGI middleware counting answered requests by endpoint and status (BaseHTTPMiddleware would
    wrap `receive` and break the disconnect watcher)."""

    def __init__(self, app: Any, metrics: ServerMetrics, endpoints: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_and_record(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            path = scope.get("path", "")
            self.metrics.requests.labels(path if path in self.endpoints else "other", str(status[0])).inc()


# ---------------------------------------------------------------------------------------------- the app
def create_app(engine: LLMEngine, config: ServerConfig | None = None, *, engine_thread: bool = True) -> FastAPI:
    """The ASGI app. The engine loop starts with the app's lifespan and stops with it: on a thread of its own,
    or (engine_thread=False) on the thread that calls `app.state.server.engine.run()` once the lifespan began."""
    # anyio (>= 4.16) imports its submodules lazily, and two threads resolving them at once can fail: a fresh
    # server's first streamed response once died with "No module named 'anyio.abc._sockets'" (500) while a thread-
    # pool worker was importing too. Import its asyncio backend here, on the one thread that builds the app.
    import anyio._backends._asyncio  # noqa: F401

    server = _Server(engine, config or ServerConfig())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        server.engine.start(own_thread=engine_thread)
        try:
            yield
        finally:
            server.engine.shutdown()

    # The schema and its Swagger page are public even with --api-key (as vLLM serves them): they describe the API
    # and hold nothing of the model's or the clients'.
    app = FastAPI(title="brisk", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json",
                  description="OpenAI-compatible completions and chat completions over brisk's continuous-batching "
                              "engine. A sampling field a request omits takes the model's default (GET /v1/models "
                              "shows them).")
    app.state.server = server
    _install_error_handlers(app)
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest,
                          *POOLING_REQUEST_MODELS, ResponsesRequest],
                    lambda: ServedFacts([server.model_name, *server.loras.adapters], server.vocab_size))

    async def check_api_key(request: Request) -> None:
        key = server.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ClientError("missing API key: send the header 'Authorization: Bearer <key>'", status_code=401,
                              err_type="authentication_error", code="invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), key.encode()):  # constant time: no timing oracle
            raise ClientError("invalid API key", status_code=401, err_type="authentication_error",
                              code="invalid_api_key")

    auth = [Depends(check_api_key)]

    async def read_json(request: Request) -> Any:
        limit = server.config.max_request_bytes
        too_large = ClientError(f"the request body is larger than this server's limit of {limit} bytes "
                                "(--max-request-bytes)", status_code=413, code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:
            raise ClientDisconnected() from None
        body = b"".join(chunks)
        if not body.strip():
            raise ClientError("the request body is empty; send a JSON object", code="invalid_json")
        try:
            return json.loads(body)
        except RecursionError:
            raise ClientError("the request body is nested too deeply to parse", code="invalid_json") from None
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise ClientError(f"the request body is not valid JSON: {e}", code="invalid_json") from None

    @app.get("/health", responses={**ok_response(HealthStatus, "The engine loop is running"),
                                   503: _error_doc("The engine loop is not running")})
    async def health() -> Response:
        if not server.engine.is_running:
            why = f": {server.engine.dead}" if server.engine.dead else ""
            return _error_response(503, f"the engine loop is not running{why}", "internal_error", code="engine_down")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", responses={200: {"description": "Prometheus text exposition format",
                                          "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=auth,
             responses={**ok_response(ModelList, "The served model, its context and its sampling defaults"),
                        **AUTH_ERRORS})
    async def models() -> JSONResponse:
        card = ModelCard(id=server.model_name, created=server.created, max_model_len=server.max_model_len,
                         sampling_defaults=SamplingDefaultsInfo(**server.sampling_defaults.as_dict()))
        adapters = [card.model_copy(update={"id": name}) for name in server.loras.adapters]
        return JSONResponse(ModelList(data=[card, *adapters]).model_dump())

    @app.post("/v1/completions", dependencies=auth, openapi_extra=request_body(CompletionRequest),
              responses={**ok_response(CompletionResponse, "The completions (stream false)",
                                       streamed="stream true: server-sent events, each `data: ` a CompletionResponse "
                                                "chunk, then `data: [DONE]`"), **BODY_ERRORS, **AUTH_ERRORS,
                         **GUARD_ERRORS})
    async def completions(request: Request) -> Response:
        req = parse_request(CompletionRequest, await read_json(request))
        server.check_generation()
        req.check()
        ctx = responses.Context(f"cmpl-{uuid.uuid4().hex}", int(time.time()), server.check_model(req.model),
                                server.tokenizer, req.n or 1, _holdback(req.stop))
        structured, param = req.structured_request()
        engine_requests = server.completion_requests(req, ctx.request_id, structured)
        if structured is not None:
            await run_in_threadpool(server.check_constraints, [(structured, param)])
        stream = server.engine.open_stream(engine_requests, request.receive)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return _sse(responses.completion_events(stream, ctx, req.logprobs, include_usage), stream)
        outputs = await _collect(stream)
        return JSONResponse(responses.completion_response(outputs, ctx, req.logprobs).model_dump())

    @app.post("/v1/chat/completions", dependencies=auth, openapi_extra=request_body(ChatCompletionRequest),
              responses={**ok_response(ChatCompletionResponse, "The chat completion (stream false)",
                                       streamed="stream true: server-sent events, each `data: ` a "
                                                "ChatCompletionChunk, then `data: [DONE]`"),
                         **BODY_ERRORS, **AUTH_ERRORS, **GUARD_ERRORS})
    async def chat_completions(request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, await read_json(request))
        server.check_generation()
        ctx, stream = await server.open_chat(req, f"chatcmpl-{uuid.uuid4().hex}", request.receive)
        top = (req.top_logprobs or 0) if req.logprobs else None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return _sse(responses.chat_events(stream, ctx, top, include_usage), stream)
        outputs = await _collect(stream)
        return JSONResponse(responses.chat_response(outputs, ctx, top).model_dump())

    @app.post("/tokenize", dependencies=auth, openapi_extra=request_body(TokenizeRequest),
              responses={**ok_response(TokenizeResponse, "The prompt's token ids (a chat rendered by its template, "
                                                         "as /v1/chat/completions renders it)"),
                         **BODY_ERRORS, **AUTH_ERRORS, **GUARD_ERRORS})
    async def tokenize(request: Request) -> JSONResponse:
        req = parse_request(TokenizeRequest, await read_json(request))
        req.check()
        server.check_model(req.model)
        if req.messages is not None:
            ids = server.chat_prompt(req.chat_request())[1]
        else:
            ids = server.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens is not False)
        strs = [server.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if req.return_token_strs \
            else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=server.max_model_len, tokens=ids,
                                             token_strs=strs).model_dump())

    @app.post("/detokenize", dependencies=auth, openapi_extra=request_body(DetokenizeRequest),
              responses={**ok_response(DetokenizeResponse, "The text of the token ids, special tokens written out"),
                         **BODY_ERRORS, **AUTH_ERRORS, **GUARD_ERRORS})
    async def detokenize(request: Request) -> JSONResponse:
        req = parse_request(DetokenizeRequest, await read_json(request))
        server.check_model(req.model)
        bad = [t for t in req.tokens if t >= server.vocab_size]
        if bad:
            raise ClientError(f"'tokens' has token ids outside the vocabulary [0, {server.vocab_size}): {bad[:5]}",
                              param="tokens", code="invalid_value")
        return JSONResponse(DetokenizeResponse(prompt=server.tokenizer.decode(req.tokens, skip_special_tokens=False))
                            .model_dump())

    # embeddings, rerank, score (serve/pooling.py)
    install_pooling_routes(app, server, auth, read_json, {**BODY_ERRORS, **AUTH_ERRORS, **GUARD_ERRORS})

    # the Responses API, served as a chat completion (serve/responses_api.py)
    response_store = ResponseStore()
    not_stored = {404: _error_doc("No response of that id is stored (the server keeps the latest ones sent with "
                                  "store true, in memory)")}

    @app.post("/v1/responses", dependencies=auth, openapi_extra=request_body(ResponsesRequest),
              responses={**ok_response(ResponseObject, "The response (stream false)",
                                       streamed="stream true: server-sent events, each `event: ` its type and "
                                                "`data: ` a JSON event with its `type` and `sequence_number`, from "
                                                "response.created to response.completed (response.incomplete when "
                                                "max_output_tokens cut the answer)"),
                         **BODY_ERRORS, **not_stored, **AUTH_ERRORS, **GUARD_ERRORS})
    async def create_response(request: Request) -> Response:
        req = parse_request(ResponsesRequest, await read_json(request))
        turn = Turn(req, response_store, server.sampling_defaults.as_dict())
        with responses_errors():
            ctx, stream = await server.open_chat(turn.chat, turn.id, request.receive)
        if req.stream:
            return _sse(turn.events(responses.chat_events(stream, ctx, None, True), ctx.model), stream)
        outputs = await _collect(stream)
        return JSONResponse(turn.answer(responses.chat_response(outputs, ctx, None)))

    @app.get("/v1/responses/{response_id}", dependencies=auth,
             responses={**ok_response(ResponseObject, "A stored response"), **not_stored, **AUTH_ERRORS})
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(response_store.lookup(response_id).response)

    @app.delete("/v1/responses/{response_id}", dependencies=auth,
                responses={**ok_response(ResponseDeleted, "The response is no longer stored"), **not_stored,
                           **AUTH_ERRORS})
    async def delete_response(response_id: str) -> JSONResponse:
        response_store.lookup(response_id)
        response_store.pop(response_id)
        return JSONResponse(ResponseDeleted(id=response_id).model_dump())

    if server.loras.enabled:  # the runtime adapter routes exist only on a server started with --enable-lora
        from brisk.serve.lora import install_lora_routes

        install_lora_routes(app, server.loras, auth)
    # outermost first: every answer counted, then the browser checks (serve/security.py), then CORS for the
    # origins they let through
    if server.config.access.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=server.config.access.allowed_origins,
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(RequestGuard, policy=server.config.access)
    endpoints = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
                 "/detokenize", "/openapi.json", "/docs", "/v1/embeddings", "/v1/rerank", "/rerank", "/v1/score",
                 "/v1/responses"}
    app.add_middleware(_CountRequests, metrics=server.metrics, endpoints=endpoints)
    return app


def _holdback(stop: str | list[str] | None) -> int:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    return max((len(s) for s in stops), default=1) - 1


async def _collect(stream: RequestStream) -> dict[int, Any]:
    """Wait for every prompt's final output (prompt index -> RequestOutput)."""
    try:
        final = {}
        async for index, out in stream:
            if out.finished:
                final[index] = out
        return final
    except ValueError as e:  # the engine refused a prompt the handler let through
        raise ClientError(str(e)) from None
    finally:
        stream.close()


def _sse(events: AsyncIterator[str], stream: RequestStream) -> StreamingResponse:
    # The background close covers a response whose body is never iterated (client gone before it starts).
    async def close() -> None:  # async, so Starlette runs it on the event loop and not in a worker thread
        stream.close()

    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(close),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def run_server(engine: LLMEngine, config: ServerConfig | None = None, *, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info", access_log: bool = True) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM).

    The engine loop runs on the main thread, which loaded the model, and uvicorn's event loop on a second
    thread. The other way round, torch's kernels ran 15-25% slower (a 128-sequence decode step 449 -> 569 ms,
    small ops up to 2x): the engine thread was then a second OpenMP root next to the main thread's, and
    libgomp's idle team still cost the new one (OMP_WAIT_POLICY=PASSIVE removed the gap, at a price for
    batch-1 latency)."""
    import signal

    import uvicorn

    # the browser checks need the address really bound (a loopback one refuses other Host names)
    config = ServerConfig(host=host) if config is None else dataclasses.replace(config, host=host)
    app = create_app(engine, config, engine_thread=False)
    web = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log,
                                        timeout_graceful_shutdown=5))
    http_thread = threading.Thread(target=web.run, name="brisk-http", daemon=True)  # no signal handlers there

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # both explicitly: a process started in the background by a shell has SIGINT ignored otherwise
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    async_engine: AsyncEngine = app.state.server.engine
    http_thread.start()
    try:
        while not async_engine.ready.wait(0.1):  # the lifespan has started: requests can come in
            if not http_thread.is_alive():  # uvicorn could not start (it logged why: port in use, ...)
                raise SystemExit(1)
        async_engine.run()  # until the lifespan's shutdown stops it, or a signal
    except KeyboardInterrupt:
        pass
    finally:
        web.should_exit = True
        http_thread.join(timeout=15)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not web.started:  # it never listened (the lifespan ran, then binding failed: it logged why)
        raise SystemExit(1)
    if async_engine.dead is not None:  # the engine cannot go on: exit non-zero so a supervisor restarts brisk
        logger.error("the engine is down (%s); the server stopped", async_engine.dead)
        raise SystemExit(1)
