"""`brisk bench serve`: drive a `brisk serve` process with the load generator and report what it saw.

    parent (this module)                              load generator (loadgen.py, its own process)
    --------------------                              --------------------------------------------
    warm-up request, scrape /metrics (before)
    spawn, write the LoadSpec to its stdin  ------->  stream requests at their Poisson arrival times
    progress bar <-- one JSON line per ended request  (TTFT, TPOT, E2E, tokens, outcome)
    sampler thread: server RSS + KV gauges / 0.25 s
    wait until the server is idle, scrape /metrics (after)
    summary: throughput, latency percentiles, counts, server-side facts, PASS / FAIL checks

The three checks are the issue's soak target: every request ended completed or as a clean 503/429 (none
lost, failed or malformed), no KV block is still held once the server is idle, and the server's RSS did
not grow after warm-up.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from brisk.bench import report
from brisk.bench.loadgen import LoadSpec, Outcome, check_local_url
from brisk.console import progress_bar, stderr_console

SAMPLE_INTERVAL_S = 0.25
# The first quarter of the run is warm-up for the RSS check: allocator pools, thread pools and the first
# batch shapes settle there. What follows must stay flat.
RSS_WARMUP_FRACTION = 0.25


class LoadGeneratorError(RuntimeError):
    """The load-generator process failed; the message carries its stderr."""


def load_tokenizer(model: str | None):  # noqa: ANN201 - brisk.model.tokenizer.Tokenizer
    """The tokenizer of a model path (or the default model) without loading its weights."""
    from brisk.model.loader import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        from brisk.model.tokenizer import Tokenizer

        return Tokenizer.from_hf_folder(path)
    from brisk.model.gguf import read_gguf
    from brisk.model.gguf_tokenizer import tokenizer_from_gguf_metadata

    return tokenizer_from_gguf_metadata(read_gguf(path).metadata, path)


# ---------------------------------------------------------------------------- the server, from outside
def scrape_metrics(client: httpx.Client) -> dict[str, float] | None:
    """/metrics as {sample name{label=value,...} -> value}; None when the server has no Prometheus page."""
    try:
        resp = client.get("/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def read_rss_bytes(pid: int) -> int | None:
    """Resident memory of a local process (Linux /proc; None elsewhere or once it has exited)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    return None


def wait_until_idle(client: httpx.Client, timeout_s: float = 30.0) -> dict[str, float] | None:
    """Scrape until nothing is admitted, running or waiting (the gauges lag the last answer by a moment)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape_metrics(client)
        busy = m is not None and any(m.get(k, 0) for k in ("brisk_num_sequences_admitted",
                                                          "brisk_num_requests_running",
                                                          "brisk_num_requests_waiting"))
        if not busy or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


class ServerSampler:
    """A thread sampling the server's RSS (when its pid is known) and KV / queue gauges every interval."""

    def __init__(self, client: httpx.Client, pid: int | None, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.client, self.pid, self.interval_s = client, pid, interval_s
        self.samples: list[dict[str, float | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="brisk-bench-sampler", daemon=True)
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread.start()

    def stop(self) -> list[dict[str, float | None]]:
        """Stop (a sampler never started has nothing to say) and return the samples, one taken now."""
        if not self._thread.is_alive():
            return self.samples
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.samples

    def _sample(self) -> None:
        m = scrape_metrics(self.client) or {}
        self.samples.append({"t_s": time.monotonic() - self._t0,
                             "rss_bytes": read_rss_bytes(self.pid) if self.pid else None,
                             "kv_blocks_in_use": m.get("brisk_kv_blocks_in_use"),
                             "running": m.get("brisk_num_requests_running"),
                             "waiting": m.get("brisk_num_requests_waiting")})

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()


# ---------------------------------------------------------------------------- the load generator process
def run_load_process(spec: LoadSpec, on_event: Callable[[dict[str, Any]], None]) -> tuple[list[dict], float]:
    """Run loadgen.py in a child process; `on_event` sees every event line. Returns (records, wall time)."""
    records: list[dict] = []
    duration_s = None
    doc = {k: getattr(spec, k) for k in ("url", "prompts", "arrival_times", "output_len", "max_concurrency",
                                         "request_timeout_s", "api_key")}
    with tempfile.TemporaryFile("w+") as err:
        # stderr to a file: an undrained pipe would block the child once it filled
        proc = subprocess.Popen([sys.executable, "-m", "brisk.bench.loadgen"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            proc.stdin.write(json.dumps(doc))  # the child reads all of stdin before it writes anything
            proc.stdin.close()
            for line in proc.stdout:
                event = json.loads(line)
                if event["event"] == "request":
                    records.append({k: v for k, v in event.items() if k != "event"})
                elif event["event"] == "end":
                    duration_s = event["duration_s"]
                on_event(event)
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if rc != 0 or duration_s is None:
            err.seek(0)
            tail = "\n".join(err.read().splitlines()[-20:])
            raise LoadGeneratorError(f"the load generator exited with code {rc}:\n{tail}")
    return sorted(records, key=lambda r: r["index"]), duration_s


# ---------------------------------------------------------------------------- summaries
def _stats(name: str, xs: list[float]) -> dict[str, float | None]:
    """Mean and percentiles; None (JSON null, not NaN) when there is nothing to summarize."""
    if not xs:
        return {f"{name}_{s}": None for s in ("mean", "p50", "p90", "p99")}
    return {f"{name}_mean": report.mean(xs), f"{name}_p50": report.percentile(xs, 50),
            f"{name}_p90": report.percentile(xs, 90), f"{name}_p99": report.percentile(xs, 99)}


def _peak_in_flight(records: list[dict]) -> int:
    edges = sorted([(r["sent_s"], 1) for r in records] + [(r["sent_s"] + (r["e2e_s"] or 0.0), -1) for r in records],
                   key=lambda e: (e[0], e[1]))  # at equal times an end goes before a start
    peak = now = 0
    for _, d in edges:
        now += d
        peak = max(peak, now)
    return peak


def summarize(records: list[dict], elapsed_s: float) -> dict[str, Any]:
    """Counts, throughput over the completed requests, latency statistics, errors by kind."""
    by = Counter(r["outcome"] for r in records)
    done = [r for r in records if r["outcome"] == Outcome.COMPLETED]
    output_tokens = sum(r["output_tokens"] for r in done)
    prompt_tokens = sum(r["prompt_len"] for r in done)
    out: dict[str, Any] = {
        "num_prompts": len(records),
        "num_completed": by[Outcome.COMPLETED],
        "num_rejected": by[Outcome.REJECTED],
        # everything that neither completed nor was cleanly refused, malformed answers included
        "num_failed": by[Outcome.FAILED] + by[Outcome.MALFORMED],
        "num_malformed": by[Outcome.MALFORMED],
        "errors": dict(Counter(r["error_kind"] for r in records if r["outcome"] != Outcome.COMPLETED)),
        "error_examples": {r["error_kind"]: r["error"] for r in records if r["outcome"] != Outcome.COMPLETED},
        "elapsed_s": elapsed_s,
        "requests_s": len(done) / elapsed_s,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tok_s": output_tokens / elapsed_s,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed_s,
        "peak_in_flight": _peak_in_flight(records),
        "mean_chunks_per_request": report.mean([r["num_chunks"] for r in done]) if done else None,
    }
    out |= _stats("ttft_s", [r["ttft_s"] for r in done])
    out |= _stats("tpot_s", [r["tpot_s"] for r in done if r["tpot_s"] is not None])
    out |= _stats("e2e_s", [r["e2e_s"] for r in done])
    out |= _stats("reject_s", [r["e2e_s"] for r in records if r["outcome"] == Outcome.REJECTED])
    return out


def rss_flat_check(samples: list[tuple[float, int]], elapsed_s: float, tolerance_bytes: int,
                   warmup_fraction: float = RSS_WARMUP_FRACTION) -> dict[str, Any]:
    """Did the server's RSS stay flat after warm-up? Samples are (seconds from the start, RSS bytes).

    The samples after the warm-up are split into an early and a late half; growth = peak of the late half -
    peak of the early half. Peaks, not means, because RSS follows the batch composition up and down while a
    leak lifts every peak; comparing two halves of a steady load cancels that composition out.
    """
    post = [(t, r) for t, r in samples if t >= warmup_fraction * elapsed_s]
    out: dict[str, Any] = {"tolerance_bytes": tolerance_bytes, "num_samples": len(samples),
                           "rss_start_bytes": samples[0][1] if samples else None,
                           "rss_peak_bytes": max((r for _, r in samples), default=None),
                           "rss_end_bytes": samples[-1][1] if samples else None}
    if len(post) < 4:
        return out | {"verdict": "n/a", "reason": f"{len(post)} RSS samples after warm-up, need 4: run longer"
                      if samples else "no RSS samples: the server's pid is unknown (pass --server-pid)"}
    early, late = post[:len(post) // 2], post[len(post) // 2:]
    growth = max(r for _, r in late) - max(r for _, r in early)
    t, r = np.array([t for t, _ in post]), np.array([r for _, r in post], dtype=np.float64)
    slope = float(np.polyfit(t, r, 1)[0]) if t[-1] > t[0] else 0.0
    return out | {"verdict": "PASS" if growth <= tolerance_bytes else "FAIL",
                  "rss_after_warmup_bytes": post[0][1], "growth_after_warmup_bytes": growth,
                  "rss_min_after_warmup_bytes": min(r for _, r in post),
                  "rss_max_after_warmup_bytes": max(r for _, r in post), "slope_bytes_per_s": slope}


def server_facts(before: dict[str, float] | None, after: dict[str, float] | None,
                 samples: list[dict[str, float | None]]) -> dict[str, Any]:
    """What the server's own /metrics say about the run: deltas of its counters and its state once idle."""
    if before is None or after is None:
        return {"metrics": False}

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queries, hits = delta("brisk_prefix_cache_queries_total"), delta("brisk_prefix_cache_hits_total")
    kv = [s["kv_blocks_in_use"] for s in samples if s["kv_blocks_in_use"] is not None]
    return {
        "metrics": True,
        "kv_blocks_in_use_after": after.get("brisk_kv_blocks_in_use"),
        "kv_blocks_total": after.get("brisk_kv_blocks_total"),
        "kv_blocks_in_use_peak": max(kv, default=None),
        "num_admitted_after": after.get("brisk_num_sequences_admitted"),
        "running_peak": max((s["running"] for s in samples if s["running"] is not None), default=None),
        "waiting_peak": max((s["waiting"] for s in samples if s["waiting"] is not None), default=None),
        "num_preemptions": delta("brisk_num_preemptions_total"),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_hit_rate": hits / queries if queries else None,
        "num_rejected": delta("brisk_requests_rejected_total"),
        "num_aborted": delta("brisk_requests_aborted_total"),
        "generation_tokens": delta("brisk_generation_tokens_total"),
        "prompt_tokens": delta("brisk_prompt_tokens_total"),
    }


def soak_checks(summary: dict[str, Any], server: dict[str, Any], rss: dict[str, Any]) -> dict[str, dict]:
    """The issue's three soak criteria, each PASS / FAIL (or n/a when the server does not expose the fact)."""
    n, ok, rej = summary["num_prompts"], summary["num_completed"], summary["num_rejected"]
    failed, malformed = summary["num_failed"], summary["num_malformed"]
    clean = {"verdict": "PASS" if failed == 0 else "FAIL",
             "detail": f"{n} requests = {ok} completed + {rej} rejected (503/429) + {failed} failed "
                       f"({malformed} malformed)" + (f"; errors: {summary['errors']}" if failed else "")}
    if not server.get("metrics") or server["kv_blocks_in_use_after"] is None:
        blocks = {"verdict": "n/a", "detail": "the server has no brisk /metrics"}
    else:
        used, admitted = server["kv_blocks_in_use_after"], server["num_admitted_after"]
        blocks = {"verdict": "PASS" if used == 0 and not admitted else "FAIL",
                  "detail": f"{used:.0f} KV blocks in use and {admitted or 0:.0f} sequences admitted once idle"}
    if rss["verdict"] == "n/a":
        flat = {"verdict": "n/a", "detail": rss["reason"]}
    else:
        mib = 2**20
        flat = {"verdict": rss["verdict"],
                "detail": f"after warm-up {rss['rss_min_after_warmup_bytes'] / mib:.0f}-"
                          f"{rss['rss_max_after_warmup_bytes'] / mib:.0f} MiB (peak of the whole run "
                          f"{rss['rss_peak_bytes'] / mib:.0f}); late-half peak - early-half peak = "
                          f"{rss['growth_after_warmup_bytes'] / mib:+.1f} MiB (tolerance "
                          f"{rss['tolerance_bytes'] / mib:.0f} MiB); linear trend "
                          f"{rss['slope_bytes_per_s'] / mib * 60:+.1f} MiB/min"}
    return {"every_request_completed_or_rejected": clean, "no_leaked_kv_blocks": blocks, "rss_flat": flat}


# ---------------------------------------------------------------------------- one benchmark run
def run_serve_bench(url: str, prompts: list[list[int]], output_len: int, arrival_times: list[float], *,
                    max_concurrency: int | None = None, request_timeout_s: float = 600.0,
                    api_key: str | None = None, server_pid: int | None = None,
                    rss_tolerance_bytes: int = 32 * 2**20, show_progress: bool = True) -> dict[str, Any]:
    """Warm the server up, run the load, and return {"summary", "server", "rss", "checks", "samples",
    "records"}. The server must be idle when this starts: its counters are compared before and after."""
    base = check_local_url(url)
    spec = LoadSpec(base, prompts, arrival_times, output_len, max_concurrency, request_timeout_s, api_key)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base, headers=headers, trust_env=False, timeout=60) as client:
        # one untimed request: thread pools and first-call paths start outside the clock. Four tokens stay
        # under a KV block, so nothing lands in the prefix cache for the timed prompts.
        warm = client.post("/v1/completions", json={"prompt": prompts[0][:4], "max_tokens": 2, "temperature": 0})
        if warm.status_code != 200:
            raise ValueError(f"the warm-up request to {base} got HTTP {warm.status_code}: {warm.text[:300]}")
        before = wait_until_idle(client)
        sampler = ServerSampler(client, server_pid)
        counts: Counter = Counter()
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=stderr_console(), transient=True,
                            disable=not show_progress)
        task = progress.add_task("serve: starting", total=len(prompts))

        def on_event(event: dict[str, Any]) -> None:
            if event["event"] == "start":
                sampler.start()
            elif event["event"] == "request":
                counts[event["outcome"]] += 1
                progress.update(task, advance=1, description=(
                    f"serve: {counts[Outcome.COMPLETED]} ok, {counts[Outcome.REJECTED]} rejected, "
                    f"{counts[Outcome.FAILED] + counts[Outcome.MALFORMED]} failed"))

        try:
            with progress:
                records, elapsed_s = run_load_process(spec, on_event)
        finally:
            samples = sampler.stop()
        after = wait_until_idle(client)

    summary = summarize(records, elapsed_s)
    server = server_facts(before, after, samples)
    rss_samples = [(s["t_s"], s["rss_bytes"]) for s in samples if s["rss_bytes"] is not None]
    server["rss_idle_after_bytes"] = read_rss_bytes(server_pid) if server_pid else None
    rss = rss_flat_check(rss_samples, elapsed_s, rss_tolerance_bytes)
    return {"summary": summary, "server": server, "rss": rss, "checks": soak_checks(summary, server, rss),
            "samples": samples, "records": records}


def default_llamacpp_type(model: str | None, dtype: str) -> str:
    """The llama.cpp file type that matches the served weights: F32 for float32, F16 for bfloat16. A quantized
    brisk checkpoint has no single match (RTN int4 g32 asym is Q4_1, int8 per channel is near Q8_0): say so."""
    from brisk.model.loader import resolve_model

    path = resolve_model(model)
    config = path / "config.json"
    if path.is_dir() and config.exists() and "quantization_config" in json.loads(config.read_text()):
        raise ValueError(f"{path} is a quantized checkpoint: name the llama.cpp type to compare it with, e.g. "
                         "--llamacpp-type q4_1 for RTN int4 with 32-weight groups and zero points, q8_0 for int8")
    return "f32" if dtype == "float32" else "f16"


def llamacpp_baseline(source: Path, gguf_type: str, prompts: list[list[int]], output_len: int, batch_size: int,
                      threads: int, workdir: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """llama.cpp on the same prompts: the whole workload in static batches of `batch_size` (prefill included:
    the same-workload figure), then its decode-only rate at `batch_size` sequences (the first prompts of the
    workload, prefill excluded: the issue's "llama.cpp batch-8 decode rate"). `source` is retyped to
    `gguf_type` when it is not that type already (as `bench compare` does)."""
    from brisk.bench.compare import gguf_for
    from brisk.bench.llamacpp import LlamaCppModel
    from brisk.bench.throughput import ThroughputResult

    path = gguf_for(source, gguf_type, workdir, log)
    seq_len = max(len(p) for p in prompts) + output_len + 16
    with LlamaCppModel(path, seq_len, n_seq_max=batch_size, threads=threads) as lc:
        lc.decode_rate([prompts[0][:8]], 4)  # untimed warm-up, as the others get
        with progress_bar(f"llama.cpp {gguf_type.upper()}: batches of {batch_size}", len(prompts)) as advance:
            elapsed, output_tokens = lc.static_batches(prompts, output_len, batch_size, advance)
        first = [prompts[i % len(prompts)] for i in range(batch_size)]
        decode_tok_s, _ = lc.decode_rate(first, output_len)
    result = ThroughputResult(num_prompts=len(prompts), output_len=output_len,
                              prompt_tokens=sum(len(p) for p in prompts), output_tokens=output_tokens,
                              elapsed_s=elapsed)
    return {**result.summary(), "batch_size": batch_size, "gguf_type": gguf_type, "file": path.name,
            "decode_tok_s": decode_tok_s}


def llamacpp_table(summary: dict[str, Any], lc: dict[str, Any]) -> Table:
    """brisk's server against llama.cpp: the same workload in static batches, and llama.cpp's decode-only rate."""
    b, t = lc["batch_size"], lc["gguf_type"].upper()
    rows = [(label, summary[key], lc[key], fmt) for label, key, fmt in (
        ("wall time (s)", "elapsed_s", ".2f"), ("output tok/s", "output_tok_s", ".1f"),
        ("total (prompt + output) tok/s", "total_tok_s", ".1f"))]
    rows.append((f"output tok/s against llama.cpp's batch-{b} decode alone, tok/s", summary["output_tok_s"],
                 lc["decode_tok_s"], ".1f"))
    return report.comparison_table(f"against llama.cpp {t} ({lc['file']}): the same prompts in static batches of "
                                   f"{b} (prefill included); last row: its decode-only rate at {b} sequences",
                                   rows, f"llama.cpp {t}")


def server_model_card(url: str, api_key: str | None = None) -> dict[str, Any]:
    """The first entry of the server's /v1/models (brisk's carries max_model_len)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=check_local_url(url), headers=headers, trust_env=False, timeout=30) as client:
        resp = client.get("/v1/models")
    if resp.status_code != 200:
        raise ValueError(f"GET {url}/v1/models answered HTTP {resp.status_code}: {resp.text[:300]}")
    data = resp.json().get("data") or [{}]
    return data[0]


def rate_label(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"Poisson {rate:g} req/s"


# ---------------------------------------------------------------------------- terminal output
def summary_table(title: str, res: dict[str, Any], hf: dict[str, Any] | None, hf_name: str) -> Table:
    """Throughput (against the baseline's, when there is one), counts, the server's figures and its RSS."""
    s, mib = res["server"], 2**-20
    facts = {**res["summary"], **{f"server_{k}": v for k, v in s.items()}, **res["rss"],
             "server_prefix_hit_pct": None if s.get("prefix_hit_rate") is None else 100 * s["prefix_hit_rate"]}
    spec = [
        ("wall time (s)", "elapsed_s", 1, ".2f"),
        ("requests/s (completed)", "requests_s", 1, ".2f"),
        ("output tok/s", "output_tok_s", 1, ".1f"),
        ("total (prompt + output) tok/s", "total_tok_s", 1, ".1f"),
        ("completed", "num_completed", 1, ".0f"),
        ("rejected (503/429)", "num_rejected", 1, ".0f"),
        ("failed", "num_failed", 1, ".0f"),
        ("  of which malformed", "num_malformed", 1, ".0f"),
        ("peak requests in flight", "peak_in_flight", 1, ".0f"),
        ("server: rejected (its own count)", "server_num_rejected", 1, ".0f"),
        ("server: peak running", "server_running_peak", 1, ".0f"),
        ("server: peak waiting", "server_waiting_peak", 1, ".0f"),
        ("server: peak KV blocks in use", "server_kv_blocks_in_use_peak", 1, ".0f"),
        ("server: KV blocks in use after", "server_kv_blocks_in_use_after", 1, ".0f"),
        ("server: preemptions", "server_num_preemptions", 1, ".0f"),
        ("server: prefix-cache hit rate (%)", "server_prefix_hit_pct", 1, ".1f"),
        ("server RSS at start (MiB)", "rss_start_bytes", mib, ".0f"),
        ("server RSS after warm-up, min (MiB)", "rss_min_after_warmup_bytes", mib, ".0f"),
        ("server RSS after warm-up, max (MiB)", "rss_max_after_warmup_bytes", mib, ".0f"),
        ("server RSS at end (MiB)", "rss_end_bytes", mib, ".0f"),
    ]
    return report.comparison_table(title, report.table_rows(spec, facts, hf), hf_name if hf else None)


def latency_table(summary: dict[str, Any]) -> Table:
    table = Table(title="latency of completed requests (ms; TPOT per output token after the first)",
                  title_justify="left")
    table.add_column("")
    for col in ("mean", "p50", "p90", "p99"):
        table.add_column(col, justify="right")
    for label, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("end to end", "e2e_s"),
                       ("503/429 answer", "reject_s")):
        table.add_row(label, *(_ms(summary[f"{key}_{c}"]) for c in ("mean", "p50", "p90", "p99")))
    return table


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def check_lines(checks: dict[str, dict]) -> list[str]:
    names = {"every_request_completed_or_rejected": "every request completed or was cleanly rejected",
             "no_leaked_kv_blocks": "no KV blocks leaked", "rss_flat": "server RSS flat after warm-up"}
    style = {"PASS": "bold green", "FAIL": "bold red", "n/a": "yellow"}
    return [f"[{style[c['verdict']]}]{c['verdict']:>4}[/] {names[k]}: {c['detail']}" for k, c in checks.items()]
