"""`brisk report` on a tiny model with a setting smaller than --quick: every section's rows, the files."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

from brisk.bench.report_cmd import SECTIONS, Params, plot_report, render_markdown, run_report
from brisk.cli import main

TINY = Params(input_len=16, output_len=6, runs=1, batch=2, ppl_window=64, ppl_windows=2, spec_prompts=1,
              spec_tokens=8, paged_requests=6, paged_max_len=128, kv_prompt=32, calibrated=True,
              calib_samples=2, calib_seq_len=32, calib_text=None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("report") / "tiny"
    make_tiny_hf_model(path, "llama", seed=5, hidden_size=64, intermediate_size=128, max_position_embeddings=512)
    return str(path)


def test_every_section_gives_rows(tiny, tmp_path):
    calib = tmp_path / "calib.txt"  # a short text: tokenizing a whole novel with the tiny tokenizer takes minutes
    calib.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 40)
    report = run_report(tiny, replace(TINY, calib_text=str(calib)), SECTIONS, log=lambda m: None)
    assert report.failures == []
    groups = {r.group for r in report.rows}
    assert {"int8", "int4", "speculative", "paged", "sparsity", "fusion", "kv"} <= groups
    for r in report.rows:
        assert r.speedup is not None and r.speedup > 0, r
    quant = {r.setting: r for r in report.rows if r.group in ("int8", "int4")}
    assert {"int8 RTN per channel", "int4 RTN g64", "int4 GPTQ g64", "int4 AWQ g64"} <= set(quant)
    assert quant["int4 RTN g64"].memory_bytes < quant["int8 RTN per channel"].memory_bytes
    assert all(r.ppl_cost is not None for r in quant.values())
    kv = {r.setting: r for r in report.rows if r.group == "kv"}
    assert kv["KV cache int4"].memory_bytes < kv["KV cache int8"].memory_bytes
    fusion = [r for r in report.rows if r.group == "fusion"]
    assert len(fusion) == 2 and all(r.ppl is None for r in fusion)  # lossless: no perplexity row
    assert set(report.best) == {"latency", "throughput"}
    assert all(b["commands"] for b in report.best.values())
    plots = plot_report(report, tmp_path)
    assert [p.rsplit("/", 1)[1] for p in plots] == ["speedups.png", "quality.png"]
    md = render_markdown(report, {"cpu_model": "x", "torch_threads": 1}, "0.0", plots)
    assert "| INT8 quantization | 2x |" in md and "## Best combination" in md


def test_cli_writes_markdown_json_and_plots(tiny, tmp_path):
    out = tmp_path / "r"
    result = CliRunner().invoke(main, ["report", "--model", tiny, "--quick", "--sections", "fusion",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads((out / "report.json").read_text())
    assert doc["command"] == "brisk report --quick" and len(doc["rows"]) == 2
    assert (out / "report.md").read_text().startswith("# brisk report")
    assert (out / "speedups.png").stat().st_size > 1000


def test_cli_rejects_unknown_section():
    result = CliRunner().invoke(main, ["report", "--sections", "weights,turbo"])
    assert result.exit_code != 0 and "unknown section(s) turbo" in result.output
