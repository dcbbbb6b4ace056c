"""brisk's C++ CPU kernels (every ops/csrc/*.cpp), compiled with torch.utils.cpp_extension on first use.

Nothing is built when `brisk` is imported: the first call that could use a kernel calls `get_ops()`, which
compiles each source file as its own small extension (in parallel, about 15-25 s each on 2 cores; logged),
caches the shared libraries under `$TORCH_EXTENSIONS_DIR` or `~/.cache/brisk/ext`, and loads them into
`torch.ops.brisk`. Later processes reuse the cached builds in well under a second; torch rebuilds a library
when its source changes. One file per extension, so a kernel that fails to build costs only its own ops.

Two instruction-set tiers (`kernel_isa()`): "avx2" (AVX2 + FMA + F16C), and on CPUs with AVX-512 F/BW/VL/DQ, VNNI
and BF16 (AMD Zen 4/5, Intel Sapphire Rapids) "avx512": the same sources with those flags, where linear_small uses
vdpbf16ps for bfloat16, quant_q8 vpdpbusd for its int8 dot products, the sparse kernels vexpandps and (with VBMI2,
where the CPU has it) vpexpandb, and the GEMV loops prefetch further ahead. The tier is part of the build's name.

Every kernel has a pure-PyTorch reference path next to it, taken when
- its build failed (no compiler, no ninja, a header mismatch): one warning line per source, brisk carries on;
- `BRISK_DISABLE_KERNELS=1` is set (read on every call, so tests can flip it);
- the tensors are not on the CPU, or a dtype / shape the kernel does not cover.
Callers ask for an op by name (`get_op`), so a missing one is just "use the reference path".
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_lock = threading.Lock()
_state: dict[str, Any] = {"tried": False, "ops": None}


def kernels_disabled() -> bool:
    """True when BRISK_DISABLE_KERNELS asks for the pure-PyTorch paths."""
    return os.environ.get("BRISK_DISABLE_KERNELS", "") not in ("", "0")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split()[2:])
    except OSError:
        return frozenset()


# what the avx512 tier compiles for: 512-bit float (F), byte/word (BW) and 256-bit EVEX (VL) forms, int8 dot
# products (VNNI: vpdpbusd) and bfloat16 dot products (BF16: vdpbf16ps), as on AMD Zen 4/5 and Intel Sapphire
# Rapids; and where the CPU has it, byte expansion (VBMI2: vpexpandb, the sparse int8 kernel's AVX-512 path;
# without it, as on Cooper Lake, that kernel keeps its AVX2 loop and the build is tagged avx512nv)
_AVX512_FLAGS = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl",
                 "avx512dq": "-mavx512dq", "avx512_vnni": "-mavx512vnni", "avx512_bf16": "-mavx512bf16"}
_AVX512_OPTIONAL = {"avx512_vbmi2": "-mavx512vbmi2"}
_AVX2_FLAGS = ["-mavx2", "-mfma", "-mf16c"]


def _isa_flags() -> tuple[str, list[str]]:
    """(tag, compiler flags) of the kernels' build for this CPU: "avx512" (the AVX2 code plus 512-bit, VNNI and
    BF16 paths) where the CPU has every flag of _AVX512_FLAGS, "avx2" where torch runs AVX2 or better, else
    "generic" (no kernels). BRISK_KERNEL_ISA=avx2 asks for the AVX2 build on an AVX-512 CPU (tests and A/B runs).
    Explicit ISA flags rather than -march=native, so a build cached on a shared home directory by a newer CPU
    cannot crash an older one: the tag is part of the build directory's name."""
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    if not capability.startswith("AVX"):
        return "generic", []
    wanted = os.environ.get("BRISK_KERNEL_ISA", "").strip().lower()
    if wanted not in ("", "avx2", "avx512"):
        raise ValueError(f"BRISK_KERNEL_ISA={wanted!r}: use avx2 or avx512 (or leave it unset for the best this "
                         "CPU has)")
    if wanted != "avx2" and capability == "AVX512" and set(_AVX512_FLAGS) <= cpu_flags():
        if set(_AVX512_OPTIONAL) <= cpu_flags():
            return "avx512", _AVX2_FLAGS + list(_AVX512_FLAGS.values()) + list(_AVX512_OPTIONAL.values())
        return "avx512nv", _AVX2_FLAGS + list(_AVX512_FLAGS.values())
    return "avx2", list(_AVX2_FLAGS)


def kernel_isa() -> str:
    """The instruction-set tier brisk's kernels are built for on this machine: avx512, avx2 or generic."""
    tag = _isa_flags()[0]
    return "avx512" if tag.startswith("avx512") else tag


def build_directory(name: str, source: Path | None = None) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "brisk" / "ext"
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    folder = f"{name}-{py}-torch{torch.__version__.replace('+', '_')}"
    if source is not None:
        # The build files record the source's path and torch versions builds by content: two checkouts (or
        # two versions of a kernel) sharing one folder would rebuild each other's library on every switch.
        # the shared headers (csrc/*.h) are part of every build
        headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
        key = hashlib.sha256(str(source.resolve()).encode() + source.read_bytes() + headers).hexdigest()[:12]
        folder += f"-{key}"
    return base / folder


def _build(source: Path) -> None:
    """Compile (or load the cached build of) one source file; its TORCH_LIBRARY_FRAGMENT registers its ops."""
    from torch.utils import cpp_extension

    tag, isa = _isa_flags()
    name = f"brisk_{source.stem}_{tag}"
    directory = build_directory(name, source)
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / f"{name}.so"
    before = library.stat().st_mtime if library.exists() else None
    t0 = time.perf_counter()
    # -fopenmp: at::parallel_for is a header template that only runs in parallel when compiled with OpenMP;
    # the runtime it links (libgomp.so.1) is the one torch already loaded.
    cpp_extension.load(name=name, sources=[str(source)], extra_cflags=["-O3", "-fopenmp", *isa],
                       extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False,
                       verbose=False)
    elapsed = time.perf_counter() - t0
    if before is None or library.stat().st_mtime != before:
        logger.warning("brisk: compiled C++ kernels %s (%s) in %.1f s, cached in %s", source.name, tag, elapsed,
                       directory)
    else:
        logger.info("brisk: loaded cached C++ kernels %s (%s) in %.2f s", source.name, tag, elapsed)


def _try_build(source: Path) -> bool:
    try:
        _build(source)
        return True
    # a failed build must never take the engine down: any error here means "use the reference path"
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        logger.warning("brisk: C++ kernels %s unavailable (%s: %s); using the PyTorch reference path",
                       source.name, type(e).__name__, first)
        return False


def get_ops() -> Any | None:
    """`torch.ops.brisk` once the kernels are built and loaded, or None (disabled, or nothing built)."""
    if kernels_disabled():
        return None
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                sources = list(_SOURCES)
                with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
                    built = list(pool.map(_try_build, sources))
                _state["ops"] = torch.ops.brisk if any(built) else None
                _state["tried"] = True
    return _state["ops"]


def get_op(name: str) -> Callable[..., Any] | None:
    """The kernel `torch.ops.brisk.<name>`, or None when the reference path must be used."""
    ops = get_ops()
    return getattr(ops, name, None) if ops is not None else None
