"""A progress bar for model loads, in bytes, advanced tensor by tensor by the readers (hf.py, gguf.py, dummy.py).

A 1B model in float32 is ~5 GB: reading, converting and copying it takes 5-30 s on a 2-core machine, long enough
that a silent terminal looks hung. The default model loads in about a second, and a bar that flashes up and
vanishes for that is noise, so the bar appears only once a load has run for `DELAY_S` seconds, and never when
stderr is not a terminal (logs, pipes, tests) or when the caller turns it off.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)

DELAY_S = 2.0  # loads shorter than this never show a bar

Advance = Callable[[int], None]  # bytes done since the last call


class LoadProgress:
    """`advance(nbytes)` after each tensor; the bar starts (transient, on stderr) at the first call after
    `delay_s` seconds. A context manager: leaving it removes the bar."""

    def __init__(self, description: str, total_bytes: int, *, enabled: bool = True, delay_s: float = DELAY_S,
                 console: Console | None = None) -> None:
        self.description = description
        self.total_bytes = max(0, int(total_bytes))
        self.console = console or Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal and self.total_bytes > 0
        self.delay_s = delay_s
        self.done_bytes = 0
        self._start = time.perf_counter()
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    @property
    def shown(self) -> bool:
        """Whether the bar is on the terminal (it is only once the load has taken longer than `delay_s`)."""
        return self._progress is not None

    def advance(self, nbytes: int) -> None:
        self.done_bytes += int(nbytes)
        if self._progress is None:
            if not self.enabled or time.perf_counter() - self._start < self.delay_s:
                return
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
                                      TransferSpeedColumn(), TimeElapsedColumn(), console=self.console,
                                      transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total_bytes)
        assert self._task is not None
        self._progress.update(self._task, completed=min(self.done_bytes, self.total_bytes))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> LoadProgress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
