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


def test_estimate_counts_the_weights_once_and_the_measured_runtime(tiny):
    shape = mem.model_shape(tiny)
    f32, g64 = mem.Precision("float32", torch.float32), mem.Precision("int4-rtn-g64", torch.float32, 4, 64)
    est32, _ = mem.estimate(shape, f32, "auto", 256, 1)
    est4, _ = mem.estimate(shape, g64, "auto", 256, 1)
    # a quantized folder's source pages leave the resident set once repacked: its linears are held once
    assert est32.weights == mem.weight_bytes(shape, f32) and est4.weights == mem.weight_bytes(shape, g64)
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
    assert cal.batch_tok_s > 0 and cal.per_seq_s >= 0  # the batch probe: what each further sequence adds
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
    # past the model's 512 positions only StreamingLLM candidates run, and no table prices them for this model
    r = CliRunner().invoke(main, ["advise", tiny, "--context", "100000", "--membw", "20"])
    assert r.exit_code != 0 and "quality cost is unknown" in r.output and "--measure-quality" in r.output


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

    # a path as measured on some CPU: half the float cache's rate per byte, 20 us more a layer-step
    factors = {**spd.stored_factors(), "kv_paths": {"int8": {"read": 0.5, "step_us": 20.0}}}
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


def test_streaming_pool_is_bounded_by_the_budget_and_holds_the_batch(tiny):
    """A StreamingLLM candidate's pool holds each sequence's sinks and window plus one step's chunk, whatever the
    context; the engine built from its settings runs past the model's positions with every request together."""
    from brisk.bench.quant import decode_rate
    from brisk.engine.llm import LLM

    shape = mem.model_shape(tiny)
    p = mem.Precision("float32", torch.float32)
    bounded = mem.kv_pool_bytes(shape, p, "auto", 100_000, 4, stream_budget=64)
    assert bounded == mem.kv_pool_bytes(shape, p, "auto", 8192, 4, stream_budget=64)
    assert bounded < mem.kv_pool_bytes(shape, p, "auto", 8192, 4)
    # at a context within the budget nothing is evicted: the full pool
    assert mem.kv_pool_bytes(shape, p, "auto", 64, 4, stream_budget=64) == mem.kv_pool_bytes(shape, p, "auto", 64, 4)
    settings = mem.engine_settings(shape, p, "auto", 1024, 4, stream_budget=64)
    assert settings["kv_policy"] == "streaming" and settings["kv_budget"] == 64 and settings["sink_tokens"] == 4
    llm = LLM(tiny, enable_prefix_caching=False, **settings)
    assert llm.engine.max_model_len == 1024 > shape.footprint.config.max_position_embeddings
    rate, tokens = decode_rate(llm, [(7 * j) % 200 + 3 for j in range(600)], 4, 8)  # raises unless together
    assert rate > 0 and len(tokens) == 8 and llm.engine.scheduler.num_preemptions == 0


def test_streaming_is_predicted_from_the_tokens_it_keeps():
    from brisk.advise import speed as spd

    factors = spd.stored_factors()
    cal = spd.Calibration(read_gbps=20.0, probed="float32", decode_tok_s=40.0, prefill_tok_s=400.0,
                          weight_bytes=500 * 2**20, kv_bytes_read=0, seconds=1.0, efficiency=0.8)

    def rate(context: int, budget: int | None) -> float:
        return spd.predict(cal, factors, "float32", cal.weight_bytes, 30 * 1536, context, 16, num_layers=30,
                           stream_budget=budget).decode_batch_tok_s

    assert rate(32768, 1024) > 4 * rate(32768, None)  # reads ~1k tokens a step, not ~16k
    assert rate(32768, 1024) > rate(32768, 4096)
    assert rate(512, 1024) == rate(512, None)  # nothing evicted: the full cache


def test_advise_past_the_models_positions_ranks_streaming_only(tiny, monkeypatch):
    ppl = {"float32": 10.0, "int8": 10.05, "kv-int8": 10.02, "stream-full": 9.0, "streaming-512": 9.3,
           "streaming-1024": 9.1, "streaming-2048": 9.05, "streaming-4096": 9.01}
    monkeypatch.setattr(qual, "stored_table", lambda model: _table(ppl))
    a = advise(tiny, 2**30, "latency", 0.05, context=32768, read_gbps=20.0)
    assert a.ranked and all(c.stream_budget is not None for c in a.ranked)
    assert any("past the model's 512 positions" in why for c, why in a.rejected if c.stream_budget is None)
    best = a.ranked[0]
    assert best.quality == pytest.approx(qual.combined_cost(_table(ppl), [
        *([] if best.precision.name == "float32" else [best.precision.name]),
        *([] if best.kv_cache_dtype == "auto" else [f"kv-{best.kv_cache_dtype}"]), f"streaming-{best.stream_budget}"]))
    serve = next(line for line in a.commands if line.startswith("brisk serve"))
    assert f"--kv-policy streaming --kv-budget {best.stream_budget} --sink-tokens 4" in serve
    assert "--max-model-len 32768" in serve


def test_a_smaller_step_budget_is_taken_when_the_default_does_not_fit(tiny):
    """One step's activations scale with the step's token budget: when the engine's default 2,048 does not fit,
    the candidate is priced (and run) at the largest smaller budget that does; --memory-scope engine leaves the
    process's runtime out of the comparison."""
    from brisk.advise import speed as spd
    from brisk.advise.advisor import build_candidates, commands

    shape = mem.model_shape(tiny)
    p = mem.Precision("float32", torch.float32)
    full, _ = mem.estimate(shape, p, "auto", 256, 1)
    small, settings = mem.estimate(shape, p, "auto", 256, 1, step_tokens=256)
    assert small.activations < full.activations and settings["max_num_batched_tokens"] == 256
    cal = spd.Calibration(20.0, "float32", 1.0, 1.0, 1, 0, 0.0, 1.0)
    budget = small.total - small.runtime  # fits only at the smallest step, and only without the runtime
    for scope, step in (("engine", 256), ("process", 2048)):  # nothing fits the process: the default step
        cands = build_candidates(shape, cal, spd.stored_factors(), None, 256, 1, budget, scope)
        plain = next(c for c in cands if c.name == "float32")
        assert plain.settings["max_num_batched_tokens"] == step
    assert plain.charged("engine") == plain.memory.total - plain.memory.runtime
    engine = next(c for c in build_candidates(shape, cal, spd.stored_factors(), None, 256, 1, budget, "engine")
                  if c.name == "float32")
    assert "--max-num-batched-tokens 256" in commands(engine, tiny, "latency")[-1]


def test_scenarios_measure_a_spread_of_formats(tiny, monkeypatch):
    from brisk.advise.scenarios import main as scenarios_main
    from brisk.advise.scenarios import spread

    table = _table({"float32": 10.0, "bfloat16": 10.01, "int8": 10.02, "kv-int8": 10.01, "kv-int4": 10.05})
    monkeypatch.setattr(qual, "stored_table", lambda model: table)
    a = advise(tiny, 2**30, "latency", 0.05, context=256, read_gbps=20.0)
    picked = spread(a, 5)
    assert picked[:2] == a.ranked[:2] and len(set(map(id, picked))) == 5
    formats = {c.precision.name for c in picked}
    assert {"float32", "bfloat16", "int8"} <= formats  # each format's best-ranked is measured
    with pytest.raises(SystemExit):
        scenarios_main(["--scenarios", "nope"])


def test_every_candidate_is_a_configuration_the_engine_accepts(tiny):
    """The settings a candidate is priced at are what its command runs: each must pass the engine's own validation
    (speculative decoding with an int4 cache, for one, is refused there and is no candidate)."""
    from brisk.advise import speed as spd
    from brisk.advise.advisor import build_candidates
    from brisk.engine.settings import build_engine_config

    shape = mem.model_shape(tiny)
    cal = spd.Calibration(20.0, "float32", 1.0, 1.0, 1, 0, 0.0, 1.0)
    cands = build_candidates(shape, cal, spd.stored_factors(), None, 2048, 4)
    assert any(c.stream_budget for c in cands) and any(c.speculative for c in cands)
    assert not any(c.speculative and c.kv_cache_dtype == "int4" for c in cands)
    for c in cands:
        build_engine_config(**c.settings)
