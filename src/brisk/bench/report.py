"""What every benchmark shares on top of brisk/console.py: statistics and comparison tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.table import Table


# ---------------------------------------------------------------------------- statistics
def mean(xs: Sequence[float]) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


# ---------------------------------------------------------------------------- tables
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
