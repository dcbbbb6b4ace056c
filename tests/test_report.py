"""`brisk report` on a tiny model with a setting smaller than --quick: every section's rows, the files."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

from brisk.bench.report_cmd import SECTIONS, Params, plot_report, render_markdown, run_report
from brisk.cli import main

TINY = Params(input_len=16, output_len=6, runs=1, batch=2, ppl_window=64, ppl_windows=2, spec_prompts=1,
              spec_tokens=8, paged_requests=6, paged_max_len=128, kv_prompt=32, calibrated=True,
              calib_samples=2, calib_seq_len=32, calib_text=None, stream_context=320, stream_budget=48)
NEW_SECTIONS = ("gqa", "streaming", "onnxruntime")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("report") / "tiny"
    make_tiny_hf_model(path, "llama", seed=5, hidden_size=64, intermediate_size=128, max_position_embeddings=512)
    return str(path)


def test_every_section_gives_rows(tiny, tmp_path):
    calib = tmp_path / "calib.txt"  # a short text: tokenizing a whole novel with the tiny tokenizer takes minutes
    calib.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 40)
    sections = tuple(s for s in SECTIONS if s not in NEW_SECTIONS)  # those: test_kv_and_runtime_sections
    report = run_report(tiny, replace(TINY, calib_text=str(calib)), sections, log=lambda m: None)
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


@pytest.fixture
def onnx_cache(tmp_path, monkeypatch):  # the exported graph goes to this test's folder, not the user's cache
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_kv_and_runtime_sections(tiny, onnx_cache):
    pytest.importorskip("onnxruntime", reason="onnxruntime (brisk[onnx]) is not installed")
    report = run_report(tiny, TINY, NEW_SECTIONS, log=lambda m: None)
    assert report.failures == []
    rows: dict[str, list] = {}
    for r in report.rows:
        rows.setdefault(r.group, []).append(r)
    # GQA: the tiny model's 2 KV heads pooled into 1 (MQA); half the KV bytes per token, a perplexity cost measured
    gqa = rows["gqa"]
    assert [r.figure.split(",")[0] for r in gqa] == ["decode b=1", "decode b=2"]
    assert all(r.speedup > 0 and r.ppl_cost is not None for r in gqa)
    assert gqa[0].setting == "MQA: 2 -> 1 KV heads, mean-pooled" and "(2x the tokens per byte)" in gqa[0].memory
    assert gqa[0].memory_bytes == 2 * 2 * 1 * 16 * 4  # K and V, 2 layers, 1 head of 16, float32
    # StreamingLLM: the stream holds at most sinks + window + one chunk (in blocks) where the full cache holds all
    (stream,) = rows["streaming"]
    assert stream.speedup > 0 and stream.ppl is not None and stream.ppl_base is not None
    per_block = 2 * 2 * 2 * 16 * 4 * 16
    assert stream.memory_bytes <= (1 + -(-(44 + 64) // 16) + 2) * per_block < 320 // 16 * per_block
    assert stream.figure == "decode b=1 at 320 tokens"
    # ONNX Runtime: brisk over onnxruntime at both batch sizes, with both rates in the note
    ort = rows["onnxruntime"]
    assert [r.figure for r in ort] == ["decode b=1", "decode b=2"]
    assert all(r.speedup > 0 and "onnxruntime" in r.note and r.ppl is None for r in ort)


def test_onnxruntime_row_is_skipped_without_the_extra(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` raises ImportError
    report = run_report(tiny, TINY, ("onnxruntime",), log=lambda m: None)
    (row,) = report.rows
    assert row.speedup is None and "onnxruntime not installed" in row.note
    md = render_markdown(report, {"cpu_model": "x", "torch_threads": 1}, "0.0", [])
    assert "skipped: onnxruntime not installed" in md
