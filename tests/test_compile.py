"""--compile (engine/compiled.py): torch.compile graphs of the dense parts against the uncompiled engine.

Inductor fuses and reorders float arithmetic, so logits are close, not bit-equal; greedy tokens must be equal.
Every test here compiles (seconds each on 2 cores, cached on disk by inductor across runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.engine import compiled as compiled_mod
from brisk.engine.compiled import CompiledModel, CompileError, bucket_rows, compile_model

PROMPTS = [[1, 5, 9, 33, 7], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36], [3]]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("compile")
    make_tiny_hf_model(path, "llama", num_kv_heads=2, intermediate_size=96)
    return path


def _llm(folder: Path, dtype: str, compile: bool, **kw) -> LLM:
    # a 12-token step budget: the 18-token prompt is chunked (12 rows: the dynamic graph; then 6 + decodes)
    return LLM(str(folder), dtype=dtype, max_model_len=64, kv_cache_memory="4MiB", max_num_seqs=4,
               max_num_batched_tokens=12, enable_prefix_caching=False, compile=compile, **kw)


def _generate(llm: LLM, n: int = 10) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, params)]


def test_bucket_rows():
    assert [bucket_rows(t) for t in (1, 2, 3, 4, 5, 8, 9, 100)] == [1, 2, 4, 4, 8, 8, 9, 100]


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-4), ("bfloat16", 0.15)])
def test_compiled_engine_matches_uncompiled(ops, tiny_folder, monkeypatch, dtype, atol):
    rows = []
    real_run = CompiledModel.run

    def run(self, x, *a):
        rows.append(x.shape[0])
        return real_run(self, x, *a)

    monkeypatch.setattr(CompiledModel, "run", run)
    compiled = _llm(tiny_folder, dtype, True)
    assert compiled.engine.compile_seconds > 0
    got = _generate(compiled)
    # every step ran compiled: padded decode buckets (3 rows -> 4, 2 -> 2, ...) and the dynamic graph (12 rows)
    assert {3, 12} <= set(rows) and max(rows) == 12
    want = _generate(_llm(tiny_folder, dtype, False))
    for (g_ids, g_lp), (w_ids, w_lp) in zip(got, want, strict=True):
        # float32: the same tokens. bfloat16 (a random tiny model's logits are nearly flat): the same tokens up to
        # a step where the reference itself had a near-tie between its token and the compiled one
        same = next((i for i, (a, b) in enumerate(zip(g_ids, w_ids, strict=True)) if a != b), len(g_ids))
        if dtype == "float32":
            assert g_ids == w_ids
        elif same < len(g_ids):
            assert g_ids[same] in w_lp[same] and max(w_lp[same].values()) - w_lp[same][g_ids[same]] < atol
        for g_step, w_step in zip(g_lp[:same], w_lp[:same], strict=True):
            for tok in g_step.keys() & w_step.keys():
                assert g_step[tok] == pytest.approx(w_step[tok], abs=atol)
        assert same > 0


def test_compiled_speculative_decoding_equals_plain(ops, tiny_folder):
    """Verification steps (γ + 1 rows per request, laid out by query_start_loc) through the compiled graphs."""
    plain = _generate(_llm(tiny_folder, "float32", False), n=14)
    spec = _generate(_llm(tiny_folder, "float32", True, speculative="ngram", num_speculative_tokens=3), n=14)
    assert [ids for ids, _ in spec] == [ids for ids, _ in plain]


def test_compile_refuses_quantized_layers(ops, tiny_folder, tmp_path):
    r = CliRunner().invoke(main, ["quantize", "--method", "rtn", "--bits", "8", "--group-size", "32",
                                  str(tiny_folder), str(tmp_path / "q8")])
    assert r.exit_code == 0, r.output
    with pytest.raises(CompileError, match="QuantLinear.*without --compile"):
        _llm(tmp_path / "q8", "float32", True)


def test_compile_needs_the_kernels(kernel_settings, tiny_folder, monkeypatch):
    llm = _llm(tiny_folder, "float32", False)
    kernel_settings(enabled=False)
    with pytest.raises(CompileError, match="C\\+\\+ kernels"):
        compile_model(llm.engine.loaded.model, 12)
    monkeypatch.setattr(compiled_mod.shutil, "which", lambda name: None)
    kernel_settings(enabled=True)
    with pytest.raises(CompileError, match="C\\+\\+ compiler"):
        compile_model(llm.engine.loaded.model, 12)
    assert llm.engine.runner.executor.path == "cpp"  # the engine's own executor is left as it was


def test_generate_cli_with_compile(ops, tiny_folder):
    args = ["generate", "--model", str(tiny_folder), "--max-tokens", "6", "--temperature", "0",
            "--kv-cache-memory", "4MiB", "--max-model-len", "64", "--no-stream", "hello there"]
    plain = CliRunner().invoke(main, args)
    compiled = CliRunner().invoke(main, [*args, "--compile"])
    assert plain.exit_code == 0 and compiled.exit_code == 0, compiled.output
    assert compiled.stdout.strip() == plain.stdout.strip()  # the same answer
    assert "--compile: the decoder's graphs compiled in" in compiled.stderr  # the start-up cost, reported


def test_bench_latency_compile_against_eager(ops, tiny_folder, tmp_path):
    out = tmp_path / "l.json"
    r = CliRunner().invoke(main, ["bench", "latency", "--model", str(tiny_folder), "--input-len", "8",
                                  "--output-len", "4", "--runs", "2", "--membw", "10", "--kv-cache-memory",
                                  "4MiB", "--max-model-len", "64", "--compile", "--baseline", "eager",
                                  "--json", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "brisk uncompiled" in r.output and "compilation at start-up" in r.output
    doc = json.loads(out.read_text())
    assert doc["compile_s"] > 0 and doc["same_tokens"] is True
    assert doc["brisk"]["runs"] == doc["eager"]["runs"] == 2
    assert doc["speedup"]["decode_tok_s"] == pytest.approx(doc["brisk"]["decode_tok_s"]
                                                           / doc["eager"]["decode_tok_s"])
    bad = CliRunner().invoke(main, ["bench", "latency", "--model", str(tiny_folder), "--baseline", "eager"])
    assert bad.exit_code != 0 and "add --compile" in bad.output


def test_compiled_graphs_are_reused_across_layers(ops, tiny_folder):
    """One graph per shape bucket, shared by every layer: the weights are inputs, not constants."""
    llm = _llm(tiny_folder, "float32", False)
    model = llm.engine.loaded.model
    torch._dynamo.reset()  # forget the other tests' graphs
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    compile_model(model, 12)
    frames = stats["unique_graphs"]
    # first / mid / last at 1, 2, 4 and 8 rows and the dynamic one (steps of 9-12 rows): 15 graphs, any depth
    assert frames - before == 3 * 5
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert stats["unique_graphs"] == frames  # no recompilation while serving
