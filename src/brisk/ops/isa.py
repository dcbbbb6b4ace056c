"""The instruction-set tiers brisk's C++ kernels are built for, and the choice of one from what the running CPU
reports.

A tier is a fixed set of compiler flags and the /proc/cpuinfo flags that every instruction those compiler flags
allow needs, including what a flag implies: GCC's -mavx2 also defines __SSE4_2__, __POPCNT__ and __XSAVE__, so the
avx2 tier requires popcnt, sse4_2 and xsave as well. The compiler never emits an instruction outside the enabled
extensions, so a CPU that reports every required flag runs every instruction of the tier's build. Linux clears
a flag in /proc/cpuinfo when the kernel does not enable its register state (XCR0), so these flags already mean
"usable by this process", except for AMX, whose tile data each process must request with arch_prctl
(ARCH_REQ_XCOMP_PERM).

AMX is therefore no tier and no tier's compiler flag enables it. The AVX-512 builds of the W8A8 GEMM
(ops/csrc/int8_gemm.cpp) hold one function compiled with `target("amx-tile,amx-int8")`, called only after a run-time
check: /proc/cpuinfo reports amx_tile and amx_int8 (`has_amx_int8`), the process was granted the tile state, and
the setting allows it (ops/kernels.py). tests/test_kernel_instructions.py decodes every build and fails on an AMX
instruction in any other function.

    tier      compiler flags (beyond x86-64)                      CPUs
    avx512    avx2 tier + AVX-512 F/BW/VL/DQ, VNNI, BF16, VBMI2   AMD Zen 4/5, Intel Sapphire/Emerald Rapids
    avx512nv  avx512 without VBMI2                                Intel Cooper Lake
    avx2vnni  avx2 tier + AVX-VNNI (VEX vpdpbusd)                 Intel Alder Lake and later desktops/laptops, Zen 5
    avx2      AVX2, FMA, F16C                                     Haswell and later, Zen 1-3, AVX2-only VMs
    generic   (no kernels: the PyTorch reference paths)           anything else

The tier is chosen per process from /proc/cpuinfo of the running CPU, never from a cached build: a home directory
(and its build cache) carried from one machine to another gets the tier, and the build, of the machine it runs on.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tier:
    """One build of the kernels: its name (part of the build's folder name), the compiler flags, and the
    /proc/cpuinfo flags a CPU must report to run it."""

    name: str
    cflags: tuple[str, ...]
    requires: frozenset[str]


# /proc/cpuinfo spells SSE3 "pni". -mavx2 implies (GCC 12) SSE3, SSSE3, SSE4.1/4.2 (with CRC32), POPCNT, AVX and
# XSAVE; -mfma and -mf16c are separate CPUID bits.
_AVX2 = Tier("avx2", ("-mavx2", "-mfma", "-mf16c"),
             frozenset({"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "xsave", "avx", "avx2", "fma", "f16c"}))
# 512-bit float (F), byte/word (BW), 256/128-bit EVEX forms (VL), dword/qword (DQ), int8 dot products (VNNI:
# vpdpbusd) and bfloat16 dot products (BF16: vdpbf16ps). The avx512 tier adds VBMI2 (vpexpandb, the sparse int8
# kernel's AVX-512 path) and VBMI (vpermb, the int8 table kernel of lut_linear.cpp): two CPUID bits of their own,
# which every CPU with VBMI2 (Ice Lake and later, Zen 4 and later) reports together.
_AVX512_NV = Tier("avx512nv", _AVX2.cflags + ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni",
                                              "-mavx512bf16"),
                  _AVX2.requires | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16"})
_AVX512 = Tier("avx512", _AVX512_NV.cflags + ("-mavx512vbmi2", "-mavx512vbmi"),
               _AVX512_NV.requires | {"avx512_vbmi2", "avx512vbmi"})
# AVX-VNNI: the VEX (256-bit) form of vpdpbusd, on CPUs that have no AVX-512 (Alder Lake and later client chips) and on
# some that do (Sapphire Rapids, Zen 5); a CPUID bit of its own, not implied by AVX-512 VNNI (Zen 4, Ice Lake lack
# it). The AVX2 kernels' int8 dot products take it where it is built (__AVXVNNI__) instead of vpmaddubsw + vpmaddwd.
_AVX2_VNNI = Tier("avx2vnni", _AVX2.cflags + ("-mavxvnni",), _AVX2.requires | {"avx_vnni"})
GENERIC = Tier("generic", (), frozenset())
AMX_INT8 = frozenset({"amx_tile", "amx_int8"})  # what the W8A8 GEMM's AMX path needs the CPU to report

# best first. The AVX-512 tiers do not contain avx2vnni (Zen 4 and Cooper Lake have no AVX-VNNI), so the order, not
# nesting, decides: a CPU gets the first tier whose every flag it reports.
TIERS: tuple[Tier, ...] = (_AVX512, _AVX512_NV, _AVX2_VNNI, _AVX2)
# what BRISK_KERNEL_ISA / kernels.configure(isa=...) may ask for: a cap, the named tier or one after it in TIERS
ISA_CHOICES = ("avx2", "avx2vnni", "avx512")


def cpuinfo_field(name: str) -> str:
    """The value of the first `name` line of /proc/cpuinfo (the first CPU's), stripped; empty where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            line = next((line for line in f if line.split(":", 1)[0].strip() == name), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The running CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return frozenset(cpuinfo_field("flags").split())


@functools.cache
def cpu_vendor() -> str:
    """The running CPU's vendor_id from /proc/cpuinfo (AuthenticAMD, GenuineIntel, ...; empty where there is none)."""
    return cpuinfo_field("vendor_id")


def vendor_cflags(vendor: str) -> tuple[str, ...]:
    """Compiler defines for the CPU's maker: BRISK_CPU_AMD selects the weight-stream prefetch that measured best on
    AMD (non-temporal, ops/csrc/quant_q8t.cpp); every other CPU gets the default (into L2)."""
    return ("-DBRISK_CPU_AMD",) if vendor == "AuthenticAMD" else ()


def has_amx_int8(flags: Iterable[str]) -> bool:
    """The CPU reports AMX tiles with int8 dot products (Intel Sapphire Rapids and later): the W8A8 GEMM's AMX path
    may be tried (it still needs the kernel's grant of the tile state, asked for by the kernel itself)."""
    return AMX_INT8 <= frozenset(flags)


def choose_tier(flags: Iterable[str], isa: str | None = None) -> Tier:
    """The best tier whose every required flag is in `flags` (a CPU's /proc/cpuinfo flags); `isa` caps it: "avx2"
    at the plain AVX2 build, "avx2vnni" at the AVX-VNNI one (tests and A/B runs on a bigger CPU). A request never
    raises the tier above the CPU's."""
    have = frozenset(flags)
    for tier in allowed_tiers(isa):
        if tier.requires <= have:
            return tier
    return GENERIC


def allowed_tiers(isa: str | None = None) -> tuple[Tier, ...]:
    """The tiers a cap `isa` leaves (all of them for None): the named one and those after it in TIERS."""
    if isa is None:
        return TIERS
    names = [t.name for t in TIERS]
    if isa not in names:
        raise ValueError(f"kernel isa {isa!r}: use {', '.join(ISA_CHOICES)}")
    return TIERS[names.index(isa):]


def running_tier(isa: str | None = None) -> Tier:
    """The tier for the CPU this process runs on. Where there is no /proc/cpuinfo (not Linux), torch's own CPU
    detection decides between avx2 and none: AVX-512 builds are only chosen from flags read here."""
    flags = cpu_flags()
    if not flags:
        return _AVX2 if torch.backends.cpu.get_cpu_capability().startswith("AVX") else GENERIC
    return choose_tier(flags, isa)


def explain(flags: Iterable[str], isa: str | None = None) -> list[str]:
    """One line per tier: chosen, or which required flags the CPU lacks (`brisk kernels info`)."""
    have, chosen = frozenset(flags), choose_tier(flags, isa)
    lines = []
    for tier in TIERS:
        missing = sorted(tier.requires - have)
        if tier == chosen:
            lines.append(f"{tier.name}: chosen (the CPU reports every flag it needs)")
        elif tier not in allowed_tiers(isa):
            lines.append(f"{tier.name}: skipped (isa={isa} caps the build)")
        else:
            lines.append(f"{tier.name}: " + (f"the CPU lacks {', '.join(missing)}" if missing else "available"))
    return lines
