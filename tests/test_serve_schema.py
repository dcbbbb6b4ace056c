"""The server's OpenAPI schema, and schemathesis fuzzing a live server over it.

The schema must be valid OpenAPI 3 and describe every route with the models the handlers really validate and
build. schemathesis then sends schema-generated requests (valid and invalid) to every operation of a real
`brisk serve` on 127.0.0.1 and checks each answer: no 5xx, a status code and content type the schema lists,
a body that matches the schema, invalid data rejected. A bounded number of examples per operation keeps it to
seconds; afterwards no KV block may still be held. A longer run: docs/serving.md, figures in BENCHMARKS.md.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hf_utils import make_tiny_hf_model
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import validate
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance
from test_serve import scrape

from brisk.serve.process import ServerProcess

# A short context: any request schemathesis makes up (n up to 16, max_tokens up to the context) ends quickly.
ENGINE_ARGS = ["--max-model-len", "48", "--kv-cache-memory", "8MiB", "--max-num-seqs", "16"]
MAX_EXAMPLES = 6  # per operation


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
    assert set(spec["paths"]) == {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"}
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
    assert "sampling_defaults" in schemas["ModelCard"]["required"]
    assert httpx.get(f"{fuzz_server.url}/docs", timeout=10).status_code == 200


OPERATIONS = [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
              ("POST", "/v1/chat/completions")]


# positive_data_acceptance is left out: a request can match the schema and still be refused with a 400 that the
# schema cannot express (a prompt longer than the context, a model name other than the served one, an OpenAI
# feature brisk rejects by name, such as echo or tools). Every other built-in check runs. (Hypothesis drives
# schemathesis' strategies directly: its pytest plugin does not run under pytest 9.)
# schema-valid requests to every operation; invalid ones to the two with a body (the GET routes take no input)
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"]


@pytest.mark.parametrize("method,path,mode", CASES)
def test_fuzz_operation(api_schema, method, path, mode):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def check(case):
        case.call_and_validate(excluded_checks=[positive_data_acceptance], timeout=60)

    check()


def test_no_kv_block_leaks_after_fuzzing(fuzz_server):
    # runs after the fuzzing above (file order): everything it admitted has been answered and freed
    metrics = scrape(fuzz_server)
    assert metrics["brisk_kv_blocks_in_use"] == 0
    assert metrics["brisk_num_sequences_admitted"] == 0
    assert metrics["brisk_num_requests_running"] == 0 and metrics["brisk_num_requests_waiting"] == 0
    fuzzed = sum(v for k, v in metrics.items() if k.startswith("brisk_http_requests_total{endpoint=/v1/"))
    assert fuzzed > 0, "the fuzzing sent no request to the /v1 routes"
