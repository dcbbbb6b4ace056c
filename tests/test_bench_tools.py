"""`brisk bench ab`, `ab-kernels` and `profile` on a tiny model: they run, compare, and report what they say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

from brisk.bench.ab import renamed_source
from brisk.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "tiny"
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=5)
    return path


def _invoke(args: list[str]) -> str:
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_ab_kv_dtypes_agree_on_greedy_tokens_per_batch(tiny: Path) -> None:
    out = _invoke(["ab", "--model", str(tiny), "--kv", "bfloat16", "--batches", "1,2", "--runs", "1",
                   "--input-len", "16", "--output-len", "4", "--ttft", "16"])
    for batch in (1, 2):
        line = next(s for s in out.splitlines() if s.startswith(f"batch {batch}:"))
        assert "kv auto best" in line and "kv bfloat16 best" in line and "greedy tokens equal:" in line
    assert re.search(r"time to first token, 16 tokens: kv auto median \d+ ms", out)


def test_ab_kernels_needs_two_files_and_a_library_to_rename(tmp_path: Path) -> None:
    one = tmp_path / "a.cpp"
    one.write_text("int x;\n")
    result = CliRunner().invoke(main, ["bench", "ab-kernels", str(one)])
    assert result.exit_code != 0 and "at least two" in result.output
    with pytest.raises(ValueError, match="TORCH_LIBRARY_FRAGMENT"):
        renamed_source("int x;\n", 0)
    src = "TORCH_LIBRARY_FRAGMENT(brisk, m) {\n  m.def(...);\n}\n"
    assert renamed_source(src, 3) == "TORCH_LIBRARY_FRAGMENT(brisk_v3, m) {\n  m.def(...);\n}\n"
    src += "TORCH_LIBRARY_IMPL(brisk, CPU, m) {\n  m.impl(...);\n}\n"  # kernels registered apart from the schema
    assert "TORCH_LIBRARY_IMPL(brisk_v3, CPU, m)" in renamed_source(src, 3) and "(brisk," not in renamed_source(src, 3)


def test_profile_prints_rates_and_the_op_table(tiny: Path) -> None:
    out = _invoke(["profile", "--model", str(tiny), "--input-len", "16", "--tokens", "4", "--rows", "5"])
    assert re.search(r"decode [\d.]+ tok/s without the profiler, [\d.]+ tok/s under it", out)
    assert "Self CPU" in out


def test_ab_kernels_float_calls_cover_the_decoder_linears(tiny: Path) -> None:
    """`--op linear_small_m` runs over the float decoder linears: one call per layer, weights as the model holds
    them, activations of the asked rows and dtype."""
    import torch

    from brisk.bench.ab import kernel_calls

    calls, nbytes = kernel_calls(str(tiny), "linear_small_m", 8, head=False, dtype=torch.bfloat16)
    assert calls and nbytes == sum(w.numel() * 2 for _, w in calls)
    for x, w in calls:
        assert x.shape == (8, w.shape[1]) and x.dtype == w.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="no quantized linear layers"):
        kernel_calls(str(tiny), "quant_linear_q8", 1, head=False)
