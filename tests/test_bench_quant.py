"""`brisk bench quant` on a tiny model: every row measured, sizes shrink with bits, JSON written."""

from __future__ import annotations

import json

from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

from brisk.cli import main


def test_bench_quant_report_on_a_tiny_model(tmp_path):
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=7, max_position_embeddings=512)
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 80)
    out = tmp_path / "quant.json"
    settings = "int8,int4-g64,int2-g64,int4-g64-a8"
    result = CliRunner().invoke(main, ["bench", "quant", "--model", str(src), "--settings", settings,
                                       "--text", str(text), "--window", "64", "--max-windows", "2", "--batch", "3",
                                       "--input-len", "16", "--output-len", "6", "--prefill-len", "64",
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["float32", "int8", "int4-g64", "int2-g64", "int4-g64-a8"]
    a8 = rows.pop()
    # the same checkpoint, run with int8 activations: its perplexity windows round x too, so the figure moves
    assert a8["size_bytes"] == rows[2]["size_bytes"] and a8["label"].endswith("int8 act")
    assert a8["ppl"] != rows[2]["ppl"] and abs(a8["ppl"] / rows[2]["ppl"] - 1) < 0.05
    sizes = [r["size_bytes"] for r in rows]
    assert sizes == sorted(sizes, reverse=True)  # fewer bits, fewer bytes
    for r in rows:
        assert r["decode_tok_s_b1"] > 0 and r["decode_tok_s_batch"] > 0 and r["ppl"] > 1
    assert rows[0]["same_greedy_as_float"] is True


def test_bench_quant_w8a8_rows_and_prefill(tmp_path):
    """The calibrated W8A8 settings are rows like the RTN ones (int8 activations in their label), and every row
    has a prefill figure."""
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=7, max_position_embeddings=512)
    out = tmp_path / "quant.json"
    result = CliRunner().invoke(main, ["bench", "quant", "--model", str(src), "--settings", "int8,smoothquant",
                                       "--max-windows", "1", "--window", "64", "--batch", "2", "--input-len", "16",
                                       "--output-len", "4", "--prefill-len", "48", "--runs", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["float32", "int8", "smoothquant"]
    assert rows[2]["label"].endswith("int8 act") and not rows[1]["label"].endswith("int8 act")
    assert rows[2]["size_bytes"] == rows[1]["size_bytes"]  # the same int8 per-channel weights on disk
    assert all(r["prefill_tok_s"] > 0 and r["prefill_len"] == 48 for r in rows)
    assert "prefill" in result.output


def test_bench_quant_rejects_unknown_setting():
    for bad in ("int5", "float32-a8", "smoothquant-a8"):
        result = CliRunner().invoke(main, ["bench", "quant", "--settings", bad])
        assert result.exit_code != 0 and f"unknown setting '{bad}'" in result.output, result.output


def test_decode_rate_refuses_requests_that_did_not_run_together(tmp_path):
    """A pool that holds fewer than `batch` requests queues the last ones behind the others: the figure would be a
    lone request's decode, so decode_rate says so instead of returning it."""
    import pytest

    from brisk import LLM
    from brisk.bench.quant import decode_rate

    src = tmp_path / "tiny"
    make_tiny_hf_model(src, "llama", seed=7, max_position_embeddings=512)
    prompt = list(range(3, 67))  # 64 tokens + 16 out: 5 blocks of 16 a request
    roomy = LLM(str(src), kv_cache_memory="4MiB", max_model_len=128, enable_prefix_caching=False)
    assert decode_rate(roomy, prompt, 4, 16)[0] > 0
    c = roomy.engine.loaded.config
    per_block = 16 * c.kv_bytes_per_token(4)  # all layers, float32
    # room for one max_model_len sequence (8 blocks) and a bit: two 5-block requests never fit at once
    tight = LLM(str(src), kv_cache_memory=f"{(9 * per_block + 1023) // 1024}KiB", max_model_len=128,
                enable_prefix_caching=False)
    with pytest.raises(RuntimeError, match="did not run 4 requests"):
        decode_rate(tight, prompt, 4, 16)
