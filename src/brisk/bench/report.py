"""What every benchmark shares: statistics, peak memory, machine facts, progress bars, tables, JSON."""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

Advance = Callable[[int], None]  # progress callback: n units done


# ---------------------------------------------------------------------------- statistics
def mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


# ---------------------------------------------------------------------------- memory
def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (Linux: VmHWM), so a later `peak_rss_bytes` covers one phase.

    Returns False where that is not possible; the peak is then the whole process's so far.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """Peak resident memory since the last `reset_peak_rss` (or since the process started)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


# ---------------------------------------------------------------------------- machine and run facts
def _cpu_model() -> str | None:
    from brisk.ops.isa import cpuinfo_field

    return cpuinfo_field("model name") or platform.processor() or None


def machine_info() -> dict[str, Any]:
    import psutil

    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "memory_bytes": int(psutil.virtual_memory().total),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        from importlib.metadata import version

        info["brisk_version"] = version("brisk")
    except Exception:  # not installed as a distribution (running from a source tree)
        info["brisk_version"] = None
    return info


def write_json(path: str | Path, benchmark: str, params: dict[str, Any], results: dict[str, Any]) -> None:
    """All the numbers plus what is needed to reproduce and compare them: command line, date, machine."""
    doc = {
        "benchmark": benchmark,
        "command": " ".join(sys.argv),
        "params": params,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        **results,
    }
    Path(path).write_text(json.dumps(doc, indent=2, default=_json_default) + "\n", encoding="utf-8")


def _json_default(x: Any) -> Any:
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    if hasattr(x, "to_dict"):
        return x.to_dict()
    raise TypeError(f"cannot write {type(x).__name__} to JSON")


# ---------------------------------------------------------------------------- terminal output
def stderr_console() -> Console:
    """Progress goes to stderr so that stdout holds only the result table."""
    return Console(stderr=True)


@contextmanager
def progress_bar(description: str, total: int, enabled: bool = True) -> Iterator[Advance]:
    """A transient rich progress bar over `total` units; yields `advance(n)`."""
    if not enabled:
        yield lambda n: None
        return
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=stderr_console(), transient=True)
    task = progress.add_task(description, total=total)
    with progress:
        yield lambda n: progress.advance(task, n)


def table_rows(spec: list[tuple[str, str, float, str]], ours: dict[str, Any], theirs: dict[str, Any] | None,
               ) -> list[tuple[str, float | None, float | None, str]]:
    """(label, key, scale, format) + two result dicts -> `comparison_table` rows; missing keys show as '-'."""
    def get(d: dict[str, Any] | None, key: str, scale: float) -> float | None:
        v = (d or {}).get(key)
        return None if v is None else v * scale

    return [(label, get(ours, key, scale), get(theirs, key, scale), fmt) for label, key, scale, fmt in spec]


def comparison_table(title: str, rows: list[tuple[str, float | None, float | None, str]],
                     baseline_name: str | None) -> Table:
    """Rows of (metric, brisk value, baseline value, format); a speedup column when there is a baseline.

    A metric whose name ends in "/s" is better higher (speedup = brisk / baseline); any other is a time or
    a size, better lower (speedup = baseline / brisk). Sizes get no speedup.
    """
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    table.add_column("brisk", justify="right")
    if baseline_name:
        table.add_column(baseline_name, justify="right")
        table.add_column("speedup", justify="right")
    for name, ours, theirs, fmt in rows:
        cells = [name, _fmt(ours, fmt)]
        if baseline_name:
            cells += [_fmt(theirs, fmt), _fmt(speedup(name, ours, theirs), ".2f", "x")]
        table.add_row(*cells)
    return table


def speedup(metric: str, ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or ours <= 0 or theirs <= 0:
        return None
    if metric.endswith("/s"):
        return ours / theirs
    if "(ms)" in metric or "(s)" in metric:
        return theirs / ours
    return None


def _fmt(x: float | None, fmt: str, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and np.isnan(x)):
        return "-"
    return f"{x:{fmt}}{suffix}"
