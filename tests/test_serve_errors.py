"""`brisk serve` under bad input and overload: every bad request gets the right 4xx and an OpenAI error object
saying what was wrong (never a 500 or a traceback); a bad key gets 401; a full waiting queue gets 503 with
Retry-After while the server stays healthy.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from hf_utils import make_tiny_hf_model

from brisk.serve.process import ServerProcess

MODEL = "tiny"
KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 64
COMMON = ["--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "8MiB"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-serve-errors")
    make_tiny_hf_model(path, "llama", seed=3)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir):
    # the key comes from the environment, as an operator would set it
    proc = ServerProcess(["--model", model_dir, *COMMON, "--max-request-bytes", "64KiB",
                          "--cors-origins", "http://good.test"], env={"BRISK_API_KEY": KEY}, startup_timeout_s=90)
    proc.start()
    yield proc
    proc.stop()


def chat(content: object = "hi", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "Emma Woodhouse", **kw}


C, CH = "/v1/completions", "/v1/chat/completions"
# (path, body: dict or raw bytes, expected status, expected `param` (None = not checked), words the message names)
BAD_REQUESTS = [
    (C, b"{not json", 400, None, "not valid JSON"),
    (C, b"", 400, None, "empty"),
    (C, b"[1, 2]", 400, None, "JSON object"),
    (C, b"\xff\xfe\x00garbage", 400, None, "not valid JSON"),
    (C, b"[" * 20_000 + b"]" * 20_000, 400, None, "nested too deeply"),
    (C, {"model": MODEL}, 400, "prompt", "'prompt' is required"),
    (C, cmpl(prompt=5), 400, "prompt", "'prompt' must be a string"),
    (C, cmpl(prompt=""), 400, "prompt", "empty"),
    (C, cmpl(prompt=[]), 400, "prompt", "empty"),
    (C, cmpl(prompt=[1, 2, 100_000]), 400, "prompt", "outside the vocabulary"),
    (C, cmpl(prompt=[1, True]), 400, "prompt", "list of token ids"),
    (C, cmpl(prompt="Emma " * 80), 400, "prompt", "context"),
    (C, cmpl(max_tokens=60), 400, "max_tokens", "exceeds this model's context"),
    (C, cmpl(max_tokens=-5), 400, "max_tokens", "greater than or equal to 1"),
    (C, cmpl(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    (C, cmpl(max_tokens="ten"), 400, "max_tokens", "valid integer"),
    (C, cmpl(max_tokens=2.5), 400, "max_tokens", "valid integer"),
    (C, cmpl(temperature=2.5), 400, "temperature", "less than or equal to 2"),
    (C, cmpl(temperature=-0.1), 400, "temperature", "greater than or equal to 0"),
    (C, cmpl(temperature="hot"), 400, "temperature", "valid number"),
    (C, cmpl(top_p=0), 400, "top_p", "greater than 0"),
    (C, cmpl(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    (C, cmpl(top_k=-3), 400, "top_k", "greater than or equal to -1"),
    (C, cmpl(min_p=1.5), 400, "min_p", "less than or equal to 1"),
    (C, cmpl(presence_penalty=3), 400, "presence_penalty", "less than or equal to 2"),
    (C, cmpl(frequency_penalty=-2.5), 400, "frequency_penalty", "greater than or equal to -2"),
    (C, cmpl(n=0), 400, "n", "greater than or equal to 1"),
    (C, cmpl(n=1000), 400, "n", "less than or equal to 16"),
    (C, cmpl(logprobs=50), 400, "logprobs", "less than or equal to 20"),
    (C, cmpl(seed="abc"), 400, "seed", "valid integer"),
    (C, cmpl(seed=2**70), 400, "seed", "less than"),
    (C, cmpl(stop=[""]), 400, "stop", "empty string"),
    (C, cmpl(stop=5), 400, "stop", "'stop' must be a string or a list of strings"),
    (C, cmpl(stream="yes"), 400, "stream", "valid boolean"),
    (C, cmpl(stream_options={"include_usage": True}), 400, "stream_options", "only allowed when stream"),
    (C, cmpl(model="gpt-4"), 400, "model", "'gpt-4' does not exist"),
    (C, cmpl(echo=True), 400, "echo", "not supported"),
    (C, cmpl(logit_bias={"5": 10}), 400, "logit_bias", "not supported"),
    (C, cmpl(min_tokens=10, max_tokens=5), 400, "min_tokens", "less than or equal to max_tokens"),
    (C, cmpl(prompt=["Emma"] * 20, n=16), 400, "prompt", "admits at most 256 at once"),
    (CH, {"model": MODEL, "messages": []}, 400, "messages", "at least 1 item"),
    (CH, {"model": MODEL, "messages": "hello"}, 400, "messages", "non-empty list"),
    (CH, {"model": MODEL}, 400, "messages", "'messages' is required"),
    (CH, {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", "'user'"),
    (CH, chat(content=42), 400, "messages.0.content", "must be a string or a list"),
    (CH, {"model": MODEL, "messages": [{"role": "user"}]}, 400, "messages.0.content", "needs a 'content'"),
    (CH, chat(content=[{"type": "image_url", "image_url": {"url": "http://x"}}]), 400, "messages.0.content.0.type",
     "only takes text"),
    (CH, chat(top_logprobs=3), 400, "top_logprobs", "requires logprobs"),
    (CH, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs", "less than or equal to 20"),
    (CH, chat(max_completion_tokens=-1), 400, "max_completion_tokens", "greater than or equal to 1"),
    (CH, chat(max_completion_tokens=500), 400, "max_completion_tokens", "exceeds this model's context"),
    (CH, chat(content="Emma " * 80), 400, "messages", "context"),
    (CH, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool_choice",
     "--enable-auto-tool-choice"),
    (CH, chat(tools=[{"type": "function", "function": {"name": "bad name!"}}], tool_choice="required"), 400,
     "tools.0.function.name", "should match pattern"),
    (CH, chat(tools=[{"type": "retrieval"}]), 400, "tools.0.type", "'function'"),
    (CH, chat(tool_choice="required"), 400, "tool_choice", "needs a non-empty 'tools'"),
    (CH, chat(tool_choice="sometimes"), 400, "tool_choice", "'none', 'auto' or 'required'"),
    (CH, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
              response_format={"type": "json_object"}), 400, "response_format", "cannot be combined with tools"),
    (CH, chat(response_format={"type": "xml"}), 400, "response_format.type", "'json_schema'"),
    (CH, chat(response_format={"type": "json_schema"}), 400, "response_format.json_schema.schema", "needs json_schema"),
    (CH, chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}), 400,
     "response_format.json_schema.name", "required"),
    (CH, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     400, "response_format.json_schema.schema", "does not compile"),
    (C, cmpl(guided_json="{not json"), 400, "guided_json", "not valid JSON"),
    (C, cmpl(guided_regex="a(b"), 400, "guided_regex", "does not compile"),
    (C, cmpl(guided_choice=["a", ""]), 400, "guided_choice", "non-empty strings"),
    (C, cmpl(guided_regex="a", guided_decoding_backend="magic"), 400, "guided_decoding_backend", "xgrammar"),
    (C, cmpl(structured_outputs={"json": {}, "regex": "a"}), 400, "structured_outputs", "exactly one"),
    (C, cmpl(structured_outputs={"regx": "a"}), 400, "structured_outputs.regx", "unknown field"),
    (C, cmpl(structured_outputs={"grammar": "root ::= ("}), 400, "structured_outputs.grammar", "grammar"),
    (CH, {"model": MODEL, "messages": [{"role": "tool", "tool_call_id": "c1"}]}, 400, "messages.0.content",
     "tool's result"),
    (CH, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "messages.1.tool_calls.0.function.arguments", "not valid JSON"),
    (CH, chat(model="nope"), 400, "model", "does not exist"),
    (C, cmpl(prompt="x" * 70_000), 413, None, "larger than this server's limit"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD_REQUESTS,
                         ids=[f"{i}-{row[2]}-{row[3] or row[4][:20]}" for i, row in enumerate(BAD_REQUESTS)])
def test_bad_request_gets_a_4xx_error_object(server, path, body, status, param, words):
    kw = {"content": body, "headers": {**AUTH, "Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": AUTH}
    resp = httpx.post(f"{server.url}{path}", timeout=30, **kw)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error["message"]
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_unknown_routes_and_methods(server):
    resp = httpx.get(f"{server.url}/v1/nothing", headers=AUTH, timeout=10)
    assert resp.status_code == 404 and "no route GET /v1/nothing" in resp.json()["error"]["message"]
    resp = httpx.get(f"{server.url}/v1/completions", headers=AUTH, timeout=10)
    assert resp.status_code == 405 and "method GET is not allowed" in resp.json()["error"]["message"]


def test_api_key(server):
    url = f"{server.url}/v1/models"
    for headers, words in [({}, "missing API key"), ({"Authorization": "Bearer wrong"}, "invalid API key"),
                           ({"Authorization": f"Basic {KEY}"}, "missing API key"),
                           ({"Authorization": f"Bearer {KEY}x"}, "invalid API key")]:
        resp = httpx.get(url, headers=headers, timeout=10)
        assert resp.status_code == 401, headers
        assert resp.json()["error"]["type"] == "authentication_error"
        assert words in resp.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).completions.create(
            model=MODEL, prompt="x", max_tokens=1)
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=30)
    assert client.completions.create(model=MODEL, prompt="Emma", max_tokens=2).usage.completion_tokens >= 1
    # health and metrics stay open for probes and scrapers
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200


def test_cors_allows_only_the_configured_origin(server):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{server.base_url}/completions", timeout=10, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    assert preflight("http://good.test").headers.get("access-control-allow-origin") == "http://good.test"
    assert "access-control-allow-origin" not in preflight("http://evil.test").headers


def test_no_server_error_and_no_traceback_after_all_that(server):
    # runs after the table (file order): the server is healthy, logged no traceback, answered no 5xx
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert 'status="400"' in metrics and 'status="5' not in metrics
    assert "Traceback" not in server.log()


def test_back_pressure_rejects_beyond_the_waiting_queue(model_dir):
    """max_num_seqs 4 + max_waiting 4 admit 8 requests; 32 at once: the rest get 503 + Retry-After."""
    with ServerProcess(["--model", model_dir, *COMMON, "--max-num-seqs", "4", "--max-waiting", "4"],
                       startup_timeout_s=90) as srv:
        body = {"model": MODEL, "prompt": "Emma Woodhouse", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        barrier = threading.Barrier(32)
        results: list[httpx.Response | BaseException] = [None] * 32  # type: ignore[list-item]

        def send(i: int) -> None:
            with httpx.Client(timeout=60) as client:
                barrier.wait(timeout=30)
                try:
                    results[i] = client.post(f"{srv.base_url}/completions", json=body)
                except httpx.HTTPError as e:
                    results[i] = e

        threads = [threading.Thread(target=send, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert all(isinstance(r, httpx.Response) for r in results), results
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 503}, codes
        rejected = [r for r in results if r.status_code == 503]
        assert rejected, "32 simultaneous requests against a capacity of 8 must see some rejected"
        # a rejection means 8 were admitted at that moment, and each of those completes
        assert codes.count(200) >= 8
        for r in rejected:
            assert r.headers["retry-after"] == "1"
            error = r.json()["error"]
            assert error["type"] == "server_overloaded" and "at capacity" in error["message"]
        for r in results:
            if r.status_code == 200:
                assert r.json()["usage"]["completion_tokens"] == 40
        # healthy afterwards, and new requests are served
        assert srv.is_healthy()
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=30)
        assert client.completions.create(model=MODEL, prompt="Emma", max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True}).usage.completion_tokens == 3
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert f"brisk_requests_rejected_total {float(len(rejected))}" in metrics
        assert "brisk_kv_blocks_in_use 0.0" in metrics and "brisk_num_sequences_admitted 0.0" in metrics
        assert "Traceback" not in srv.log()


def test_the_server_log_of_its_own_is_removed_with_the_process_object():
    import gc

    from brisk.serve.process import ServerProcess

    server = ServerProcess(["--model", "unused"])  # never started: only the log file is made
    path = server.log_path
    assert path.exists() and server.log() == ""
    del server
    gc.collect()
    assert not path.exists()
