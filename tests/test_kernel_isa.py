"""The kernels' instruction-set tiers: the best this CPU has by default, the AVX2 build on request, and that build
still passing the kernel tests of the files whose code differs between the tiers (an AVX-512 machine would
otherwise never run the AVX2 loops that older CPUs depend on)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from brisk.ops import isa, kernels

TESTS = Path(__file__).parent


# /proc/cpuinfo flag sets (the ISA-relevant part) of the machines brisk runs on
_X86_64 = "fpu sse sse2 mmx fxsr cx8 cmov"
_AVX2_VM = _X86_64 + " pni ssse3 sse4_1 sse4_2 popcnt xsave avx f16c fma avx2 bmi1 bmi2 movbe aes"
_AVX512_COMMON = " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"
CPUS = {
    "AMD Zen 4": _AVX2_VM + _AVX512_COMMON + " avx512ifma avx512vbmi avx512_vbmi2 avx512_bf16 avx512_bitalg "
                 "avx512_vpopcntdq gfni vaes vpclmulqdq sse4a",
    "AMD Zen 5": _AVX2_VM + _AVX512_COMMON + " avx512ifma avx512vbmi avx512_vbmi2 avx512_bf16 avx512_bitalg "
                 "avx512_vpopcntdq gfni vaes vpclmulqdq sse4a avx_vnni avx512_vp2intersect",
    "Intel Sapphire Rapids": _AVX2_VM + _AVX512_COMMON + " avx512ifma avx512vbmi avx512_vbmi2 avx512_bf16 "
                             "avx512_bitalg avx512_vpopcntdq gfni vaes vpclmulqdq avx_vnni avx512_fp16 amx_bf16 "
                             "amx_tile amx_int8",
    "Intel Cooper Lake": _AVX2_VM + _AVX512_COMMON + " avx512_bf16",
    "Intel Ice Lake server": _AVX2_VM + _AVX512_COMMON + " avx512ifma avx512vbmi avx512_vbmi2 avx512_bitalg gfni",
    "AVX2-only VM": _AVX2_VM,
    "Intel Alder Lake": _AVX2_VM + " avx_vnni bmi1 bmi2 movbe gfni vaes",
    "AVX only (Sandy Bridge)": _X86_64 + " pni ssse3 sse4_1 sse4_2 popcnt xsave avx",
    "AVX2 without F16C reported": _AVX2_VM.replace(" f16c", ""),
}
EXPECTED = {"AMD Zen 4": "avx512", "AMD Zen 5": "avx512", "Intel Sapphire Rapids": "avx512",
            "Intel Cooper Lake": "avx512nv", "Intel Ice Lake server": "avx2", "AVX2-only VM": "avx2",
            "Intel Alder Lake": "avx2vnni",
            "AVX only (Sandy Bridge)": "generic", "AVX2 without F16C reported": "generic"}


@pytest.mark.parametrize("cpu", list(CPUS))
def test_tier_follows_the_flags_the_cpu_reports(cpu):
    flags = CPUS[cpu].split()
    tier = isa.choose_tier(flags, machine="x86_64")
    assert tier.name == EXPECTED[cpu]
    assert tier.requires <= set(flags)  # (what makes it safe: every flag the build needs is reported)
    assert isa.choose_tier(flags, "avx2", "x86_64").name == ("generic" if tier.name == "generic" else "avx2")
    # the avx2vnni cap: the AVX-VNNI build where the CPU reports avx_vnni, else the plain AVX2 one
    capped = isa.choose_tier(flags, "avx2vnni", "x86_64").name
    assert capped == ("generic" if tier.name == "generic" else "avx2vnni" if "avx_vnni" in flags else "avx2")
    # nothing outside the chosen tier's checked flags reaches the build: AMX, VP2INTERSECT, FP16 are not in any
    # tier, so a machine that reports them gets the same library as one that does not; VBMI only with VBMI2
    assert not {f for f in tier.requires if f.startswith("amx") or f in ("avx512_vp2intersect", "avx512_fp16",
                                                                          "sse4a")}
    assert ("avx512vbmi" in tier.requires) == ("avx512_vbmi2" in tier.requires)


@pytest.mark.parametrize("cpu", list(CPUS))
def test_amx_path_needs_both_amx_flags(cpu):
    # the W8A8 GEMM's AMX path is no tier: the CPU's amx_tile and amx_int8 (then the kernel's tile-state request)
    flags = set(CPUS[cpu].split())
    assert isa.has_amx_int8(flags) == (cpu == "Intel Sapphire Rapids")
    assert not isa.has_amx_int8(flags - {"amx_int8"}) and not isa.has_amx_int8(flags - {"amx_tile"})


def test_tiers_are_nested_and_every_cflag_is_checked():
    # each tier's compiler flags name an extension its requires covers (-mavx512vbmi2 -> avx512_vbmi2, not the
    # different CPUID bit avx512vbmi); what a flag implies is checked by test_kernel_instructions.py, against the
    # compiler's own macros and the instructions in the built libraries
    spelled = {"-mavx2": "avx2", "-mfma": "fma", "-mf16c": "f16c", "-mavx512f": "avx512f", "-mavx512bw": "avx512bw",
               "-mavx512vl": "avx512vl", "-mavx512dq": "avx512dq", "-mavx512vnni": "avx512_vnni",
               "-mavx512bf16": "avx512_bf16", "-mavx512vbmi2": "avx512_vbmi2", "-mavx512vbmi": "avx512vbmi",
               "-mavxvnni": "avx_vnni"}
    for tier in isa.X86_TIERS:
        assert {spelled[f] for f in tier.cflags} <= tier.requires, tier.name
    # two chains above the plain AVX2 tier: avx512nv < avx512, and avx2vnni (Zen 4 and Cooper Lake lack AVX-VNNI)
    by_name = {t.name: t for t in isa.X86_TIERS}
    for better, worse in (("avx512", "avx512nv"), ("avx512nv", "avx2"), ("avx2vnni", "avx2")):
        b, w = by_name[better], by_name[worse]
        assert w.requires < b.requires and set(w.cflags) < set(b.cflags), (better, worse)
    assert [t.name for t in isa.X86_TIERS] == ["avx512", "avx512nv", "avx2vnni", "avx2"]  # best first
    assert isa.tiers_for("x86_64") == isa.X86_TIERS and isa.isa_choices("AMD64") == ("avx2", "avx2vnni", "avx512")


def test_this_process_follows_this_cpu_and_the_settings():
    assert kernels.kernel_tier() == isa.running_tier(kernels.settings.isa)
    if kernels.settings.isa is None and isa.cpu_flags():
        assert kernels.kernel_tier() == isa.choose_tier(isa.cpu_flags())
    with kernels.override(isa="avx2"):
        assert kernels.kernel_isa() in ("avx2", "generic")
    with pytest.raises(ValueError, match="kernel isa 'avx1024': use avx2, avx2vnni, avx512"):
        kernels.configure(isa="avx1024")
    with pytest.raises(ValueError, match="BRISK_KERNEL_ISA='avx1024': use avx2, avx2vnni, avx512"):
        kernels.KernelSettings.from_env({"BRISK_KERNEL_ISA": "avx1024"})
    read = kernels.KernelSettings.from_env({"BRISK_KERNEL_ISA": "AVX2", "BRISK_DISABLE_KERNELS": "1",
                                            "TORCH_EXTENSIONS_DIR": "/cache/ext"})
    assert (read.isa, read.enabled, str(read.cache_dir)) == ("avx2", False, "/cache/ext")
    assert kernels.KernelSettings.from_env({"BRISK_DISABLE_KERNELS": "0"}).enabled
    # the AMX switch: on unless BRISK_DISABLE_AMX says otherwise
    assert kernels.KernelSettings.from_env({}).amx and kernels.KernelSettings.from_env({"BRISK_DISABLE_AMX": "0"}).amx
    assert not kernels.KernelSettings.from_env({"BRISK_DISABLE_AMX": "1"}).amx


def test_build_folder_is_keyed_by_the_exact_flags(tmp_path):
    source = kernels.kernel_sources()[0]
    a = kernels.build_directory("x", source, ("-O3", "-mavx2"))
    b = kernels.build_directory("x", source, ("-O3", "-mavx2", "-mavx512f"))
    assert a != b and a == kernels.build_directory("x", source, ("-O3", "-mavx2"))
    paths = {kernels.library_path(source, t) for t in isa.TIERS}
    assert len(paths) == len(isa.TIERS) and all(t.name in str(kernels.library_path(source, t)) for t in isa.TIERS)


# the tests of every kernel whose code differs between the tiers, and of the paths that depend on which kernels a
# tier builds (the tiled layout, the decode plan and the C++ layer loop, SqueezeLLM's integer tables, GGUF repacking)
_TIER_TESTS = ("test_linear.py", "test_qlinear_q8.py", "test_qlinear_q8t.py", "test_sparse_linear.py",
               "test_sparse_q8.py", "test_kernels.py", "test_w8a8_kernel.py", "test_squeezellm.py",
               "test_decode_plan.py", "test_gguf_repack.py", "test_gguf_place.py", "test_kernel_instructions.py")


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["avx2", "avx2vnni"])
def test_a_lower_tier_passes_the_kernel_tests(tier):
    """Every other test runs this CPU's own build; this one builds a lower tier's in a child process
    (BRISK_KERNEL_ISA) and runs the tests of the kernels and paths that differ by tier (_TIER_TESTS: vdpbf16ps or
    not, vpdpbusd in its AVX-512 / AVX-VNNI forms or vpmaddubsw, 16-row tiles as one 512-bit vector or two 256-bit
    ones, vpermb or vpshufb tables, vpexpandb, 512-bit attention rows), with the libraries' Python paths answering
    as that CPU would. So CI on any CPU checks the AVX2 builds, and the suite on an AVX2 CPU runs them all."""
    want = isa.choose_tier(isa.cpu_flags(), tier)
    if want == kernels.kernel_tier() or want.name == "generic":
        pytest.skip(f"this CPU's own build is the {tier} cap's ({want.name}): every other test runs it")
    if tier == "avx2vnni" and want.name != "avx2vnni":
        pytest.skip("this CPU has no AVX-VNNI: the avx2vnni cap is the plain avx2 build, tested by the avx2 case")
    env = {**os.environ, "BRISK_KERNEL_ISA": tier}
    env.pop("BRISK_DISABLE_KERNELS", None)
    env.pop("PYTEST_ADDOPTS", None)  # the child's summary is read below (--durations would list test names)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           *(str(TESTS / name) for name in _TIER_TESTS)],
                          env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
    # a kernel test skips only where its feature cannot run on this tier: none of them "is not built" on AVX2
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert not [line for line in skipped if "not built" in line or "AVX-512" in line], skipped


_BUILD_ONE = """
import logging, sys
from pathlib import Path
from brisk.ops import kernels
logging.basicConfig(level=logging.INFO, format="%(message)s")
kernels.configure(cache_dir=Path(sys.argv[1]))
source = next(s for s in kernels.kernel_sources() if s.name == "kv_write.cpp")
print("RESULT", kernels._build(source), flush=True)
"""


def _build_one(cache: Path, **kwargs):
    env = {k: v for k, v in os.environ.items() if k != "BRISK_DISABLE_KERNELS"}
    return subprocess.Popen([sys.executable, "-c", _BUILD_ONE, str(cache)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **kwargs)


def test_a_build_killed_mid_way_leaves_nothing_that_makes_the_next_wait(tmp_path):
    """A build killed while it compiles (Ctrl-C, kill -9) leaves torch's own lock file and a half-made folder; the
    next build takes the folder over at once (its flock died with the killed process) and compiles, where it used to
    wait for the lock file to age. Then a third process loads the library as it is, without compiling."""
    cache = tmp_path / "ext"
    first = _build_one(cache)
    deadline = time.monotonic() + 120
    folder = None
    while time.monotonic() < deadline and folder is None:  # wait until the compiler runs (torch's lock exists)
        folder = next((f for f in cache.glob("brisk_kv_write_*") if (f / "lock").exists()), None) if cache.exists() \
            else None
        time.sleep(0.05)
    assert folder is not None, "the build never started"
    first.kill()
    first.wait()
    assert (folder / "lock").exists() and not (folder / kernels.BUILT_STAMP).exists()
    second = _build_one(cache)
    out, _ = second.communicate(timeout=300)
    assert second.returncode == 0 and "built=True" in out, out
    assert "waiting" not in out, out
    third = _build_one(cache)
    out, _ = third.communicate(timeout=120)
    assert third.returncode == 0 and "built=False" in out and "loaded cached" in out, out


def test_a_live_build_is_waited_for_and_said_once(tmp_path, caplog):
    """Another process holding a folder's build lock (building now): this one says so once, with its pid, and goes
    on when that process lets go."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from brisk.ops import kernels\n"
        "with kernels.build_lock(Path(sys.argv[1]), 'x.cpp'):\n"
        "    print('held', flush=True); time.sleep(2); (Path(sys.argv[1]) / 'done').touch()\n"), str(tmp_path)],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    kernels._waited.clear()
    with caplog.at_level("WARNING", logger="brisk.ops.kernels"):
        with kernels.build_lock(tmp_path, "a.cpp"):
            assert (tmp_path / "done").exists()  # got the lock only once the holder was done
        with kernels.build_lock(tmp_path, "b.cpp"):  # free now: no word
            pass
    said = [r.getMessage() for r in caplog.records if "is compiling" in r.getMessage()]
    assert len(said) == 1 and f"pid {holder.pid}" in said[0], said
    holder.wait()


def test_a_second_path_to_the_environment_loads_the_same_builds(tmp_path):
    """The kernels built for this environment are loaded, not compiled again, from a second path to it (a symlink)
    and from a shell whose PATH has another ninja (or none): the build key has what the build depends on, resolved,
    and a built library is loaded without running ninja."""
    if kernels.get_ops() is None:
        pytest.skip("no kernels are built here (generic tier or kernels disabled)")
    link = tmp_path / "env"
    link.symlink_to(Path(sys.prefix), target_is_directory=True)
    python = link / "bin" / Path(sys.executable).name
    env = {k: v for k, v in os.environ.items() if k != "BRISK_DISABLE_KERNELS"}
    env["PATH"] = "/usr/bin:/bin"
    if kernels.settings.isa:
        env["BRISK_KERNEL_ISA"] = kernels.settings.isa
    done = subprocess.run([str(python), "-m", "brisk.cli", "kernels", "build"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.strip().endswith(" s") and ".cpp" in line]
    assert rows and all(row[2] in ("cached", "failed") for row in rows), done.stdout


def test_every_build_runs_brisks_own_ninja():
    import ninja

    assert kernels.ninja_dir() == str(ninja.BIN_DIR)
    with kernels._ninja_first_on_path():
        assert os.environ["PATH"].split(os.pathsep)[0] == str(ninja.BIN_DIR)
    assert os.environ["PATH"].split(os.pathsep)[0] != str(ninja.BIN_DIR) or "PATH" not in os.environ


def test_bfloat16_gemm_rows_follow_the_tier_cap():
    """bfloat16 linears of 4+ rows go to oneDNN's GEMM only where it is native (AMX-BF16 with the AVX-512 kernels);
    a tier capped at AVX2 keeps them on the small-M kernel, as an AVX2 CPU does."""
    native = "amx_bf16" in isa.cpu_flags() and kernels.kernel_isa() == "avx512"
    assert kernels.bf16_gemm_rows() == (kernels.BF16_GEMM_ROWS if native and kernels.settings.amx else 0)
    with kernels.override(isa="avx2"):
        assert kernels.bf16_gemm_rows() == 0
    with kernels.override(amx=False):
        assert kernels.bf16_gemm_rows() == 0


def test_the_cpu_maker_picks_the_stream_prefetch_define():
    assert isa.vendor_cflags("AuthenticAMD") == ("-DBRISK_CPU_AMD",)
    assert isa.vendor_cflags("GenuineIntel") == () and isa.vendor_cflags("") == ()
    key_amd = kernels.build_directory("x", kernels.kernel_sources()[0], ("-O3", *isa.vendor_cflags("AuthenticAMD")))
    key_intel = kernels.build_directory("x", kernels.kernel_sources()[0], ("-O3", *isa.vendor_cflags("GenuineIntel")))
    assert key_amd != key_intel


def test_kernels_info_names_the_prefetch_and_the_bfloat16_path():
    from click.testing import CliRunner

    from brisk.ops.kernels_cli import info

    out = CliRunner().invoke(info, ["--load"]).output
    amd = isa.cpu_vendor() == "AuthenticAMD"
    assert f"weight-stream prefetch of the tiled kernels: {'non-temporal (AMD)' if amd else 'into L2'}" in out
    on_amx = kernels.settings.amx and "amx_bf16" in isa.cpu_flags() and kernels.get_ops() is not None
    assert ("bfloat16 linears of 4-8 rows: ATen's GEMM" in out) == on_amx, out


# /proc/cpuinfo `Features` of ARM64 machines brisk runs on
_CORTEX_A72 = "fp asimd evtstrm crc32 cpuid"
_NEOVERSE_N1 = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs"
_NEOVERSE_V1 = (_NEOVERSE_N1 + " jscvt fcma sha3 sm3 sm4 sha512 sve asimdfhm dit uscat ilrcpc flagm paca pacg dcpodp "
                "svei8mm svebf16 i8mm bf16 dgh rng")
ARM_CPUS = {
    "Raspberry Pi 4 (Cortex-A72)": _CORTEX_A72,
    "Raspberry Pi 3 (Cortex-A53)": _CORTEX_A72,
    "Raspberry Pi 5 (Cortex-A76)": "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm "
                                   "lrcpc dcpop asimddp",
    "Graviton2 (Neoverse N1)": _NEOVERSE_N1,
    "Ampere Altra (Neoverse N1)": _NEOVERSE_N1,
    "Graviton3 (Neoverse V1)": _NEOVERSE_V1,
    "Apple M1 under Asahi Linux": "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm "
                                  "jscvt fcma lrcpc dcpop sha3 asimddp sha512 asimdfhm dit uscat ilrcpc flagm ssbs sb "
                                  "paca pacg dcpodp flagm2 frint",
    "dotprod reported without LSE atomics": "fp asimd asimddp asimdrdm crc32",
    "no NEON reported": "fp evtstrm cpuid",
}
ARM_EXPECTED = {"Raspberry Pi 4 (Cortex-A72)": "neon", "Raspberry Pi 3 (Cortex-A53)": "neon",
                "Raspberry Pi 5 (Cortex-A76)": "neon-dotprod", "Graviton2 (Neoverse N1)": "neon-dotprod",
                "Ampere Altra (Neoverse N1)": "neon-dotprod", "Graviton3 (Neoverse V1)": "neon-i8mm",
                "Apple M1 under Asahi Linux": "neon-dotprod", "dotprod reported without LSE atomics": "neon",
                "no NEON reported": "generic"}


@pytest.mark.parametrize("cpu", list(ARM_CPUS))
def test_arm64_tier_follows_the_features_the_cpu_reports(cpu):
    flags = ARM_CPUS[cpu].split()
    tier = isa.choose_tier(flags, machine="aarch64")
    assert tier.name == ARM_EXPECTED[cpu]
    assert tier.requires <= set(flags)
    # the caps: neon (the baseline build) and neon-dotprod never raise the tier
    assert isa.choose_tier(flags, "neon", "aarch64").name == ("generic" if tier.name == "generic" else "neon")
    capped = isa.choose_tier(flags, "neon-dotprod", "aarch64").name
    assert capped == (tier.name if tier.name in ("generic", "neon") else "neon-dotprod")
    # the other family's tiers are never considered: an ARM CPU's flags on x86 (and the reverse) give no kernels
    assert isa.choose_tier(flags, machine="x86_64") == isa.GENERIC
    assert isa.choose_tier(CPUS["AMD Zen 4"].split(), machine="arm64") == isa.GENERIC
    # SVE is no tier: Graviton3 gets the NEON build
    assert not {f for f in tier.requires if f.startswith("sve")}


def test_arm64_tiers_are_nested_best_first_and_capped_by_name():
    tiers = isa.tiers_for("aarch64")
    assert tiers == isa.tiers_for("arm64") == isa.ARM64_TIERS  # Linux and macOS spell the machine differently
    assert [t.name for t in tiers] == ["neon-i8mm", "neon-dotprod", "neon"]
    for better, worse in zip(tiers, tiers[1:], strict=False):
        assert worse.requires < better.requires, (better.name, worse.name)
    assert isa.isa_choices("aarch64") == ("neon", "neon-dotprod", "neon-i8mm")
    with pytest.raises(ValueError, match="kernel isa 'avx2': use neon, neon-dotprod, neon-i8mm"):
        isa.choose_tier(_NEOVERSE_N1.split(), "avx2", "aarch64")
    lines = isa.explain(_CORTEX_A72.split(), machine="aarch64")
    assert lines[-1] == "neon: chosen (the CPU reports every flag it needs)"
    assert lines[0] == "neon-i8mm: the CPU lacks asimddp, asimdrdm, atomics, bf16, i8mm"


# `sysctl hw.optional` of Apple Silicon Macs (the ISA-relevant part)
_M1_SYSCTL = {"hw.optional.floatingpoint": "1", "hw.optional.AdvSIMD": "1", "hw.optional.neon": "1",
              "hw.optional.arm.FEAT_DotProd": "1", "hw.optional.arm.FEAT_I8MM": "0", "hw.optional.arm.FEAT_BF16": "0",
              "hw.optional.arm.FEAT_LSE": "1", "hw.optional.arm.FEAT_CRC32": "1", "hw.optional.arm.FEAT_RDM": "1",
              "hw.optional.arm.FEAT_FP16": "1", "hw.optional.arm.FEAT_FHM": "1", "hw.optional.arm.FEAT_SME": "0"}
_M2_SYSCTL = {**_M1_SYSCTL, "hw.optional.arm.FEAT_I8MM": "1", "hw.optional.arm.FEAT_BF16": "1"}
# macOS 11 had none of the FEAT_ names: what it does not report, no build uses
_M1_MACOS11_SYSCTL = {"hw.optional.floatingpoint": 1, "hw.optional.neon": 1, "hw.optional.armv8_1_atomics": 1,
                      "hw.optional.armv8_crc32": 1, "hw.optional.neon_fp16": 1, "hw.optional.armv8_2_fhm": 1}


@pytest.mark.parametrize(("sysctl", "expected"), [(_M1_SYSCTL, "neon-dotprod"), (_M2_SYSCTL, "neon-i8mm"),
                                                  (_M1_MACOS11_SYSCTL, "neon"), ({}, "generic")],
                         ids=["M1", "M2", "M1-macOS11", "none"])
def test_apple_silicon_tier_from_sysctl(sysctl, expected):
    flags = isa.macos_flags(sysctl)
    assert isa.choose_tier(flags, machine="arm64").name == expected
    assert ("i8mm" in flags) == (sysctl.get("hw.optional.arm.FEAT_I8MM") == "1")  # a 0 is not reported


# compiler macro -> /proc/cpuinfo feature, for what the ARM64 tiers' -march adds to GCC's aarch64 default
ARM_MACRO_TO_FEATURE = {"__ARM_FEATURE_ATOMICS": "atomics", "__ARM_FEATURE_CRC32": "crc32",
                        "__ARM_FEATURE_QRDMX": "asimdrdm", "__ARM_FEATURE_DOTPROD": "asimddp",
                        "__ARM_FEATURE_MATMUL_INT8": "i8mm", "__ARM_FEATURE_BF16_SCALAR_ARITHMETIC": "bf16",
                        "__ARM_FEATURE_BF16_VECTOR_ARITHMETIC": "bf16", "__ARM_FEATURE_BF16": "bf16",
                        "__ARM_NEON": "asimd", "__ARM_FEATURE_FP16_SCALAR_ARITHMETIC": "fphp",
                        "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC": "asimdhp", "__ARM_FEATURE_SVE": "sve"}


@pytest.mark.parametrize("tier", isa.ARM64_TIERS, ids=lambda t: t.name)
def test_every_extension_the_arm64_flags_enable_is_checked(tier):
    """With the cross compiler (g++-aarch64-linux-gnu, as .ci/arm64-check.sh installs it): every feature macro a
    tier's -march defines beyond the compiler's default names a feature the tier requires the CPU to report."""
    import re
    import shutil

    compiler = shutil.which("aarch64-linux-gnu-g++")
    if compiler is None:
        pytest.skip("no aarch64 cross compiler here")

    def macros(flags: tuple[str, ...]) -> set[str]:
        out = subprocess.run([compiler, "-dM", "-E", "-x", "c++", "-", *flags], input="", capture_output=True,
                             text=True, check=True).stdout
        return {m for m in re.findall(r"#define (__ARM_\w+) ", out) if m.startswith(("__ARM_FEATURE_", "__ARM_NEON"))}

    added = macros(tier.cflags) - macros(())
    unmapped = sorted(m for m in added if m not in ARM_MACRO_TO_FEATURE)
    assert not unmapped, f"{tier.name}: the compiler enables {unmapped}, which no feature check of the tier covers"
    assert {ARM_MACRO_TO_FEATURE[m] for m in added} <= tier.requires, tier.name
    assert "__ARM_NEON" in macros(tier.cflags) and "asimd" in tier.requires
