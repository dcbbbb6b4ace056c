"""A GGUF file's weights as brisk runs them, cached on disk: the next load maps them instead of converting.

llama.cpp starts a model by mapping its file: nothing is read until the first token. brisk cannot map what it
converts at load: a quantized matrix repacked into the tiled kernels' layout (model/gguf_place.py), an F16 matrix
run in bfloat16, q/k/v and gate/up fused into one buffer. At the 3B and 8B shapes that conversion is most of the
load (a 3.4 GB Q8_0 file: about 1 of 1.9 s, against llama.cpp's 0.5 s). So the first load of a file writes what it
converted to the cache, once, and every later load of the same file with the same settings maps it back:

    <cache>/<key>.bin    every converted buffer's bytes, each at a 4 KiB-aligned offset
    <cache>/<key>.json   where each tensor lies (in the .bin, or in the GGUF file itself for the tensors that were
                         views of it already), with the packed weights' fields and the load's other outputs

The key hashes the file's identity (path, size, modification time, inode), the load's settings (dtype, fusion,
own precision), the kernels that decide the layout (tiled or not, the CPU's ISA tier) and the source of every
module that shapes the converted bytes, so an edited file, another CPU or a changed repack never meets a stale
entry. The .json is written last, after the .bin is complete under its final name: an entry without one is not
there. A hit is checked against the .bin's size; a damaged or unreadable entry is deleted and the load converts
again.

The mapping is private (copy-on-write, as model/mapped.py maps a GGUF file): a tool that writes weights in place
never writes the cache. Its pages are page cache: shared between processes that load the same model, read from
disk only when memory is short, and not on 2 MiB pages (the measured batch-1 decode is in BENCHMARKS.md).

Settings (environment): BRISK_WEIGHTS_CACHE = 0 turns it off, or names the folder (default
$XDG_CACHE_HOME/brisk/weights, i.e. ~/.cache/brisk/weights); BRISK_WEIGHTS_CACHE_MIN_MB (default 256): loads that
convert less than this are not cached (the default model loads in well under a second); BRISK_WEIGHTS_CACHE_MAX_GB
(default 32): the least recently used entries are deleted beyond it. An entry is not written when the disk would
keep less than 1 GiB free. `brisk cache info` lists the entries, `brisk cache clear` deletes them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from brisk.model import mapped
from brisk.ops.qlinear import PackedWeight

log = logging.getLogger(__name__)

FORMAT = 1
_ALIGN = 4096
_FREE_MARGIN = 1 << 30
# the modules whose code decides the converted bytes: an edit to any of them makes every entry a miss
_LAYOUT_SOURCES = ("model/gguf.py", "model/gguf_place.py", "model/gguf_repack.py", "model/gguf_dequant.py",
                   "model/gguf_kquants.py", "model/fuse.py", "model/moe.py", "ops/qlinear.py", "ops/csrc/repack.cpp",
                   "ops/csrc/fused_ops.cpp", "model/weights_cache.py")


@dataclass
class Settings:
    folder: Path | None  # None: off
    min_bytes: int = 256 << 20
    max_bytes: int = 32 << 30

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ) if env is None else env
        value = env.get("BRISK_WEIGHTS_CACHE", "").strip()
        if value.lower() in ("0", "off", "false", "no"):
            folder = None
        elif value and value.lower() not in ("1", "on", "true", "yes"):
            folder = Path(value).expanduser()
        else:
            folder = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "brisk" / "weights"
        return cls(folder, _number(env, "BRISK_WEIGHTS_CACHE_MIN_MB", 256, 1 << 20),
                   _number(env, "BRISK_WEIGHTS_CACHE_MAX_GB", 32, 1 << 30))


def _number(env: dict[str, str], name: str, default: float, unit: int) -> int:
    text = env.get(name, "").strip()
    try:
        value = float(text) if text else default
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None
    if value < 0:
        raise ValueError(f"{name}={text!r} must be >= 0")
    return int(value * unit)


@dataclass
class Cached:
    """What a load of the GGUF file gave (model/gguf.py `load_gguf`'s converted outputs), read back from an entry."""

    tensors: dict[str, torch.Tensor]
    packed: dict[str, PackedWeight]
    packed_types: dict[str, str]
    mapped: list[torch.Tensor] = field(default_factory=list)  # the maps the tensors view (the .bin, the GGUF file)


def key(path: Path, options: dict[str, Any]) -> str:
    """The entry's name for this file and these load settings (see the module docstring)."""
    from brisk.ops.kernels import get_op

    st = path.stat()
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    identity = {"format": FORMAT, "path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "inode": st.st_ino, "options": options, "torch": torch.__version__,
                "tiled": get_op("quant_linear_q8t") is not None, "repack": get_op("gguf_repack") is not None,
                "tier": _tier_name()}
    h.update(json.dumps(identity, sort_keys=True, default=str).encode())
    for rel in _LAYOUT_SOURCES:
        try:
            h.update((root / rel).read_bytes())
        except OSError:
            h.update(rel.encode())
    return h.hexdigest()[:32]


def _tier_name() -> str:
    from brisk.ops import kernels

    return kernels.kernel_tier().name


def lookup(settings: Settings, path: Path, options: dict[str, Any], name: str | None = None) -> Cached | None:
    """The entry for this file and these settings (`name`: their `key`, computed here if not given) mapped back, or
    None (no entry, off, damaged: then deleted)."""
    if settings.folder is None:
        return None
    name = name or key(path, options)
    meta_path, bin_path = settings.folder / f"{name}.json", settings.folder / f"{name}.bin"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT or bin_path.stat().st_size != meta["bin_bytes"]:
            raise ValueError("size or format differs from its record")
        base = mapped.map_file(bin_path) if meta["bin_bytes"] else torch.empty(0, dtype=torch.uint8)
        source = mapped.map_file(path) if meta["uses_source"] else None

        def tensor(spec: dict[str, Any]) -> torch.Tensor:
            return _from_spec(spec, base, source)

        tensors = {n: tensor(s) for n, s in meta["tensors"].items()}
        packed = {}
        for n, fields in meta["packed"].items():
            values = {k: (tensor(v) if isinstance(v, dict) else v) for k, v in fields.items()}
            packed[n] = PackedWeight(**values)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        log.warning("weights cache entry %s is damaged (%s): deleted; this load converts the file again", name, e)
        _remove(meta_path, bin_path)
        return None
    now = time.time()
    os.utime(meta_path, (now, now))  # last used: eviction keeps the recently used entries
    maps = [base] + ([source] if source is not None else [])
    return Cached(tensors, packed, dict(meta["packed_types"]), maps)


def store(settings: Settings, path: Path, options: dict[str, Any], tensors: dict[str, torch.Tensor],
          packed: dict[str, PackedWeight], packed_types: dict[str, str], source: torch.Tensor | None,
          name: str | None = None) -> bool:
    """Write an entry for this load's outputs (`source`: the GGUF file's map, which some tensors may view: those
    are recorded as views of it, not copied). Returns whether an entry was written; never fails the load."""
    if settings.folder is None:
        return False
    src_ptr = source.untyped_storage().data_ptr() if source is not None and source.numel() else None
    every = list(tensors.values()) + [t for pw in packed.values() for t in _packed_tensors(pw)]
    try:
        spans = _spans(t for t in every if t.untyped_storage().data_ptr() != src_ptr)
    except ValueError as e:
        log.warning("%s", e)
        return False
    total = sum(hi - lo for _, lo, hi in spans.values())
    if total < settings.min_bytes:
        return False
    name = name or key(path, options)
    folder = settings.folder
    meta_path, bin_path = folder / f"{name}.json", folder / f"{name}.bin"
    unique = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"  # (pid first: `evict` tells a dead writer's leftovers by it)
    tmp = folder / f"{name}.{unique}.partial"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if shutil.disk_usage(folder).free < total + _FREE_MARGIN:
            log.warning("weights cache: not written (%.1f GB needed, the disk in %s keeps less than 1 GiB free "
                        "after it)", total / 1e9, folder)
            return False
        offsets, at = {}, 0
        with open(tmp, "wb") as f:
            for ptr, (storage, lo, hi) in spans.items():
                offsets[ptr] = at - lo  # a tensor's byte in the .bin = its byte in its storage + this
                region = torch.empty(0, dtype=torch.uint8).set_(storage, lo, (hi - lo,))
                f.write(memoryview(region.numpy()))
                at += hi - lo
                pad = -at % _ALIGN
                f.write(b"\0" * pad)
                at += pad

        def spec(t: torch.Tensor) -> dict[str, Any]:
            ptr = t.untyped_storage().data_ptr()
            where = "source" if ptr == src_ptr else "bin"
            byte = t.storage_offset() * t.element_size() + (0 if where == "source" else offsets[ptr])
            return {"in": where, "byte": byte, "shape": list(t.shape), "stride": list(t.stride()),
                    "dtype": str(t.dtype).removeprefix("torch.")}

        st = path.stat()
        meta = {"format": FORMAT, "file": str(path.resolve()), "file_size": st.st_size,
                "file_mtime_ns": st.st_mtime_ns, "written": time.strftime("%Y-%m-%d %H:%M:%S"),
                "options": options, "bin_bytes": at, "uses_source": False,
                "tensors": {n: spec(t) for n, t in tensors.items()}, "packed": {}, "packed_types": packed_types}
        for n, pw in packed.items():
            meta["packed"][n] = {f.name: (spec(v) if isinstance(v, torch.Tensor) else v)
                                 for f in dataclasses.fields(pw) for v in [getattr(pw, f.name)]}
        meta["uses_source"] = src_ptr is not None and any(
            t.untyped_storage().data_ptr() == src_ptr for t in every)
        tmp.replace(bin_path)
        text = json.dumps(meta)
        part = folder / f"{name}.{unique}.json.partial"
        part.write_text(text)
        part.replace(meta_path)
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("weights cache: not written to %s (%s)", folder, e)
        _remove(tmp, bin_path)
        return False
    evict(settings, keep=name)
    return True


def _packed_tensors(pw: PackedWeight) -> list[torch.Tensor]:
    return [v for f in dataclasses.fields(pw) if isinstance(v := getattr(pw, f.name), torch.Tensor)]


def _spans(tensors: Iterable[torch.Tensor]) -> dict[int, tuple[torch.UntypedStorage, int, int]]:
    """storage pointer -> (storage, first byte, end byte) that the given tensors cover in it (in first-seen order)."""
    out: dict[int, tuple[torch.UntypedStorage, int, int]] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.numel() == 0:
            raise ValueError(f"weights cache: cannot record a tensor of layout {t.layout} on {t.device}")
        if any(s < 0 for s in t.stride()):
            raise ValueError("weights cache: negative strides")
        storage = t.untyped_storage()
        lo = t.storage_offset() * t.element_size()
        hi = lo + _extent(t.shape, t.stride(), t.element_size())
        ptr = storage.data_ptr()
        if ptr in out:
            _, a, b = out[ptr]
            lo, hi = min(lo, a), max(hi, b)
        out[ptr] = (storage, lo, hi)
    return out


def _extent(shape: Iterable[int], stride: Iterable[int], itemsize: int) -> int:
    """Bytes from a strided tensor's first element to just past its last (non-negative strides, numel > 0)."""
    return (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * itemsize


def _from_spec(spec: dict[str, Any], base: torch.Tensor, source: torch.Tensor | None) -> torch.Tensor:
    dtype = getattr(torch, spec["dtype"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = base if spec["in"] == "bin" else source
    if buf is None or spec["byte"] % itemsize or buf.numel() % itemsize:
        raise ValueError(f"a tensor at byte {spec['byte']} of the {spec['in']} is not aligned to its {dtype}")
    shape, stride = spec["shape"], spec["stride"]
    end = spec["byte"] + _extent(shape, stride, itemsize)
    if end > buf.numel():
        raise ValueError(f"a tensor ends at byte {end}, past the {spec['in']}'s {buf.numel()}")
    return buf.view(dtype).as_strided(shape, stride, spec["byte"] // itemsize)


def _remove(*paths: Path) -> None:
    for p in paths:
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass


@dataclass
class Entry:
    name: str
    file: str
    bytes: int
    last_used: float
    written: str
    file_size: int | None = None
    file_mtime_ns: int | None = None

    def orphaned(self) -> bool:
        """Whether its GGUF file is gone or is no longer the file it was written from (its key cannot be met)."""
        try:
            st = Path(self.file).stat()
        except OSError:
            return True
        return (self.file_size, self.file_mtime_ns) != (st.st_size, st.st_mtime_ns)


def entries(settings: Settings) -> list[Entry]:
    """The complete entries in the cache folder, most recently used first."""
    if settings.folder is None or not settings.folder.is_dir():
        return []
    out = []
    for meta_path in settings.folder.glob("*.json"):
        name = meta_path.stem
        bin_path = meta_path.with_suffix(".bin")
        try:
            meta = json.loads(meta_path.read_text())
            out.append(Entry(name, meta.get("file", "?"), bin_path.stat().st_size, meta_path.stat().st_mtime,
                             meta.get("written", "?"), meta.get("file_size"), meta.get("file_mtime_ns")))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda e: -e.last_used)


def evict(settings: Settings, keep: str | None = None) -> list[str]:
    """Delete the entries of files that are gone or changed (a benchmark's temporary file, an edited model), the
    least recently used entries beyond `settings.max_bytes` (never `keep`), and the leftovers of writes that did
    not finish (a .partial whose process is gone, a .bin without its .json). Returns the names deleted."""
    if settings.folder is None or not settings.folder.is_dir():
        return []
    folder = settings.folder
    for part in folder.glob("*.partial"):
        pid = part.name.split(".")[1] if part.name.count(".") >= 2 else ""
        if not (pid.isdigit() and _alive(int(pid))):
            _remove(part)
    for bin_path in folder.glob("*.bin"):
        if not bin_path.with_suffix(".json").exists() and time.time() - bin_path.stat().st_mtime > 60:
            _remove(bin_path)
    gone, total = [], 0
    for e in entries(settings):
        total += e.bytes
        if e.name != keep and (e.orphaned() or total > settings.max_bytes):
            _remove(folder / f"{e.name}.json", folder / f"{e.name}.bin")
            gone.append(e.name)
            total -= e.bytes
    return gone


def clear(settings: Settings) -> int:
    """Delete every entry; returns the bytes freed."""
    freed = 0
    for e in entries(settings):
        freed += e.bytes
        assert settings.folder is not None
        _remove(settings.folder / f"{e.name}.json", settings.folder / f"{e.name}.bin")
    return freed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
