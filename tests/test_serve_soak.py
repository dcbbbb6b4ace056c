"""`brisk bench serve --soak`: a short soak of mixed requests against a real tiny `brisk serve` process reports the
server's RSS before / peak / after and its growth; and the two things that keep the RSS flat (serve/memory.py).
No timing assertions; the memory bound is loose (a short soak after warm-up, +50%)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from click.testing import CliRunner
from test_serve import model_dir  # noqa: F401 - the tiny model, shared with test_serve

from brisk.bench.soak import KINDS, _body
from brisk.cli import main
from brisk.serve.memory import IdleTrimmer, prefault_kv_pool

pytest.importorskip("llguidance")
MIB = 2**20


def test_the_mix_is_seeded_and_covers_every_kind():
    words = "the quick brown fox jumps over the lazy dog".split() * 40
    bodies = [_body(i, "m", words, seed=0) for i in range(60)]
    assert bodies == [_body(i, "m", words, seed=0) for i in range(60)]
    assert bodies != [_body(i, "m", words, seed=1) for i in range(60)]
    assert set(Counter(kind for kind, _, _ in bodies)) == set(KINDS)
    for kind, path, body in bodies:
        assert path in ("/v1/completions", "/v1/chat/completions")
        assert 1 <= body["max_tokens"] <= 32
        assert kind != "n_samples" or body["n"] in (2, 3)


def test_prefault_keeps_the_pool_zero_and_covers_its_tensors():
    caches = [torch.zeros(2, 8, 16, 2, 4) for _ in range(3)]
    assert prefault_kv_pool([*caches, object()]) == 3 * caches[0].numel() * 4
    assert all(not c.any() for c in caches)


def test_the_idle_trimmer_trims_once_per_burst():
    trimmer = IdleTrimmer(interval_s=0.0)
    trimmer.idle()
    assert trimmer.num_trims == 0  # no work since start: nothing to give back
    trimmer.worked()
    trimmer.idle()
    trimmer.idle()
    assert trimmer.num_trims in (0, 1)  # 0 where the C library has no malloc_trim
    assert not trimmer.dirty


def test_a_short_soak_reports_sane_rss_figures(model_dir, tmp_path):  # noqa: F811
    out = tmp_path / "soak.json"
    args = ["bench", "serve", "--model", model_dir, "--max-model-len", "2048", "--kv-cache-memory", "16MiB",
            "--soak", "60", "--soak-warmup", "16", "--soak-threads", "8", "--soak-max-growth", "50", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "server RSS flat under a soak" in result.output
    soak = json.loads(out.read_text())["soak"]
    assert soak["num_requests"] == 60 and soak["warmup_requests"] == 16
    assert sum(soak["kinds"].values()) == 60
    assert soak["outcomes"].get("failed", 0) == 0 and not soak["errors"]
    assert soak["outcomes"].get("completed", 0) + soak["outcomes"].get("disconnected", 0) \
        + soak["outcomes"].get("rejected", 0) == 60
    assert soak["outcomes"].get("completed", 0) > 0
    before, after, peak = soak["rss_before_bytes"], soak["rss_after_bytes"], soak["rss_peak_bytes"]
    assert 50 * MIB < soak["rss_start_bytes"] and 50 * MIB < before < 8192 * MIB
    assert peak >= max(before, after)
    assert soak["growth_pct"] == pytest.approx(100 * (after - before) / before)
    assert soak["growth_pct"] < 50, soak["detail"]
    assert soak["verdict"] == "PASS"
