"""`brisk spec`: layerskip-search (choose the layer-skip draft's skipped layers), train-medusa and train-eagle (the
trained heads, one shared option block)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from brisk.data import calibration_text_path
from brisk.engine.settings import setting_option
from brisk.spec import recipe

if TYPE_CHECKING:
    from brisk.model.loader import LoadedModel

F = TypeVar("F", bound=Callable[..., Any])


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
@setting_option("num_threads")
def layerskip_search(model: str | None, text_path: str, offset: int, tokens: int, max_skip: int, out: Path | None,
                     num_threads: int | None) -> None:
    """Rank layers by how little skipping each alone changes the greedy tokens on calibration text, then skip the
    best-ranked m together for the m with the highest predicted speedup (see brisk.spec.layerskip)."""
    import torch

    from brisk.model.loader import load_model
    from brisk.spec.layerskip import layerskip_path, save_search, search_skip_layers

    if num_threads:
        torch.set_num_threads(num_threads)
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


def head_training_options(steps: int, batch_size: int, batch_help: str, lr: float) -> Callable[[F], F]:
    """The options train-medusa and train-eagle share: the self-distillation data, then the optimizer."""
    options = [
        click.argument("model"),
        click.argument("out", type=click.Path(file_okay=False, path_type=Path)),
        click.option("--text", "text_path", type=click.Path(exists=True, dir_okay=False),
                     default=str(calibration_text_path()), show_default="the bundled calibration text, Emma",
                     help="Text the training prompts are cut from (bench spec's own prompts are left out)."),
        click.option("--prompts", "num_prompts", type=int, default=recipe.DATA_PROMPTS, show_default=True,
                     help="Chat prompts cut from --text that the target answers (the self-distillation data)."),
        click.option("--written-prompts", "num_written", type=int, default=recipe.DATA_WRITTEN, show_default=True,
                     help="Also this many prompts the target writes itself (questions and requests about words of "
                          "--text, sampled), for answers beyond the text's templates."),
        click.option("--max-tokens", type=int, default=recipe.DATA_MAX_TOKENS, show_default=True,
                     help="Tokens of each answer."),
        click.option("--data-dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
                     show_default=True, help="Precision the target generates the data in (auto: bfloat16 where the "
                     "CPU computes it natively, else float32); the heads train in float32."),
        click.option("--data", "data_cache", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="Keep the generated self-distillation data in this file (read back when the settings "
                          "match, e.g. by the other head's training)."),
        click.option("--steps", type=int, default=steps, show_default=True, help="Optimizer steps."),
        click.option("--batch-size", type=int, default=batch_size, show_default=True, help=batch_help),
        click.option("--lr", type=float, default=lr, show_default=True,
                     help="Peak learning rate (AdamW, warm-up + cosine)."),
        click.option("--draft-vocab", type=int, default=recipe.DRAFT_VOCAB, show_default=True,
                     help="Most frequent target tokens the head drafts from (and is trained on)."),
        click.option("--seed", type=int, default=0, show_default=True),
        setting_option("num_threads"),
    ]

    def apply(f: F) -> F:
        for option in reversed(options):
            f = option(f)
        return f

    return apply


def _load_for_training(model: str, text_path: str, num_threads: int | None, num_prompts: int, max_tokens: int,
                       steps: int, batch_size: int, num_written: int = 0) -> tuple[LoadedModel, str]:
    import torch

    from brisk.model.loader import load_model

    if min(num_prompts, steps, batch_size) < 1 or max_tokens < 2 or num_written < 0:
        raise click.BadParameter("--prompts, --steps and --batch-size must be at least 1, --max-tokens at least 2 "
                                 "and --written-prompts not negative")
    if num_threads:
        torch.set_num_threads(num_threads)
    return load_model(model), Path(text_path).read_text(encoding="utf-8")


@spec_group.command("train-medusa")
@head_training_options(steps=recipe.MEDUSA_STEPS, batch_size=recipe.MEDUSA_BATCH,
                        batch_help="Hidden-state rows per step.", lr=recipe.MEDUSA_LR)
@click.option("--heads", "num_heads", type=int, default=recipe.MEDUSA_HEADS, show_default=True,
              help="Medusa heads (tokens 2..K+1).")
def train_medusa_cmd(model: str, out: Path, text_path: str, num_prompts: int, num_written: int, max_tokens: int,
                     data_dtype: str, data_cache: Path | None, steps: int, batch_size: int, lr: float,
                     draft_vocab: int, seed: int, num_threads: int | None, num_heads: int) -> None:
    """Train Medusa heads for MODEL by self-distillation (the target answers chat prompts cut from --text; the
    heads learn its own later tokens from its hidden states, the target frozen) and store them in OUT. Decode
    with --speculative medusa:OUT (or just medusa when OUT is the default next to the model)."""
    from brisk.spec.medusa import train_medusa

    if num_heads < 1:
        raise click.BadParameter("--heads must be at least 1")
    loaded, text = _load_for_training(model, text_path, num_threads, num_prompts, max_tokens, steps, batch_size,
                                      num_written)
    info = train_medusa(loaded, text, out, num_heads=num_heads, num_prompts=num_prompts, max_tokens=max_tokens,
                        steps=steps, batch_size=batch_size, lr=lr, seed=seed, text_name=Path(text_path).name,
                        log=lambda m: click.echo(m, err=True), data_cache=data_cache,
                        draft_vocab_size=draft_vocab, num_written=num_written, data_dtype=data_dtype)
    top1 = ", ".join(f"{a[0]:.2f}" for a in info["accuracy"])
    click.echo(f"{num_heads} heads -> {out}: held-out top-1 accuracy per head {top1}; {info['data']['rows']} rows, "
               f"{steps} steps in {info['training']['seconds']:.0f} s")


@spec_group.command("train-eagle")
@head_training_options(steps=recipe.EAGLE_STEPS, batch_size=recipe.EAGLE_BATCH, batch_help="Windows per step.",
                        lr=recipe.EAGLE_LR)
@click.option("--window", type=int, default=recipe.EAGLE_WINDOW, show_default=True,
              help="Consecutive rows per training window.")
def train_eagle_cmd(model: str, out: Path, text_path: str, num_prompts: int, num_written: int, max_tokens: int,
                    data_dtype: str, data_cache: Path | None, steps: int, batch_size: int, lr: float,
                    draft_vocab: int, seed: int, num_threads: int | None, window: int) -> None:
    """Train an EAGLE head for MODEL by self-distillation (feature regression + the target's own next tokens, the
    target frozen) and store it in OUT. Decode with --speculative eagle:OUT."""
    from brisk.spec.eagle import train_eagle

    if window < 2 or max_tokens <= window:
        raise click.BadParameter("need --window >= 2 and --max-tokens > --window")
    loaded, text = _load_for_training(model, text_path, num_threads, num_prompts, max_tokens, steps, batch_size,
                                      num_written)
    info = train_eagle(loaded, text, out, num_prompts=num_prompts, max_tokens=max_tokens, steps=steps, window=window,
                       batch_size=batch_size, lr=lr, seed=seed, draft_vocab_size=draft_vocab,
                       text_name=Path(text_path).name, log=lambda m: click.echo(m, err=True), data_cache=data_cache,
                       num_written=num_written, data_dtype=data_dtype)
    t = info["training"]
    chain = ", ".join(f"{a:.2f}" for a in info["chain_accuracy"])
    click.echo(f"EAGLE head -> {out}: loss {t['loss_first']:.3f} -> {t['loss_last']:.3f}; held-out chain "
               f"accuracy by depth {chain}; {info['data']['rows']} rows, {steps} steps in {t['seconds']:.0f} s")
