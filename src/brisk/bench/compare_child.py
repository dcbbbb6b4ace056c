"""One engine's measurements for `brisk bench compare`, in a child process of its own.

A 1B or 3B model at float32 is several GB in each engine; holding brisk's copy and llama.cpp's at once is what
pushed a 24 GiB machine into the kernel's OOM killer, which ends the whole process without a word. So each
(engine, run) loads its model in a fresh spawned child, measures, sends back plain numbers and exits; the parent
holds no model, alternates the children (brisk, llama.cpp, brisk, ...) and, when a child dies, says which one and
of which signal (SIGKILL from the OOM killer, SIGSEGV from a llama.cpp build) instead of dying with it.
"""

from __future__ import annotations

import multiprocessing
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from brisk.console import current_rss_bytes, peak_rss_bytes, reset_peak_rss


@dataclass
class EngineJob:
    """What one child measures: plain data, pickled to the child."""

    engine: str  # "brisk", "llama.cpp" or "onnxruntime"
    path: str  # the model brisk or llama.cpp loads; onnxruntime's exported graph
    dtype: str  # brisk's --dtype ("auto" keeps a GGUF's own codes); unused by llama.cpp
    prompt_ids: list[int]  # decode prompt; batch b runs b rotated copies of it
    prefill_ids: list[int]
    batch_sizes: list[int]
    output_len: int
    threads: int
    seq_len: int
    kv_cache_memory: str = "256MiB"
    kv_cache_dtype: str = "auto"
    quant_activations: str = "auto"
    prepack_weights: str = "auto"


@dataclass
class EngineRun:
    """One child's figures (a load and a warm-up, then prefill and every batch size once)."""

    load_s: float
    rss_bytes: int  # resident memory the load and warm-up added to the child (above its RSS before the load)
    peak_rss_bytes: int  # the child's peak resident memory from its load on (interpreter and libraries included)
    peak_rss_load_bytes: int  # the child's peak during the load, above its RSS before it
    prefill_s: float
    decode_tok_s: dict[int, float] = field(default_factory=dict)
    greedy_b1: list[int] = field(default_factory=list)
    weights_cache_hit: bool = False  # brisk mapped its converted weights from the cache (model/weights_cache.py)


class EngineChildError(RuntimeError):
    """A child that died (signal) or raised; the message says which engine and why."""


def run_in_child(job: EngineJob, timeout_s: float | None = None) -> EngineRun:
    """`job` measured in a spawned child process; EngineChildError when it is killed, crashes or raises."""
    ctx = multiprocessing.get_context("spawn")  # no fork: a fresh interpreter, nothing of the parent's memory
    parent_end, child_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_main, args=(child_end, job), daemon=True)
    proc.start()
    child_end.close()
    result: Any = None
    timed_out = False
    try:
        if parent_end.poll(timeout_s):
            result = parent_end.recv()
        else:
            timed_out = True
    except EOFError:  # the child died before it could answer
        result = None
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if isinstance(result, EngineRun):
        return result
    if isinstance(result, str):
        raise EngineChildError(f"{job.engine} ({job.path}) failed in its child process:\n{result}")
    raise EngineChildError(death_message(job.engine, job.path, None if timed_out else proc.exitcode, timeout_s))


def death_message(engine: str, path: str, exitcode: int | None, timeout_s: float | None = None) -> str:
    """Why a child that sent no answer ended: a signal (negative exit code), a timeout, or a plain exit status."""
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        why = {"SIGKILL": "most likely the kernel's OOM killer: the model and its buffers did not fit in the memory "
                          "free at the time (check `dmesg`, free memory, other large processes)",
               "SIGSEGV": "a crash inside the engine's native code"}.get(name, "a signal")
        return f"{engine} ({path}) was killed by {name}: {why}"
    if exitcode is None:
        return f"{engine} ({path}) gave no answer within {timeout_s} s"
    return f"{engine} ({path}) exited with status {exitcode} without an answer"


def _child_main(conn, job: EngineJob) -> None:  # noqa: ANN001 - multiprocessing.connection.Connection
    try:
        measure = {"brisk": _measure_brisk, "llama.cpp": _measure_llama_cpp, "onnxruntime": _measure_onnxruntime}
        run = measure[job.engine](job)
        conn.send(run)
    except BaseException:  # noqa: BLE001 - the parent reports it; the child ends either way
        conn.send(traceback.format_exc())
    finally:
        conn.close()


def _rotations(prompt_ids: list[int], batch: int) -> list[list[int]]:
    """`batch` distinct prompts of the same length (a rotated window each), so no prefix is shared."""
    return [prompt_ids[i:] + prompt_ids[:i] for i in range(batch)]


def _measure_brisk(job: EngineJob) -> EngineRun:
    import gc

    import torch

    from brisk.bench.quant import decode_rate
    from brisk.engine.llm import LLM

    torch.set_num_threads(job.threads)
    gc.collect()
    reset_peak_rss()
    rss0 = current_rss_bytes()
    start = time.perf_counter()
    llm = LLM(job.path, dtype=job.dtype, enable_prefix_caching=False, num_threads=job.threads,
              max_model_len=job.seq_len, kv_cache_memory=job.kv_cache_memory, kv_cache_dtype=job.kv_cache_dtype,
              quant_activations=job.quant_activations, prepack_weights=job.prepack_weights)
    load_s = time.perf_counter() - start
    peak_load = peak_rss_bytes() - rss0
    decode_rate(llm, job.prompt_ids, 1, 4)  # warm-up: kernels built, pages touched
    rss = current_rss_bytes() - rss0
    prefill_s = _brisk_prefill_seconds(llm, job.prefill_ids)
    run = EngineRun(load_s, rss, 0, peak_load, prefill_s,
                    weights_cache_hit=llm.engine.loaded.weights_cache == "hit")
    for b in job.batch_sizes:
        rate, toks = decode_rate(llm, job.prompt_ids, b, job.output_len)
        run.decode_tok_s[b] = rate
        if b == 1:
            run.greedy_b1 = toks
    run.peak_rss_bytes = peak_rss_bytes()
    return run


def _brisk_prefill_seconds(llm, prompt: list[int]) -> float:  # noqa: ANN001 - brisk.engine.llm.LLM
    from brisk.engine.sampling_params import SamplingParams

    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _measure_llama_cpp(job: EngineJob) -> EngineRun:
    from brisk.bench.llamacpp import LlamaCppModel

    reset_peak_rss()
    rss0 = current_rss_bytes()
    start = time.perf_counter()
    with LlamaCppModel(job.path, job.seq_len, n_seq_max=max(job.batch_sizes), threads=job.threads) as lc:
        # warm-up: the weights' pages read once (llama.cpp maps the file)
        return _runtime_rates(job, lc, time.perf_counter() - start, rss0)


def _measure_onnxruntime(job: EngineJob) -> EngineRun:
    from brisk.bench.onnx_baseline import OnnxModel

    reset_peak_rss()
    rss0 = current_rss_bytes()
    start = time.perf_counter()
    model = OnnxModel(job.path, job.threads)  # the graph loaded and optimized (ORT_ENABLE_ALL)
    # warm-up: buffers allocated, kernels chosen
    return _runtime_rates(job, model, time.perf_counter() - start, rss0)


def _runtime_rates(job: EngineJob, model: Any, load_s: float, rss0: int) -> EngineRun:
    """A loaded baseline runtime (decode_rate, prefill_seconds) measured as brisk is: a warm-up, the resident
    memory after it, prefill time, decode tokens/s per batch size and batch 1's greedy tokens."""

    peak_load = peak_rss_bytes() - rss0
    model.decode_rate([job.prompt_ids], 4)  # the warm-up
    rss = current_rss_bytes() - rss0
    run = EngineRun(load_s, rss, 0, peak_load, model.prefill_seconds(job.prefill_ids))
    for b in job.batch_sizes:
        rate, toks = model.decode_rate(_rotations(job.prompt_ids, b), job.output_len)
        run.decode_tok_s[b] = rate
        if b == 1:
            run.greedy_b1 = toks
    run.peak_rss_bytes = peak_rss_bytes()
    return run
