"""`brisk quantize`: a float model in, a quantized checkpoint folder out."""

from __future__ import annotations

import time
from pathlib import Path

import click

from brisk.quant.config import LayerQuant


@click.command("quantize")
@click.argument("model")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--method", type=click.Choice(["rtn"]), default="rtn", show_default=True,
              help="How the codes are chosen (rtn: round to nearest, no data needed).")
@click.option("--bits", type=click.Choice(["8", "4", "3", "2"]), default="4", show_default=True,
              help="Bits per weight of the decoder's linear layers.")
@click.option("--group-size", type=int, default=64, show_default=True,
              help="Weights per scale along the input dimension; -1 = one scale per output channel.")
@click.option("--sym", is_flag=True, help="Symmetric (zero point fixed at the middle code) instead of asymmetric.")
@click.option("--scheme", type=click.Choice(["int", "nf4"]), default="int", show_default=True,
              help="int: uniform levels; nf4: QLoRA's 4-bit NormalFloat levels (implies --bits 4).")
@click.option("--head-bits", type=click.Choice(["8", "none"]), default="8", show_default=True,
              help="Embedding and lm_head: 8-bit per channel, or none = keep them in float.")
@click.option("--skip", multiple=True, metavar="PATTERN",
              help="Keep modules matching this fnmatch pattern in float (repeatable), e.g. 'model.layers.0.*'.")
@click.option("--force", is_flag=True, help="Write into OUT even if it already holds a checkpoint.")
def quantize(model: str, out: Path, method: str, bits: str, group_size: int, sym: bool, scheme: str,
             head_bits: str, skip: tuple[str, ...], force: bool) -> None:
    """Quantize MODEL (GGUF file or HF folder; 'default' = SmolLM2-135M-Instruct) into the folder OUT.

    OUT loads with no other flags: brisk generate --model OUT, LLM(model=OUT).
    """
    from rich.console import Console

    from brisk.model.loader import load_model
    from brisk.quant.checkpoint import save_quantized
    from brisk.quant.rtn import HEAD_DEFAULT, plan_layers, rtn_quantize

    console = Console(stderr=True)
    if (out / "config.json").exists() and not force:
        raise click.ClickException(f"{out} already holds a checkpoint (config.json); pass --force to overwrite "
                                   "it or choose another folder")
    if scheme == "nf4" and bits != "4":
        raise click.ClickException("--scheme nf4 is a 4-bit format; use it with --bits 4")
    default = LayerQuant(bits=int(bits), group_size=group_size, sym=sym or scheme == "nf4", scheme=scheme)
    start = time.perf_counter()
    loaded = load_model(model, fuse=False)  # unfused: module names are the checkpoint's HF names
    if loaded.config.architecture not in ("llama", "mistral", "qwen2"):
        raise click.ClickException(f"cannot quantize architecture {loaded.config.architecture}")
    plan = plan_layers(loaded.model, loaded.config.tie_word_embeddings, default,
                       head=None if head_bits == "none" else HEAD_DEFAULT, skip=skip)
    if not plan:
        raise click.ClickException("no module left to quantize: the --skip patterns match every layer")
    tensors, qconfig = rtn_quantize(loaded, plan, default)
    save_quantized(out, loaded.config, loaded.tokenizer, qconfig, tensors)
    size = sum(p.stat().st_size for p in out.iterdir() if p.suffix == ".safetensors")
    console.print(f"[bold green]quantized[/] {loaded.name} -> {out}: {len(plan)} modules ({default.label}, "
                  f"embedding/head {'float' if head_bits == 'none' else HEAD_DEFAULT.label}), "
                  f"{size / 1e6:.1f} MB of weights, {time.perf_counter() - start:.1f} s")
    console.print(f"run it:  brisk generate --model {out} 'Hello'     size:  brisk eval size --model {out}")
