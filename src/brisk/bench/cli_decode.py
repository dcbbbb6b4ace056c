"""`brisk bench membw | latency | throughput`: the machine's bandwidth, batch-1 latency and offline throughput, each
optionally against HF transformers in the same process."""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console

from brisk.bench import report
from brisk.bench.membw import QUICK_BUFFER_BYTES, MembwResult, measure_membw
from brisk.bench.options import build_llm, describe_model, engine_flags, load_figures, set_threads
from brisk.bench.roofline import achieved_gbps
from brisk.console import peak_rss_bytes, progress_bar, reset_peak_rss, stderr_console, write_json
from brisk.engine.settings import setting_option


# ---------------------------------------------------------------------------- membw
@click.command()
@click.option("--size", default="1GiB", show_default=True, help="Buffer size (far larger than the caches).")
@click.option("--runs", type=int, default=5, show_default=True, help="Timed runs; the best is reported.")
@setting_option("num_threads")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the result here.")
def membw(size: str, runs: int, num_threads: int | None, json_path: str | None) -> None:
    """Memory bandwidth this machine gives torch: the ceiling for batch-1 decoding."""
    from brisk.engine.config import parse_size

    set_threads(num_threads)
    result = measure_membw(parse_size(size), runs)
    Console().print(f"memory bandwidth ({result.num_threads} threads, {result.buffer_bytes / 2**30:.2f} GiB "
                    f"buffer, best of {runs}): read [bold]{result.read_gbps:.1f} GB/s[/bold], "
                    f"copy {result.copy_gbps:.1f} GB/s")
    if json_path:
        write_json(json_path, "membw", click.get_current_context().params, {"membw": result.to_dict()})


# ---------------------------------------------------------------------------- latency
def _latency_figures(res: Any, bytes_per_token: float, context: float, membw_gbps: float,
                     peak_rss: int | None) -> dict[str, Any]:
    """A LatencyResult's summary plus the roofline view: achieved GB/s, fraction of measured bandwidth."""
    gbps = achieved_gbps(bytes_per_token, res.decode_tok_s)
    return {**res.summary(), "bytes_per_token": bytes_per_token, "mean_decode_context": context,
            "achieved_gbps": gbps, "fraction_of_membw": gbps / membw_gbps, "peak_rss_bytes": peak_rss}


@click.command()
@click.option("--input-len", type=int, default=128, show_default=True, help="Prompt tokens (real text).")
@click.option("--output-len", type=int, default=128, show_default=True, help="Generated tokens per run.")
@click.option("--runs", type=int, default=3, show_default=True, help="Timed runs.")
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed runs first.")
@click.option("--baseline", type=click.Choice(["hf", "eager", "float32"]), default=None,
              help="hf: also run HF transformers generate on the same model and prompt; eager (with --compile): "
                   "the same engine with its compiled graphs set aside; float32: the same model with every tensor "
                   "dequantized to float32 (a GGUF's float baseline, --dtype float32), runs alternated. Prints "
                   "speedups.")
@click.option("--baseline-model", default=None, metavar="MODEL",
              help="Also run this model (folder or GGUF file) with the same settings, runs alternated, e.g. an "
                   "int4 RTN folder against a SqueezeLLM one. Prints speedups.")
@click.option("--membw", "membw_gbps", type=float, default=None,
              help="Read bandwidth in GB/s (from `brisk bench membw`); default: measure a quick one.")
@click.option("--interleave/--no-interleave", default=True, show_default=True,
              help="With --baseline: hold both models and alternate brisk and transformers run by run, so that "
                   "a host whose speed drifts over minutes moves both sides alike (the baseline's peak RSS is "
                   "then not measured). --no-interleave runs all of brisk, then all of transformers.")
@engine_flags(defaults={"enable_prefix_caching": False}, help={
    "enable_prefix_caching": "Off by default: each run repeats the prompt, which a prefix cache would skip.",
    "compile": "Run brisk with --compile (torch.compile of the dense parts); the compile time is reported."})
def latency(input_len: int, output_len: int, runs: int, warmup: int, baseline: str | None,
            baseline_model: str | None, membw_gbps: float | None, interleave: bool, **kw: Any) -> None:
    """Batch-1 latency: time to first token, time per output token, decode tok/s and achieved GB/s."""
    from brisk.bench.hf_baseline import hf_latency, load_hf_model, require_transformers
    from brisk.bench.latency import merge_results, run_latency
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.bench.roofline import decode_bytes_per_token, mean_decode_context, weight_bytes_per_token

    if input_len < 1 or output_len < 1:
        raise ValueError(f"--input-len and --output-len must be at least 1, got {input_len} and {output_len}")
    if baseline_model is not None:
        if baseline is not None:
            raise ValueError(f"--baseline {baseline} and --baseline-model are two baselines; give one")
        baseline = "baseline_model"  # (its figures' key in the JSON)
    if baseline == "hf":
        require_transformers()  # fail before minutes of benchmarking, not after
    compile_ = kw["compile"] or kw["execution"] == "compiled"
    if baseline == "eager" and not compile_:
        raise ValueError("--baseline eager compares --compile with the same engine uncompiled; add --compile")
    set_threads(kw["num_threads"])
    llm = build_llm(kw)
    load = load_figures(llm)  # before anything runs: the load's own peak
    compile_s = llm.engine.compile_seconds
    if input_len + output_len > llm.engine.max_model_len:
        raise ValueError(f"--input-len + --output-len = {input_len + output_len} exceeds max_model_len="
                         f"{llm.engine.max_model_len}; pass --max-model-len {input_len + output_len}")
    tok = llm.get_tokenizer()
    prompt = make_prompt(tok, text_token_ids(tok), 0, input_len)
    model_facts = describe_model(llm)
    kv_pool_bytes = llm.engine.runner.kv_cache_bytes
    loaded = llm.engine.loaded
    dtype_bytes = torch.finfo(loaded.dtype).bits // 8
    context = mean_decode_context(input_len, output_len)
    bytes_per_token = decode_bytes_per_token(weight_bytes_per_token(loaded.model), loaded.config, dtype_bytes,
                                             context)

    reset_peak_rss()
    total = (warmup + runs) * output_len
    config, model_path, torch_dtype = loaded.config, loaded.path, loaded.dtype
    theirs = None
    theirs_rss = None
    theirs_bytes = None
    moe = None  # MoE models: routed-expert bytes per decode token (model/moe.py ExpertBytes)
    if baseline in ("float32", "baseline_model"):
        # a second engine: on the same file, every tensor dequantized (--dtype float32), or on --baseline-model;
        # runs alternated
        base_llm = build_llm({**kw, "dtype": "float32"} if baseline == "float32" else {**kw, "model": baseline_model})
        base_loaded = base_llm.engine.loaded
        theirs_bytes = decode_bytes_per_token(weight_bytes_per_token(base_loaded.model), base_loaded.config,
                                              torch.finfo(base_loaded.dtype).bits // 8, context)
        parts, base_parts = [], []
        pair = f"{kw['dtype']} / float32" if baseline == "float32" else "model / baseline model"
        with progress_bar(f"alternating {pair}: {warmup} warm-up + {runs} runs each",
                                 2 * total) as advance:
            for engine in (llm, base_llm):
                if warmup:
                    run_latency(engine, prompt, output_len, 1, warmup - 1, advance)
            for _ in range(runs):
                for engine, sink in ((llm, parts), (base_llm, base_parts)):
                    sink.append(run_latency(engine, prompt, output_len, 1, 0, advance))
        ours, theirs = merge_results(parts), merge_results(base_parts)
        ours_rss = None  # both engines were held: not one model's peak
        del base_llm, base_loaded
    elif baseline == "eager":
        # one engine, its runner switched run by run between the compiled executor and the default one
        # (engine/executor.py)
        from brisk.engine.executor import Executor

        runner = llm.engine.runner
        executors = {"compiled": runner.executor, "eager": Executor(loaded.model, "auto")}
        parts, eager_parts = [], []
        with progress_bar(f"alternating compiled / eager: {warmup} warm-up + {runs} runs each",
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
        ours_rss, theirs_bytes = peak_rss_bytes(), bytes_per_token
    elif baseline == "hf" and interleave:
        # brisk's warm-up alone first (its peak RSS), then the baseline loads and the runs alternate
        with progress_bar(f"brisk: {warmup} warm-up + 1 run", (warmup + 1) * output_len) as advance:
            parts = [run_latency(llm, prompt, output_len, 1, warmup, advance)]
        ours_rss = peak_rss_bytes()
        stderr_console().print(f"loading {model_path.name} in transformers for the baseline ...")
        hf_model = load_hf_model(model_path, torch_dtype)
        theirs_bytes = decode_bytes_per_token(weight_bytes_per_token(hf_model), config, dtype_bytes, context)
        with progress_bar(f"transformers: {warmup} warm-up", max(1, warmup * output_len)) as advance:
            if warmup:
                hf_latency(hf_model, prompt, output_len, 0, warmup, advance)
        hf_parts = []
        with progress_bar(f"alternating: {runs} runs each", 2 * runs * output_len) as advance:
            for r in range(runs):
                hf_parts.append(hf_latency(hf_model, prompt, output_len, 1, 0, advance))
                if r:  # round 0's brisk run is the one measured right after its warm-up
                    parts.append(run_latency(llm, prompt, output_len, 1, 0, advance))
                else:
                    advance(output_len)
        ours, theirs = merge_results(parts), merge_results(hf_parts)
        del hf_model
    else:
        from brisk.model.moe import expert_bytes_per_token, record_expert_loads

        with (progress_bar(f"brisk: {warmup} warm-up + {runs} runs", total) as advance,
              record_expert_loads(loaded.model) as loads):
            ours = run_latency(llm, prompt, output_len, runs, warmup, advance)
        ours_rss = peak_rss_bytes()
        if loads.counts:  # MoE: the routed experts' bytes the decode steps really read (prefills left out)
            moe = expert_bytes_per_token(loaded.model, loads, max_tokens=1)
    # drop brisk's model before loading the baseline's, so that one's peak memory does not include the other
    del llm, loaded
    gc.collect()

    if membw_gbps is None:
        bw: MembwResult | None = measure_membw(QUICK_BUFFER_BYTES, runs=3)
        membw_gbps = bw.read_gbps
    else:
        bw = None

    if baseline == "hf" and not interleave:
        stderr_console().print(f"loading {model_path.name} in transformers for the baseline ...")
        hf_model = load_hf_model(model_path, torch_dtype)
        theirs_bytes = decode_bytes_per_token(weight_bytes_per_token(hf_model), config, dtype_bytes, context)
        reset_peak_rss()
        with progress_bar(f"transformers: {warmup} warm-up + {runs} runs", total) as advance:
            theirs = hf_latency(hf_model, prompt, output_len, runs, warmup, advance)
        theirs_rss = peak_rss_bytes()
        del hf_model
        gc.collect()

    brisk_figures = _latency_figures(ours, bytes_per_token, context, membw_gbps, ours_rss)
    # the process's peak over load and runs (the counter was restarted after the load)
    after_run = max(load["peak_rss_after_load_bytes"], ours_rss or 0)  # None: two engines were held
    results: dict[str, Any] = {"model": model_facts, "membw_read_gbps": membw_gbps,
                               "membw": bw.to_dict() if bw else None,
                               "brisk": {**brisk_figures, **load, "peak_rss_after_run_bytes": after_run,
                                         "kv_pool_bytes": kv_pool_bytes, "token_ids": ours.token_ids}}
    if compile_:
        results["compile_s"] = compile_s
    if moe is not None:
        results["brisk"]["moe_expert_bytes_per_token"] = dataclasses.asdict(moe)
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
        ("model load (s)", "load_s", 1, ".2f"),
        ("peak RSS after load (MiB)", "peak_rss_after_load_bytes", 2**-20, ".0f"),
        ("peak RSS after the runs (MiB)", "peak_rss_after_run_bytes", 2**-20, ".0f"),
    ]
    rows = report.table_rows(spec, results["brisk"], results.get(baseline or "hf"))
    console = Console()
    title = (f"latency, batch 1: {model_facts['name']} ({model_facts['dtype']}), {input_len} prompt tokens "
             f"-> {output_len} generated, {runs} runs, {torch.get_num_threads()} threads, "
             f"read bandwidth {membw_gbps:.1f} GB/s")
    other = {"hf": "transformers", "eager": "brisk uncompiled", "float32": "brisk float32",
             "baseline_model": Path(baseline_model or "").name}.get(baseline or "")
    console.print(report.comparison_table(title, rows, other if theirs else None))
    if compile_:
        console.print(f"--compile: {compile_s:.1f} s of compilation at start-up (every shape bucket)")
    if moe is not None:
        console.print(f"MoE, routed experts per decode token: {moe.read / 1e6:.2f} MB read (measured: every expert "
                      f"call), {moe.read / moe.active:.3f}x the top-k bound of {moe.active / 1e6:.2f} MB, "
                      f"{moe.read / moe.dense:.3f}x of all experts' {moe.dense / 1e6:.2f} MB; "
                      "'MB read per token' counts top-k experts a layer")
    if baseline == "eager" and theirs is not None:
        console.print("speedup = uncompiled time / compiled time; greedy tokens: "
                      f"{'identical' if results['same_tokens'] else 'different'}; runs alternated")
    elif baseline == "float32" and theirs is not None:
        console.print("speedup = float32 time / this model's time; greedy tokens: "
                      f"{'identical' if results['same_tokens'] else 'different'}; runs alternated")
    elif baseline == "baseline_model" and theirs is not None:
        console.print(f"speedup = {other}'s time / this model's time; greedy tokens: "
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
        write_json(kw["json_path"], "latency", click.get_current_context().params, results)


# ---------------------------------------------------------------------------- throughput
@click.command()
@click.option("--num-prompts", type=int, default=64, show_default=True)
@click.option("--input-len-min", type=int, default=32, show_default=True, help="Shortest prompt (tokens).")
@click.option("--input-len-max", type=int, default=512, show_default=True, help="Longest prompt (tokens).")
@click.option("--output-len", type=int, default=128, show_default=True, help="Generated tokens per prompt.")
@click.option("--baseline", type=click.Choice(["hf"]), default=None,
              help="Also run HF transformers generate with static batches; print speedups.")
@click.option("--hf-batch-size", type=int, default=8, show_default=True,
              help="Static batch size of the baseline.")
@engine_flags()
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
    set_threads(kw["num_threads"])
    llm = build_llm(kw)
    load = load_figures(llm)
    tok = llm.get_tokenizer()
    prompts = sample_prompts(tok, num_prompts, input_len_min, input_len_max, kw["seed"])
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    model_facts = describe_model(llm)
    warm_up(llm)
    with progress_bar(f"brisk: {num_prompts} requests", num_prompts) as advance:
        ours = run_throughput(llm, prompts, output_len, advance)
    load["peak_rss_after_run_bytes"] = peak_rss_bytes()  # the process's peak: load, warm-up and runs
    model_path, torch_dtype = llm.engine.loaded.path, llm.engine.loaded.dtype
    num_kv_blocks, block_size = llm.engine.num_blocks, llm.engine.config.cache.block_size
    del llm  # before the baseline loads its copy of the model
    gc.collect()

    theirs = None
    if baseline == "hf":
        stderr_console().print(f"loading {model_path.name} in transformers for the baseline ...")
        hf_model = load_hf_model(model_path, torch_dtype)
        with progress_bar(f"transformers: batches of {hf_batch_size}", num_prompts) as advance:
            theirs = hf_throughput(hf_model, prompts, output_len, hf_batch_size, pad_id, advance)
        del hf_model
        gc.collect()

    results: dict[str, Any] = {"model": model_facts, "num_kv_blocks": num_kv_blocks, "block_size": block_size,
                               "prompt_lens": [len(p) for p in prompts], "brisk": {**ours.summary(), **load}}
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
        ("model load (s)", "load_s", 1, ".2f"),
        ("peak RSS after load (MiB)", "peak_rss_after_load_bytes", 2**-20, ".0f"),
        ("peak RSS after the runs (MiB)", "peak_rss_after_run_bytes", 2**-20, ".0f"),
    ]
    rows = report.table_rows(spec, results["brisk"], results.get("hf"))
    lens = results["prompt_lens"]
    title = (f"throughput: {model_facts['name']} ({model_facts['dtype']}), {num_prompts} prompts of "
             f"{min(lens)}-{max(lens)} tokens (mean {sum(lens) / len(lens):.0f}) -> {output_len} generated "
             f"each, {torch.get_num_threads()} threads, KV pool {num_kv_blocks} blocks x {block_size}")
    baseline_name = f"transformers (batch {hf_batch_size})" if theirs else None
    Console().print(report.comparison_table(title, rows, baseline_name))
    if kw["json_path"]:
        write_json(kw["json_path"], "throughput", click.get_current_context().params, results)
