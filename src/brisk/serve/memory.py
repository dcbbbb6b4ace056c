"""Keep a long-running server's resident memory flat: what `brisk serve` does about it, and why.

Two things made a server's RSS climb under a steady mixed load (the default model, 512 MiB KV pool), though
nothing leaked:

- The KV pool is one fresh anonymous mapping (model/hugepages.py: `huge_zeros`), zeros from the kernel, so its
  pages become resident only as blocks are first written. The block allocator hands out the least recently freed
  block (a freed block keeps its prefix-cache entry as long as possible), so a steady load walks the whole pool
  and the RSS climbs by the pool's size: 398 -> 1,058 MiB over the first 30 mixed requests, 494 MiB the pool's.
  `prefault_kv_pool` makes those pages resident when the server starts: the reservation shows up at once, a
  machine without the memory fails at start-up rather than mid-soak, and the first requests do not pay the faults.
  An offline `LLM()` keeps the lazy pool (a short script may never fill it).
- glibc keeps freed heap memory in its arenas. A batch's activations, logits and masks come and go at sizes that
  change with the batch, and the free space between the blocks still held (tokenizer, grammar matchers, request
  state) is not handed back: 219-240 MiB over the start's RSS, outside the pool, after 90-210 mixed requests.
  `release_heap` (glibc's malloc_trim) hands every free page back (~100 MiB left, flat); the engine loop calls it
  when it goes idle after work (serve/async_engine.py), at most every `TRIM_INTERVAL_S`, where it costs no request
  any latency.

`brisk bench serve --soak N` measures the result.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import time
from typing import Any

import torch

logger = logging.getLogger("brisk.serve")

_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in, writable, without touching its contents
# The engine loop trims at most this often (seconds): malloc_trim walks every arena, ~1-10 ms.
TRIM_INTERVAL_S = 2.0


def _libc() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _populate(libc: Any, ptr: int, nbytes: int) -> bool:
    """MADV_POPULATE_WRITE over the whole pages of [ptr, ptr + nbytes); False where the kernel refuses."""
    page = mmap.PAGESIZE
    start = ptr // page * page
    end = (ptr + nbytes + page - 1) // page * page
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_POPULATE_WRITE) == 0


def prefault_kv_pool(kv_caches: list[Any]) -> int:
    """Make every page of the KV pool's float tensors resident now; the bytes covered. Unused blocks are zeros and
    stay zeros: MADV_POPULATE_WRITE maps the pages without writing, and the fallback writes the zeros they hold.
    Call before the first request (the fallback overwrites the whole pool). Quantized caches (torch.zeros) are
    resident already."""
    libc = _libc()
    done = 0
    for t in kv_caches:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            continue
        nbytes = t.numel() * t.element_size()
        if libc is None or not _populate(libc, t.data_ptr(), nbytes):
            t.zero_()
        done += nbytes
    return done


def prefault_engine_kv(engine: Any) -> int:
    """`prefault_kv_pool` on an engine's KV caches (those of its own process: none for a parallel engine's workers,
    which hold theirs); the bytes covered."""
    caches = getattr(getattr(engine, "runner", None), "kv_caches", None)
    if not caches:
        return 0
    t0 = time.perf_counter()
    done = prefault_kv_pool(list(caches))
    logger.info("KV pool resident: %.0f MiB in %.2f s", done / 2**20, time.perf_counter() - t0)
    return done


def release_heap() -> bool:
    """Hand the C heap's free pages back to the kernel (glibc's malloc_trim); False where there is no glibc."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True


class IdleTrimmer:
    """Calls `release_heap` when the engine goes idle after work, at most every `interval_s` seconds."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.dirty = False  # work was done since the last trim
        self._last = 0.0
        self.num_trims = 0

    def worked(self) -> None:
        self.dirty = True

    def idle(self) -> None:
        now = time.monotonic()
        if not self.dirty or now - self._last < self.interval_s:
            return
        self.dirty = False
        self._last = now
        if release_heap():
            self.num_trims += 1
