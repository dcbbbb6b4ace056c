"""`brisk serve` end to end: a real server process on 127.0.0.1, the official openai client, offline oracles.

Greedy outputs must equal LLM.generate / LLM.chat for the same prompts (streamed or not, alone or among 32
concurrent clients), and the KV cache must be empty again afterwards — also when clients disconnect.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from hf_utils import TRAINING_TEXT, make_tiny_hf_model
from prometheus_client.parser import text_string_to_metric_families

from brisk import LLM, SamplingParams
from brisk.serve.async_engine import AsyncEngine, EngineRequest
from brisk.serve.metrics import ServerMetrics
from brisk.serve.process import ServerProcess

MODEL = "tiny"
MAX_MODEL_LEN = 256
ENGINE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "8MiB"]
# Ten-word windows over the Emma text: distinct prompts of a realistic mix of tokens.
_WORDS = TRAINING_TEXT.split()
PROMPTS = [" ".join(_WORDS[i * 7: i * 7 + 10]) for i in range(32)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-serve")
    make_tiny_hf_model(path, "llama", seed=3)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir):
    proc = ServerProcess(["--model", model_dir, "--served-model-name", MODEL, *ENGINE_ARGS], startup_timeout_s=90)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def long_server(model_dir):
    """The same model with a 4,096-token context: a request long enough to be still running after a metrics read."""
    proc = ServerProcess(["--model", model_dir, "--served-model-name", MODEL, "--max-model-len", "4096",
                          "--kv-cache-memory", "8MiB"], startup_timeout_s=90)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, max_model_len=MAX_MODEL_LEN, kv_cache_memory="8MiB")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def scrape(server: ServerProcess) -> dict[str, float]:
    """/metrics as {sample name (with labels) -> value}."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_for_metric(server: ServerProcess, name: str, predicate, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape(server)
        if predicate(metrics.get(name)):
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} = {metrics.get(name)} after {timeout_s} s")
        time.sleep(0.05)


def test_health_and_models(server):
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
    models = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0).models.list()
    assert [(m.id, m.object) for m in models.data] == [(MODEL, "model")]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion_equals_offline_greedy(client, llm):
    want = llm.generate(PROMPTS[:3], greedy(12))
    for prompt, w in zip(PROMPTS[:3], want, strict=True):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert got.object == "text_completion" and got.id.startswith("cmpl-") and got.created > 0
        assert got.choices[0].text == w.outputs[0].text
        assert got.choices[0].finish_reason == w.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(w.prompt_token_ids)
        assert got.usage.completion_tokens == len(w.outputs[0].token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_completion_stream_equals_offline_greedy(client, llm):
    want = llm.generate(PROMPTS[3], greedy(20))[0].outputs[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1, "the answer should arrive in several chunks"
    assert "".join(c.choices[0].text for c in text_chunks) == want.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert len({c.id for c in chunks}) == 1


def test_sse_wire_format_ends_with_done(server):
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_chat_equals_offline_greedy(client, llm):
    messages = [{"role": "system", "content": "You are Emma."}, {"role": "user", "content": "Who is Miss Taylor?"}]
    want = llm.chat(messages, greedy(16))[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.outputs[0].finish_reason
    assert chunks[-1].usage.total_tokens == got.usage.total_tokens


def test_prompt_lists_token_ids_and_n(client, llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[5])
    want = [o.outputs[0].text for o in llm.generate([PROMPTS[5], PROMPTS[6]], greedy(8))]
    # a list of strings: one choice per prompt, in order
    got = client.completions.create(model=MODEL, prompt=[PROMPTS[5], PROMPTS[6]], max_tokens=8, temperature=0)
    assert [(c.index, c.text) for c in got.choices] == [(0, want[0]), (1, want[1])]
    # token ids in, same text out
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert got.choices[0].text == want[0] and got.usage.prompt_tokens == len(ids)
    # n samples of each of two prompts: choice index = prompt * n + sample
    got = client.completions.create(model=MODEL, prompt=[ids, tok.encode(PROMPTS[6])], n=3, max_tokens=8,
                                    temperature=0)
    assert sorted(c.index for c in got.choices) == list(range(6))
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [want[0]] * 3 + [want[1]] * 3


def test_seeded_sampling_equals_offline(client, llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, n=2)
    want = [c.text for c in llm.generate(PROMPTS[7], params)[0].outputs]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[7], temperature=1.0, top_p=0.9, seed=1234,
                                    max_tokens=16, n=2, extra_body={"top_k": 50})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
    assert want[0] != want[1], "the two samples draw from different generators (seed + k)"


def test_stop_strings_and_penalties_match_offline(client, llm):
    full = llm.generate(PROMPTS[8], greedy(24))[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip(), "pick a stop string that occurs in the greedy answer"
    want = llm.generate(PROMPTS[8], greedy(24, stop=[stop]))[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=24, temperature=0, stop=[stop])
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
    # streamed: the first characters of a stop string never go out before the string completes
    for i, at in enumerate(range(0, len(full) - 4, max(1, len(full) // 8))):
        stop = full[at: at + 2 + i % 3]
        want = llm.generate(PROMPTS[8], greedy(24, stop=[stop]))[0].outputs[0].text
        chunks = client.completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=24, temperature=0,
                                           stop=[stop], stream=True)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want, stop
    want = llm.generate(PROMPTS[8], greedy(24, presence_penalty=1.5, frequency_penalty=1.0))[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[8], max_tokens=24, temperature=0,
                                    presence_penalty=1.5, frequency_penalty=1.0)
    assert got.choices[0].text == want.text


def test_logprobs(client, llm):
    want = llm.generate(PROMPTS[9], greedy(6, logprobs=3))[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=6, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    tok = llm.get_tokenizer()
    # tokens that are only part of a UTF-8 character are named by their bytes, as OpenAI does
    texts = [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert any("\ufffd" in t for t in texts), "this prompt should exercise a partial-character token"
    assert [t if "\ufffd" not in t else "bytes" for t in texts] == [t.split(":")[0] for t in lp.tokens]
    assert lp.token_logprobs == pytest.approx([d[t] for d, t in zip(want.logprobs, want.token_ids, strict=True)],
                                              abs=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == pytest.approx(v, abs=1e-5) for top, v in zip(lp.top_logprobs, lp.token_logprobs,
                                                                                  strict=True))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    # the bytes of the tokens rejoin into the answer, partial characters included
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", errors="replace") == \
        chat.choices[0].message.content
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, temperature=0, logprobs=True, stream=True)
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [c.token for c in content]


def test_32_concurrent_streams_equal_offline_and_free_every_block(server, llm):
    want = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy(16))]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in PROMPTS)), timeout=60)

    before = scrape(server)
    got = asyncio.run(all_of_them())
    assert got == want
    after = wait_for_metric(server, "brisk_kv_blocks_in_use", lambda v: v == 0)
    assert after["brisk_num_requests_running"] == 0 and after["brisk_num_requests_waiting"] == 0
    assert after["brisk_num_sequences_admitted"] == 0
    assert after["brisk_generation_tokens_total"] - before["brisk_generation_tokens_total"] == 32 * 16
    # each request got exactly one time-to-first-token observation
    assert after["brisk_time_to_first_token_seconds_count"] - before["brisk_time_to_first_token_seconds_count"] == 32


def test_disconnect_mid_stream_aborts_and_frees_blocks(long_server):
    """The tiny model streams whether or not the client reads (230 tokens took ~0.1 s, and a CI run once finished
    them before the first metrics read three times in a row), so the request asks for 4,000 tokens (~2 s) on a
    server with a long context; the metrics are read as soon as the first token arrives, and the attempt repeated
    (up to 3 times) if the request had already finished by then."""
    server = long_server
    before = scrape(server)["brisk_requests_aborted_total"]
    body = {"model": MODEL, "prompt": PROMPTS[10], "max_tokens": 4000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    for _ in range(3):
        with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            received = [next(lines)]  # the first data event: the request is running
            running = scrape(server)["brisk_kv_blocks_in_use"] > 0  # the request holds KV blocks while it streams
            received += [next(lines) for _ in range(3)]  # (each event is followed by a blank line)
            assert received[0].startswith("data: ") and received[2].startswith("data: ")
        if running:
            break
        wait_for_metric(server, "brisk_kv_blocks_in_use", lambda v: v == 0)  # it ran to its end: no abort
    else:
        pytest.fail("the streamed request had always finished before the first metrics read (3 tries)")
    # the context exit closed the connection long before 4,000 tokens
    metrics = wait_for_metric(server, "brisk_requests_aborted_total", lambda v: v == before + 1)
    metrics = wait_for_metric(server, "brisk_kv_blocks_in_use", lambda v: v == 0)
    assert metrics["brisk_num_requests_running"] == 0 and metrics["brisk_num_sequences_admitted"] == 0
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts(long_server):
    """The client sends a non-streamed request and hangs up once it runs. A raw socket, closed as soon as the
    metrics show the request running: a client-side read timeout would race the tiny model, which answers 4 x 230
    tokens in well under a second; so, as for the streamed disconnect, a long request on the long-context server
    (4 x 2,000 tokens)."""
    server = long_server
    before = scrape(server)["brisk_requests_aborted_total"]
    body = {"model": MODEL, "prompt": PROMPTS[11], "max_tokens": 2000, "temperature": 0.8, "n": 4,
            "ignore_eos": True}
    payload = json.dumps(body).encode()
    sock = socket.create_connection((server.host, server.port), timeout=10)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
        deadline = time.monotonic() + 10
        while scrape(server).get("brisk_num_requests_running", 0) < 1:
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.002)
    finally:
        sock.close()
    wait_for_metric(server, "brisk_requests_aborted_total", lambda v: v == before + 1)
    wait_for_metric(server, "brisk_kv_blocks_in_use", lambda v: v == 0)
    wait_for_metric(server, "brisk_num_sequences_admitted", lambda v: v == 0)


def test_a_slow_reader_gets_the_newest_output_not_a_backlog(llm):
    """While nobody reads a stream, its outputs coalesce: a stalled client holds one output, not one per step."""
    want = llm.generate(PROMPTS[12], greedy(40, ignore_eos=True))[0].outputs[0]

    async def run() -> list:
        metrics = ServerMetrics(llm.engine.num_blocks)
        engine = AsyncEngine(llm.engine, max_waiting=0, metrics=metrics)
        engine.start()
        try:
            ids = llm.get_tokenizer().encode(PROMPTS[12])
            stream = engine.open_stream([EngineRequest("slow", ids, greedy(40, ignore_eos=True))])
            for _ in range(1000):  # until the engine thread has finished the request, reading nothing
                if metrics.registry.get_sample_value("brisk_requests_finished_total", {"reason": "length"}):
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # the delivery is scheduled right after the count
            items = [out async for _, out in stream]
            stream.close()
            return items
        finally:
            engine.shutdown()

    items = asyncio.run(run())
    assert len(items) == 1 and items[0].finished
    assert items[0].outputs[0].text == want.text and items[0].outputs[0].token_ids == want.token_ids


def test_metrics_exposes_the_serving_figures(server):
    m = scrape(server)
    for name in ("brisk_prompt_tokens_total", "brisk_generation_tokens_total",
                 "brisk_time_to_first_token_seconds_count",
                 "brisk_inter_token_latency_seconds_count", "brisk_e2e_request_latency_seconds_count",
                 "brisk_kv_cache_usage_percent", "brisk_prefix_cache_hit_rate", "brisk_num_preemptions_total",
                 "brisk_requests_rejected_total", "brisk_num_requests_running", "brisk_num_requests_waiting"):
        assert name in m, name
    assert m["brisk_prompt_tokens_total"] > 0 and m["brisk_generation_tokens_total"] > 0
    assert m["brisk_http_requests_total{endpoint=/v1/completions,status=200}"] > 0
    assert m["brisk_requests_finished_total{reason=length}"] > 0
    # the same prompt twice: the second is served from the prefix cache
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    long_prompt = " ".join(_WORDS[:60])
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    m2 = wait_for_metric(server, "brisk_prefix_cache_hits_total", lambda v: v > m["brisk_prefix_cache_hits_total"])
    assert 0 < m2["brisk_prefix_cache_hit_rate"] <= 1


def test_cors_is_off_by_default(server):
    resp = httpx.options(f"{server.base_url}/completions", timeout=10,
                         headers={"Origin": "http://evil.test", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in resp.headers


def test_signals_stop_the_server_cleanly_and_a_taken_port_is_an_error(server, model_dir):
    """The engine loop runs on the server process's main thread and uvicorn on another (run_server): SIGINT and
    SIGTERM still end it with code 0 while a stream is open, the stream ends (no hang), and a second server on
    a port already taken exits with code 1 saying so."""
    taken = subprocess.run([sys.executable, "-m", "brisk.cli", "serve", "--port", str(server.port), "--model",
                            model_dir, *ENGINE_ARGS], capture_output=True, text=True, timeout=120)
    assert taken.returncode == 1 and "address already in use" in taken.stdout + taken.stderr
    assert server.is_healthy()  # the first server is untouched
    for sig in (signal.SIGINT, signal.SIGTERM):
        with ServerProcess(["--model", model_dir, *ENGINE_ARGS], startup_timeout_s=90) as srv:
            with httpx.stream("POST", f"{srv.base_url}/completions", timeout=60,
                              json={"prompt": "Once upon", "max_tokens": 200, "stream": True,
                                    "ignore_eos": True}) as resp:
                lines = resp.iter_lines()
                next(lines)  # the stream is open and producing
                srv.proc.send_signal(sig)
                rest = list(lines)  # ends, one way or another, instead of hanging
            assert srv.proc.wait(30) == 0, srv.log_tail()
            assert "Finished server process" in srv.log() and "Traceback" not in srv.log(), srv.log_tail()
            assert len(rest) < 400


@pytest.mark.slow
def test_default_model_chat_equals_offline(default_llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = default_llm.chat(messages, greedy(12))[0].outputs[0].text
    with ServerProcess(["--max-model-len", "1024", "--kv-cache-memory", "128MiB"], startup_timeout_s=120) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        got = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=12,
                                             temperature=0)
    assert got.choices[0].message.content == want
    assert "Paris" in want
