"""The load generator of `brisk bench serve`: a separate process that streams completions at a server.

It runs in a process of its own so that parsing every streamed chunk of hundreds of concurrent requests
never shares an interpreter (and its GIL) with the process that draws the progress bar and samples the
server, and never with the server itself. Only plain JSON crosses the process boundary:

    parent --stdin-->  one LoadSpec as a JSON object (token-id prompts, arrival offsets, limits)
    parent <-stdout--  JSON lines: {"event": "start"}, one {"event": "request", ...} per finished request
                       (a RequestRecord), then {"event": "end", "duration_s": ...}

Each request is `POST /v1/completions` with the prompt as token ids, greedy, `ignore_eos` (so every
completed request has exactly `output_len` tokens) and `stream_options.include_usage`. Its end is one of
four outcomes: completed, rejected (a clean 503/429 with an OpenAI error object: back-pressure doing its
job), failed (any other status, a transport error, a timeout, an error event in the stream), malformed
(the server broke the protocol: not SSE, bad JSON, no [DONE], missing usage, wrong token count).

Run as `python -m brisk.bench.loadgen`; this module imports no torch, so the child starts in well under
a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import math
import random
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx


class Outcome(enum.StrEnum):
    COMPLETED = "completed"
    REJECTED = "rejected"  # 503 / 429 with an error object: back-pressure, not a failure
    FAILED = "failed"  # other HTTP status, transport error, timeout, in-band error event
    MALFORMED = "malformed"  # the answer broke the protocol


REJECT_STATUSES = (429, 503)


def check_local_url(url: str) -> str:
    """The URL without a trailing slash, when it is plain http on 127.0.0.1; ValueError otherwise.

    The benchmark floods its target with requests, so it only ever talks to this machine's loopback.
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname != "127.0.0.1" or parts.port is None:
        raise ValueError(f"--url must look like http://127.0.0.1:PORT (the benchmark only loads a server on this "
                         f"machine's loopback), got {url!r}")
    if parts.path.rstrip("/") not in ("", "/v1"):
        raise ValueError(f"--url must be the server's root (http://127.0.0.1:PORT), got {url!r}")
    return f"http://127.0.0.1:{parts.port}"


def poisson_arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets in seconds from the start: a Poisson process of `rate` requests/s (inf: all at 0).

    The first request goes at 0; the gaps between consecutive requests are independent exponentials with
    mean 1/rate, drawn from their own seeded generator, so a run is reproducible.
    """
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf for all at once), got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    times, t = [], 0.0
    for i in range(num_requests):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


@dataclass
class LoadSpec:
    url: str
    prompts: list[list[int]]
    arrival_times: list[float]  # seconds from the start, one per prompt, non-decreasing
    output_len: int
    max_concurrency: int | None = None  # None: no limit beyond the arrival schedule
    request_timeout_s: float = 600.0
    api_key: str | None = None

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.arrival_times):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.arrival_times)} arrival times")
        if self.output_len < 1:
            raise ValueError(f"--output-len must be at least 1, got {self.output_len}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be > 0 s, got {self.request_timeout_s}")


@dataclass
class RequestRecord:
    """How one request ended. Times are seconds; `arrival_s` and `sent_s` count from the run's start."""

    index: int
    prompt_len: int
    outcome: Outcome = Outcome.FAILED
    error_kind: str | None = None  # "http_503", "timeout", "no_done", "ReadError", ...
    error: str | None = None  # the server's message or what was wrong, shortened
    status: int | None = None
    arrival_s: float = 0.0  # when the schedule said it arrives
    sent_s: float = 0.0  # when it went out (later than arrival_s while waiting for a --max-concurrency slot)
    ttft_s: float | None = None  # sent -> first chunk carrying a token
    tpot_s: float | None = None  # (last token chunk - first) / (output tokens - 1)
    e2e_s: float | None = None  # sent -> end of the response
    output_tokens: int = 0
    num_chunks: int = 0  # chunks carrying tokens (fewer than tokens when the server coalesces steps)


@dataclass
class StreamResult:
    outcome: Outcome
    error_kind: str | None = None
    error: str | None = None
    first_token_t: float | None = None
    last_token_t: float | None = None
    output_tokens: int = 0
    num_chunks: int = 0


def check_stream(lines: list[tuple[float, str]], output_len: int) -> StreamResult:
    """The SSE lines of one streamed completion, each with its arrival time -> outcome and token timing.

    Complete means: every non-blank line is `data: <JSON chunk>`; chunks with choices carry tokens and
    exactly one of them a finish_reason; a usage chunk reports `output_len` completion tokens (ignore_eos
    was asked for, so anything else is a wrong answer); `data: [DONE]` comes last. An error event is a
    failure the server reported (in-band, after its 200), not a protocol violation.
    """
    def malformed(kind: str, message: str) -> StreamResult:
        return StreamResult(Outcome.MALFORMED, kind, message)

    res = StreamResult(Outcome.COMPLETED)
    num_finish, usage, done = 0, None, False
    for t, line in lines:
        if not line:
            continue
        if done:
            return malformed("data_after_done", f"a line after data: [DONE]: {line[:80]!r}")
        if not line.startswith("data: "):
            return malformed("not_sse", f"not an SSE data line: {line[:80]!r}")
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            continue
        try:
            chunk = json.loads(payload)
        except ValueError:
            return malformed("bad_json", f"a data line is not JSON: {payload[:80]!r}")
        if not isinstance(chunk, dict):
            return malformed("bad_json", f"a chunk is not a JSON object: {payload[:80]!r}")
        if "error" in chunk:
            err = chunk["error"]
            message = err.get("message") if isinstance(err, dict) else str(err)
            return StreamResult(Outcome.FAILED, "stream_error", str(message)[:200])
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return malformed("no_choices", f"a chunk has no choices list: {payload[:80]!r}")
        if choices:
            res.num_chunks += 1
            res.first_token_t = t if res.first_token_t is None else res.first_token_t
            res.last_token_t = t
            num_finish += sum(1 for c in choices if isinstance(c, dict) and c.get("finish_reason") is not None)
        if chunk.get("usage"):
            usage = chunk["usage"]
    if not done:
        return malformed("no_done", "the stream ended without data: [DONE]")
    if res.num_chunks == 0:
        return malformed("no_tokens", "the stream carried no token chunks")
    if num_finish != 1:
        return malformed("finish_reason", f"{num_finish} chunks carried a finish_reason, expected exactly 1")
    if not isinstance(usage, dict):
        return malformed("no_usage", "no usage chunk although stream_options.include_usage was set")
    res.output_tokens = usage.get("completion_tokens")
    if res.output_tokens != output_len:
        return malformed("token_count", f"usage says {res.output_tokens} completion tokens; asked for "
                                        f"{output_len} with ignore_eos")
    return res


def _error_message(body: bytes) -> str | None:
    """The `error.message` of an OpenAI error body, or None when the body is not one."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return str(err.get("message", "")) if isinstance(err, dict) else None


async def send_request(client: httpx.AsyncClient, spec: LoadSpec, index: int, t0: float) -> RequestRecord:
    """One streamed completion; never raises for anything the server or the network does."""
    prompt = spec.prompts[index]
    rec = RequestRecord(index=index, prompt_len=len(prompt), arrival_s=spec.arrival_times[index])
    body = {"prompt": prompt, "max_tokens": spec.output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    rec.sent_s = sent - t0
    try:
        async with asyncio.timeout(spec.request_timeout_s):
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    message = _error_message(await resp.aread())
                    rec.error_kind, rec.error = f"http_{resp.status_code}", (message or "")[:200]
                    if message is None:
                        rec.outcome, rec.error = Outcome.MALFORMED, "the error body is not an OpenAI error object"
                    else:
                        rec.outcome = Outcome.REJECTED if resp.status_code in REJECT_STATUSES else Outcome.FAILED
                else:
                    lines = [(time.perf_counter(), line) async for line in resp.aiter_lines()]
                    res = check_stream(lines, spec.output_len)
                    rec.outcome, rec.error_kind, rec.error = res.outcome, res.error_kind, res.error
                    rec.output_tokens, rec.num_chunks = res.output_tokens, res.num_chunks
                    if res.first_token_t is not None:
                        rec.ttft_s = res.first_token_t - sent
                    if res.outcome is Outcome.COMPLETED and res.output_tokens > 1:
                        rec.tpot_s = (res.last_token_t - res.first_token_t) / (res.output_tokens - 1)
    except TimeoutError:
        rec.outcome, rec.error_kind = Outcome.FAILED, "timeout"
        rec.error = f"no complete answer within {spec.request_timeout_s:g} s (--request-timeout)"
    except httpx.HTTPError as e:  # connection refused or dropped, protocol error
        rec.outcome, rec.error_kind, rec.error = Outcome.FAILED, type(e).__name__, str(e)[:200]
    rec.e2e_s = time.perf_counter() - sent
    return rec


def _raise_fd_limit() -> None:
    """Each in-flight request holds a socket; lift the soft open-file limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run_load(spec: LoadSpec, on_event: Callable[[dict[str, Any]], None]) -> float:
    """Send every prompt at its arrival time; report each record as it ends. Returns the wall time (s) from
    the first request out to the last one ended."""
    _raise_fd_limit()
    base = check_local_url(spec.url)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    # No client-side pool limit (the schedule and --max-concurrency are the only limits, so the client never
    # queues requests the benchmark meant to be in flight), and trust_env=False: no proxy from the environment
    # ever sees the traffic.
    # keepalive_expiry under the server's keep-alive timeout (uvicorn: 5 s): a connection idle for exactly that long
    # could otherwise be reused as the server closes it, and the request would fail with a ReadError
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=2.0)
    slots = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None

    async def one(client: httpx.AsyncClient, index: int, t0: float) -> None:
        async with slots if slots is not None else contextlib.nullcontext():
            rec = await send_request(client, spec, index, t0)
        on_event({"event": "request", **asdict(rec)})

    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=None, limits=limits,
                                 trust_env=False) as client:
        on_event({"event": "start"})
        t0 = time.perf_counter()
        tasks = []
        for i, at in enumerate(spec.arrival_times):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, i, t0)))
        await asyncio.gather(*tasks)
        return time.perf_counter() - t0


@dataclass
class _Writer:
    """JSON lines to stdout, flushed per line so the parent's progress bar moves as requests end."""

    out: Any = field(default_factory=lambda: sys.stdout)

    def __call__(self, event: dict[str, Any]) -> None:
        self.out.write(json.dumps(event) + "\n")
        self.out.flush()


def main() -> None:
    spec = LoadSpec(**json.load(sys.stdin))
    write = _Writer()
    duration_s = asyncio.run(run_load(spec, write))
    write({"event": "end", "duration_s": duration_s})


if __name__ == "__main__":
    main()
