"""The server's OpenAPI schema, and schemathesis fuzzing a live server over it.

The schema must be valid OpenAPI 3 and describe every route with the models the handlers really validate and
build. schemathesis then sends schema-generated requests (valid and invalid) to every operation of a real
`brisk serve` on 127.0.0.1 and checks each answer: no 5xx, a status code and content type the schema lists,
a body that matches the schema, invalid data rejected, valid data accepted. A bounded number of examples per
operation keeps it to seconds; afterwards no KV block may still be held. A longer run: docs/serving.md, figures
in BENCHMARKS.md.
"""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hf_utils import make_tiny_hf_model
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import validate
from schemathesis import GenerationMode
from test_serve import scrape

from brisk.serve.process import ServerProcess

# A context that holds the made-up conversations, and answers of at most MAX_TOKENS tokens (the default, and the
# cap the valid cases are held to below): any request schemathesis makes up (n up to 16) ends quickly.
MAX_TOKENS = 2
ENGINE_ARGS = ["--max-model-len", "4096", "--kv-cache-memory", "48MiB", "--max-num-seqs", "16", "--max-waiting", "512",
               "--override-generation-config", json.dumps({"max_new_tokens": MAX_TOKENS}), "--enable-auto-tool-choice"]
MAX_EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 6}  # per operation


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-fuzz")
    make_tiny_hf_model(path, "llama", seed=3)
    proc = ServerProcess(["--model", str(path), "--served-model-name", "tiny", *ENGINE_ARGS], startup_timeout_s=90)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def test_openapi_json_is_valid_openapi_3_and_describes_every_route(fuzz_server):
    spec = httpx.get(f"{fuzz_server.url}/openapi.json", timeout=10).json()
    validate(spec)  # raises on any violation of the OpenAPI 3.1 meta-schema
    assert spec["openapi"].startswith("3.")
    assert {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize",
            "/detokenize", "/v1/embeddings", "/v1/rerank", "/rerank", "/v1/score", "/v1/responses",
            "/v1/responses/{response_id}"} <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    for path, request, response in [("/v1/completions", "CompletionRequest", "CompletionResponse"),
                                    ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse")]:
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{request}"}
        assert op["responses"]["200"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{response}"}
        assert "text/event-stream" in op["responses"]["200"]["content"]
        assert {"400", "401", "413", "503"} <= set(op["responses"])
    # the request models' own fields and limits, as pydantic validates them
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    n = schemas["ChatCompletionRequest"]["properties"]["n"]["anyOf"][0]
    assert (n["minimum"], n["maximum"]) == (1, 16)
    # the rules the handlers enforce, stated: content per role, tool_calls on assistant messages only, no empty
    # prompt, the closed structured_outputs object, the rules across fields
    assert "content" in schemas["ToolMessage"]["required"] and "content" not in schemas["AssistantMessage"]["required"]
    assert schemas["UserMessage"]["properties"]["tool_calls"]["anyOf"][0]["maxItems"] == 0
    assert all(branch.get("minItems", branch.get("minLength")) == 1
               for branch in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"])
    assert schemas["StructuredOutputs"]["additionalProperties"] is False
    assert len(schemas["ChatCompletionRequest"]["allOf"]) == 4
    # and what the running server adds: the names it serves, its vocabulary
    assert schemas["CompletionRequest"]["properties"]["model"]["anyOf"][0] == {"enum": ["tiny"]}
    token_ids = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"][2]["items"]
    assert (token_ids["minimum"], token_ids["maximum"]) == (0, 383)  # the tiny model's 384 ids
    assert "sampling_defaults" in schemas["ModelCard"]["required"]
    assert httpx.get(f"{fuzz_server.url}/docs", timeout=10).status_code == 200


def test_integral_numbers_are_integers_as_json_schema_says(fuzz_server):
    url = f"{fuzz_server.url}/v1/completions"
    body = {"prompt": "Emma", "max_tokens": 2.0, "n": 2.0, "best_of": 2, "seed": 7.0}
    resp = httpx.post(url, json=body, timeout=60)
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 2, resp.text
    resp = httpx.post(url, json={**body, "n": 2.5}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n", resp.text


OPERATIONS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
              ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("POST", "/v1/embeddings"), ("POST", "/v1/rerank"), ("POST", "/v1/score"), ("POST", "/v1/responses"),
              ("GET", "/v1/responses/{response_id}")]


# Every built-in check runs, positive_data_acceptance included: the schema states what the handlers refuse, as
# far as JSON Schema can. What it cannot state, the valid cases are brought within by `within_server_rules`.
# (Hypothesis drives schemathesis' strategies directly: its pytest plugin does not run under pytest 9.)
# schema-valid requests to every operation; invalid ones to those with a body (the GET routes take no input)
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"]


@pytest.mark.parametrize("method,path,mode", CASES)
def test_fuzz_operation(api_schema, method, path, mode):
    operation = api_schema[path][method]

    strategy = operation.as_strategy(generation_mode=mode)
    if mode == GenerationMode.POSITIVE:
        strategy = strategy.map(within_server_rules)

    @given(case=strategy)
    @settings(max_examples=MAX_EXAMPLES[mode], deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    def check(case):
        case.call_and_validate(timeout=60)

    check()


CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")


def within_server_rules(case):
    """A schema-valid request, brought within what no schema states: answers of at most MAX_TOKENS tokens (the
    prompt and max_tokens must fit the context, min_tokens at most max_tokens), a few tools (they are written into
    the prompt), best_of equal to n, at most one
    output constraint (tools included) and one that compiles, a named tool_choice among the tools, earlier tool
    calls' arguments in JSON."""
    body = case.body
    if not isinstance(body, dict):
        return case
    if case.path == "/v1/responses":
        return _within_responses_rules(case)
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None:
            body[key] = min(body[key], MAX_TOKENS)
    body.pop("dimensions", None)  # /v1/embeddings: only a Matryoshka model takes it, which the tiny one is not
    if isinstance(body.get("text_1"), list) and isinstance(body.get("text_2"), list):  # /v1/score: pairwise
        body["text_1"] = body["text_1"][:1]
    if body.get("min_tokens") is not None:
        body["min_tokens"] = min(body["min_tokens"], 1)
    if body.get("best_of") is not None:
        body["best_of"] = body.get("n") or 1
    tools = body.get("tools") or []
    if len(tools) > 3:  # each is written into the prompt, with its JSON schema
        del tools[3:]
    for tool in tools:
        tool["function"]["parameters"] = {"type": "object", "properties": {"x": {"type": "integer"}}}
    if isinstance(body.get("tool_choice"), dict):
        body["tool_choice"]["function"]["name"] = tools[0]["function"]["name"]  # the schema says tools is not empty
    given = [k for k in CONSTRAINTS if body.get(k) is not None
             and not (k == "response_format" and body[k]["type"] == "text")]
    if tools and body.get("tool_choice") != "none":
        given.insert(0, "tools")
    for key in given[1:]:
        del body[key]
    # a constraint that compiles: the generated schemas, regular expressions and grammars are random text
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    compiles = {"json": schema, "regex": "[a-z]{1,3}", "grammar": 'start: "a" | "b"'}
    for holder, prefix in ((body, "guided_"), (body.get("structured_outputs") or {}, "")):
        for kind, value in compiles.items():
            if holder.get(prefix + kind) not in (None, False):
                holder[prefix + kind] = value
    if (body.get("response_format") or {}).get("type") == "json_schema":
        body["response_format"]["json_schema"]["schema"] = schema
    for message in body.get("messages") or []:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.dumps({"text": call["function"]["arguments"]})
    return case


def _within_responses_rules(case):
    """/v1/responses: as within_server_rules (its tools are flat {type, name, parameters}, its output constraint is
    text.format), no previous_response_id (the fuzzed ids name no stored response: a 404), earlier calls' arguments
    in JSON."""
    body = case.body
    body.pop("previous_response_id", None)
    if body.get("max_output_tokens") is not None:
        body["max_output_tokens"] = min(body["max_output_tokens"], MAX_TOKENS)
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    tools = body.get("tools") or []
    del tools[3:]
    for tool in tools:
        tool["parameters"] = schema
    if isinstance(body.get("tool_choice"), dict):
        body["tool_choice"]["name"] = tools[0]["name"]  # the schema says tools is not empty
    fmt = (body.get("text") or {}).get("format") or {}
    if tools and body.get("tool_choice") != "none" and fmt.get("type") not in (None, "text"):
        del body["text"]["format"]
    elif fmt.get("type") == "json_schema":
        fmt["schema"] = schema
    for item in body["input"] if isinstance(body.get("input"), list) else []:
        if item.get("type") == "function_call":
            item["arguments"] = json.dumps({"text": item["arguments"]})
    return case


def test_no_kv_block_leaks_after_fuzzing(fuzz_server):
    # runs after the fuzzing above (file order): everything it admitted has been answered and freed
    metrics = scrape(fuzz_server)
    assert metrics["brisk_kv_blocks_in_use"] == 0
    assert metrics["brisk_num_sequences_admitted"] == 0
    assert metrics["brisk_num_requests_running"] == 0 and metrics["brisk_num_requests_waiting"] == 0
    fuzzed = sum(v for k, v in metrics.items() if k.startswith("brisk_http_requests_total{endpoint=/v1/"))
    assert fuzzed > 0, "the fuzzing sent no request to the /v1 routes"
    # the valid cases got through validation to the engine (positive_data_acceptance failed on any refusal)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        assert metrics[f"brisk_http_requests_total{{endpoint={path},status=200}}"] >= MAX_EXAMPLES[
            GenerationMode.POSITIVE] // 2, path
