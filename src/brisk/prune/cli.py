"""`brisk prune`: a float model in, a pruned checkpoint folder out."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from brisk.data import calibration_text_path
from brisk.prune.masks import PruneConfigError, check_sparsity, parse_pattern

_CALIB_DEFAULTS = {"num_samples": 32, "seq_len": 512}  # ~16k tokens: a few minutes on 2 cores for SparseGPT


@click.command("prune")
@click.argument("model")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--method", type=click.Choice(["magnitude", "wanda", "sparsegpt", "structured"]), required=True,
              help="magnitude: |W|, no data; wanda: |W|*||X||; sparsegpt: OBS reconstruction; structured: remove "
                   "head groups, MLP channels, layers.")
@click.option("--sparsity", type=float, default=0.5, show_default=True,
              help="Fraction of the decoder's linear weights removed (structured: of all parameters). Ignored "
                   "with --pattern, whose N:M fixes it.")
@click.option("--pattern", default="unstructured", show_default=True,
              help="'unstructured' or N:M semi-structured, e.g. 2:4 or 4:8 (at most N nonzeros in every M).")
@click.option("--scope", type=click.Choice(["per_layer", "per_row"]), default=None,
              help="magnitude only: one threshold per matrix (default, the papers' baseline) or per output row.")
@click.option("--calib-text", type=click.Path(exists=True, dir_okay=False), default=str(calibration_text_path()),
              show_default="the bundled calibration text, Emma",
              help="UTF-8 calibration text (wanda, sparsegpt, structured); never the text you evaluate on.")
@click.option("--num-samples", type=int, default=_CALIB_DEFAULTS["num_samples"], show_default=True,
              help="Calibration windows.")
@click.option("--seq-len", type=int, default=_CALIB_DEFAULTS["seq_len"], show_default=True,
              help="Tokens per calibration window.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the calibration windows.")
@click.option("--bits", type=click.Choice(["8", "4", "3", "2"]), default=None,
              help="sparsegpt only: also quantize in the same sweep (writes the quantized format).")
@click.option("--group-size", type=int, default=64, show_default=True, help="With --bits: weights per scale.")
@click.option("--sym", is_flag=True, help="With --bits: symmetric quantization.")
@click.option("--drop-head-groups", type=int, default=0, show_default=True,
              help="structured: GQA head groups (a KV head with its query heads) removed per layer.")
@click.option("--drop-layers", type=int, default=0, show_default=True,
              help="structured: whole decoder layers removed (lowest block influence; never the first or last).")
@click.option("--force", is_flag=True, help="Write into OUT even if it already holds a checkpoint.")
def prune(model: str, out: Path, method: str, sparsity: float, pattern: str, scope: str | None,
          calib_text: str | None, num_samples: int, seq_len: int, seed: int, bits: str | None, group_size: int,
          sym: bool, drop_head_groups: int, drop_layers: int, force: bool) -> None:
    """Prune MODEL (GGUF file or HF folder; 'default' = SmolLM2-135M-Instruct) into the folder OUT.

    OUT is an ordinary checkpoint (zeros stored densely; structured: a smaller model) that loads with no
    other flags: brisk generate --model OUT, LLM(model=OUT); it can be quantized further with brisk quantize.
    """
    from rich.console import Console

    console = Console(stderr=True)
    try:
        settings = _check_settings(method, sparsity, pattern, scope, calib_text, bits, drop_head_groups,
                                   drop_layers)
    except PruneConfigError as e:
        raise click.ClickException(str(e)) from None
    if (out / "config.json").exists() and not force:
        raise click.ClickException(f"{out} already holds a checkpoint (config.json); pass --force to overwrite "
                                   "it or choose another folder")
    from brisk.model.loader import load_model
    from brisk.quant.calib import CalibConfig, CalibrationError, load_calibration_ids

    start = time.perf_counter()
    loaded = load_model(model, fuse=False)  # unfused: module names are the checkpoint's HF names
    from brisk.prune.support import check_prune_supports

    try:  # each method's architectures (and MoE experts): prune/support.py, before any calibration
        check_prune_supports(method, loaded.config)
    except PruneConfigError as e:
        raise click.ClickException(str(e)) from None
    ids = None
    calib = None
    if method != "magnitude":
        try:
            calib = CalibConfig(calib_text or "", num_samples=num_samples, seq_len=seq_len, seed=seed)
            ids = load_calibration_ids(loaded.tokenizer, calib)
        except CalibrationError as e:
            raise click.ClickException(str(e)) from None
    from brisk.prune.run import prune_and_save

    try:
        summary = prune_and_save(loaded, out, ids=ids, calib=calib, group_size=group_size, sym=sym, **settings)
    except PruneConfigError as e:
        raise click.ClickException(str(e)) from None
    console.print(f"[bold green]pruned[/] {loaded.name} -> {out}: {summary}, {time.perf_counter() - start:.1f} s")
    console.print(f"run it:  brisk generate --model {out} 'Hello'     check:  brisk eval sparsity --model {out}")


def _check_settings(method: str, sparsity: float, pattern: str, scope: str | None, calib_text: str | None,
                    bits: str | None, drop_head_groups: int, drop_layers: int) -> dict[str, Any]:
    """Every flag combination checked before the model loads; PruneConfigError says what to change."""
    nm = parse_pattern(pattern)
    from brisk.prune.support import prune_support

    if nm is not None and not prune_support(method).nm:
        raise PruneConfigError(f"--pattern applies to unstructured methods; --method {method} removes whole "
                               "heads, channels and layers (drop --pattern)")
    if method == "structured":
        if not (0.0 < sparsity < 1.0):
            raise PruneConfigError(f"--sparsity for structured pruning is the fraction of parameters removed, in "
                                   f"(0, 1); got {sparsity}")
    else:
        check_sparsity(sparsity)
        if drop_head_groups or drop_layers:
            raise PruneConfigError("--drop-head-groups / --drop-layers are structured-pruning options; use them "
                                   "with --method structured")
    if scope is not None and method != "magnitude":
        raise PruneConfigError(f"--scope is a magnitude option ({method} has its own comparison group)")
    if bits is not None and method != "sparsegpt":
        raise PruneConfigError("--bits (joint pruning + quantization) needs --method sparsegpt; to quantize a "
                               "pruned folder afterwards run brisk quantize on it")
    if method != "magnitude" and calib_text is None:
        raise PruneConfigError(f"--method {method} needs calibration data: pass --calib-text FILE "
                               "(never the text you evaluate on)")
    return {"method": method, "sparsity": sparsity, "pattern": nm, "scope": scope or "per_layer",
            "bits": int(bits) if bits else None, "drop_head_groups": drop_head_groups, "drop_layers": drop_layers}
