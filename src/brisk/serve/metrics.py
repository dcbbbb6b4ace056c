"""Prometheus metrics of the server, in one registry per server (so several servers can live in one process).

Who writes what:
- the HTTP side (event loop thread) counts requests by endpoint and status code, and rejections;
- the engine thread counts tokens, observes latencies, and publishes the scheduler's gauges.
prometheus-client's metrics are thread-safe, so both may write without further locking.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from brisk.engine.scheduler import SchedulerStats

# Latency buckets (seconds): a CPU engine's time to first token runs from milliseconds (tiny model, idle)
# to tens of seconds (long prompts behind a full batch); inter-token latency from ~1 ms to seconds.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# The `*_created` timestamp series double the output and no dashboard reads them (vLLM turns them off too).
disable_created_metrics()


class ServerMetrics:
    def __init__(self, num_kv_blocks: int) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("brisk_http_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.rejected = Counter("brisk_requests_rejected", "Requests refused with 503 because the waiting "
                                "queue was full (back-pressure)", registry=r)
        self.finished = Counter("brisk_requests_finished", "Engine requests finished, by finish reason "
                                "(stop, length, abort, error)", ["reason"], registry=r)
        self.aborted = Counter("brisk_requests_aborted", "Engine requests aborted before finishing "
                               "(client disconnected)", registry=r)
        self.prompt_tokens = Counter("brisk_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("brisk_generation_tokens", "Generated tokens", registry=r)
        # per task: generate, embed (/v1/embeddings), rerank (/v1/rerank, /rerank), score (/v1/score)
        self.task_requests = Counter("brisk_task_requests", "HTTP requests handed to the engine, by task",
                                     ["task"], registry=r)
        self.task_prompt_tokens = Counter("brisk_task_prompt_tokens", "Prompt tokens of admitted requests, by task",
                                          ["task"], registry=r)
        self.ttft = Histogram("brisk_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.itl = Histogram("brisk_inter_token_latency_seconds", "Time between consecutive generated tokens "
                             "of one request", buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("brisk_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self.admitted = Gauge("brisk_num_sequences_admitted", "Sequences admitted by the server and not yet "
                              "answered (running, waiting, or on their way in or out)", registry=r)
        self.running = Gauge("brisk_num_requests_running", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("brisk_num_requests_waiting", "Sequences in the engine's waiting queue", registry=r)
        self.kv_usage = Gauge("brisk_kv_cache_usage_percent", "KV cache blocks held by requests, in percent "
                              "(0-100)", registry=r)
        self.kv_blocks_used = Gauge("brisk_kv_blocks_in_use", "KV cache blocks held by at least one request",
                                    registry=r)
        self.kv_blocks_total = Gauge("brisk_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.kv_blocks_total.set(num_kv_blocks)
        self.prefix_queries = Counter("brisk_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("brisk_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=r)
        self.prefix_hit_rate = Gauge("brisk_prefix_cache_hit_rate", "Prefix-cache hits / queries, in tokens, "
                                     "since the server started (0-1)", registry=r)
        self.preemptions = Counter("brisk_num_preemptions", "Requests preempted to free KV blocks", registry=r)
        self._num_kv_blocks = num_kv_blocks
        self._last = SchedulerStats()
        self._prefix_queries_total = 0
        self._prefix_hits_total = 0
        self._offload: dict[str, Counter | Gauge] = {}  # the disk tier's metrics, made on its first stats
        self._offload_last: dict[str, int] = {}

    def publish(self, stats: SchedulerStats) -> None:
        """Set the gauges from a scheduler snapshot; advance counters by what changed since the last one."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(100.0 * stats.kv_usage)
        self.kv_blocks_used.set(round(stats.kv_usage * self._num_kv_blocks))
        last = self._last
        # Counters only go up; a reset of the engine's own statistics restarts the deltas from zero.
        deltas = [now - before if now >= before else now
                  for now, before in ((stats.num_preemptions, last.num_preemptions),
                                      (stats.prefix_queries, last.prefix_queries),
                                      (stats.prefix_hits, last.prefix_hits))]
        self.preemptions.inc(deltas[0])
        self.prefix_queries.inc(deltas[1])
        self.prefix_hits.inc(deltas[2])
        self._prefix_queries_total += deltas[1]
        self._prefix_hits_total += deltas[2]
        if self._prefix_queries_total:
            self.prefix_hit_rate.set(self._prefix_hits_total / self._prefix_queries_total)
        self._last = stats
        if stats.kv_offload is not None:
            self._publish_offload(stats.kv_offload)

    def _publish_offload(self, now: dict[str, int]) -> None:
        """The disk tier's counters (kvcache/offload.py OffloadStats) as brisk_kv_offload_<name>: the sizes of the
        directory as gauges, the rest as counters advanced by their change."""
        last = self._offload_last
        for name, value in now.items():
            metric = self._offload.get(name)
            if metric is None:
                kind = Gauge if name.startswith("disk_") else Counter
                metric = self._offload[name] = kind(f"brisk_kv_offload_{name}", f"KV disk tier: {name}",
                                                    registry=self.registry)
            if isinstance(metric, Gauge):
                metric.set(value)
            else:
                before = last.get(name, 0)
                metric.inc(value - before if value >= before else value)
        self._offload_last = dict(now)

    def render(self) -> bytes:
        return generate_latest(self.registry)
