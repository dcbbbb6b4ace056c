"""`brisk bench serve`: a server under load (started here or at --url), optionally against HF transformers or
llama.cpp static batches."""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console

from brisk.bench.options import engine_flags, set_threads
from brisk.console import progress_bar, stderr_console, write_json
from brisk.engine.settings import SETTINGS, cli_args, engine_kwargs

# ---------------------------------------------------------------------------- serve
# Settings that configure the server `bench serve` starts; with --url the running server's own settings apply.
# --model and --seed are not among them: the prompts use --model's tokenizer and --seed's sampling either way.
_SERVER_SETTINGS = tuple(k for k in SETTINGS if SETTINGS[k].meta.cli and k not in ("model", "seed")) + ("max_waiting",)


def _serve_args(kw: dict[str, Any], max_waiting: int) -> list[str]:
    """`brisk serve`'s command line for this command's engine settings."""
    settings = {k: v for k, v in engine_kwargs(kw).items() if SETTINGS[k].meta.cli}
    return cli_args(settings) + ["--max-waiting", str(max_waiting)]


@click.command("serve")
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
@click.option("--soak", type=int, default=None,
              help="Soak mode: instead of the streamed-completions load, send this many mixed requests (chat and "
                   "completions, streamed or not, structured outputs, n>1, stop sequences, clients that go away "
                   "mid-stream) from --soak-threads threads after --soak-warmup warm-up requests, and report the "
                   "server's RSS before (idle after warm-up), peak and after, and the growth in %.")
@click.option("--soak-threads", type=int, default=16, show_default=True, help="Client threads of --soak.")
@click.option("--soak-warmup", type=int, default=48, show_default=True,
              help="Mixed requests before --soak's 'before' RSS.")
@click.option("--soak-max-growth", type=float, default=10.0, show_default=True,
              help="RSS growth after warm-up (%) over which --soak's check fails.")
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
@engine_flags()
def serve(url: str | None, num_prompts: int, request_rate: float, input_len_min: int, input_len_max: int,
          output_len: int, max_concurrency: int | None, max_waiting: int,
          request_timeout: float, server_pid: int | None, rss_tolerance: str, soak: int | None, soak_threads: int,
          soak_warmup: int, soak_max_growth: float, baselines: tuple[str, ...],
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
    from brisk.engine.config import parse_size, resolve_dtype
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
    if soak is not None:
        if soak < 1 or soak_threads < 1 or soak_warmup < 0:
            raise ValueError("--soak and --soak-threads must be at least 1, --soak-warmup at least 0")
        if baselines:
            raise ValueError("--soak measures the server's memory; run --baseline without it")
        if url is not None and server_pid is None:
            raise ValueError("--soak with --url needs --server-pid: the soak reports the server's RSS")
        _soak(url, server_pid, kw, max_waiting, soak, soak_threads, soak_warmup, soak_max_growth)
        return
    if "hf" in baselines:
        require_transformers()  # fail before minutes of benchmarking, not after
    if hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be at least 1, got {hf_batch_size}")
    lc_source = None
    if "llamacpp" in baselines:
        require_llama_cpp()
        dtype_name = str(resolve_dtype(kw["dtype"], kw["model"], kw.get("load_format", "auto"))).removeprefix("torch.")
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
                stderr_console().print("starting brisk serve ...")
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
        set_threads(kw["num_threads"])
        model_path = resolve_model(kw["model"])
        stderr_console().print(f"loading {model_path.name} in transformers for the baseline ...")
        hf_model = load_hf_model(model_path, resolve_dtype(kw["dtype"], kw["model"], kw.get("load_format", "auto")))
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        with progress_bar(f"transformers: batches of {hf_batch_size}", num_prompts) as advance:
            theirs = hf_throughput(hf_model, prompts, output_len, hf_batch_size, pad_id, advance)
        del hf_model
        gc.collect()
    lc = None
    if lc_source is not None:
        set_threads(kw["num_threads"])
        with tempfile.TemporaryDirectory(prefix="brisk-bench-serve-gguf-") as tmp:
            lc = sb.llamacpp_baseline(lc_source, llamacpp_type, prompts, output_len, hf_batch_size,
                                      torch.get_num_threads(), Path(tmp), stderr_console().print)

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
        write_json(kw["json_path"], "serve", params, results)
    if any(c["verdict"] == "FAIL" for c in res["checks"].values()):
        ctx.exit(1)


def _soak(url: str | None, server_pid: int | None, kw: dict[str, Any], max_waiting: int, num_requests: int,
          threads: int, warmup: int, max_growth: float) -> None:
    """`bench serve --soak`: mixed requests against the started server (or --url), RSS before / peak / after."""
    import os
    import tempfile

    import httpx

    from brisk.bench import serve as sb
    from brisk.bench.report import comparison_table
    from brisk.bench.soak import run_soak
    from brisk.serve.process import ServerProcess, ServerStartError

    ctx = click.get_current_context()
    api_key = os.environ.get("BRISK_API_KEY") if url else None
    server = None
    with tempfile.TemporaryDirectory(prefix="brisk-bench-soak-") as tmp:
        try:
            if url is None:
                stderr_console().print("starting brisk serve ...")
                server = ServerProcess(_serve_args(kw, max_waiting), startup_timeout_s=600,
                                       log_path=Path(tmp) / "serve.log").start()
                url, server_pid = server.url, server.proc.pid
            card = sb.server_model_card(url, api_key)
            with progress_bar(f"soak: {warmup} warm-up + {num_requests} mixed requests",
                                     warmup + num_requests) as advance:
                res = run_soak(url, server_pid, card.get("id"), num_requests, warmup=warmup,  # type: ignore[arg-type]
                               threads=threads, seed=kw["seed"], api_key=api_key, max_growth_pct=max_growth,
                               on_done=lambda _: advance(1))
            if server is not None:
                server.stop()
                res["log_tracebacks"] = server.log().count("Traceback (most recent call last)")
        except (ServerStartError, httpx.HTTPError) as e:
            raise click.ClickException(f"{type(e).__name__}: {e}") from e
        finally:
            if server is not None:
                server.stop()
    mib = 2**20
    rows = [("server RSS at start, idle (MiB)", res["rss_start_bytes"] / mib, ".0f"),
            (f"server RSS before: idle after {warmup} warm-up requests (MiB)", res["rss_before_bytes"] / mib, ".0f"),
            (f"server RSS peak during the {num_requests} requests (MiB)", res["rss_peak_bytes"] / mib, ".0f"),
            ("server RSS after: idle after them (MiB)", res["rss_after_bytes"] / mib, ".0f"),
            ("growth after warm-up (%)", res["growth_pct"], "+.1f"),
            ("wall time of the soak (s)", res["elapsed_s"], ".1f")]
    console = Console()
    table = comparison_table(f"soak: {card.get('id')}, {num_requests} mixed requests from {threads} threads "
                              f"({'started server' if server is not None else f'server at {url}'})",
                              [(label, v, None, fmt) for label, v, fmt in rows], None)
    console.print(table)
    console.print("outcomes: " + ", ".join(f"{k} x{v}" for k, v in res["outcomes"].items())
                  + "; kinds: " + ", ".join(f"{k} x{v}" for k, v in res["kinds"].items()))
    if res["errors"]:
        console.print("errors: " + "; ".join(f"{k} x{v}" for k, v in res["errors"].items()))
    style = "bold green" if res["verdict"] == "PASS" else "bold red"
    console.print(f"[{style}]{res['verdict']:>4}[/] server RSS flat under a soak: {res['detail']}")
    if kw["json_path"]:
        params = {**ctx.params, "request_rate": "inf" if math.isinf(ctx.params["request_rate"])
                  else ctx.params["request_rate"]}
        write_json(kw["json_path"], "serve", params, {"model": card.get("id"), "soak": res,
                                                             "server_started": server is not None})
    if res["verdict"] == "FAIL":
        ctx.exit(1)
