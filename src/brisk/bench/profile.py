"""`brisk bench profile`: where a decode step's time goes, by op, under the torch profiler.

The model is loaded (optionally magnitude-pruned per row and moved to the sparse kernels, as `brisk bench sparse`
does), warmed up once, then a `--input-len`-token prompt is decoded at batch `--batch` under the profiler and the
ops' self times are printed. The profiled run includes its prefill (its GEMMs show as aten::mm / mkldnn rows);
the decode rate without the profiler is printed first, so the profiler's own overhead can be read off.
"""

from __future__ import annotations

import click
import torch

from brisk.engine.settings import setting_option


def profile_decode(model: str | None, dtype: str = "float32", batch: int = 1, prune: str | None = None,
                   quant_activations: str = "auto", input_len: int = 128, tokens: int = 48,
                   row_limit: int = 18) -> tuple[float, float, str]:
    """(tok/s without the profiler, tok/s under it, the profiler's op table sorted by self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.bench.quant import decode_rate, output_len_together, pool_for
    from brisk.bench.sparse import _engine, prune_decoder_
    from brisk.model.loader import load_model
    from brisk.ops.sparse import sparsify_model

    loaded = load_model(model, dtype=getattr(torch, dtype), sparse=False)
    if prune:
        prune_decoder_(loaded.model, prune)
        sparsify_model(loaded.model)
    kv_token_bytes = loaded.config.kv_bytes_per_token(loaded.dtype.itemsize)
    llm = _engine(loaded, quant_activations, pool_for(batch, input_len, tokens, kv_token_bytes))
    tok = loaded.tokenizer
    prompt = make_prompt(tok, text_token_ids(tok), 0, input_len)
    decode_rate(llm, prompt, batch, output_len_together(llm, batch, input_len, min(8, tokens)))  # warm-up
    tokens = output_len_together(llm, batch, input_len, tokens)  # every request started before any finishes
    plain = decode_rate(llm, prompt, batch, tokens)[0]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = decode_rate(llm, prompt, batch, tokens)[0]
    return plain, profiled, prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=row_limit)


@click.command("profile")
@click.option("--model", "-m", default=None, help="GGUF file or model folder (default: SmolLM2-135M-Instruct).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]))
@click.option("--batch", type=int, default=1, show_default=True, help="Requests decoding together.")
@click.option("--prune", default=None, help="Magnitude-prune the decoder first: 0.5, 2:4, 4:8.")
@setting_option("quant_activations")
@click.option("--input-len", type=int, default=128, show_default=True, help="Prompt tokens.")
@click.option("--tokens", type=int, default=48, show_default=True, help="Generated tokens per run.")
@click.option("--rows", "row_limit", type=int, default=18, show_default=True, help="Ops shown.")
def profile_command(model: str | None, dtype: str, batch: int, prune: str | None, quant_activations: str,
                    input_len: int, tokens: int, row_limit: int) -> None:
    """Profile a decode step: the ops' self CPU times over a batch-B greedy decode."""
    plain, profiled, table = profile_decode(model, dtype, batch, prune, quant_activations, input_len, tokens,
                                            row_limit)
    click.echo(f"decode {plain:.1f} tok/s without the profiler, {profiled:.1f} tok/s under it")
    click.echo(table)
