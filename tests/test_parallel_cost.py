"""The parallel cost model's arithmetic on hand-computed inputs, its monotonic behaviour, and `brisk bench parallel`
end to end on a tiny random model with 2 ranks (short mode)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

from brisk.parallel.cost import (
    Link,
    ModelShape,
    RankSpeed,
    all_reduce_s,
    gather_s,
    model_shape,
    predict,
    send_s,
    speedup,
)

# 2 layers of 1000 matmul parameters, hidden 10, vocab 100 (head: 1000 parameters), 1 byte a parameter
SHAPE = ModelShape("toy", num_layers=2, hidden_size=10, vocab_size=100, layer_params=1000, head_params=1000,
                   kv_values_per_token=4)
LINK = Link(latency_s=1e-3, bandwidth=1000.0)  # 1 ms, 1000 bytes/s
SPEED = RankSpeed(mem_bandwidth=1000.0, flops=1e9, step_overhead_s=0.01)  # memory bound at batch 1


def test_collectives_hand_computed():
    # ring over 2 ranks: 2 steps of latency, 2 (N-1)/N = 1 x the bytes
    assert all_reduce_s(400, 2, LINK) == pytest.approx(2e-3 + 0.4)
    # 4 ranks: 6 latencies, 1.5 x the bytes
    assert all_reduce_s(400, 4, LINK) == pytest.approx(6e-3 + 0.6)
    assert all_reduce_s(400, 1, LINK) == 0.0
    assert send_s(80, LINK) == pytest.approx(1e-3 + 0.08)
    assert gather_s(80, 3, LINK) == pytest.approx(2 * (1e-3 + 0.08))


def test_single_and_tensor_parallel_step_hand_computed():
    single = predict(SHAPE, "single", 1, 1, SPEED, bytes_per_param=1.0)
    # 3000 bytes / 1000 bytes/s = 3 s of weights (flops: 6000 / 1e9, negligible) + 10 ms host
    assert single.compute_s == pytest.approx(3.0)
    assert single.step_s == pytest.approx(3.01)
    assert single.tok_s == pytest.approx(1 / 3.01)
    tp = predict(SHAPE, "tp", 2, 1, SPEED, LINK, bytes_per_param=1.0, act_bytes=4)
    # each rank streams half: 1.5 s; 2 layers x 2 all-reduces of 1 x 10 x 4 = 40 bytes: 4 x (2 ms + 40 ms);
    # logits gather: 1 x (1 ms + 1 x 50 x 4 bytes / 1000) = 201 ms; the schedule to the worker: 1 ms
    assert tp.compute_s == pytest.approx(1.5)
    assert tp.comm_s == pytest.approx(4 * 0.042 + 0.201 + 0.001)
    assert tp.step_s == pytest.approx(0.01 + 1.5 + 0.370)
    assert tp.read_bytes_per_rank == pytest.approx(1500)
    # sends on a link of their own: only the schedule's latency moves (collectives stay on LINK)
    tp2 = predict(SHAPE, "tp", 2, 1, SPEED, LINK, bytes_per_param=1.0, p2p=Link(5e-3, 1000.0))
    assert tp2.comm_s == pytest.approx(4 * 0.042 + 0.201 + 0.005)


def test_host_time_per_step_per_layer_and_per_token():
    speed = RankSpeed(1000.0, 1e9, step_overhead_s=0.01, layer_overhead_s=0.002, step_token_s=0.001,
                      layer_token_s=0.0005)
    # driver: 10 ms + 4 x 1 ms, + 3 layers x (2 ms + 4 x 0.5 ms); a worker only the layers
    assert speed.host_s(3, 4) == pytest.approx(0.014 + 3 * 0.004)
    assert speed.host_s(3, 4, driver=False) == pytest.approx(3 * 0.004)
    with pytest.raises(ValueError, match="cannot be negative"):
        RankSpeed(1000.0, 1e9, layer_token_s=-1.0)


def test_pipeline_overlap_hand_computed():
    link = Link(0.0, 1e12)  # a free link: only the stages count
    # stage 0: 1 layer = 1 s + the driver's 10 ms host; stage 1: 1 layer + head = 2 s
    one = predict(SHAPE, "pp", 2, 1, SPEED, link, bytes_per_param=1.0)
    assert one.step_s == pytest.approx(1.01 + 2.0, rel=1e-6)  # one micro-batch walks both stages
    four = predict(SHAPE, "pp", 2, 4, SPEED, link, bytes_per_param=1.0)
    assert four.step_s == pytest.approx(2 * 2.0, rel=1e-6)  # 2 micro-batches: 2 x the slowest stage
    assert four.tok_s == pytest.approx(4 / 4.0, rel=1e-6)
    # a slow driver makes the first stage the slowest
    slow = predict(SHAPE, "pp", 2, 4, RankSpeed(1000.0, 1e9, step_overhead_s=1.5), link, bytes_per_param=1.0)
    assert slow.step_s == pytest.approx(2 * 2.5, rel=1e-6)
    # the hand-offs on the p2p link: stage 0 sends [2, 2, 10] float32 (160 bytes), stage 1 the logits (2 x 100 x 4)
    wire = Link(0.0, 1000.0)
    sent = predict(SHAPE, "pp", 2, 4, SPEED, link, bytes_per_param=1.0, p2p=wire)
    assert sent.step_s == pytest.approx(2 * (2.0 + 0.8), rel=1e-6)


def test_fit_link_least_squares():
    from brisk.bench.cli_parallel import fit_link

    pts = [{"bytes": b, "seconds": 1e-4 + b / 2e9} for b in (1000, 10_000, 100_000)]
    fit = fit_link(pts)
    assert fit["latency_s"] == pytest.approx(1e-4) and fit["bandwidth"] == pytest.approx(2e9)
    # a ring all-reduce on 2 ranks: 2 latencies, the bytes once
    ar = fit_link([{"bytes": b, "seconds": 2e-4 + b / 2e9} for b in (1000, 100_000)], steps=2, share=1)
    assert ar["latency_s"] == pytest.approx(1e-4) and ar["bandwidth"] == pytest.approx(2e9)
    # noise larger than the bytes' part: all latency, never a negative bandwidth
    flat = fit_link([{"bytes": 1000, "seconds": 3e-4}, {"bytes": 100_000, "seconds": 2e-4}])
    assert flat["latency_s"] == pytest.approx(2.5e-4) and flat["bandwidth"] == pytest.approx(100_000 / 2e-4)


def test_more_bandwidth_is_faster_and_more_ranks_split_the_weights():
    shape = model_shape("llama-3.1-8b")
    rank = RankSpeed(mem_bandwidth=100e9, flops=1e12, step_overhead_s=1e-3)
    times = [predict(shape, "tp", 8, 1, rank, Link(5e-6, bw)).step_s for bw in (1e9, 5e9, 25e9, 100e9)]
    assert times == sorted(times, reverse=True) and times[0] > times[-1]
    pp = [predict(shape, "pp", 8, 8, rank, Link(5e-6, bw)).step_s for bw in (1e9, 25e9)]
    assert pp[0] > pp[1]
    per_rank = [predict(shape, "tp", n, 1, rank, Link(0.0, 1e15)).read_bytes_per_rank for n in (1, 2, 4, 8)]
    assert per_rank == pytest.approx([per_rank[0] / n for n in (1, 2, 4, 8)])
    # a faster link, a higher speed-up; a slower rank (fewer threads each), a lower one
    fast = speedup(shape, "tp", 8, 1, rank, rank, Link(5e-6, 100e9))
    slow = speedup(shape, "tp", 8, 1, rank, rank, Link(5e-6, 1e9))
    assert fast > slow
    half = RankSpeed(50e9, 0.5e12, 1e-3)
    assert speedup(shape, "tp", 8, 1, rank, half, Link(5e-6, 100e9)) < fast


def test_model_shape_of_a_named_shape():
    s = model_shape("llama-3.1-8b")
    # q, o: 4096 x 4096; k, v: 4096 x 1024; gate, up, down: 4096 x 14336
    assert s.layer_params == 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert s.head_params == 128256 * 4096
    assert s.matmul_params == 32 * s.layer_params + s.head_params
    assert model_shape("llama-3.1-70b").num_layers == 80


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="unknown parallel mode"):
        predict(SHAPE, "dp", 2, 1, SPEED, LINK)
    with pytest.raises(ValueError, match="cannot be split into 3 pipeline stages"):
        predict(SHAPE, "pp", 3, 1, SPEED, LINK)
    with pytest.raises(ValueError, match="needs a Link"):
        predict(SHAPE, "tp", 2, 1, SPEED)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Link(1e-6, 0.0)
    with pytest.raises(ValueError, match="unknown shape"):
        model_shape("llama-9000")


def test_bench_parallel_end_to_end(tmp_path):
    from brisk.bench.cli import bench

    path = tmp_path / "m"
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=384)
    out = tmp_path / "parallel.json"
    result = CliRunner().invoke(bench, ["parallel", "--model", str(path), "--short", "--batch", "4",
                                        "--input-len", "16", "--max-model-len", "128", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "decode tok/s" in result.output and "PP2" in result.output
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "parallel" and doc["ranks"] == 2
    assert set(doc["summary"]) == {f"{m}/{b}" for m in ("single", "tp", "pp") for b in (1, 4)}
    for row in doc["summary"].values():
        assert row["measured_tok_s"] > 0 and row["predicted_tok_s"] > 0
    assert [p["bytes"] for p in doc["link"]["all_reduce"]] == [r * 64 * 4 for r in (1, 4, 16)]
    assert [p["bytes"] for p in doc["link"]["gather"]] == [r * 192 * 4 for r in (1, 4)]  # vocab 384 / 2 ranks
    assert [p["bytes"] for p in doc["link"]["send_recv"]] == ([2 * r * 64 * 4 for r in (1, 4, 16)]
                                                              + [r * 384 * 4 for r in (1, 4)])
    assert doc["link"]["collectives"]["bandwidth"] > 0 and doc["link"]["p2p"]["bandwidth"] > 0
    assert all(doc["decode"][f"modules/{b}"]["forward_s"] > 0 for b in (1, 4))
    assert len(doc["compute"]["tp"]) == 2 and set(doc["compute"]["tp"][0]["seconds"]) == {"1", "4", "16"}
    # tensor parallelism: each rank holds about half the weights
    full = doc["weight_bytes_per_rank"]["single"][0]
    assert all(0.4 < w / full < 0.6 for w in doc["weight_bytes_per_rank"]["tp"])
    assert sum(doc["weight_bytes_per_rank"]["pp"]) == pytest.approx(full, rel=0.05)


def test_bench_parallel_refuses_bad_options():
    from brisk.bench.cli import bench

    result = CliRunner().invoke(bench, ["parallel", "--ranks", "1"])
    assert result.exit_code != 0 and "--ranks >= 2" in result.output


def test_bench_parallel_predict_writes_the_table(tmp_path):
    from brisk.bench.cli import bench

    out = tmp_path / "predict.json"
    result = CliRunner().invoke(bench, ["parallel", "--predict", "llama-3.1-8b", "--ranks", "8", "--context", "0",
                                        "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["predicted"]
    assert [(r["mode"], r["batch"]) for r in rows] == [(m, b) for b in (1, 8) for m in ("single", "tp", "pp")]
    single, tp = rows[0], rows[1]
    # 1 rank of 200 GB/s reading 2 bytes x the matmul parameters, + 1 ms host
    params = model_shape("llama-3.1-8b").matmul_params
    assert single["step_s"] == pytest.approx(2 * params / 200e9 + 1e-3)
    assert tp["speedup"] == pytest.approx(single["step_s"] / tp["step_s"])
