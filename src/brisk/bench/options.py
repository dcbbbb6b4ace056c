"""What the engine-building bench commands share: the engine options (generated from the settings), threads, the
engine, and the model facts every JSON report records."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click
import torch

from brisk.console import peak_rss_bytes
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
    """The engine of the settings in `kw`; its start-up wall time is kept on it for `load_figures`."""
    from brisk.engine.llm import LLM

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(kw))
    llm.start_seconds = time.perf_counter() - start
    return llm


def load_figures(llm) -> dict[str, Any]:  # noqa: ANN001 - an LLM
    """What starting the engine cost, taken right after it started: the model load's wall seconds, the whole
    start-up's (load + KV pool + executor), and the process's peak RSS so far, which is the load's peak (a
    conversion's transient copies show here, not in the steady state while generating)."""

    return {"load_s": llm.engine.loaded.load_seconds, "start_s": getattr(llm, "start_seconds", None),
            "peak_rss_after_load_bytes": peak_rss_bytes()}


def describe_model(llm) -> dict[str, Any]:  # noqa: ANN001 - an LLM
    loaded = llm.engine.loaded
    return {"name": loaded.name, "path": str(loaded.path), "dtype": str(loaded.dtype).removeprefix("torch."),
            "num_params": loaded.config.num_params, "load_s": loaded.load_seconds}
