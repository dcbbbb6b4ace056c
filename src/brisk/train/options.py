"""The trainer's command-line options, defined once for every command that trains (`brisk distill`,
`brisk finetune`): the optimizer, schedule and batch shape first, the run's bookkeeping last."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def _apply(options: list[Callable[[F], F]], f: F) -> F:
    for option in reversed(options):  # click lists options in the order they are written above the function
        f = option(f)
    return f


def optimizer_options(steps: int, lr: float, batch_help: str, seq_len_help: str) -> Callable[[F], F]:
    """--steps --batch-size --grad-accum --seq-len --lr --warmup-steps --weight-decay --max-grad-norm."""
    return lambda f: _apply([
        click.option("--steps", type=int, default=steps, show_default=True, help="Optimizer steps."),
        click.option("--batch-size", type=int, default=4, show_default=True, help=batch_help),
        click.option("--grad-accum", type=int, default=1, show_default=True, help="Micro-batches per step."),
        click.option("--seq-len", type=int, default=256, show_default=True, help=seq_len_help),
        click.option("--lr", type=float, default=lr, show_default=True, help="Peak learning rate (AdamW)."),
        click.option("--warmup-steps", type=int, default=10, show_default=True),
        click.option("--weight-decay", type=float, default=0.0, show_default=True),
        click.option("--max-grad-norm", type=float, default=1.0, show_default=True),
    ], f)


def activation_checkpointing_option(f: F) -> F:
    return click.option("--activation-checkpointing", is_flag=True,
                        help="Recompute layers in the backward (less memory).")(f)


def run_options(f: F) -> F:
    """--checkpoint-every --seed --resume --force."""
    return _apply([
        click.option("--checkpoint-every", type=int, default=50, show_default=True,
                     help="Steps between saves of OUT/last."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--resume", is_flag=True, help="Continue the run whose state is in OUT/last."),
        click.option("--force", is_flag=True, help="Start a new run in OUT even if it holds one."),
    ], f)
