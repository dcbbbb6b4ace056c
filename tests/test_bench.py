"""`brisk bench`: the bytes-per-token arithmetic exactly, the measurement loops on a tiny model (counts and
internal consistency, never speed), and the CLI end to end with its JSON, with and without the HF baseline."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.bench.latency import LatencyResult, merge_results, run_latency
from brisk.bench.membw import measure_membw
from brisk.bench.prompts import make_prompt, sample_prompts, text_token_ids
from brisk.bench.roofline import (
    config_weight_bytes_per_token,
    decode_bytes_per_token,
    kv_bytes_read,
    mean_decode_context,
    weight_bytes_per_token,
)
from brisk.bench.throughput import run_throughput
from brisk.cli import main
from brisk.model.config import ModelConfig


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("bench")
    untied = make_tiny_hf_model(root / "untied", "llama", num_kv_heads=2, seed=3)
    tied = make_tiny_hf_model(root / "tied", "llama", num_kv_heads=2, seed=4, tie_word_embeddings=True)
    return {"untied": root / "untied", "tied": root / "tied", "hf_untied": untied, "hf_tied": tied}


@pytest.fixture(scope="module")
def tiny_llm(tiny_dirs: dict) -> LLM:
    # no prefix caching: latency runs repeat one prompt
    return LLM(str(tiny_dirs["untied"]), max_model_len=128, kv_cache_memory="4MiB",
               enable_prefix_caching=False)


# ---------------------------------------------------------------------------- bytes per token
def _config(tied: bool) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=100, hidden_size=8, intermediate_size=16,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True])
def test_bytes_per_token_formula_exact(tied: bool) -> None:
    # per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 + mlp 3x8x16 + 2 norms x 8 = 592; two layers 1184;
    # final norm 8; lm_head 100x8 = 800; one embedding row 8 -> 2000 parameters read, tied or not
    cfg = _config(tied)
    assert config_weight_bytes_per_token(cfg, 4) == 2000 * 4
    assert config_weight_bytes_per_token(cfg, 2) == 2000 * 2
    # K and V x 2 layers x 1 kv head x head_dim 4 x 4 bytes x 10 positions
    assert kv_bytes_read(cfg, 4, 10) == 2 * 2 * 1 * 4 * 4 * 10
    assert decode_bytes_per_token(8000, cfg, 4, 10) == 8000 + 640
    assert decode_bytes_per_token(8000, cfg, 2, 2.5) == 8000 + 2 * 2 * 1 * 4 * 2 * 2.5


def test_mean_decode_context() -> None:
    # decode steps attend to input_len + 1 .. input_len + output_len - 1 positions
    for input_len, output_len in [(128, 128), (5, 2), (7, 9)]:
        steps = [input_len + j for j in range(1, output_len)]
        assert mean_decode_context(input_len, output_len) == pytest.approx(sum(steps) / len(steps))
    assert mean_decode_context(5, 1) == 5


@pytest.mark.parametrize("which", ["untied", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_weight_bytes_match_config(tiny_dirs: dict, which: str, dtype: torch.dtype) -> None:
    from brisk.model.loader import load_model

    loaded = load_model(tiny_dirs[which], dtype=dtype)
    dtype_bytes = torch.finfo(dtype).bits // 8
    expected = config_weight_bytes_per_token(loaded.config, dtype_bytes)
    assert weight_bytes_per_token(loaded.model) == expected
    # transformers' module of the same checkpoint (its tied lm_head shares the embedding's storage)
    assert weight_bytes_per_token(copy.deepcopy(tiny_dirs[f"hf_{which}"]).to(dtype)) == expected


# ---------------------------------------------------------------------------- prompts and membw
def test_sample_prompts_seeded_and_in_range(tiny_llm: LLM) -> None:
    tok = tiny_llm.get_tokenizer()
    a = sample_prompts(tok, 20, 5, 40, seed=1)
    assert a == sample_prompts(tok, 20, 5, 40, seed=1)
    assert a != sample_prompts(tok, 20, 5, 40, seed=2)
    assert all(5 <= len(p) <= 40 for p in a)
    ids = text_token_ids(tok)
    cyclic = ids + ids[:40]
    for p in a[:3]:  # each prompt is a window of the text
        assert any(cyclic[i:i + len(p)] == p for i in range(len(ids)))
    assert make_prompt(tok, ids, len(ids) - 3, 10) == ids[-3:] + ids[:7]  # wraps around the end


def test_prompts_start_with_bos_when_the_tokenizer_adds_it(tmp_path: Path) -> None:
    from hf_utils import write_tiny_tokenizer

    from brisk.model.tokenizer import Tokenizer

    write_tiny_tokenizer(tmp_path, add_bos_token=True, bos_token="<|endoftext|>")
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.add_bos_token
    ids = text_token_ids(tok)
    p = make_prompt(tok, ids, 5, 10)
    assert p == [tok.bos_token_id] + ids[5:14]
    assert all(q[0] == tok.bos_token_id for q in sample_prompts(tok, 4, 1, 9, seed=0))


def test_membw_small_buffer() -> None:
    r = measure_membw(8 << 20, runs=2)
    assert r.buffer_bytes == 8 << 20 and r.runs == 2 and r.num_threads == torch.get_num_threads()
    assert r.read_gbps > 0 and r.copy_gbps > 0
    with pytest.raises(ValueError, match="at least 4 KiB"):
        measure_membw(1024)


# ---------------------------------------------------------------------------- the loops
def test_merge_results_concatenates_runs_and_weights_the_step_split() -> None:
    a = LatencyResult(8, 3, [0.1], [0.01, 0.03], [0.14], [1, 2, 3], {"forward": 10.0, "total": 12.0, "steps": 2.0})
    b = LatencyResult(8, 3, [0.2], [0.02, 0.02], [0.24], [1, 2, 4], {"forward": 4.0, "total": 6.0, "steps": 6.0})
    m = merge_results([a, b])
    assert m.ttft_s == [0.1, 0.2] and m.tpot_s == [0.01, 0.03, 0.02, 0.02] and m.e2e_s == [0.14, 0.24]
    assert m.token_ids == [1, 2, 4]  # the last part's
    assert m.step_split_ms == {"forward": pytest.approx(5.5), "total": pytest.approx(7.5), "steps": 8.0}
    with pytest.raises(ValueError, match="different request shapes"):
        merge_results([a, LatencyResult(9, 3)])


def test_latency_counts_and_consistency(tiny_llm: LLM) -> None:
    prompt = make_prompt(tiny_llm.get_tokenizer(), text_token_ids(tiny_llm.get_tokenizer()), 0, 12)
    ticks = []
    res = run_latency(tiny_llm, prompt, output_len=5, runs=2, warmup=1, advance=ticks.append)
    assert sum(ticks) == 3 * 5  # warm-up runs are generated too, just not recorded
    assert res.runs == 2 and len(res.e2e_s) == 2 and len(res.tpot_s) == 2 * 4
    assert all(t > 0 for t in res.ttft_s + res.tpot_s)
    for run in range(2):  # end-to-end time = first token + the gaps between the later ones
        gaps = res.tpot_s[4 * run:4 * run + 4]
        assert res.e2e_s[run] == pytest.approx(res.ttft_s[run] + sum(gaps))
    assert res.decode_tok_s == pytest.approx(1 / (sum(res.tpot_s) / 8))
    greedy = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert res.token_ids == greedy[0].outputs[0].token_ids
    assert not tiny_llm.engine.has_unfinished_requests()
    # the decode-step split covers the 2 measured runs' 4 decode steps each, and its parts add up
    split = res.step_split_ms
    assert split["steps"] == 2 * 4
    parts = ("schedule", "prepare", "forward", "sample", "runner_other", "update_outputs")
    assert all(split[k] >= 0 for k in parts) and split["forward"] > 0
    assert split["total"] == pytest.approx(sum(split[k] for k in parts))
    # and the decode steps' wall time bounds it: a mean step is within the mean time per output token
    assert split["total"] <= 1e3 * max(res.tpot_s)


def test_throughput_counts_and_kv_stats(tiny_llm: LLM) -> None:
    prompts = sample_prompts(tiny_llm.get_tokenizer(), 6, 4, 30, seed=0)
    finished = []
    res = run_throughput(tiny_llm, prompts, output_len=5, advance=finished.append)
    assert sum(finished) == 6
    assert res.output_tokens == 6 * 5 and res.prompt_tokens == sum(len(p) for p in prompts)
    assert res.num_steps >= 5 and len(res.kv_usage) == res.num_steps
    assert all(0 < u <= 1 for u in res.kv_slot_util)
    assert res.num_preemptions == 0
    s = res.summary()
    assert s["output_tok_s"] == pytest.approx(30 / res.elapsed_s)
    assert s["total_tok_s"] == pytest.approx((30 + res.prompt_tokens) / res.elapsed_s)


def test_throughput_counts_preemptions(tiny_dirs: dict) -> None:
    # 4 blocks of 16 slots for six requests of up to 35 tokens: the pool runs out, requests are preempted
    llm = LLM(str(tiny_dirs["untied"]), max_model_len=64, num_kv_blocks=4)
    prompts = sample_prompts(llm.get_tokenizer(), 6, 20, 30, seed=0)
    res = run_throughput(llm, prompts, output_len=5)
    assert res.output_tokens == 6 * 5
    assert res.num_preemptions >= 1
    assert max(res.kv_usage) == 1.0 and all(0 <= u <= 1 for u in res.kv_usage)


# ---------------------------------------------------------------------------- the CLI
def _invoke(args: list[str]) -> Result:
    return CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)


def test_cli_membw_json(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    r = _invoke(["membw", "--size", "8MiB", "--runs", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "membw" and doc["membw"]["read_gbps"] > 0
    assert {"cpu_count", "torch_threads", "torch_version"} <= set(doc["machine"])


def test_cli_latency_against_another_model(tiny_dirs: dict, tmp_path: Path) -> None:
    """--baseline-model: a second engine on another model with the same settings, runs alternated; the speedup is
    of the first over the second, and each side's bytes per token are its own model's."""
    out = tmp_path / "l.json"
    r = _invoke(["latency", "--model", str(tiny_dirs["untied"]), "--baseline-model", str(tiny_dirs["tied"]),
                 "--input-len", "8", "--output-len", "4", "--runs", "2", "--warmup", "1", "--membw", "10",
                 "--kv-cache-memory", "4MiB", "--max-model-len", "64", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "alternated" in r.output and "tied" in r.output
    doc = json.loads(out.read_text())
    ours, theirs = doc["brisk"], doc["baseline_model"]
    assert doc["speedup"]["decode_tok_s"] == pytest.approx(ours["decode_tok_s"] / theirs["decode_tok_s"])
    assert theirs["runs"] == 2 and len(theirs["token_ids"]) == 4
    bad = CliRunner().invoke(main, ["bench", "latency", "--model", str(tiny_dirs["untied"]), "--baseline-model",
                                    str(tiny_dirs["tied"]), "--baseline", "hf"])
    assert bad.exit_code != 0 and "give one" in bad.output


@pytest.mark.parametrize("interleave", [True, False])
def test_cli_latency_with_hf_baseline(tiny_dirs: dict, tmp_path: Path, interleave: bool) -> None:
    out = tmp_path / "l.json"
    r = _invoke(["latency", "--model", str(tiny_dirs["untied"]), "--input-len", "8", "--output-len", "4",
                 "--runs", "3", "--warmup", "1", "--membw", "10", "--kv-cache-memory", "4MiB",
                 "--max-model-len", "64", "--baseline", "hf", "--json", str(out),
                 "--interleave" if interleave else "--no-interleave"])
    assert r.exit_code == 0, r.output
    assert "decode tok/s" in r.output and "transformers" in r.output
    assert ("alternated" in r.output) == interleave
    doc = json.loads(out.read_text())
    assert {"benchmark", "command", "params", "date", "machine", "brisk", "hf", "speedup"} <= set(doc)
    assert doc["params"]["input_len"] == 8 and doc["membw_read_gbps"] == 10
    assert doc["brisk"]["peak_rss_bytes"] > 0
    # the load's cost: its wall seconds (within the engine's start-up) and the peak RSS after it and after the runs
    b = doc["brisk"]
    assert 0 < b["load_s"] <= b["start_s"] and b["load_s"] == doc["model"]["load_s"]
    assert 0 < b["peak_rss_after_load_bytes"] <= b["peak_rss_after_run_bytes"]
    assert b["peak_rss_after_run_bytes"] >= b["peak_rss_bytes"]
    assert "model load (s)" in r.output and "peak RSS after load (MiB)" in r.output
    # interleaved, both models are resident: the baseline's own peak cannot be told apart
    assert (doc["hf"]["peak_rss_bytes"] is None) == interleave
    assert doc["brisk"]["decode_step_split_ms"]["steps"] == 3 * 3  # 3 measured runs of 3 decode steps
    for side in ("brisk", "hf"):
        d = doc[side]
        assert d["runs"] == 3 and len(d["token_ids"]) == 4 and len(d["ttft_s_all"]) == 3
        assert d["achieved_gbps"] == pytest.approx(d["bytes_per_token"] * d["decode_tok_s"] / 1e9)
        assert d["fraction_of_membw"] == pytest.approx(d["achieved_gbps"] / 10)
        assert d["tpot_s_p50"] <= d["tpot_s_p90"]
    assert doc["brisk"]["bytes_per_token"] == doc["hf"]["bytes_per_token"]  # same weights, same KV
    assert doc["same_tokens"] is True  # float32 greedy on both sides: the same work was timed
    assert doc["speedup"]["decode_tok_s"] == pytest.approx(
        doc["brisk"]["decode_tok_s"] / doc["hf"]["decode_tok_s"])


def test_cli_latency_with_a_bfloat16_kv_cache(tiny_dirs: dict, tmp_path: Path) -> None:
    """--kv-cache-dtype reaches the engine (recorded in the JSON); the pool stays within the same budget."""
    docs = {}
    for kv in ("auto", "bfloat16"):
        out = tmp_path / f"{kv}.json"
        r = _invoke(["latency", "--model", str(tiny_dirs["untied"]), "--input-len", "8", "--output-len", "3",
                     "--runs", "1", "--warmup", "0", "--membw", "10", "--kv-cache-memory", "4MiB",
                     "--max-model-len", "64", "--kv-cache-dtype", kv, "--json", str(out)])
        assert r.exit_code == 0, r.output
        docs[kv] = json.loads(out.read_text())
    assert docs["bfloat16"]["params"]["kv_cache_dtype"] == "bfloat16"
    pools = [docs[kv]["brisk"]["kv_pool_bytes"] for kv in ("auto", "bfloat16")]
    assert abs(pools[0] - pools[1]) <= 0.01 * pools[0]  # the same budget, spent on 16-bit entries
    assert len(docs["bfloat16"]["brisk"]["token_ids"]) == 3


def test_cli_throughput_with_hf_baseline(tiny_dirs: dict, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    r = _invoke(["throughput", "--model", str(tiny_dirs["tied"]), "--num-prompts", "5",
                 "--input-len-min", "3", "--input-len-max", "20", "--output-len", "4",
                 "--kv-cache-memory", "4MiB", "--max-model-len", "64",
                 "--baseline", "hf", "--hf-batch-size", "2", "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert len(doc["prompt_lens"]) == 5 and all(3 <= n <= 20 for n in doc["prompt_lens"])
    assert doc["brisk"]["output_tokens"] == doc["hf"]["output_tokens"] == 5 * 4
    assert doc["brisk"]["prompt_tokens"] == doc["hf"]["prompt_tokens"] == sum(doc["prompt_lens"])
    assert 0 < doc["brisk"]["kv_slot_util_mean"] <= 1 and doc["brisk"]["num_preemptions"] == 0
    assert 0 < doc["brisk"]["load_s"] <= doc["brisk"]["start_s"]
    assert 0 < doc["brisk"]["peak_rss_after_load_bytes"] <= doc["brisk"]["peak_rss_after_run_bytes"]
    assert "peak RSS after the runs (MiB)" in r.output
    assert doc["speedup"]["output_tok_s"] == pytest.approx(
        doc["brisk"]["output_tok_s"] / doc["hf"]["output_tok_s"])


def test_cli_baseline_without_transformers(tiny_dirs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` sees when absent
    r = CliRunner().invoke(main, ["bench", "latency", "--model", str(tiny_dirs["untied"]),
                                  "--baseline", "hf"])
    assert r.exit_code != 0
    assert "pip install" in r.output and "transformers" in r.output


def test_cli_rejects_lengths_over_max_model_len(tiny_dirs: dict) -> None:
    r = CliRunner().invoke(main, ["bench", "latency", "--model", str(tiny_dirs["untied"]),
                                  "--max-model-len", "32", "--kv-cache-memory", "4MiB",
                                  "--input-len", "30", "--output-len", "8"])
    assert r.exit_code != 0 and "--max-model-len 38" in r.output


def test_cli_spec_runs_each_method_against_plain(tiny_dirs: dict, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`brisk bench spec` end to end on a tiny model: every method's greedy output equals plain decoding (in both
    of the default two rounds), and --disable-by-batch-size reaches the engines' speculative configs."""
    import brisk.spec.bench as spec_bench

    configs = []
    real_engine = spec_bench._engine
    monkeypatch.setattr(spec_bench, "_engine", lambda loaded, spec, *a: configs.append(spec) or
                        real_engine(loaded, spec, *a))
    out = tmp_path / "s.json"
    r = _invoke(["spec", "--model", str(tiny_dirs["untied"]), "--methods", "ngram,self:int8", "--sets", "chat",
                 "--num-prompts", "1", "--concurrency", "2", "--max-tokens", "8", "--num-speculative-tokens", "2",
                 "--disable-by-batch-size", "none", "--json", str(out)])
    assert r.exit_code == 0, r.output
    runs = json.loads(out.read_text())["runs"]
    assert [(x["method"], x["batch"]) for x in runs] == [(m, b) for b in ("1", "concurrent")
                                                        for m in ("plain", "ngram", "self:int8")]
    for x in runs:
        assert x["tokens_per_s"] > 0 and x["output_tokens"] == 8 * x["num_requests"]
        if x["method"] != "plain":
            assert x["identical_to_plain"] is True and x["speedup"] > 0
    specs = [c for c in configs if c is not None]
    assert [c.method for c in specs] == ["ngram", "self"] and all(c.disable_by_batch_size is None for c in specs)
    assert all(c.num_speculative_tokens == 2 for c in specs)
    bad = CliRunner().invoke(main, ["bench", "spec", "--model", str(tiny_dirs["untied"]),
                                    "--disable-by-batch-size", "0"])
    assert bad.exit_code != 0 and "positive integer or 'none'" in bad.output
    bad = CliRunner().invoke(main, ["bench", "spec", "--model", str(tiny_dirs["untied"]), "--rounds", "0"])
    assert bad.exit_code != 0 and "--rounds" in bad.output


def test_cli_spec_dtype_auto_keeps_the_file_precision(tiny_dirs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """`brisk bench spec --dtype auto` loads the target as brisk generate does (a GGUF's quantized layers kept)."""
    import brisk.model.loader as loader

    seen = []
    real = loader.load_model
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: seen.append(k) or real(*a, **k))
    r = _invoke(["spec", "--model", str(tiny_dirs["untied"]), "--methods", "ngram", "--sets", "chat",
                 "--num-prompts", "1", "--concurrency", "1", "--max-tokens", "4", "--rounds", "1", "--dtype", "auto"])
    assert r.exit_code == 0, r.output
    assert seen[0]["keep_quantized"] is True and "its own precision" in r.output
