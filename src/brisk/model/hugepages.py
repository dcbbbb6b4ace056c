"""Model weights in one arena on transparent huge pages (Linux).

Batch-1 decode streams every weight once per token. On 4 KiB pages that is one TLB entry per 4 KiB of weights, and
the hardware prefetchers stop at every page boundary; on 2 MiB pages neither happens. Measured on the 2-core Zen 5
VM (alternated processes, float32 batch-1 decode of the default model): 71.6 / 70.7 / 72.5 -> 75.6 / 79.8 / 81.3
tok/s with torch's own THP allocation (THP_MEM_ALLOC_ENABLE=1, which covers tensors of 2 MiB and more only); an
int4 g64 model's small tensors, moved here into one arena, 307.7 -> 320.9 tok/s (medians, one process).

`to_huge_pages` copies a model's parameters and buffers (and the quantized / sparse weights' own fields, which the
modules mirror as buffers) into one contiguous, 2 MiB-aligned buffer advised MADV_HUGEPAGE, in module order, and
points every holder at its slice: the same values, the same dtypes and shapes. A GGUF file's packed weights skip
the copy: the loader allocates their own arena up front (`huge_empty`) and repacks each matrix straight into it
(model/gguf_place.py), and `to_huge_pages` leaves that storage where it is. One arena instead of one region per
tensor: a region per tensor would round each up to whole huge pages (a 2.2 MiB tensor taking 4 MiB).
Nothing happens where the kernel offers no THP (`/sys/kernel/mm/transparent_hugepage/enabled` says never, or is
absent), on other platforms, when switched off (`settings.enabled`: BRISK_HUGE_PAGES=0 at start-up, or
`configure(enabled=False)` / `with override(enabled=False):` in-process), or when the weights exceed half of the
available memory (the copy holds them twice for a moment).

Memory given back as the copy goes: a tensor's old storage is freed as soon as its copy is made, but glibc keeps
freed blocks below its mmap threshold (which it raises as large blocks come and go) in its heap, so the process's
resident set would still hold the whole model twice at the end of the copy. `release_free_memory`
(malloc_trim) hands free heap pages back to the kernel every `_TRIM_EVERY` bytes copied, and the loader calls it
after each stage that frees temporaries, so that the peak stays near the weights plus one step's worth.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import os
import sys
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_ALIGN = 64  # each tensor starts on a cache line
_TRIM_EVERY = 16 << 20  # bytes copied into the arena between two release_free_memory calls


def release_free_memory() -> bool:
    """Give the C heap's free pages back to the kernel (glibc's malloc_trim); whether it could be called (False
    elsewhere than on glibc). Freed tensors leave their pages resident in the heap otherwise."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return False
    trim(ctypes.c_size_t(0))
    return True


def bound_heap_retention(threshold: int = 1 << 20) -> bool:
    """Serve allocations of `threshold` bytes and more from their own mappings, returned to the kernel when freed
    (glibc's M_MMAP_THRESHOLD, fixed: by default glibc raises it up to 32 MiB after the first large frees, and a
    training step's freed activations then stay resident in the heap: +400 MB on the default model's fine-tune).
    Whether it could be set (False elsewhere than on glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(ctypes.c_int(-3), ctypes.c_int(threshold)))  # -3: M_MMAP_THRESHOLD


@dataclasses.dataclass(frozen=True)
class HugePageSettings:
    """Read once from the environment at import (`from_env`); changed in-process with `configure` / `override`."""

    enabled: bool = True  # False: weights and KV caches stay on ordinary pages (BRISK_HUGE_PAGES=0)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> HugePageSettings:
        return cls(enabled=env.get("BRISK_HUGE_PAGES", "1") != "0")


settings = HugePageSettings.from_env()  # the start-up read of BRISK_HUGE_PAGES


def configure(**changes: Any) -> HugePageSettings:
    """Change the settings in-process (fields of HugePageSettings); returns the previous ones."""
    global settings
    previous = settings
    settings = dataclasses.replace(settings, **changes)
    return previous


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[HugePageSettings]:
    """`configure(**changes)` for the duration of a `with` block, then the settings as they were."""
    previous = configure(**changes)
    try:
        yield settings
    finally:
        configure(**dataclasses.asdict(previous))


def huge_pages_available() -> bool:
    """Linux with transparent huge pages in `always` or `madvise` mode, and not switched off in the settings."""
    if not settings.enabled or not sys.platform.startswith("linux"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def _arena(nbytes: int) -> tuple[torch.Tensor, int] | None:
    """(a uint8 buffer, the offset of its 2 MiB-aligned start) with nbytes from there advised MADV_HUGEPAGE, or
    None if the kernel refuses. The buffer is a fresh private anonymous mapping: it reads as zeros, and nothing is
    touched yet (pages are faulted in, huge and zeroed by the kernel, on first write); it is unmapped when the last
    tensor on it goes."""
    size = nbytes + HUGE_PAGE
    # (private: a shared anonymous mapping is shmem, whose huge pages follow another setting, usually off)
    buf = torch.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    start = (buf.data_ptr() + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE - buf.data_ptr()
    span = min((nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE, buf.numel() - start)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(buf.data_ptr() + start), ctypes.c_size_t(span), _MADV_HUGEPAGE) != 0:
        return None
    return buf, start


def huge_zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """`count` zero tensors of one shape in one huge-page arena (the per-layer KV caches: attention reads them
    through block tables, a TLB miss per 4 KiB page otherwise), or None where huge pages are not available. The
    arena is a fresh mapping, zeros already: nothing is written here, and a cache's pages become resident as
    blocks are first written (a load no longer spends 0.2-0.5 s clearing a pool it may not fill)."""
    if not huge_pages_available() or count == 0:
        return None
    each = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    step = (each + _ALIGN - 1) // _ALIGN * _ALIGN
    arena = _arena(step * count)
    if arena is None:
        return None
    buf, start = arena
    out = []
    for i in range(count):
        out.append(buf[start + i * step:start + i * step + each].view(dtype).view(shape))
    return out


def huge_empty(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """Uninitialized tensors of the given (shape, dtype)s in one huge-page arena, each on a cache line, and the
    arena's buffer (for `to_huge_pages`' skip: the loader writes packed weights straight into their final place
    here, model/gguf_place.py); None where huge pages are not available. Nothing is touched: the pages are faulted
    in, huge, as the tensors are first written."""
    if not huge_pages_available() or not specs:
        return None
    sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += (size + _ALIGN - 1) // _ALIGN * _ALIGN
    arena = _arena(total)
    if arena is None:
        return None
    buf, start = arena
    return [buf[start + o:start + o + size].view(dtype).view(shape)
            for o, size, (shape, dtype) in zip(offsets, sizes, specs, strict=True)], buf


def _available_bytes() -> int:
    """MemAvailable from /proc/meminfo (bytes); 0 if unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _holders(model: nn.Module) -> list[tuple[object, str, torch.Tensor]]:
    """(owner, attribute, tensor) for every parameter, buffer and packed/sparse weight field, in module order."""
    out = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                out.append((module, "param:" + name, p))
        for name, b in module._buffers.items():
            if b is not None:
                out.append((module, "buffer:" + name, b))
        for attr in ("packed", "sparse"):  # QuantLinear.packed / SparseLinear.sparse: their fields mirror buffers
            holder = getattr(module, attr, None)
            if dataclasses.is_dataclass(holder):
                for f in dataclasses.fields(holder):
                    value = getattr(holder, f.name)
                    if isinstance(value, torch.Tensor):
                        out.append((holder, "field:" + f.name, value))
    return out


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor the model holds: parameters, buffers and the packed / sparse weights' fields."""
    return [t for _, _, t in _holders(model)]


def to_huge_pages(model: nn.Module, min_bytes: int = 4096, skip: Collection[int] = ()) -> int:
    """Move the model's CPU tensors of at least `min_bytes` into one huge-page arena (see the module docstring).
    Returns the bytes moved (0 when huge pages are not available). Tensors shared by several holders (tied
    embeddings, a packed weight and the buffer mirroring it) stay shared. Tensors on a storage whose data_ptr is
    in `skip` stay where they are: the loader passes the memory-mapped files' (model/mapped.py), whose pages are
    shared page cache; copying them here would make them private anonymous memory again."""
    if not huge_pages_available():
        return 0
    holders = _holders(model)
    # storages seen through more than one distinct view (aliasing slices) stay where they are: copying the views
    # apart would break the aliasing (no model here has any; a guard for custom layers)
    views_of: dict[int, set] = {}
    for _, _, t in holders:
        if t.device.type == "cpu" and t.layout == torch.strided:
            views_of.setdefault(t.untyped_storage().data_ptr(), set()).add((t.data_ptr(), t.shape, t.dtype, t.stride()))
    moved: dict[int, tuple[torch.Tensor, int]] = {}  # the original tensor's data_ptr -> (tensor, offset in the arena)
    total = 0
    for _, _, t in holders:
        if t.device.type != "cpu" or t.layout != torch.strided or t.nbytes < min_bytes or not t.is_contiguous():
            continue
        if t.untyped_storage().data_ptr() in skip or len(views_of[t.untyped_storage().data_ptr()]) > 1:
            continue
        key = t.data_ptr()
        if key in moved:
            continue
        moved[key] = (t, total)
        total += (t.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    if total == 0 or total > _available_bytes() // 2:
        return 0  # (the copy briefly holds the weights twice: not where that could run the machine out of memory)
    release_free_memory()  # what the loader's fusion and tiling freed: not resident while the arena fills
    arena = _arena(total)
    if arena is None:
        return 0  # the kernel refused: keep the model as it is
    buf, start = arena
    holders_of: dict[int, list[tuple[nn.Module, str, torch.Tensor]]] = {}
    for owner, where, t in holders:
        if t.device.type == "cpu" and t.layout == torch.strided and t.data_ptr() in moved:
            holders_of.setdefault(t.data_ptr(), []).append((owner, where, t))
    del holders
    with torch.no_grad():
        # each tensor's holders move to its copy as soon as it is made, so that its old storage is freed then
        # (a Parameter keeps its object, so nothing else holds the old storage): the copy holds one tensor twice
        # at a time, not the whole model
        since_trim = 0
        for key in list(moved):  # (the keys only: a list of the items would hold every old tensor to the end)
            t, offset = moved.pop(key)
            view = buf[start + offset:start + offset + t.nbytes].view(t.dtype).view(t.shape)
            view.copy_(t)  # first touch: faults in huge pages
            since_trim += t.nbytes
            del t
            # (a moved storage has one view: each holder's tensor has the view's shape and dtype)
            for owner, where, held in holders_of.pop(key):
                kind, name = where.split(":", 1)
                if kind == "param":
                    held.data = view  # the Parameter object stays (optimizers, tying), its storage moves
                elif kind == "buffer":
                    owner._buffers[name] = view  # type: ignore[attr-defined]
                else:
                    setattr(owner, name, view)
            if since_trim >= _TRIM_EVERY:  # the old storages just freed: their pages back to the kernel
                release_free_memory()
                since_trim = 0
    release_free_memory()
    return total
