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

On ARM64 (aarch64 Linux: Graviton, Ampere, Raspberry Pi; Apple Silicon) the tiers are NEON builds, chosen from the
`Features` line of /proc/cpuinfo, or on macOS from `sysctl hw.optional` (its FEAT_* names are mapped to the Linux
spellings, `macos_flags`). platform.machine() decides which family of tiers a process considers (`TIERS`); the
choice itself is a pure function of the flags and the family, so tests feed any CPU's flag set. GCC's -march=armv8.2-a
implies Armv8.1's LSE atomics, CRC32 and RDM (the compiler emits LSE atomics on its own), so the tiers built on it
require atomics, crc32 and asimdrdm too. No tier enables SVE or the FP16 arithmetic (fphp/asimdhp): the kernels
convert float16 with base NEON instructions.

    tier          compiler flags                              CPUs
    neon-i8mm     -march=armv8.2-a+dotprod+i8mm+bf16          Graviton3/4, Neoverse V1/V2/N2, Apple M2 and later
    neon-dotprod  -march=armv8.2-a+dotprod                    Graviton2, Ampere Altra, Cortex-A76 (Pi 5), Apple M1
    neon          -march=armv8-a+simd                         Cortex-A53/A72 (Raspberry Pi 3/4), any aarch64
    generic       (no kernels: the PyTorch reference paths)   anything else

The tier is chosen per process from /proc/cpuinfo of the running CPU, never from a cached build: a home directory
(and its build cache) carried from one machine to another gets the tier, and the build, of the machine it runs on.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


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
# ARM64. NEON (asimd) and the FP unit are part of every aarch64 Linux CPU, but a tier still checks them. Armv8.2-A
# is the oldest -march that takes +dotprod; GCC's armv8.2-a brings Armv8.1's LSE atomics (which it emits for
# std::atomic read-modify-writes), CRC32 and RDM. +dotprod: sdot/udot (vdotq_s32); +i8mm: smmla/usdot; +bf16:
# bfdot/bfmmla/bfcvt. Graviton3 reports i8mm and bf16 (and SVE, which no tier uses); Apple M1 has dotprod only.
_NEON = Tier("neon", ("-march=armv8-a+simd",), frozenset({"fp", "asimd"}))
_NEON_DOTPROD = Tier("neon-dotprod", ("-march=armv8.2-a+dotprod",),
                     _NEON.requires | {"atomics", "crc32", "asimdrdm", "asimddp"})
_NEON_I8MM = Tier("neon-i8mm", ("-march=armv8.2-a+dotprod+i8mm+bf16",), _NEON_DOTPROD.requires | {"i8mm", "bf16"})
GENERIC = Tier("generic", (), frozenset())
AMX_INT8 = frozenset({"amx_tile", "amx_int8"})  # what the W8A8 GEMM's AMX path needs the CPU to report

# best first. The AVX-512 tiers do not contain avx2vnni (Zen 4 and Cooper Lake have no AVX-VNNI), so the order, not
# nesting, decides: a CPU gets the first tier whose every flag it reports.
X86_TIERS: tuple[Tier, ...] = (_AVX512, _AVX512_NV, _AVX2_VNNI, _AVX2)
ARM64_TIERS: tuple[Tier, ...] = (_NEON_I8MM, _NEON_DOTPROD, _NEON)  # nested: each one's flags include the next's
# what BRISK_KERNEL_ISA / kernels.configure(isa=...) may ask for: a cap, the named tier or one after it
X86_ISA_CHOICES = ("avx2", "avx2vnni", "avx512")
ARM64_ISA_CHOICES = ("neon", "neon-dotprod", "neon-i8mm")


def is_arm64(machine: str | None = None) -> bool:
    """Whether `machine` (platform.machine() of this process by default) is 64-bit ARM: aarch64 (Linux) or arm64
    (macOS)."""
    return (platform.machine() if machine is None else machine).lower() in ("aarch64", "arm64")


def tiers_for(machine: str | None = None) -> tuple[Tier, ...]:
    """The tiers of `machine`'s family (this process's by default), best first."""
    return ARM64_TIERS if is_arm64(machine) else X86_TIERS


def isa_choices(machine: str | None = None) -> tuple[str, ...]:
    """The tier names a cap may name on `machine`'s family (this process's by default)."""
    return ARM64_ISA_CHOICES if is_arm64(machine) else X86_ISA_CHOICES


TIERS: tuple[Tier, ...] = tiers_for()  # this process's family
ISA_CHOICES: tuple[str, ...] = isa_choices()

# macOS names the CPU's features in sysctl hw.optional (FEAT_* since macOS 12, older spellings before): the Linux
# /proc/cpuinfo spelling of each, so one flag set decides on both systems
_SYSCTL_TO_CPUINFO = {
    "hw.optional.floatingpoint": ("fp",), "hw.optional.AdvSIMD": ("asimd",), "hw.optional.neon": ("asimd",),
    "hw.optional.arm.FEAT_DotProd": ("asimddp",), "hw.optional.arm.FEAT_I8MM": ("i8mm",),
    "hw.optional.arm.FEAT_BF16": ("bf16",), "hw.optional.arm.FEAT_LSE": ("atomics",),
    "hw.optional.armv8_1_atomics": ("atomics",), "hw.optional.arm.FEAT_CRC32": ("crc32",),
    "hw.optional.armv8_crc32": ("crc32",), "hw.optional.arm.FEAT_RDM": ("asimdrdm",),
    "hw.optional.arm.FEAT_FP16": ("fphp", "asimdhp"), "hw.optional.neon_fp16": ("fphp", "asimdhp"),
    "hw.optional.arm.FEAT_FHM": ("asimdfhm",), "hw.optional.armv8_2_fhm": ("asimdfhm",),
}


def macos_flags(sysctl: Mapping[str, str | int]) -> frozenset[str]:
    """The /proc/cpuinfo-style flags of a Mac's `sysctl hw.optional` values (name -> 0/1): those it reports as 1."""
    flags: set[str] = set()
    for name, value in sysctl.items():
        if str(value).strip() == "1":
            flags.update(_SYSCTL_TO_CPUINFO.get(name, ()))
    return frozenset(flags)


def _read_sysctl() -> dict[str, str]:
    """`sysctl hw.optional` of this Mac as name -> value; empty where there is no sysctl (or it fails)."""
    try:
        out = subprocess.run(["sysctl", "hw.optional"], capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


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
    """The running CPU's feature flags: /proc/cpuinfo's `flags` (x86) or `Features` (aarch64) line, on an ARM Mac
    `sysctl hw.optional` in those spellings; empty where there is neither."""
    flags = frozenset(cpuinfo_field("Features" if is_arm64() else "flags").split())
    if not flags and is_arm64() and platform.system() == "Darwin":
        flags = macos_flags(_read_sysctl())
    return flags


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


def choose_tier(flags: Iterable[str], isa: str | None = None, machine: str | None = None) -> Tier:
    """The best tier of `machine`'s family (this process's by default: platform.machine()) whose every required
    flag is in `flags` (a CPU's /proc/cpuinfo flags); `isa` caps it: "avx2" at the plain AVX2 build, "avx2vnni" at
    the AVX-VNNI one, "neon" / "neon-dotprod" on ARM64 (tests and A/B runs on a bigger CPU). A request never raises
    the tier above the CPU's."""
    have = frozenset(flags)
    for tier in allowed_tiers(isa, machine):
        if tier.requires <= have:
            return tier
    return GENERIC


def allowed_tiers(isa: str | None = None, machine: str | None = None) -> tuple[Tier, ...]:
    """The tiers of `machine`'s family a cap `isa` leaves (all of them for None): the named one and those after
    it."""
    tiers = tiers_for(machine)
    if isa is None:
        return tiers
    names = [t.name for t in tiers]
    if isa not in names:
        raise ValueError(f"kernel isa {isa!r}: use {', '.join(isa_choices(machine))}")
    return tiers[names.index(isa):]


@functools.cache  # a pure function of the (cached) flags and the cap: asked on every quantized linear's dispatch
def running_tier(isa: str | None = None) -> Tier:
    """The tier for the CPU this process runs on. Where no flags can be read (an x86 system without
    /proc/cpuinfo), torch's own CPU detection decides between avx2 and none: AVX-512 builds are only chosen from
    flags read here. An ARM64 CPU that reports nothing gets no kernels."""
    flags = cpu_flags()
    if not flags:
        if is_arm64():
            return GENERIC
        import torch  # here only: the CLI imports this module for its tier names, and torch takes seconds

        return _AVX2 if torch.backends.cpu.get_cpu_capability().startswith("AVX") else GENERIC
    return choose_tier(flags, isa)


def explain(flags: Iterable[str], isa: str | None = None, machine: str | None = None) -> list[str]:
    """One line per tier of `machine`'s family: chosen, or which required flags the CPU lacks (`brisk kernels
    info`)."""
    have, chosen = frozenset(flags), choose_tier(flags, isa, machine)
    lines = []
    for tier in tiers_for(machine):
        missing = sorted(tier.requires - have)
        if tier == chosen:
            lines.append(f"{tier.name}: chosen (the CPU reports every flag it needs)")
        elif tier not in allowed_tiers(isa, machine):
            lines.append(f"{tier.name}: skipped (isa={isa} caps the build)")
        else:
            lines.append(f"{tier.name}: " + (f"the CPU lacks {', '.join(missing)}" if missing else "available"))
    return lines
