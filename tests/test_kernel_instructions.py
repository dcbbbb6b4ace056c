"""Every compiled kernel tier uses only instructions its CPUID check covers.

Two checks per tier (this CPU's, and avx2, the tier of AVX2-only machines):
- the compiler: every macro its flags define (what a flag implies included: -mavx2 brings __POPCNT__, __XSAVE__)
  names an extension the tier requires the CPU to report;
- the libraries: the executable sections of every built .so, decoded with iced-x86, name no CPUID feature outside
  the tier's required flags and the x86-64 baseline. VP2INTERSECT or an extension a flag implies silently would
  show up here as a feature no CPU check covers.
- AMX: no tier requires it. Its instructions may appear in one function only, int8_gemm.cpp's `amx_items` (compiled
  with target("amx-tile,amx-int8") and called only after the run-time check: /proc/cpuinfo's amx_tile and amx_int8,
  the kernel's arch_prctl grant of the tile state, settings.amx); an AMX instruction in any other function fails.
Builds are the cached ones (each source built at most once per tier, shared with the rest of the suite).
"""

from __future__ import annotations

import bisect
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from brisk.ops import isa, kernels

iced_x86 = pytest.importorskip("iced_x86")
elffile = pytest.importorskip("elftools.elf.elffile")

if platform.machine() not in ("x86_64", "AMD64"):
    pytest.skip("x86 tiers only", allow_module_level=True)

# CPUID features every x86-64 CPU has (iced's names): the baseline any build may use. CET_IBT is endbr64, a NOP
# on CPUs without CET; MULTIBYTENOP the long NOPs compilers pad with.
BASELINE = {"INTEL8086", "INTEL186", "INTEL286", "INTEL386", "INTEL486", "X64", "CMOV", "CX8", "FPU", "SSE", "SSE2",
            "FXSR", "MULTIBYTENOP", "CET_IBT", "PAUSE"}
# iced CPUID feature -> /proc/cpuinfo flag (unlisted features map to their own lower-case name, which no tier
# requires: they fail the check with that name)
ICED_TO_CPUINFO = {"SSE3": "pni", "SSSE3": "ssse3", "SSE4_1": "sse4_1", "SSE4_2": "sse4_2", "POPCNT": "popcnt",
                   "XSAVE": "xsave", "AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c",
                   "AVX512F": "avx512f", "AVX512BW": "avx512bw", "AVX512VL": "avx512vl", "AVX512DQ": "avx512dq",
                   "AVX512CD": "avx512cd", "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16",
                   "AVX512_VBMI": "avx512vbmi", "AVX512_VBMI2": "avx512_vbmi2", "AVX_VNNI": "avx_vnni",
                   "AVX512_VP2INTERSECT": "avx512_vp2intersect", "AVX512_FP16": "avx512_fp16",
                   "AMX_TILE": "amx_tile", "AMX_INT8": "amx_int8", "AMX_BF16": "amx_bf16", "BMI1": "bmi1",
                   "BMI2": "bmi2", "LZCNT": "abm", "MOVBE": "movbe", "SSE4A": "sse4a"}
# compiler macro -> /proc/cpuinfo flag, for the macros a tier's flags add to the x86-64 defaults
MACRO_TO_CPUINFO = {"__SSE3__": "pni", "__SSSE3__": "ssse3", "__SSE4_1__": "sse4_1", "__SSE4_2__": "sse4_2",
                    "__CRC32__": "sse4_2", "__POPCNT__": "popcnt", "__XSAVE__": "xsave", "__AVX__": "avx",
                    "__AVX2__": "avx2", "__FMA__": "fma", "__F16C__": "f16c", "__AVX512F__": "avx512f",
                    "__AVX512BW__": "avx512bw", "__AVX512VL__": "avx512vl", "__AVX512DQ__": "avx512dq",
                    "__AVX512CD__": "avx512cd", "__AVX512VNNI__": "avx512_vnni", "__AVX512BF16__": "avx512_bf16",
                    "__AVX512VBMI__": "avx512vbmi", "__AVX512VBMI2__": "avx512_vbmi2",
                    "__AVXVNNI__": "avx_vnni"}
_AVX2 = next(t for t in isa.TIERS if t.name == "avx2")
AMX_FEATURES = {"AMX_TILE", "AMX_INT8"}
AMX_LIBRARY, AMX_FUNCTION = "int8_gemm", "amx_items"  # where AMX may be: the function behind the run-time check


def tiers_to_check() -> list[isa.Tier]:
    here = kernels.kernel_tier()
    if here.name == "generic":  # no build runs here; the tier choice itself is tested in test_kernel_isa.py
        return []
    return [here] if here == _AVX2 else [here, _AVX2]


def _macros(flags: tuple[str, ...]) -> set[str]:
    compiler = os.environ.get("CXX", "c++")
    out = subprocess.run([compiler, "-dM", "-E", "-x", "c++", "-", *flags], input="", capture_output=True,
                         text=True, check=True).stdout
    return {m.group(1) for m in re.finditer(r"#define (\w+) ", out)}


@pytest.mark.parametrize("tier", isa.TIERS, ids=lambda t: t.name)
def test_every_extension_the_compiler_flags_enable_is_checked(tier):
    added = _macros(tier.cflags) - _macros(())
    isa_macros = {m for m in added if m in MACRO_TO_CPUINFO or re.fullmatch(r"__[A-Z0-9_]+__", m)}
    unmapped = sorted(m for m in isa_macros if m not in MACRO_TO_CPUINFO)
    assert not unmapped, f"{tier.name}: the compiler enables {unmapped}, which no CPUID check of the tier covers"
    enabled = {MACRO_TO_CPUINFO[m] for m in isa_macros}
    assert enabled <= tier.requires, f"{tier.name}: not checked: {sorted(enabled - tier.requires)}"
    assert "avx2" in enabled  # (the macro listing did see the flags)


def built_libraries(tier: isa.Tier) -> list[Path]:
    """The tier's libraries, built (or found cached) for every kernel source."""
    if tier == kernels.kernel_tier():
        with kernels.override(enabled=True):
            kernels.get_ops()
    else:  # another tier cannot load into this process (its ops have the same names): build it in a child
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(kernels.settings.cache_dir)}
        done = subprocess.run([sys.executable, "-m", "brisk.cli", "kernels", "build", "--isa", "avx2"], env=env,
                              capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    paths = [kernels.library_path(source, tier) for source in kernels.kernel_sources()]
    missing = [p.name for p in paths if not p.exists()]
    assert not missing, f"{tier.name}: not built: {missing}"
    return paths


def _functions(elf) -> tuple[list[int], list[tuple[int, str]]]:  # noqa: ANN001 - an ELFFile
    """The function symbols of the library, sorted: (start addresses, [(end, name)])."""
    table = elf.get_section_by_name(".symtab") or elf.get_section_by_name(".dynsym")
    funcs = sorted((sym["st_value"], sym["st_value"] + sym["st_size"], sym.name) for sym in table.iter_symbols()
                   if sym["st_info"]["type"] == "STT_FUNC" and sym["st_size"] > 0)
    return [f[0] for f in funcs], [(f[1], f[2]) for f in funcs]


def cpuid_features(library: Path) -> dict[str, dict[str, str]]:
    """{iced CPUID feature name: {function symbol: one instruction of it using the feature}} over the library's
    executable sections (the symbol "?" where an instruction lies in no function symbol; only AMX instructions
    are looked up, other features name their first function)."""
    names = {v: k for k, v in vars(iced_x86.CpuidFeature).items() if isinstance(v, int) and not k.startswith("_")}
    formatter = iced_x86.Formatter(iced_x86.FormatterSyntax.INTEL)
    seen: dict[str, dict[str, str]] = {}
    with open(library, "rb") as f:
        elf = elffile.ELFFile(f)
        starts, ends = _functions(elf)
        for section in elf.iter_sections():
            if not section["sh_flags"] & 0x4 or section["sh_type"] != "SHT_PROGBITS":  # SHF_EXECINSTR
                continue
            for ins in iced_x86.Decoder(64, section.data(), ip=section["sh_addr"]):
                if ins.is_invalid:
                    continue
                for feature in ins.cpuid_features():
                    by_function = seen.setdefault(names[feature], {})
                    if names[feature] in AMX_FEATURES or not by_function:
                        i = bisect.bisect_right(starts, ins.ip) - 1
                        function = ends[i][1] if i >= 0 and ins.ip < ends[i][0] else "?"
                        by_function.setdefault(function, formatter.format(ins))
    return seen


@pytest.mark.parametrize("tier", tiers_to_check(), ids=lambda t: t.name)
def test_built_libraries_use_only_checked_instructions(tier):
    allowed, seen, amx_seen = tier.requires, set(), set()
    for library in built_libraries(tier):
        features = cpuid_features(library)
        assert "X64" in features, f"{library.name}: decoded no code"
        seen |= set(features)
        outside = {name: next(iter(example.values())) for name, example in features.items() if name not in BASELINE
                   and name not in AMX_FEATURES and ICED_TO_CPUINFO.get(name, name.lower()) not in allowed}
        assert not outside, f"{library.name} ({tier.name}) uses instructions no CPUID check covers: {outside}"
        for name in AMX_FEATURES & set(features):
            stray = {fn: ex for fn, ex in features[name].items() if AMX_LIBRARY not in library.name
                     or AMX_FUNCTION not in fn}
            assert not stray, f"{library.name} ({tier.name}): {name} outside {AMX_FUNCTION}: {stray}"
            amx_seen.add(name)
    # the decode did see the tier's vector code: AVX-512 on those tiers only, AVX-VNNI's vpdpbusd where the tier
    # has it (the W8A8 GEMM and the int8 table kernel take it)
    avx512 = tier.name.startswith("avx512")
    assert {"AVX2", "FMA", "F16C"} <= seen and avx512 == ("AVX512F" in seen), sorted(seen)
    assert ("avx_vnni" in allowed) == ("AVX_VNNI" in seen), sorted(seen)
    # and the AMX path where it is built (the AVX-512 tiers): the check above did look at its instructions
    assert amx_seen == (AMX_FEATURES if avx512 else set()), amx_seen
