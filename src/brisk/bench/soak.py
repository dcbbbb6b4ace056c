"""`brisk bench serve --soak N`: N mixed requests from many client threads, the server's RSS before and after.

    warm-up: W mixed requests (the KV pool, allocator pools, thread pools and first batch shapes settle)
    idle -> RSS "before"
    soak: N mixed requests from T threads, RSS sampled every 0.25 s (peak)
    idle -> RSS "after"; growth = after / before - 1

The mix is what clients of an OpenAI-compatible server send, drawn per request from a seeded generator:
completions and chat completions, streamed and not, prompts of a few to a few hundred words, max_tokens 1-32,
structured outputs (a JSON schema shared by many requests, a JSON schema of its own per request, regexes,
choices), n of 2-3, stop sequences, logprobs, and clients that go away in the middle of a stream. Requests are
plain HTTP (httpx), each answer checked for its status and shape; 503 / 429 count as rejected, not failed.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from brisk.bench.prompts import bench_text
from brisk.bench.serve import SAMPLE_INTERVAL_S, read_rss_bytes, wait_until_idle

KINDS = ("completion", "completion_stream", "chat", "chat_stream", "json_shared", "json_unique", "regex", "choice",
         "n_samples", "stop", "disconnect")
_SHARED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                   "age": {"type": "integer"}}, "required": ["name", "age"]}


class SoakRequestError(RuntimeError):
    """A soak request got an answer of the wrong status or shape."""


def _body(i: int, model: str, words: list[str], seed: int) -> tuple[str, str, dict[str, Any]]:
    """(kind, path, JSON body) of the i-th soak request."""
    rng = random.Random(seed * 1_000_003 + i)
    kind = KINDS[rng.randrange(len(KINDS))]
    start = rng.randrange(len(words))
    text = " ".join(words[start:start + rng.randint(3, 200)]) or "Hello"
    max_tokens = rng.choice((1, 4, 8, 16, 24, 32))
    chat = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    cmpl = {"model": model, "prompt": text, "max_tokens": max_tokens}
    if kind == "completion":
        return kind, "/v1/completions", {**cmpl, "temperature": 0.7, "logprobs": rng.choice((None, 2))}
    if kind == "completion_stream":
        return kind, "/v1/completions", {**cmpl, "stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        return kind, "/v1/chat/completions", {**chat, "temperature": 0.8}
    if kind == "chat_stream":
        return kind, "/v1/chat/completions", {**chat, "stream": True, "temperature": 1.0}
    if kind in ("json_shared", "json_unique"):
        schema = _SHARED_SCHEMA
        if kind == "json_unique":  # a schema no other request sends: the compiled-grammar cache must stay bounded
            props = {**schema["properties"], f"field_{i}": {"type": "string", "maxLength": 8}}
            schema = {"type": "object", "properties": props, "required": list(props)}
        return kind, "/v1/chat/completions", {**chat, "max_tokens": 32, "response_format": {
            "type": "json_schema", "json_schema": {"name": "record", "schema": schema}}}
    if kind == "regex":
        return kind, "/v1/completions", {**cmpl, "max_tokens": 16,
                                         "structured_outputs": {"regex": f"[a-z]{{2,{3 + i % 20}}} [0-9]+"}}
    if kind == "choice":
        return kind, "/v1/chat/completions", {**chat, "max_tokens": 8, "structured_outputs": {
            "choice": ["yes", "no", f"maybe {i % 7}"]}}
    if kind == "n_samples":
        return kind, "/v1/completions", {**cmpl, "n": rng.choice((2, 3)), "temperature": 1.0}
    if kind == "stop":
        return kind, "/v1/chat/completions", {**chat, "stop": [".", "\n\n", " the"]}
    return kind, "/v1/completions", {**cmpl, "max_tokens": 32, "stream": True}  # disconnect


def _stream_events(resp: httpx.Response, limit: int | None = None) -> int:
    """Read server-sent events up to [DONE] (or `limit` events, then stop reading); the events read."""
    num = 0
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return num
        event = json.loads(line[6:])
        if "error" in event:
            raise SoakRequestError(f"error event: {str(event['error'])[:200]}")
        num += 1
        if limit is not None and num >= limit:
            return num
    if limit is None:
        raise SoakRequestError("the stream ended without [DONE]")
    return num


def run_one(client: httpx.Client, i: int, model: str, words: list[str], seed: int) -> tuple[str, str]:
    """Send the i-th soak request; (kind, outcome): completed, rejected, disconnected, or failed: <why>."""
    kind, path, body = _body(i, model, words, seed)
    try:
        if body.get("stream"):
            with client.stream("POST", path, json=body) as resp:
                if resp.status_code in (429, 503):
                    return kind, "rejected"
                if resp.status_code != 200:
                    resp.read()
                    raise SoakRequestError(f"HTTP {resp.status_code}: {resp.text[:200]}")
                if kind == "disconnect":  # a few events, then the client goes away mid-stream
                    _stream_events(resp, limit=3)
                    return kind, "disconnected"
                _stream_events(resp)
                return kind, "completed"
        resp = client.post(path, json=body)
        if resp.status_code in (429, 503):
            return kind, "rejected"
        if resp.status_code != 200:
            raise SoakRequestError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        choices = resp.json().get("choices")
        if not isinstance(choices, list) or len(choices) != body.get("n", 1):
            raise SoakRequestError(f"{len(choices or [])} choices, asked for {body.get('n', 1)}")
        return kind, "completed"
    except (httpx.HTTPError, SoakRequestError, ValueError) as e:
        return kind, f"failed: {type(e).__name__}: {str(e)[:200]}"


def run_requests(base: str, indices: range, model: str, *, threads: int, seed: int, api_key: str | None = None,
                 timeout_s: float = 600.0, on_done: Callable[[str], None] | None = None) -> Counter:
    """Send the soak requests `indices` from `threads` client threads (one connection pool each); outcome counts."""
    words = bench_text().split()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()

    def send(i: int) -> tuple[str, str]:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(base_url=base, headers=headers, trust_env=False, timeout=timeout_s)
            with lock:
                clients.append(client)
        out = run_one(client, i, model, words, seed)
        if on_done is not None:
            on_done(out[1])
        return out

    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="brisk-soak") as pool:
            results = list(pool.map(send, indices))
    finally:
        for client in clients:
            client.close()
    counts: Counter = Counter()
    for kind, outcome in results:
        counts["failed" if outcome.startswith("failed") else outcome] += 1
        counts[f"kind:{kind}"] += 1
        if outcome.startswith("failed"):
            counts[outcome] += 1
    return counts


class RssSampler:
    """A thread reading a process's RSS every interval; `peak` and the samples."""

    def __init__(self, pid: int, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="brisk-soak-rss", daemon=True)
        self._t0 = time.monotonic()

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            rss = read_rss_bytes(self.pid)
            if rss is not None:
                self.samples.append((time.monotonic() - self._t0, rss))
            if self._stop.wait(self.interval_s):
                return

    @property
    def peak(self) -> int | None:
        return max((r for _, r in self.samples), default=None)


def idle_rss(client: httpx.Client, pid: int, settle_s: float = 3.0) -> int | None:
    """The server's RSS once it is idle: nothing admitted, then `settle_s` for the engine loop to go idle (and
    trim its heap)."""
    wait_until_idle(client, timeout_s=120.0)
    time.sleep(settle_s)
    return read_rss_bytes(pid)


def run_soak(base: str, pid: int, model: str, num_requests: int, *, warmup: int = 48, threads: int = 16,
             seed: int = 0, api_key: str | None = None, max_growth_pct: float = 10.0,
             on_done: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Warm up, then the soak; the server's RSS at start, before (idle after warm-up), peak and after (idle after
    the soak), the growth after warm-up in percent, outcome counts and a PASS / FAIL verdict on the growth."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    mib = 2**20
    with httpx.Client(base_url=base, headers=headers, trust_env=False, timeout=60) as client:
        rss_start = idle_rss(client, pid, settle_s=0.0)
        t0 = time.monotonic()
        warm = run_requests(base, range(warmup), model, threads=threads, seed=seed, api_key=api_key, on_done=on_done)
        warmup_s = time.monotonic() - t0
        rss_before = idle_rss(client, pid)
        t0 = time.monotonic()
        with RssSampler(pid) as sampler:
            counts = run_requests(base, range(warmup, warmup + num_requests), model, threads=threads, seed=seed,
                                  api_key=api_key, on_done=on_done)
        soak_s = time.monotonic() - t0
        rss_after = idle_rss(client, pid)
    if rss_before is None or rss_after is None:
        raise RuntimeError(f"cannot read the RSS of process {pid} (Linux /proc only)")
    growth = 100.0 * (rss_after - rss_before) / rss_before
    peak = max(sampler.peak or 0, rss_after)
    failed = counts["failed"] + warm["failed"]
    return {
        "num_requests": num_requests, "warmup_requests": warmup, "threads": threads, "seed": seed,
        "warmup_s": warmup_s, "elapsed_s": soak_s,
        "rss_start_bytes": rss_start, "rss_before_bytes": rss_before, "rss_peak_bytes": peak,
        "rss_after_bytes": rss_after, "growth_bytes": rss_after - rss_before, "growth_pct": growth,
        "peak_over_before_pct": 100.0 * (peak - rss_before) / rss_before,
        "max_growth_pct": max_growth_pct,
        "outcomes": {k: v for k, v in sorted(counts.items()) if not k.startswith(("kind:", "failed:"))},
        "kinds": {k.removeprefix("kind:"): v for k, v in sorted(counts.items()) if k.startswith("kind:")},
        "errors": {k.removeprefix("failed: "): v for k, v in (counts + warm).items() if k.startswith("failed:")},
        "verdict": "PASS" if growth <= max_growth_pct and failed == 0 else "FAIL",
        "detail": f"RSS {rss_before / mib:.0f} MiB after {warmup} warm-up requests -> {rss_after / mib:.0f} MiB after "
                  f"{num_requests} more ({growth:+.1f}%, limit +{max_growth_pct:g}%; peak {peak / mib:.0f} MiB); "
                  f"{failed} failed",
    }
