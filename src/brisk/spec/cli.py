"""`brisk spec layerskip-search`: choose and store the layer-skip draft's skipped layers."""

from __future__ import annotations

from pathlib import Path

import click

from brisk.data import calibration_text_path


@click.group("spec")
def spec_group() -> None:
    """Speculative decoding tools (decode with --speculative on generate / chat / serve)."""


@spec_group.command("layerskip-search")
@click.option("--model", "-m", default=None, help="Model (default: SmolLM2-135M-Instruct).")
@click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False), default=str(calibration_text_path()),
              show_default="the bundled calibration text, Emma", help="Calibration text.")
@click.option("--offset", type=int, default=20000, show_default=True, help="Character offset into the text.")
@click.option("--tokens", type=int, default=192, show_default=True, help="Calibration tokens.")
@click.option("--max-skip", type=int, default=14, show_default=True, help="Most layers to skip.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to store the result (default: next to the model, where --speculative layerskip looks).")
@click.option("--threads", type=int, default=None, help="torch intra-op threads.")
def layerskip_search(model: str | None, text_path: str, offset: int, tokens: int, max_skip: int, out: Path | None,
                     threads: int | None) -> None:
    """Rank layers by how little skipping each alone changes the greedy tokens on calibration text, then skip the
    best-ranked m together for the m with the highest predicted speedup (see brisk.spec.layerskip)."""
    import torch

    from brisk.model.loader import load_model
    from brisk.spec.layerskip import layerskip_path, save_search, search_skip_layers

    if threads:
        torch.set_num_threads(threads)
    loaded = load_model(model)
    text = Path(text_path).read_text(encoding="utf-8")[offset:]
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)[:tokens]
    if len(ids) < 16:
        raise ValueError(f"the calibration text gave only {len(ids)} tokens; use a longer text or a smaller --offset")
    result = search_skip_layers(loaded.model, ids, loaded.dtype, max_skip,
                                f"{Path(text_path).name}: {len(ids)} tokens from character {offset}",
                                log=lambda m: click.echo(m, err=True))
    path = out or layerskip_path(loaded.path)
    save_search(result, path)
    click.echo(f"skip {result.skip_layers} of {result.num_layers} layers: agreement {result.agreement:.3f}, "
               f"predicted speedup {result.predicted_speedup:.2f}x -> {path}")
