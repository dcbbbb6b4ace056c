"""Weights memory-mapped from their file, where the stored layout is the runtime layout.

A tensor whose bytes in the file already are what the model runs on (a safetensors tensor in the runtime dtype, a
GGUF F32/F16/BF16 tensor loaded in that dtype, with no row permutation or fusion to apply) is not read into a
fresh buffer: it is a view of the file mapped into memory. Its pages come from the page cache on first touch and
are shared with every other process that maps the file (and with the next run: a warm load reads nothing); the
kernel may drop them under memory pressure and read them again instead of swapping.

The mapping is private (MAP_PRIVATE, Python's ACCESS_COPY): writable, so in-place tools (pruning, tests) work on
a copy-on-write page and never write to the file, while pages that are only read stay shared page cache.

Each mapping is one uint8 tensor (`map_file`); the weights are views of it (`view`), so the mapping lives as long
as any weight taken from it. Huge pages (model/hugepages.py) leave these storages alone: copying them into the
arena would turn shared, reclaimable page cache back into private anonymous memory, which is what mapping saves.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import struct
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import torch

_MADV_DONTNEED = 4

# safetensors dtype names -> torch dtypes (the ones brisk checkpoints and HF folders hold)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def map_file(path: str | Path) -> torch.Tensor:
    """The whole file as a uint8 tensor over a private, read-mostly memory map (nothing is read yet)."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            return torch.empty(0, dtype=torch.uint8)
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(buf, dtype=torch.uint8)  # holds `buf`: the mapping lives while any view does


def view(base: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """`shape` elements of `dtype` at byte `offset` of a mapping, without copying; None if the offset is not a
    multiple of the element size (kernels assume aligned rows; the caller copies instead)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    if offset % itemsize or offset + numel * itemsize > base.numel():
        return None
    return base[offset:offset + numel * itemsize].view(dtype).view(shape)


def drop_pages(t: torch.Tensor) -> None:
    """Unmap the whole pages of a mapping's view `t` from this process (madvise MADV_DONTNEED): pages read through
    a map count in its resident set while mapped; the page cache keeps them for the next reader. A page that was
    written (copy-on-write) reverts to the file's bytes: call it on pages that were only read."""
    if t.numel() == 0 or not sys.platform.startswith("linux"):
        return
    begin, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages
    if last > first:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def drop_unused_pages(base: torch.Tensor, live: Iterable[torch.Tensor]) -> int:
    """Unmap every whole page of mapping `base` that none of the `live` tensors lies on (`drop_pages` on the
    gaps between them); returns the bytes of the gaps. A load reads a quantized folder's codes, scales and zero
    points through the map into the kernels' repacked layout: those source pages were resident, and stayed so
    while the map lived (the embedding and the norms, views of it, keep it alive). A dropped page that is read
    again later faults back in from the file: only pages that were written and then abandoned lose anything."""
    if base.numel() == 0 or not sys.platform.startswith("linux"):
        return 0
    storage, begin = base.untyped_storage().data_ptr(), base.data_ptr()
    end = begin + base.numel()
    spans = []
    for t in live:
        if t.device.type != "cpu" or t.layout != torch.strided or t.untyped_storage().data_ptr() != storage:
            continue
        if t.numel() == 0:
            continue
        steps = [(n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)]
        size = t.element_size()
        spans.append((t.data_ptr() + size * sum(s for s in steps if s < 0),
                      t.data_ptr() + size * (sum(s for s in steps if s > 0) + 1)))
    spans.sort()
    dropped, at = 0, begin
    for lo, hi in [*spans, (end, end)]:
        if lo > at:
            drop_pages(base[at - begin:lo - begin])
            dropped += lo - at
        at = max(at, hi)
    return dropped


def read_tensor(f: BinaryIO, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """`shape` elements of `dtype` at byte `offset` of the open file, read with read(2) (not through a map: pages
    read through a map count in the process's RSS while it is mapped, the page cache that read(2) fills does not)
    into `out` (contiguous, of that dtype and shape) or a new tensor."""
    t = torch.empty(shape, dtype=dtype) if out is None else out
    assert t.is_contiguous() and t.dtype == dtype and tuple(t.shape) == tuple(shape), "read_tensor: bad `out`"
    f.seek(offset)
    dest = memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    if f.readinto(dest) != len(dest):
        raise EOFError(f"{getattr(f, 'name', 'file')}: {len(dest)} bytes at {offset} run past the end")
    return t


def safetensors_layout(path: str | Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """name -> (dtype, shape, absolute byte offset) from a safetensors header, for the dtypes torch maps; call it
    after safe_open has accepted the file (it checks the header against the file's size)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = {}
    for name, entry in header.items():
        if name == "__metadata__" or entry.get("dtype") not in SAFETENSORS_DTYPES:
            continue
        out[name] = (SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + n + entry["data_offsets"][0])
    return out


def storage_ptrs(tensors: list[torch.Tensor]) -> set[int]:
    """The storages of the given mappings (for to_huge_pages' `skip`)."""
    return {t.untyped_storage().data_ptr() for t in tensors}
