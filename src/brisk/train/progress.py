"""The trainer's terminal progress (loss, tokens/s, ETA) and its loss-curve PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from brisk.console import stderr_console


class TrainProgress:
    """A rich bar over optimizer steps showing the last loss, tokens/s and the time left."""

    def __init__(self, max_steps: int, start_step: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=stderr_console(), transient=True, disable=not enabled)
        self.task = self.progress.add_task("training", total=max_steps, completed=start_step, loss="-", tps="-")

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, loss: float, tokens_per_second: float) -> None:
        self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", tps=f"{tokens_per_second:,.0f}")


class CountProgress:
    """A rich bar over a count of things done (answers generated, prompts written) with the time taken and left."""

    def __init__(self, label: str, total: int, enabled: bool = True) -> None:
        self.progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("ETA"), TimeRemainingColumn(), console=stderr_console(), transient=True,
                                 disable=not enabled)
        self.task = self.progress.add_task(label, total=total)

    def __enter__(self) -> CountProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def advance(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)


def write_loss_curve(path: Path, history: list[dict[str, Any]]) -> str | None:
    """Plot training loss (and held-out perplexity) per step to `path`; returns its name, or None (and says so)
    when matplotlib is not installed: the PNG is optional, the JSON log holds the same numbers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        stderr_console().print("matplotlib is not installed: no loss.png (train_log.jsonl has the losses)")
        return None
    steps = [h["step"] for h in history if "loss" in h]
    losses = [h["loss"] for h in history if "loss" in h]
    evals = [(h["step"], h["eval_ppl"]) for h in history if h.get("eval_ppl") is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, label="training loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    if evals:
        ax2 = ax.twinx()
        ax2.plot([s for s, _ in evals], [p for _, p in evals], "o--", color="tab:red", label="held-out ppl")
        ax2.set_ylabel("held-out perplexity")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name
