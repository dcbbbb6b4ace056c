"""`brisk advise`: candidates priced by format, ranked within the budgets, refusals, commands, --validate."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

from brisk.advise import memory as mem
from brisk.advise import quality as qual
from brisk.advise.advisor import NothingFitsError, advise, parse_percent, precisions
from brisk.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("advise") / "tiny"
    make_tiny_hf_model(path, "llama", seed=3, hidden_size=64, intermediate_size=128, max_position_embeddings=512)
    return str(path)


def _table(tiny_ppl: dict[str, float]) -> dict:
    return {"model": "tiny", "protocol": {"text": "t", "window": 64, "max_windows": 2}, "ppl": tiny_ppl}


def test_weight_bytes_follow_the_format(tiny):
    shape = mem.model_shape(tiny)
    f32 = mem.weight_bytes(shape, mem.Precision("float32", torch.float32))
    assert f32 == shape.footprint.config.num_params * 4
    assert mem.weight_bytes(shape, mem.Precision("bfloat16", torch.bfloat16)) * 2 == f32
    int8 = mem.weight_bytes(shape, mem.Precision("int8", torch.float32, 8, -1))
    g32 = mem.weight_bytes(shape, mem.Precision("int4-rtn-g32", torch.float32, 4, 32))
    g64 = mem.weight_bytes(shape, mem.Precision("int4-rtn-g64", torch.float32, 4, 64))
    assert f32 > int8 > g32 > g64
    # codes + a float16 scale and a uint8 zero point per group of 32: 0.5 + 3/32 bytes per decoder weight
    assert g32 - g64 == int(shape.decoder_linear * (3 / 32)) - int(shape.decoder_linear * (3 / 64))


def test_estimate_counts_the_mapped_linears_and_the_measured_runtime(tiny):
    shape = mem.model_shape(tiny)
    f32, g64 = mem.Precision("float32", torch.float32), mem.Precision("int4-rtn-g64", torch.float32, 4, 64)
    est32, _ = mem.estimate(shape, f32, "auto", 256, 1)
    est4, _ = mem.estimate(shape, g64, "auto", 256, 1)
    assert est32.weights == mem.weight_bytes(shape, f32) and mem.mapped_weight_bytes(shape, f32) == 0
    # a quantized folder's linears stay resident in the file's map besides their repacked copy
    stored = int(shape.decoder_linear * (0.5 + 3 / 64))
    assert mem.mapped_weight_bytes(shape, g64) == stored
    assert est4.weights == mem.weight_bytes(shape, g64) + stored
    c = shape.footprint.config
    rope = 2 * 4 * c.max_position_embeddings * c.head_dim
    assert est32.runtime == est4.runtime == mem.PROCESS_BASE_BYTES + mem.LOADED_RUNTIME_BYTES + rope


def test_kv_pool_holds_context_times_concurrency(tiny):
    shape = mem.model_shape(tiny)
    p = mem.Precision("float32", torch.float32)
    one = mem.kv_pool_bytes(shape, p, "auto", 256, 1)
    assert mem.kv_pool_bytes(shape, p, "auto", 256, 8) >= 8 * one - 8 * 2**20
    assert mem.kv_pool_bytes(shape, p, "int8", 256, 64) < mem.kv_pool_bytes(shape, p, "auto", 256, 64)


def test_quality_combines_log_increases():
    table = _table({"float32": 10.0, "int8": 10.1, "kv-int8": 10.2})
    assert qual.relative_cost(table, "int8") == pytest.approx(0.01)
    assert qual.relative_cost(table, "speculative") == 0.0
    assert qual.combined_cost(table, ["int8", "kv-int8"]) == pytest.approx(1.01 * 1.02 - 1)
    assert qual.combined_cost(table, ["int4-rtn-g64"]) is None
    assert qual.applies("int4-rtn-g128", 576, 1536) is False and qual.applies("int4-rtn-g64", 576, 1536)


def test_parse_percent():
    assert parse_percent("2%") == pytest.approx(0.02) and parse_percent("0.5") == 0.5
    with pytest.raises(ValueError, match="percentage"):
        parse_percent("two")


def test_a_quantized_checkpoint_is_priced_as_it_is(tiny, tmp_path):
    out = tmp_path / "q"
    result = CliRunner().invoke(main, ["quantize", tiny, str(out), "--bits", "4", "--group-size", "32"])
    assert result.exit_code == 0, result.output
    shape = mem.model_shape(str(out))
    assert [p.name for p in precisions(shape)] == ["given"]


def test_advise_ranks_within_budgets_and_refuses(tiny, monkeypatch):
    # a quality table measured now, on the tiny model (two windows)
    table = qual.measure_quality_table(tiny, ["int8", "int4-rtn-g32", "kv-int8"], window=64, max_windows=2,
                                       log=lambda m: None)
    assert set(table["ppl"]) == {"float32", "int8", "int4-rtn-g32", "kv-int8"}
    monkeypatch.setattr(qual, "stored_table", lambda model: table)  # this model's table, as if shipped
    a = advise(tiny, 2**30, "latency", 10.0, context=256, read_gbps=20.0)
    cal = a.calibration
    assert cal.decode_tok_s > 0 and cal.prefill_tok_s > 0 and 0 < cal.efficiency
    names = [c.name for c in a.ranked]
    assert "int8" in names and "float32" in names and all(c.memory.total <= 2**30 for c in a.ranked)
    figures = [c.figure("latency") for c in a.ranked]
    assert figures == sorted(figures, reverse=True)
    assert any(line.startswith("brisk serve") for line in a.commands)
    # a budget below every candidate: refused with the smallest one and its size
    with pytest.raises(NothingFitsError, match="smallest configuration"):
        advise(tiny, 2**20, "latency", 10.0, context=256, read_gbps=20.0, calibration=cal)
    # no lossy technique within 0%: only the float32 rows remain
    strict = advise(tiny, 2**30, "throughput", 0.0, context=256, concurrency=4, read_gbps=20.0, calibration=cal)
    assert {c.precision.name for c in strict.ranked} == {"float32"}


def test_cli_validate_and_json(tiny, tmp_path):
    out = tmp_path / "advise.json"
    result = CliRunner().invoke(main, ["advise", tiny, "--memory", "2GiB", "--goal", "throughput", "--context",
                                       "128", "--concurrency", "2", "--validate", "--validate-seconds", "0.2",
                                       "--membw", "20", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["validated"] and doc["ranked"][0]["measured"]["tok_s"] > 0
    assert "only lossless" in doc["quality_source"]
    assert "recommended:" in result.output and "brisk serve --model" in result.output


def test_cli_bad_input(tiny):
    r = CliRunner().invoke(main, ["advise", tiny, "--memory", "lots"])
    assert r.exit_code != 0 and "--memory must be a size" in r.output
    r = CliRunner().invoke(main, ["advise", tiny, "--context", "100000", "--membw", "20"])
    assert r.exit_code != 0 and "longer than the model's context" in r.output


def test_memcheck_rejects_zero_runs(capsys):
    from brisk.advise.memcheck import main as memcheck_main

    with pytest.raises(SystemExit):
        memcheck_main(["--runs", "0"])
    assert "--runs must be at least 1, got 0" in capsys.readouterr().err


def test_quantized_kv_is_priced_by_the_path_it_runs():
    """A quantized cache reads fewer bytes at a slower rate per byte (its codes are widened) and adds a per-layer
    step cost: its predicted gain over the float cache at a long context is below the bytes ratio, and vanishes
    where the KV reads do not count (a short context)."""
    from brisk.advise import speed as spd

    factors = spd.stored_factors()
    cal = spd.Calibration(read_gbps=20.0, probed="float32", decode_tok_s=40.0, prefill_tok_s=400.0,
                          weight_bytes=500 * 2**20, kv_bytes_read=0, seconds=1.0, efficiency=0.8)
    float_kv, int8_kv = 30 * 1536, 30 * 396  # bytes per token, default model's shape

    def rate(kv: str, per_token: int, context: int) -> float:
        return spd.predict(cal, factors, "float32", cal.weight_bytes, per_token, context, 64, kv_cache_dtype=kv,
                           num_layers=30).decode_batch_tok_s

    long_gain = rate("int8", int8_kv, 8192) / rate("auto", float_kv, 8192)
    assert 1.0 < long_gain < float_kv / int8_kv
    unpriced = spd.predict(cal, {**factors, "kv_paths": {}}, "float32", cal.weight_bytes, int8_kv, 8192, 64,
                           kv_cache_dtype="int8", num_layers=30).decode_batch_tok_s
    assert rate("int8", int8_kv, 8192) < unpriced  # by bytes alone it would look faster
    assert rate("int8", int8_kv, 16) <= rate("auto", float_kv, 16) * 1.001
