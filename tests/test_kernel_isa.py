"""The kernels' instruction-set tiers: the best this CPU has by default, the AVX2 build on request, and that build
still passing the kernel tests of the files whose code differs between the tiers (an AVX-512 machine would
otherwise never run the AVX2 loops that older CPUs depend on)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from brisk.ops import kernels

TESTS = Path(__file__).parent


def test_tier_follows_the_cpu_and_the_environment(monkeypatch):
    monkeypatch.delenv("BRISK_KERNEL_ISA", raising=False)
    capability = torch.backends.cpu.get_cpu_capability()
    best = kernels.kernel_isa()
    wanted = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
    if capability == "AVX512" and wanted <= kernels.cpu_flags():
        assert best == "avx512"
        tag, flags = kernels._isa_flags()
        assert "-mavx512vnni" in flags and "-mavx512bf16" in flags and "-mavx2" in flags
        # VBMI2 (vpexpandb) is used where the CPU has it, and named in the build's tag where it does not
        assert ("-mavx512vbmi2" in flags) == ("avx512_vbmi2" in kernels.cpu_flags())
        assert tag == ("avx512" if "avx512_vbmi2" in kernels.cpu_flags() else "avx512nv")
    elif capability.startswith("AVX"):
        assert best == "avx2"
    else:
        assert best == "generic"
    monkeypatch.setenv("BRISK_KERNEL_ISA", "avx2")
    assert kernels.kernel_isa() == ("generic" if best == "generic" else "avx2")
    monkeypatch.setenv("BRISK_KERNEL_ISA", "avx1024")
    with pytest.raises(ValueError, match="BRISK_KERNEL_ISA='avx1024': use avx2 or avx512"):
        kernels.kernel_isa()


def test_the_avx2_build_passes_the_kernel_tests_on_an_avx512_cpu():
    """On an AVX-512 CPU every other test runs the avx512 build; this one builds the AVX2 one in a child process
    and runs the tests of the kernels whose code differs (linear_small: vdpbf16ps; quant_q8: vpdpbusd, 512-bit int4
    tiles; sparse_linear: vexpandps; sparse_q8: vpexpandb + vpdpbusd; paged attention: 512-bit rows, bfloat16 read
    in place). On an AVX2 CPU the default build is the AVX2 one, which all the kernel tests already run."""
    if kernels.kernel_isa() != "avx512":
        assert kernels.kernel_isa() in ("avx2", "generic")
        return
    env = {**os.environ, "BRISK_KERNEL_ISA": "avx2"}
    env.pop("BRISK_DISABLE_KERNELS", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(TESTS / "test_linear.py"), str(TESTS / "test_qlinear_q8.py"),
                           str(TESTS / "test_sparse_linear.py"), str(TESTS / "test_sparse_q8.py"),
                           str(TESTS / "test_kernels.py")],
                          env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
