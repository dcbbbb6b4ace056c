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
