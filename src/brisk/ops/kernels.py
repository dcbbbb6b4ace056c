"""brisk's C++ CPU kernels (every ops/csrc/*.cpp), compiled with torch.utils.cpp_extension.

`make install` (or `brisk kernels build`) compiles every source for the installing CPU, in parallel over the cores,
so the first `brisk generate` loads cached libraries in well under a second. Nothing is built when `brisk` is
imported: the first call that could use a kernel calls `get_ops()`, which builds whatever is not cached yet (a
kernel source changed since: about 15 CPU seconds a file, logged) under `cache_dir` and loads every library into
`torch.ops.brisk`. One file per extension, so a kernel that fails to build costs only its own ops.

The build follows the running CPU (ops/isa.py): its tier ("avx512", "avx512nv", "avx2vnni", "avx2" or "generic") is
chosen from /proc/cpuinfo of this machine, and a build's folder is named after the tier and keyed by the exact
compiler flags, the source (path and content) and the shared headers, python and torch: a cache carried to a machine
of another CPU model never hands it a library built for flags it does not report.

Every kernel has a pure-PyTorch reference path next to it, taken when
- its build failed (no compiler, no ninja, a header mismatch): one warning line per source, brisk carries on;
- the kernels are switched off (`settings.enabled`: BRISK_DISABLE_KERNELS=1 at start-up, `configure(enabled=False)`
  or `with disabled():` in-process);
- the tensors are not on the CPU, or a dtype / shape the kernel does not cover.
Callers ask for an op by name (`get_op`), so a missing one is just "use the reference path".

AMX is not a tier: the AVX-512 builds carry an AMX-INT8 path for the W8A8 GEMM (ops/csrc/int8_gemm.cpp) in a
function of its own, switched on at run time (`w8a8_amx`) once the library is loaded, only where /proc/cpuinfo reports
amx_tile and amx_int8 and Linux grants the process the tile state, unless `settings.amx` is off (BRISK_DISABLE_AMX=1,
`configure(amx=False)`: every row count on the VNNI path, for A/B runs and tests). `amx_in_use()` says which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from brisk.ops.isa import ISA_CHOICES, Tier, cpu_flags, cpu_vendor, has_amx_int8, running_tier, vendor_cflags

__all__ = ["KernelSettings", "settings", "configure", "override", "disabled", "get_ops", "get_op", "kernel_isa",
           "kernel_tier", "cpu_flags", "build_all", "library_path", "kernel_sources", "amx_in_use",
           "amx_min_rows"]

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_lock = threading.RLock()  # build_all holds it, and get_ops around its call (one build per process)
_state: dict[str, Any] = {"tried": False, "ops": None, "amx": 0}


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """How brisk uses its kernels. Read once from the environment when this module is imported
    (`from_env`); change them in-process with `configure` / `override`, never through os.environ."""

    enabled: bool = True  # False: every op takes its PyTorch reference path (BRISK_DISABLE_KERNELS=1)
    isa: str | None = None  # "avx2" / "avx2vnni" caps the build's tier on a bigger CPU (BRISK_KERNEL_ISA)
    cache_dir: Path = Path.home() / ".cache" / "brisk" / "ext"  # TORCH_EXTENSIONS_DIR, or $XDG_CACHE_HOME/brisk/ext
    amx: bool = True  # False: the W8A8 GEMM stays on VNNI on an AMX CPU too (BRISK_DISABLE_AMX=1)

    def __post_init__(self) -> None:
        if self.isa is not None and self.isa not in ISA_CHOICES:
            raise ValueError(f"kernel isa {self.isa!r}: use {', '.join(ISA_CHOICES)} (or leave it unset for the "
                             "best this CPU has)")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> KernelSettings:
        isa = env.get("BRISK_KERNEL_ISA", "").strip().lower() or None
        if isa is not None and isa not in ISA_CHOICES:
            raise ValueError(f"BRISK_KERNEL_ISA={isa!r}: use {', '.join(ISA_CHOICES)} (or leave it unset for the "
                             "best this CPU has)")
        root = env.get("TORCH_EXTENSIONS_DIR")
        cache = Path(root) if root else Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "brisk" / "ext"
        return cls(enabled=env.get("BRISK_DISABLE_KERNELS", "") in ("", "0"), isa=isa, cache_dir=cache,
                   amx=env.get("BRISK_DISABLE_AMX", "") in ("", "0"))


settings = KernelSettings.from_env()  # the start-up read: the only place these environment variables are looked at


def configure(**changes: Any) -> KernelSettings:
    """Change the settings in-process (fields of KernelSettings); returns the previous ones. `enabled` and `amx`
    apply to the next call; `isa` and `cache_dir` to a build not made yet: a process builds and loads its kernels
    once (two tiers' libraries cannot both register the same ops in torch.ops.brisk)."""
    global settings
    previous = settings
    settings = dataclasses.replace(settings, **changes)
    if settings.amx != previous.amx:
        _apply_amx()
    return previous


BF16_GEMM_ROWS = 4  # linear_small_m's bfloat16 rows from which ATen's GEMM runs them on an AMX-BF16 CPU


def _apply_amx() -> None:
    """Tell the loaded W8A8 GEMM whether to use AMX: settings.amx, the CPU's flags, then the kernel's own request
    for the tile state (once per process)."""
    op = getattr(_state["ops"], "w8a8_amx", None) if _state["ops"] is not None else None
    _state["amx"] = int(op(settings.amx and has_amx_int8(cpu_flags()))) if op is not None else 0
    # bfloat16 x bfloat16 linears of 4+ rows to oneDNN's GEMM (AMX-BF16 tiles) instead of linear_small_m's loops
    bf16 = getattr(_state["ops"], "linear_small_bf16_gemm_rows", None) if _state["ops"] is not None else None
    if bf16 is not None:
        bf16(BF16_GEMM_ROWS if settings.amx and "amx_bf16" in cpu_flags() else 0)


def amx_min_rows() -> int:
    """The row count from which the W8A8 GEMM runs on AMX-INT8 tiles (prefill, batches), 0 when AMX is not in use
    (the CPU lacks it, the kernels are not loaded or are disabled, settings.amx is off)."""
    return int(_state["amx"]) if settings.enabled else 0


def amx_in_use() -> bool:
    """True when the W8A8 GEMM runs on AMX-INT8 tiles for its larger row counts."""
    return amx_min_rows() > 0


@contextlib.contextmanager
def override(**changes: Any) -> Iterator[KernelSettings]:
    """`configure(**changes)` for the duration of a `with` block, then the settings as they were."""
    previous = configure(**changes)
    try:
        yield settings
    finally:
        configure(**dataclasses.asdict(previous))


def disabled() -> contextlib.AbstractContextManager[KernelSettings]:
    """`with kernels.disabled():` every op on its PyTorch reference path for the block."""
    return override(enabled=False)


def kernels_disabled() -> bool:
    """True when the settings ask for the pure-PyTorch paths."""
    return not settings.enabled


def kernel_tier() -> Tier:
    """The tier (ops/isa.py) the kernels are built for in this process: the running CPU's, capped by settings.isa."""
    return running_tier(settings.isa)


def kernel_isa() -> str:
    """The instruction-set family brisk's kernels are built for here: avx512, avx2 (with or without AVX-VNNI) or
    generic."""
    name = kernel_tier().name
    return "avx512" if name.startswith("avx512") else "avx2" if name.startswith("avx2") else name


def _isa_flags() -> tuple[str, list[str]]:
    """(tier name, compiler flags) of this process's build."""
    tier = kernel_tier()
    return tier.name, list(tier.cflags)


# -fopenmp: at::parallel_for is a header template that only runs in parallel when compiled with OpenMP; the runtime
# it links (libgomp.so.1) is the one torch already loaded.
# The CPU's maker adds a define (isa.vendor_cflags), so a home directory shared by an AMD and an Intel machine keeps a
# build for each.
_CFLAGS = ("-O3", "-fopenmp", *vendor_cflags(cpu_vendor()))
_LDFLAGS = ("-fopenmp",)


def build_directory(name: str, source: Path | None = None, cflags: tuple[str, ...] = ()) -> Path:
    """The cache folder of one build. The build files record the source's path, and torch versions builds by
    content: two checkouts (or two versions of a kernel) sharing one folder would rebuild each other's library on
    every switch, hence the key. The shared headers (csrc/*.h) and the exact compiler flags are part of it too."""
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    folder = f"{name}-{py}-torch{torch.__version__.replace('+', '_')}"
    if source is not None:
        headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
        flags = " ".join(cflags).encode()
        key = hashlib.sha256(str(source.resolve()).encode() + source.read_bytes() + headers + b"\0" + flags)
        folder += f"-{key.hexdigest()[:12]}"
    return settings.cache_dir / folder


def library_path(source: Path, tier: Tier | None = None) -> Path:
    """Where the shared library of `source` built for `tier` (default: this process's) is cached."""
    tier = tier or kernel_tier()
    name = f"brisk_{source.stem}_{tier.name}"
    return build_directory(name, source, _CFLAGS + tier.cflags) / f"{name}.so"


@dataclasses.dataclass(frozen=True)
class BuildResult:
    """One source's build: `built` False when the cached library was loaded, `error` set when it failed."""

    source: str
    tier: str
    built: bool
    seconds: float
    error: str | None = None


STALE_LOCK_SECONDS = 20 * 60  # a build of one file takes seconds to a few minutes; a lock older than this is left over


def _clear_stale_lock(folder: Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Remove the build lock a killed build left behind (torch's FileBaton waits for it forever otherwise); a lock
    younger than `max_age` belongs to a build still running in another process and is left alone."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age:
        return False
    logger.warning("brisk: removing a stale kernel build lock (%.0f min old, left by a killed build): %s", age / 60,
                   lock)
    lock.unlink(missing_ok=True)
    return True


def _build(source: Path) -> BuildResult:
    """Compile (or load the cached build of) one source file; its TORCH_LIBRARY_FRAGMENT registers its ops."""
    from torch.utils import cpp_extension

    tier = kernel_tier()
    library = library_path(source, tier)
    library.parent.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(library.parent)
    before = library.stat().st_mtime if library.exists() else None
    t0 = time.perf_counter()
    cpp_extension.load(name=library.stem, sources=[str(source)], extra_cflags=[*_CFLAGS, *tier.cflags],
                       extra_ldflags=list(_LDFLAGS), build_directory=str(library.parent), is_python_module=False,
                       verbose=False)
    elapsed = time.perf_counter() - t0
    built = before is None or library.stat().st_mtime != before
    if built:
        logger.warning("brisk: compiled C++ kernels %s (%s) in %.1f s, cached in %s", source.name, tier.name,
                       elapsed, library.parent)
    else:
        logger.info("brisk: loaded cached C++ kernels %s (%s) in %.2f s", source.name, tier.name, elapsed)
    return BuildResult(source.name, tier.name, built, elapsed)


def _try_build(source: Path) -> BuildResult:
    t0 = time.perf_counter()
    try:
        return _build(source)
    # a failed build must never take the engine down: any error here means "use the reference path"
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        logger.warning("brisk: C++ kernels %s unavailable (%s: %s); using the PyTorch reference path",
                       source.name, type(e).__name__, first)
        return BuildResult(source.name, kernel_tier().name, False, time.perf_counter() - t0, f"{type(e).__name__}: "
                           f"{first}")


def build_all(jobs: int | None = None) -> list[BuildResult]:
    """Build (or load from the cache) every kernel source for this process's tier, `jobs` at a time (default: one
    per core; each build is one compiler process) and load them into torch.ops.brisk. What `get_ops` does on
    first use and `brisk kernels build` at install; safe to call again (the second time everything is cached)."""
    with _lock:
        sources = list(_SOURCES)
        workers = max(1, min(len(sources), jobs or os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(_try_build, sources))
        _state["ops"] = torch.ops.brisk if any(r.error is None for r in results) else None
        _state["tried"] = True
        _apply_amx()
    return results


def get_ops() -> Any | None:
    """`torch.ops.brisk` once the kernels are built and loaded, or None (disabled, or nothing built)."""
    if kernels_disabled():
        return None
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                build_all()
    return _state["ops"]


def get_op(name: str) -> Callable[..., Any] | None:
    """The kernel `torch.ops.brisk.<name>`, or None when the reference path must be used."""
    ops = get_ops()
    return getattr(ops, name, None) if ops is not None else None


def kernel_sources() -> list[Path]:
    """The kernel source files (ops/csrc/*.cpp), one extension library each."""
    return list(_SOURCES)
