"""brisk's C++ CPU kernels (every ops/csrc/*.cpp), compiled with torch.utils.cpp_extension.

`make install` (or `brisk kernels build`) compiles every source for the installing CPU, in parallel over the cores,
so the first `brisk generate` loads cached libraries in well under a second. Nothing is built when `brisk` is
imported: the first call that could use a kernel calls `get_ops()`, which builds whatever is not cached yet (a
kernel source changed since: about 15 CPU seconds a file, logged) under `cache_dir` and loads every library into
`torch.ops.brisk`. One file per extension, so a kernel that fails to build costs only its own ops.

The build follows the running CPU (ops/isa.py): its tier ("avx512", "avx512nv", "avx2vnni", "avx2"; on ARM64
"neon-i8mm", "neon-dotprod", "neon"; or "generic") is chosen from /proc/cpuinfo of this machine, and a build's folder
is named after the tier and keyed by the exact compiler flags, the source's content and the shared headers, the
compiler, python, torch and its include folders (`build_directory`): a cache carried to a machine of another CPU model
never hands it a library built for flags it does not report, and two environments, paths or shells never evict each
other's builds. A folder's library, once built, is loaded without running ninja again; a build runs under an flock of
its folder (a killed build leaves no lock behind) with brisk's own ninja (`ninja_dir`).

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
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
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
    isa: str | None = None  # "avx2" / "avx2vnni" ("neon" / "neon-dotprod") caps the tier on a bigger CPU
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
        bf16(bf16_gemm_rows())


def bf16_gemm_rows() -> int:
    """The row count from which linear_small_m hands bfloat16 x bfloat16 linears to oneDNN's GEMM: BF16_GEMM_ROWS
    on an AMX-BF16 CPU with the AVX-512 kernels and settings.amx on, else 0 (never). A CPU whose kernels are capped
    at an AVX2 tier answers as an AVX2 CPU, whose bfloat16 GEMM is emulated (8 rows at 1/4 the small-M kernel's
    speed, forced on the Xeon)."""
    native = "amx_bf16" in cpu_flags() and kernel_isa() == "avx512"
    return BF16_GEMM_ROWS if settings.amx and native else 0


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
    """The instruction-set family brisk's kernels are built for here: avx512, avx2 (with or without AVX-VNNI), neon
    (ARM64, with or without dotprod / i8mm) or generic."""
    name = kernel_tier().name
    for family in ("avx512", "avx2", "neon"):
        if name.startswith(family):
            return family
    return name


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


@functools.cache
def toolchain_key() -> bytes:
    """What the build command depends on beyond the source and the flags: the compiler (torch's choice, $CXX or
    c++: its resolved path and its --version), python, torch and the include folders torch passes (resolved, so a
    second path to the same environment, a symlink, names the same build)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    found = shutil.which(compiler)
    try:
        version = subprocess.run([found or compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        version = []
    includes = [str(Path(p).resolve()) for p in cpp_extension.include_paths()]
    parts = [str(Path(found).resolve()) if found else compiler, *version, sys.version, torch.__version__, *includes]
    return "\0".join(parts).encode()


def build_directory(name: str, source: Path | None = None, cflags: tuple[str, ...] = ()) -> Path:
    """The cache folder of one build, keyed by everything that changes what is built: the source's content (not its
    path: two checkouts, or two paths to one, share a build), the shared headers (csrc/*.h), the exact compiler flags
    and the toolchain (toolchain_key). A library in its folder is loaded as it is, without running ninja again
    (`_build`), so nothing the key leaves out can make a build start over (another ninja's log format, another
    shell's PATH); a changed kernel, flag or compiler gets a folder of its own, built once."""
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    folder = f"{name}-{py}-torch{torch.__version__.replace('+', '_')}"
    if source is not None:
        headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
        flags = " ".join(cflags).encode()
        key = hashlib.sha256(source.read_bytes() + headers + b"\0" + flags + b"\0" + toolchain_key())
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


BUILT_STAMP = "built"  # written after a build succeeded: a library without it (a killed link) is not trusted
LOCK_NAME = "brisk-build.lock"  # flock'ed while a process builds in the folder; holds the builder's pid
_waited: set[str] = set()  # the waits this process has announced (one line, not one a kernel file)


@contextlib.contextmanager
def build_lock(folder: Path, what: str) -> Iterator[None]:
    """An exclusive lock on one build folder for as long as this process builds in it: an flock, which the kernel
    releases when its holder dies however it dies, so a build killed by Ctrl-C or kill -9 never leaves a lock that
    makes the next command wait. A process that finds the lock held by a live build says so (once) and waits."""
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            if "wait" not in _waited:
                _waited.add("wait")
                logger.warning("brisk: another process (pid %s) is compiling the C++ kernels (%s); waiting for it",
                               holder, what)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the flock


def ninja_dir() -> str | None:
    """The folder of the ninja every build runs: the one installed with brisk (the `ninja` package, in this
    environment), else the first on PATH. One ninja for every build, whatever PATH a shell has: two versions write
    build logs the other rejects ("build log version is too old; starting over") and rebuild everything."""
    try:
        import ninja  # the PyPI package brisk depends on

        return str(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        found = shutil.which("ninja")
        return str(Path(found).parent) if found else None


@contextlib.contextmanager
def _ninja_first_on_path() -> Iterator[None]:
    """torch.utils.cpp_extension runs `ninja` by name: put brisk's ninja first on PATH while builds run."""
    folder, before = ninja_dir(), os.environ.get("PATH", "")
    if folder is None:
        yield
        return
    os.environ["PATH"] = folder + os.pathsep + before
    try:
        yield
    finally:
        os.environ["PATH"] = before


def _load_cached(library: Path) -> bool:
    """Load a library built before (its stamp written after a complete build); False when there is none or it
    does not load (a build killed mid-link, a file damaged since): the caller then builds it again."""
    if not (library.exists() and (library.parent / BUILT_STAMP).exists()):
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError as e:
        logger.warning("brisk: the cached kernel library %s does not load (%s); building it again", library.name, e)
        (library.parent / BUILT_STAMP).unlink(missing_ok=True)
        return False
    return True


def _build(source: Path) -> BuildResult:
    """Load the cached build of one source, or compile it (under the folder's build lock); its
    TORCH_LIBRARY_FRAGMENT registers its ops."""
    from torch.utils import cpp_extension

    tier = kernel_tier()
    library = library_path(source, tier)
    folder = library.parent
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    built = False
    if not _load_cached(library):
        with build_lock(folder, source.name):
            if not _load_cached(library):  # else: another process built it while this one waited
                # torch's own lock file, left by a build that was killed: no build is running (this process holds
                # the folder's flock), so it would only make cpp_extension wait forever
                (folder / "lock").unlink(missing_ok=True)
                (folder / BUILT_STAMP).unlink(missing_ok=True)
                cpp_extension.load(name=library.stem, sources=[str(source)], extra_cflags=[*_CFLAGS, *tier.cflags],
                                   extra_ldflags=list(_LDFLAGS), build_directory=str(folder), is_python_module=False,
                                   verbose=False)
                (folder / BUILT_STAMP).write_text(f"{source.name} {tier.name}\n")
                built = True
    elapsed = time.perf_counter() - t0
    if built:
        logger.warning("brisk: compiled C++ kernels %s (%s) in %.1f s, cached in %s", source.name, tier.name,
                       elapsed, folder)
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
        with _ninja_first_on_path(), ThreadPoolExecutor(max_workers=workers) as pool:
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
