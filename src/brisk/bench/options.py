"""What the engine-building bench commands share: the engine options (generated from the settings), threads, the
engine, and the model facts every JSON report records."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
import torch

from brisk.engine.settings import engine_kwargs, engine_options


def engine_flags(*, defaults: dict[str, Any] | None = None, help: dict[str, str] | None = None
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Every engine setting (engine/settings.py), and --json."""
    engine = engine_options(defaults=defaults, help={
        "dtype": "Weights and activations dtype (the baseline uses the same).",
        "seed": "Engine seed (and prompt sampling).", **(help or {})})
    json_opt = click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
                            help="Write every number, the command line, date and machine facts to this file.")
    return lambda f: engine(json_opt(f))


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)


def build_llm(kw: dict[str, Any]):  # noqa: ANN201 - brisk.engine.llm.LLM, imported late
    from brisk.engine.llm import LLM

    return LLM(**engine_kwargs(kw))


def describe_model(llm) -> dict[str, Any]:  # noqa: ANN001 - an LLM
    loaded = llm.engine.loaded
    return {"name": loaded.name, "path": str(loaded.path), "dtype": str(loaded.dtype).removeprefix("torch."),
            "num_params": loaded.config.num_params, "load_s": loaded.load_seconds}
