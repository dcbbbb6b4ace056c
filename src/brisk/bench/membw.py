"""The machine's memory bandwidth, measured with torch on buffers far larger than any cache.

Read bandwidth is the ceiling for batch-1 decoding (weights and KV are only read), so it is the headline;
it is measured by summing a float32 buffer, which torch vectorises and spreads over its intra-op threads,
so the figure is what torch code on this many threads can pull from memory, not a vendor peak. Copy
bandwidth (STREAM convention: bytes read + bytes written) is reported alongside for reference. Best of
several runs: interference from other processes only ever makes a run slower.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

DEFAULT_BUFFER_BYTES = 1 << 30  # 1 GiB: hundreds of times the last-level cache of a desktop or server CPU
QUICK_BUFFER_BYTES = 256 << 20  # used inside `bench latency` when no --membw is given


@dataclass
class MembwResult:
    read_gbps: float  # bytes summed / best time
    copy_gbps: float  # (bytes read + bytes written) / best time
    buffer_bytes: int
    runs: int
    num_threads: int

    def to_dict(self) -> dict:
        return asdict(self)


def _best_seconds(fn, runs: int) -> float:  # noqa: ANN001 - a no-argument callable
    fn()  # warm-up: first touch, thread pool start
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_membw(buffer_bytes: int = DEFAULT_BUFFER_BYTES, runs: int = 5) -> MembwResult:
    """Best-of-`runs` read and copy bandwidth over a `buffer_bytes` float32 buffer, in GB/s (1e9 bytes)."""
    if buffer_bytes < 4096:
        raise ValueError(f"membw buffer must be at least 4 KiB, got {buffer_bytes} bytes")
    if runs < 1:
        raise ValueError(f"membw runs must be at least 1, got {runs}")
    n = buffer_bytes // 4
    nbytes = n * 4
    # torch.ones writes every page, so they are really mapped: summing a fresh torch.empty buffer would read
    # the kernel's shared zero page and report cache bandwidth instead
    src = torch.ones(n, dtype=torch.float32)
    read_s = _best_seconds(lambda: src.sum(), runs)
    dst = torch.empty_like(src)
    dst.fill_(0.0)
    copy_s = _best_seconds(lambda: dst.copy_(src), runs)
    return MembwResult(read_gbps=nbytes / read_s / 1e9, copy_gbps=2 * nbytes / copy_s / 1e9,
                       buffer_bytes=nbytes, runs=runs, num_threads=torch.get_num_threads())
