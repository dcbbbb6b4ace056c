"""The server's engine loop: one thread owns the LLMEngine; HTTP handlers talk to it only through messages.

The engine is single-threaded by design, so exactly one thread ever calls add_request / abort_request /
step. Handlers run on the asyncio event loop and never touch the engine:

    event loop (HTTP handlers)                          engine thread (sole owner of the LLMEngine)
    --------------------------                          -------------------------------------------
    open_stream(): admit or 503                         loop:
        commands.put(_Add) ------------------------->       idle? block on commands.get() (no busy-wait)
    async for (i, out) in stream:                           drain commands: add_request / abort_request
        await stream's wake-up <-- call_soon_threadsafe --  step() -> outputs, one batch per step
    disconnect / close(): commands.put(_Abort) ----->       publish scheduler stats to the metrics

Commands travel through one FIFO, so an abort can never overtake the add it refers to, and an abort is
applied before the next step: a client that goes away frees its KV blocks within one engine step.

A stream keeps only the newest output of each of its requests (outputs carry the whole text and token
list so far, so the newest one says everything): a client that reads slowly costs one pending output per
request, not a backlog that grows with every step.

Back-pressure is admission control on the event loop: at most `max_num_seqs + max_waiting` sequences
(n samples of each prompt of each request) are admitted at once; with a full batch running, at most
`max_waiting` wait. Beyond that `open_stream` raises ServerOverloadedError (a 503), so the backlog is
bounded no matter how fast clients arrive.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from brisk.engine.llm_engine import LLMEngine
from brisk.engine.outputs import RequestOutput
from brisk.engine.pooling import PoolingParams
from brisk.engine.sampling_params import SamplingParams
from brisk.lora.manager import LoRABusyError
from brisk.lora.request import LoRARequest
from brisk.serve.memory import IdleTrimmer
from brisk.serve.metrics import ServerMetrics

logger = logging.getLogger("brisk.serve")

Receive = Callable[[], Awaitable[dict[str, Any]]]


class ServerOverloadedError(Exception):
    """The waiting queue is full; the client should retry later (503 with Retry-After)."""


class EngineError(RuntimeError):
    """The engine failed (or stopped) while this request was in it; not the client's fault (500)."""


class EngineDeadError(EngineError):
    """The engine can take no more steps (a parallel worker died, ...): 503; the server stops and exits non-zero
    so that whatever supervises it starts a new one."""


class _EngineDead(Exception):
    """Leaves the engine loop after a fatal engine failure."""


class ClientDisconnected(Exception):
    """The HTTP client went away; its engine requests have been aborted."""


@dataclass
class EngineRequest:
    """One prompt of an HTTP request, validated and tokenized by the handler."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None = None  # the adapter the OpenAI `model` field named (serve/lora.py)
    # a prefill-only request (embeddings, rerank, score: serve/pooling.py), and the task it is counted under
    pooling: PoolingParams | None = None
    task: str = "generate"


@dataclass
class _Add:
    requests: list[EngineRequest]
    stream: RequestStream
    arrival_time: float


@dataclass
class _Abort:
    request_ids: list[str]


_STOP = object()  # command: fail what is in flight and end the thread


@dataclass
class _Live:
    """Engine-thread bookkeeping of one engine request."""

    stream: RequestStream
    arrival_time: float
    last_token_time: float | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, max_waiting: int, metrics: ServerMetrics | None = None,
                 stats_interval_s: float = 0.1) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.metrics = metrics
        self.max_num_seqs = engine.scheduler.config.max_num_seqs
        self.capacity = self.max_num_seqs + max_waiting  # sequences admitted at once
        self.num_admitted = 0  # event-loop thread only
        self._stats_interval_s = stats_interval_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._running = False  # the loop (`run`) is executing, on whichever thread
        self.dead: str | None = None  # why the engine can take no more steps (a fatal failure), once it happened
        self.ready = threading.Event()  # start() was called: the outputs' event loop is known
        self._stopped = threading.Event()
        self._last_publish = 0.0
        self.trimmer = IdleTrimmer()  # hands the heap's free pages back once a burst is over (serve/memory.py)

    # ------------------------------------------------------------------ event-loop side
    def start(self, *, own_thread: bool = True) -> None:
        """Call from inside the running event loop that will read the outputs. own_thread: start the engine
        loop on a new thread; else the caller runs `run()` on a thread of its own once `ready` is set
        (`run_server` uses the main thread: see there)."""
        self._loop = asyncio.get_running_loop()
        self._running = True  # from now on requests are admitted; they wait in the FIFO until the loop runs
        self.ready.set()
        if own_thread:
            self._thread = threading.Thread(target=self.run, name="brisk-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop (failing what is in flight) and wait for it, on whichever thread it runs."""
        if self._running:
            self._commands.put(_STOP)
            self._stopped.wait(timeout_s)

    @property
    def is_running(self) -> bool:
        return self._running

    def open_stream(self, requests: list[EngineRequest], receive: Receive | None = None) -> RequestStream:
        """Admit `requests` (one HTTP request's prompts) and submit them to the engine.

        `receive` is the ASGI receive callable: when given, a client disconnect aborts the requests at once,
        even while nobody is reading the stream. Always `close()` the stream (idempotent).
        """
        num_seqs = sum(r.params.n for r in requests)
        if self.num_admitted + num_seqs > self.capacity:
            if self.metrics is not None:
                self.metrics.rejected.inc()
            raise ServerOverloadedError(
                f"the server is at capacity ({self.num_admitted} sequences admitted, at most {self.capacity}: "
                f"{self.max_num_seqs} running + {self.capacity - self.max_num_seqs} waiting); retry later")
        if not self.is_running:
            if self.dead is not None:
                raise EngineDeadError(f"the engine is down ({self.dead}); the server is stopping")
            raise EngineError("the engine loop is not running")
        self.num_admitted += num_seqs
        if self.metrics is not None:
            self.metrics.admitted.set(self.num_admitted)
        return RequestStream(self, requests, num_seqs, receive)

    def _release(self, num_seqs: int) -> None:
        self.num_admitted -= num_seqs
        assert self.num_admitted >= 0, f"admission count went negative ({self.num_admitted})"
        if self.metrics is not None:
            self.metrics.admitted.set(self.num_admitted)

    # ------------------------------------------------------------------ engine thread
    def run(self) -> None:
        """The engine loop, until shutdown() (or Ctrl-C where it runs on the main thread)."""
        try:
            self._run()
        except BaseException:  # KeyboardInterrupt on the main thread: nobody is left waiting for an answer
            self._fail_all(EngineError("the server is shutting down"))
            raise
        finally:
            self._running = False
            self._stopped.set()

    def _next_command(self) -> Any:
        """Block until a command arrives (no busy-wait), waking every 0.2 s so that a signal handler on the
        main thread gets to run soon."""
        while True:
            try:
                return self._commands.get(timeout=0.2)
            except queue.Empty:
                continue

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                if idle:
                    self._publish(force=True)
                    self.trimmer.idle()
                commands = [self._next_command()] if idle else []  # blocks while there is nothing to do
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for cmd in commands:
                    if cmd is _STOP:
                        self._fail_all(EngineError("the server is shutting down"))
                        return
                    if isinstance(cmd, _Add):
                        self._add(cmd)
                    else:
                        self._abort(cmd)
                if self.engine.has_unfinished_requests():
                    self._step()
                    self.trimmer.worked()
        except _EngineDead:
            return
        except Exception:  # a bug in this loop: fail every request rather than leave clients hanging
            logger.exception("the engine loop crashed; /health now answers 503")
            self._fail_all(EngineError("the engine loop crashed; see the server log"))

    def _add(self, cmd: _Add) -> None:
        for req in cmd.requests:
            try:
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.params,
                                        arrival_time=cmd.arrival_time, lora_request=req.lora_request,
                                        pooling=req.pooling)
            except LoRABusyError as e:  # every adapter slot held by running requests: retry later
                self._deliver([(cmd.stream, ServerOverloadedError(str(e)))])
                continue
            except ValueError as e:  # the handler validated already; report whatever the engine still refuses
                self._deliver([(cmd.stream, e)])
                continue
            except Exception as e:  # one request's failure must not take the loop (and every other client) down
                logger.exception("add_request failed")
                self._deliver([(cmd.stream, EngineError(f"the engine could not take the request: "
                                                        f"{type(e).__name__}: {e}"))])
                continue
            self._live[req.request_id] = _Live(cmd.stream, cmd.arrival_time)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
                self.metrics.task_prompt_tokens.labels(req.task).inc(len(req.prompt_token_ids))
        if self.metrics is not None and cmd.requests:
            self.metrics.task_requests.labels(cmd.requests[0].task).inc()

    def _abort(self, cmd: _Abort) -> None:
        aborted = [rid for rid in cmd.request_ids if self._live.pop(rid, None) is not None]
        if not aborted:
            return
        self.engine.abort_request(aborted)  # frees their KV blocks now
        if self.metrics is not None:
            self.metrics.aborted.inc(len(aborted))
            self.metrics.finished.labels("abort").inc(len(aborted))
        self._publish(force=True)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed")
            if getattr(e, "fatal", False):  # no later step can succeed: fail everyone, leave the loop
                self.dead = f"{type(e).__name__}: {e}"
                self._fail_all(EngineDeadError(f"the engine failed and is down: {self.dead}"))
                raise _EngineDead from e
            self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
            return
        now = time.monotonic()
        batch: list[tuple[RequestStream, Any]] = []
        m = self.metrics
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:  # not ours (cannot happen: aborts and steps both run on this thread)
                continue
            if m is not None:
                self._observe(m, live, out, now)
            if out.finished:
                del self._live[out.request_id]
            batch.append((live.stream, out))
        self._deliver(batch)
        self._publish()

    @staticmethod
    def _observe(m: ServerMetrics, live: _Live, out: RequestOutput, now: float) -> None:
        num_new = sum(c.num_new_tokens for c in out.outputs)
        if num_new:
            m.generation_tokens.inc(num_new)
            if live.last_token_time is None:
                m.ttft.observe(now - live.arrival_time)
            else:
                # per sequence, this step produced up to max(num_new_tokens) tokens (more with speculation)
                per_seq = max(c.num_new_tokens for c in out.outputs)
                m.itl.observe((now - live.last_token_time) / per_seq)
            live.last_token_time = now
        if out.finished:
            m.e2e.observe(now - live.arrival_time)
            for c in out.outputs:
                m.finished.labels(c.finish_reason or "unknown").inc()

    def _fail_all(self, err: EngineError) -> None:
        if not self._live:
            return
        ids = list(self._live)
        batch = [(live.stream, err) for live in self._live.values()]
        self._live.clear()
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("aborting the failed requests failed too")
        if self.metrics is not None:
            self.metrics.finished.labels("error").inc(len(ids))
        self._deliver(batch)
        self._publish(force=True)

    def _deliver(self, batch: list[tuple[RequestStream, Any]]) -> None:
        """Hand items to their streams on the event loop: one loop wake-up per step, not per request."""
        if not batch or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the event loop is closed: the server is going down, nobody is listening
            return
        # Let the event loop's thread take the GIL now: it would otherwise wait for the interpreter's switch
        # interval (5 ms), and a small model's steps are faster than that, so a whole answer coalesced into one
        # server-sent event on a fast machine.
        time.sleep(0)

    def _publish(self, force: bool = False) -> None:
        # stats() walks every request's blocks; while busy, refresh the gauges a few times a second only
        now = time.monotonic()
        if self.metrics is None or (not force and now - self._last_publish < self._stats_interval_s):
            return
        self._last_publish = now
        try:
            self.metrics.publish(self.engine.stats())
        except Exception:  # metrics must never take the engine down
            logger.exception("publishing engine stats failed")


def _put_all(batch: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in batch:
        stream._push(item)


class RequestStream:
    """The outputs of one HTTP request's engine requests, as (prompt index, RequestOutput), until all finish.

    Outputs of one request coalesce while nobody reads: only the newest is kept, so read `text`, `token_ids`
    and `logprobs` (cumulative), not `text_delta` / `num_new_tokens` (relative to the previous step).
    Raises ClientDisconnected when the client went away, EngineError when the engine failed, and the
    engine's ValueError when it refused a prompt.
    """

    def __init__(self, engine: AsyncEngine, requests: list[EngineRequest], num_seqs: int,
                 receive: Receive | None) -> None:
        self._engine = engine
        self._index = {r.request_id: i for i, r in enumerate(requests)}
        self._unfinished = set(self._index)
        self._num_seqs = num_seqs
        self._pending: dict[str, RequestOutput] = {}  # newest undelivered output per request, oldest first
        self._error: BaseException | None = None
        self._disconnected = False
        self._wakeup = asyncio.Event()
        self._closed = False
        engine._commands.put(_Add(requests, self, time.monotonic()))
        self._watcher = asyncio.ensure_future(self._watch(receive)) if receive is not None else None

    def _push(self, item: RequestOutput | BaseException) -> None:
        """Called on the event loop (via call_soon_threadsafe) with an engine output or failure."""
        if isinstance(item, BaseException):
            self._error = self._error or item
        else:
            self._pending[item.request_id] = item
        self._wakeup.set()

    async def _watch(self, receive: Receive) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the ASGI server no longer delivers messages for this request: treat as gone
            logger.debug("disconnect watcher stopped", exc_info=True)
        self.close()
        self._disconnected = True
        self._wakeup.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        while True:
            if self._disconnected:
                raise ClientDisconnected()
            if self._error is not None:
                self.close()
                raise self._error
            if self._pending:
                break
            if not self._unfinished:
                raise StopAsyncIteration
            self._wakeup.clear()
            await self._wakeup.wait()
        request_id = next(iter(self._pending))
        out = self._pending.pop(request_id)
        if out.finished:
            self._unfinished.discard(request_id)
        return self._index[request_id], out

    def close(self) -> None:
        """Abort whatever has not finished and give the admission slots back. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
        if self._unfinished:
            self._engine._commands.put(_Abort(sorted(self._unfinished)))
        self._engine._release(self._num_seqs)
