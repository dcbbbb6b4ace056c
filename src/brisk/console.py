"""What brisk's commands print and record, for every package: a stderr console, progress bars, peak memory,
and JSON records carrying the machine's facts. Statistics and comparison tables stay with the benchmarks
(bench/report.py)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psutil
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from brisk.ops.isa import cpuinfo_field

Advance = Callable[[int], None]  # progress callback: n units done


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
def cpu_model() -> str | None:
    return cpuinfo_field("model name") or platform.processor() or None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "memory_bytes": int(psutil.virtual_memory().total),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        info["brisk_version"] = version("brisk")
    except PackageNotFoundError:  # not installed as a distribution (running from a source tree)
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
