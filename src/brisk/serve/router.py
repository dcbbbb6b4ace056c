"""Data-parallel replicas behind one endpoint: `brisk serve --data-parallel-size N`.

    client --HTTP--> router (this process, host:port) --HTTP--> replica 0 .. N-1 (`brisk serve` children on
                                                                  127.0.0.1 and free ports, one engine each)

Each replica is a whole `brisk serve` (its own engine, KV pool and prefix cache, threads // N torch threads). The
router forwards every request as it came (streams stay streams) to one replica, chosen as SGLang's cache-aware
router does:

  * prefix: each replica has an approximate index of the prompts it was sent: the chained hashes of the prompt
    text's successive CHUNK-character pieces (what a radix tree of the text would hold, flattened to its nodes),
    least recently used dropped past `max_entries`. A request goes to the replica whose index holds the longest
    run of its leading pieces, when that run covers at least `cache_threshold` of the prompt; otherwise, and
    whenever the replicas' loads are too far apart (more than `balance_abs` requests in flight and `balance_rel`
    times the least loaded), to the least loaded replica (requests in flight, then requests sent). The router
    sees text, not tokens, so the index approximates the replica's block hashes: same text, same tokens.
  * round-robin: the baseline it is measured against (docs/parallel.md).

The router runs the server's browser checks itself (serve/security.py: Host, Origin, Content-Type) with the same
options, answers CORS for the origins they allow, and forwards without the Origin header, already checked.

/metrics gives the router's own counters (requests, in flight and routing decisions per replica) followed by
every replica's own metrics, each sample labelled `replica="i"`. /health is 200 while every replica is healthy. A
replica that exits makes the router answer 503 (`engine_dead`) and stop with exit code 1, like a single server
whose engine died.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from brisk.serve.process import ServerProcess
from brisk.serve.security import AccessPolicy, RequestGuard

logger = logging.getLogger("brisk.serve")

CHUNK = 32  # characters per indexed piece of a prompt
POLICIES = ("prefix", "round-robin")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}


def prompt_text(path: str, body: Any) -> str:
    """The text a request's prompt starts with, as the replica will see it: the completion prompt (token ids
    written out), or the chat messages' roles and contents in order (the system prompt first)."""
    if not isinstance(body, dict):
        return ""
    if path.endswith("/chat/completions"):
        parts = []
        for m in body.get("messages") or []:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role')}>{content or ''}")
        return "".join(parts)
    prompt = body.get("prompt", body.get("input", ""))
    if isinstance(prompt, list):
        prompt = prompt[0] if prompt and not isinstance(prompt[0], int) else prompt
        if isinstance(prompt, list):
            return " ".join(str(t) for t in prompt)
    return str(prompt)


def chunk_hashes(text: str, chunk: int = CHUNK) -> list[bytes]:
    """Chained hashes of the text's whole leading pieces: hash i names pieces 0..i (as a block hash names its
    whole prefix), so two prompts share hash i exactly when their first (i + 1) * chunk characters agree."""
    out, h = [], b""
    for i in range(0, len(text) - chunk + 1, chunk):
        h = hashlib.blake2b(h + text[i:i + chunk].encode(), digest_size=12).digest()
        out.append(h)
    return out


class PrefixIndex:
    """One replica's prompt pieces (chained hashes), least recently used first."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self.entries: OrderedDict[bytes, None] = OrderedDict()
        self.max_entries = max_entries

    def match(self, hashes: list[bytes]) -> int:
        """How many of the leading pieces this replica was sent before."""
        n = 0
        for h in hashes:
            if h not in self.entries:
                break
            n += 1
        return n

    def insert(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.entries[h] = None
            self.entries.move_to_end(h)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)


@dataclass
class RouterPolicy:
    """Which replica a prompt goes to (see the module docstring); counts what it chose."""

    num_replicas: int
    policy: str = "prefix"
    cache_threshold: float = 0.5
    balance_abs: int = 32
    balance_rel: float = 1.5
    in_flight: list[int] = field(default_factory=list)
    num_sent: list[int] = field(default_factory=list)
    indexes: list[PrefixIndex] = field(default_factory=list)
    _next: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if self.num_replicas < 1:
            raise ValueError(f"the router needs at least one replica, got {self.num_replicas}")
        self.in_flight = [0] * self.num_replicas
        self.num_sent = [0] * self.num_replicas
        self.indexes = [PrefixIndex() for _ in range(self.num_replicas)]

    def least_loaded(self) -> int:
        return min(range(self.num_replicas), key=lambda i: (self.in_flight[i], self.num_sent[i], i))

    def choose(self, text: str) -> tuple[int, str]:
        """(replica, why): why is 'prefix', 'load' or 'round-robin'."""
        if self.policy == "round-robin":
            i, self._next = self._next, (self._next + 1) % self.num_replicas
            return i, "round-robin"
        hashes = chunk_hashes(text)
        lo, hi = min(self.in_flight), max(self.in_flight)
        balanced = not (hi - lo > self.balance_abs and hi > self.balance_rel * lo)
        i, why = self.least_loaded(), "load"
        if hashes and balanced:
            matches = [idx.match(hashes) for idx in self.indexes]
            best = max(range(self.num_replicas), key=lambda r: (matches[r], -self.in_flight[r]))
            if matches[best] * CHUNK >= self.cache_threshold * len(text):
                i, why = best, "prefix"
        self.indexes[i].insert(hashes)
        return i, why


class _RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("brisk_router_requests", "Requests the router sent, by replica and the reason it "
                                "chose that replica (prefix, load, round-robin)", ["replica", "reason"], registry=r)
        self.in_flight = Gauge("brisk_router_requests_in_flight", "Requests sent and not yet answered, by replica",
                               ["replica"], registry=r)


def _label(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def relabel_metrics(texts: list[str]) -> str:
    """Every replica's Prometheus text, each sample labelled with its replica index, one family at a time."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in enumerate(texts):
        for fam in text_string_to_metric_families(text):
            doc, kind, lines = families.setdefault(fam.name, (fam.documentation, fam.type, []))
            for s in fam.samples:
                labels = {**s.labels, "replica": str(replica)}
                inner = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
                lines.append(f"{s.name}{{{inner}}} {s.value!r}")
    out = []
    for name, (doc, kind, lines) in families.items():
        out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", *lines]
    return "\n".join(out) + "\n"


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": code}},
                        status_code=status)


def create_router_app(urls: list[str], policy: str = "prefix", *,
                      replicas: list[ServerProcess] | None = None, access: AccessPolicy | None = None) -> FastAPI:
    """The router's app over replicas at `urls` (http://host:port); `replicas`, when given, are watched: one that
    exits makes every later request a 503 (see run_router for the exit). `access`: the browser checks (default:
    a router bound to 127.0.0.1 with no extra origins or hosts)."""
    router = RouterPolicy(len(urls), policy)
    metrics = _RouterMetrics()
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
    app = FastAPI(title="brisk router", openapi_url=None)
    app.state.router = router

    def dead() -> str | None:
        for i, p in enumerate(replicas or []):
            if p.proc is not None and p.proc.poll() is not None:
                return f"replica {i} exited with code {p.proc.returncode}"
        return None

    @app.get("/health")
    async def health() -> Response:
        why = dead()
        if why is not None:
            return _error(503, f"the engine is down: {why}", "engine_dead")
        try:
            rs = await asyncio.gather(*(client.get(f"{u}/health", timeout=5.0) for u in urls))
        except httpx.HTTPError as e:
            return _error(503, f"a replica did not answer: {e}", "engine_dead")
        ok = all(r.status_code == 200 for r in rs)
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def all_metrics() -> Response:
        texts = []
        for u in urls:
            try:
                texts.append((await client.get(f"{u}/metrics", timeout=5.0)).text)
            except httpx.HTTPError:
                texts.append("")
        body = generate_latest(metrics.registry).decode() + relabel_metrics(texts)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def forward(path: str, request: Request) -> Response:
        why = dead()
        if why is not None:
            return _error(503, f"the engine is down: {why}", "engine_dead")
        raw = await request.body()
        text = ""
        if request.method == "POST" and raw:
            try:
                text = prompt_text(request.url.path, json.loads(raw))
            except (ValueError, UnicodeDecodeError):
                text = ""  # the replica answers the malformed body with its own 400
        i, reason = router.choose(text) if request.method == "POST" else (router.least_loaded(), "load")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS and k.lower() != "origin"}
        url = f"{urls[i]}/{path}" + (f"?{request.url.query}" if request.url.query else "")
        router.in_flight[i] += 1
        router.num_sent[i] += 1
        metrics.requests.labels(str(i), reason).inc()
        metrics.in_flight.labels(str(i)).inc()

        def done() -> None:
            router.in_flight[i] -= 1
            metrics.in_flight.labels(str(i)).dec()

        try:
            upstream = await client.send(client.build_request(request.method, url, content=raw, headers=headers),
                                         stream=True)
        except httpx.HTTPError as e:
            done()
            return _error(503, f"replica {i} did not answer ({type(e).__name__}); the engine is down",
                          "engine_dead")

        async def body() -> AsyncIterator[bytes]:
            try:
                async for piece in upstream.aiter_raw():
                    yield piece
            finally:
                await upstream.aclose()
                done()

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        return StreamingResponse(body(), status_code=upstream.status_code, headers=out_headers)

    access = access or AccessPolicy()
    if access.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=access.allowed_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(RequestGuard, policy=access)
    return app


# ---------------------------------------------------------------------------- `brisk serve --data-parallel-size N`
def replica_args(argv: list[str], num_replicas: int) -> list[str]:
    """A replica's `brisk serve` arguments: the command's own, less the router's (--data-parallel-size,
    --router-policy) and the address (each replica gets its own port), with threads // N torch threads each
    unless --threads was given."""
    drop = {"--data-parallel-size", "--router-policy", "--host", "--port"}
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in drop:
            skip = "=" not in a
            continue
        out.append(a)
    if not any(a.split("=", 1)[0] == "--threads" for a in out):
        out += ["--threads", str(max(1, (os.cpu_count() or 1) // num_replicas))]
    return out


def start_replicas(args: list[str], num_replicas: int, startup_timeout_s: float = 600.0) -> list[ServerProcess]:
    """Start the replicas side by side and wait until each is healthy (all stopped if one fails)."""
    procs = [ServerProcess(args, startup_timeout_s=startup_timeout_s) for _ in range(num_replicas)]
    errors: list[BaseException] = []

    def start(p: ServerProcess) -> None:
        try:
            p.start()
        except BaseException as e:  # noqa: BLE001 - reported below, with the others stopped
            errors.append(e)

    threads = [threading.Thread(target=start, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for p in procs:
            p.stop()
        raise errors[0]
    return procs


def run_router(argv: list[str], num_replicas: int, policy: str, *, host: str = "127.0.0.1", port: int = 8000,
               access: AccessPolicy | None = None) -> None:
    """`brisk serve --data-parallel-size N`: start N replicas, serve the router until stopped (or until a
    replica dies: exit code 1), then stop the replicas."""
    import uvicorn

    RouterPolicy(num_replicas, policy)  # a bad policy fails before anything starts
    procs = start_replicas(replica_args(argv, num_replicas), num_replicas)
    logger.warning("brisk: %d replicas up (%s), routing: %s", num_replicas, ", ".join(p.url for p in procs), policy)
    app = create_router_app([p.url for p in procs], policy, replicas=procs, access=access or AccessPolicy(host))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    died: list[str] = []

    async def watch() -> None:
        while not server.should_exit:
            for i, p in enumerate(procs):
                if p.proc is not None and p.proc.poll() is not None:
                    died.append(f"replica {i} exited with code {p.proc.returncode}")
                    await asyncio.sleep(1.0)  # the requests in flight get their 503 first
                    server.should_exit = True
                    return
            await asyncio.sleep(0.5)

    async def main() -> None:
        task = asyncio.create_task(watch())
        await server.serve()
        task.cancel()

    def stop(signum: int, _frame: object) -> None:
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(main())
    finally:
        for p in procs:
            p.stop()
    if died:
        logger.error("brisk: the engine is down (%s); the router stops", died[0])
        raise SystemExit(1)
