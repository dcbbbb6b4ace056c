"""`brisk export gguf`: write any brisk-loadable model as a GGUF file (model/gguf_export.py)."""

from __future__ import annotations

import click

from brisk.model.gguf_export import EXPORT_TYPES


@click.group("export")
def export() -> None:
    """Write a model in another program's format."""


@export.command("gguf")
@click.option("--type", "outtype", required=True, type=click.Choice(list(EXPORT_TYPES)),
              help="Type of every matrix (vectors stay F32). brisk's own codes are kept where the type holds their "
                   "grid (8-bit sym -> q8_0, 4-bit sym -> q4_0, 4-bit -> q4_1; groups of 32 k); the rest is "
                   "re-encoded from float.")
@click.argument("model")
@click.argument("out", type=click.Path(dir_okay=False))
def export_gguf_command(outtype: str, model: str, out: str) -> None:
    """Write MODEL (a GGUF file, a float or quantized HF folder, or 'default') to OUT.gguf, with its tokenizer,
    chat template and architecture metadata, for llama.cpp."""
    from brisk.model.gguf_export import export_gguf

    report = export_gguf(model, out, outtype)
    click.echo(f"wrote {report.path} ({outtype.upper()}, {report.path.stat().st_size / 2**20:.1f} MiB): "
               f"{report.summary()}")


@export.command("merged")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True,
              help="Precision of the written weights (the merge itself is done in float32).")
@click.argument("model")
@click.argument("adapter", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
def export_merged_command(dtype: str, model: str, adapter: str, out: str) -> None:
    """Fold the LoRA ADAPTER (a PEFT folder, e.g. from `brisk finetune`) into MODEL's weights and write OUT, an
    ordinary HF folder that `brisk generate/serve/quantize` load with no adapter flags."""
    import torch

    from brisk.lora.export import export_merged

    try:
        report = export_merged(None if model == "default" else model, adapter, out, getattr(torch, dtype))
    except (FileExistsError, ValueError) as e:
        raise click.UsageError(str(e)) from e
    click.echo(f"wrote {report.path}: {report.modules} projections merged (r={report.rank}), "
               f"{report.bytes / 2**20:.1f} MiB of {dtype} weights")
