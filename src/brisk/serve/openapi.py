"""The OpenAPI 3 description of the server (`/openapi.json`, `/docs`), from the models it really validates.

The POST routes read and validate their bodies themselves (app.read_json + protocol.parse_request: a size limit
while streaming, strict types, OpenAI error objects), so FastAPI cannot see a body parameter to describe.
Each route therefore declares its body and its answers here: the request body is the pydantic model's own JSON
schema (the one `parse_request` validates against), the 200 answer the response model the handler builds, and
every 4xx / 503 an ErrorResponse. Nothing is written by hand that pydantic could get out of step with.

Two facts of the running server narrow the published request schemas, as its handlers enforce them: `model` is
one of the names it serves (the model and its adapters, GET /v1/models), and token ids (a prompt's, /detokenize's)
are below its vocabulary size. The rest a handler still refuses a schema-valid request for depends on the prompt's
length in tokens (the context, the admission capacity) or on compiling a grammar, which no schema can say.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from brisk.serve.protocol import ErrorResponse

_REF = "#/components/schemas/{model}"


def error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


AUTH_ERRORS = {401: error("Missing or wrong API key (only when the server runs with --api-key)")}
BODY_ERRORS = {
    400: error("Invalid request: malformed JSON, a bad field, an unsupported feature, a prompt too long"),
    413: error("The request body is larger than --max-request-bytes"),
    503: error("The server is at its admission capacity; retry after the Retry-After header's seconds"),
}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` of a route whose handler validates a JSON body of `model` itself."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}}}}


def ok_response(model: type[BaseModel], description: str, streamed: str | None = None) -> dict[int | str, Any]:
    """A 200 answer of `model` as JSON, and (`streamed`) of server-sent events when the request sets stream."""
    answer: dict[str, Any] = {"model": model, "description": description}
    if streamed is not None:
        # OpenAPI 3.1: the schema of an event stream describes each event (its fields: data, event, id, retry)
        answer["content"] = {"text/event-stream": {"schema": {
            "type": "object", "description": streamed, "required": ["data"],
            "properties": {"data": {"type": "string", "description": "A JSON chunk, or [DONE] at the end"}}}}}
    return {200: answer}


@dataclass
class ServedFacts:
    """What a request's schema depends on in the running server."""

    model_names: list[str]  # the served model's name, then its adapters'
    vocab_size: int


def install_openapi(app: FastAPI, request_models: list[type[BaseModel]],
                    facts: Callable[[], ServedFacts] | None = None) -> None:
    """Make `app.openapi()` FastAPI's own schema plus the JSON schemas of `request_models` as components, narrowed
    by `facts` (read anew for every call: adapters come and go)."""

    def openapi() -> dict[str, Any]:
        base = _base()
        if facts is None:
            return base
        return _narrowed(base, facts(), [m.__name__ for m in request_models])

    def _base() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in request_models:
                body = model.model_json_schema(ref_template=_REF, mode="validation")
                for name, sub in body.pop("$defs", {}).items():
                    assert components.get(name, sub) == sub, f"two different schemas are named {name}"
                    components[name] = sub
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _narrowed(base: dict[str, Any], facts: ServedFacts, names: list[str]) -> dict[str, Any]:
    schema = copy.deepcopy(base)
    components = schema["components"]["schemas"]
    for name in names:
        props = components[name]["properties"]
        if "model" in props:
            props["model"] = {"anyOf": [{"enum": facts.model_names}, {"type": "null"}], "default": None,
                              "title": "Model", "description": "The served model or one of its adapters "
                                                               "(GET /v1/models); null = the served model"}
        for field in ("prompt", "tokens", "input"):  # token ids: /v1/completions' prompt, /detokenize's tokens,
            # /v1/embeddings' input
            if field in props:
                _cap_integers(props[field], facts.vocab_size - 1)
    return schema


def _cap_integers(schema: Any, maximum: int) -> None:
    """Every integer in `schema` (a prompt's token ids) at most `maximum`."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = maximum
        for value in schema.values():
            _cap_integers(value, maximum)
    elif isinstance(schema, list):
        for value in schema:
            _cap_integers(value, maximum)
