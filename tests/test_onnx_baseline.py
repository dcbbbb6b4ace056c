"""The ONNX Runtime baseline (bench/onnx_baseline.py): the exported graph against brisk on a tiny random llama.

One export serves the module; onnxruntime and onnx are the `onnx` extra."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

pytest.importorskip("onnxruntime", reason="onnxruntime (brisk[onnx]) is not installed")

from brisk import LLM, SamplingParams  # noqa: E402
from brisk.bench.onnx_baseline import (  # noqa: E402
    OnnxModel,
    OnnxRuntimeMissingError,
    cached_onnx,
    check_exportable,
    export_onnx,
    io_names,
    onnx_cache_path,
    require_onnxruntime,
)
from brisk.cli import main  # noqa: E402
from brisk.model.loader import load_model  # noqa: E402
from brisk.ops.attention import AttentionMetadata  # noqa: E402

# arch -> tiny model options: GQA (4 query heads over 2 kv heads) with an untied head; q/k/v biases and a tied head;
# per-head q/k norms; a sliding window shorter than the test's sequence
CASES = {"llama": {}, "qwen2": {"tie_word_embeddings": True}, "qwen3": {}, "mistral": {"sliding_window": 5}}


@pytest.fixture(scope="module")
def export_case(tmp_path_factory):
    """arch -> (model folder, exported graph), each built once."""
    root, done = tmp_path_factory.mktemp("onnx"), {}

    def get(arch: str):  # noqa: ANN202
        if arch not in done:
            make_tiny_hf_model(root / arch, arch, num_kv_heads=2, seed=11, **CASES[arch])
            done[arch] = root / arch, export_onnx(root / arch, root / f"{arch}.onnx")
        return done[arch]

    return get


@pytest.fixture(scope="module")
def exported(export_case):
    return export_case("llama")


def brisk_logits(loaded, ids: list[int]) -> torch.Tensor:  # noqa: ANN001 - LoadedModel
    """brisk's all-position logits of one sequence, through its paged attention (one prefill)."""
    c, n = loaded.config, len(ids)
    num_blocks = (n + 15) // 16
    kv = [torch.zeros(2, num_blocks, 16, c.num_key_value_heads, c.head_dim) for _ in range(c.num_hidden_layers)]
    meta = AttentionMetadata.for_sequences([n], [n], [list(range(num_blocks))], 16, sliding_window=c.sliding_window)
    with torch.inference_mode():
        return loaded.model(torch.tensor(ids), torch.arange(n), meta, kv).float()


def test_graph_names_the_cache_as_optimum_does(exported):
    _, path = exported
    session = OnnxModel(path, threads=1).session
    past, present, inputs = io_names(2)
    assert [i.name for i in session.get_inputs()] == inputs == ["input_ids", *past]
    assert past[:2] == ["past_key_values.0.key", "past_key_values.0.value"]
    assert [o.name for o in session.get_outputs()] == ["logits", *present]
    assert present[-1] == "present.1.value"


@pytest.mark.parametrize("arch", list(CASES))
def test_prefill_and_decode_logits_equal_brisk(export_case, arch):
    """Prefill of 13 tokens, then 5 decode steps each feeding `present` back as `past`: every step's logits are
    brisk's logits at that position (brisk runs prompt + generated tokens as one sequence), within float32
    rounding; the greedy tokens are brisk's own greedy decode."""
    folder, path = export_case(arch)
    loaded = load_model(folder, fuse=False, sparse=False, show_progress=False)
    prompt = torch.randint(3, loaded.config.vocab_size, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    model = OnnxModel(path, threads=1)
    _, tokens, rows = model.generate([prompt], output_len=6)
    want = brisk_logits(loaded, prompt + tokens[:-1])[len(prompt) - 1:]  # [6, vocab]: the positions that predict
    got = torch.from_numpy(np.stack(rows))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    llm = LLM(str(folder), max_model_len=64, kv_cache_memory="2MiB")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert tokens == out.outputs[0].token_ids


def test_a_batch_decodes_each_row_as_alone(exported):
    """Batch 3 (distinct prompts, one length): row 0's tokens are its batch-1 tokens, every row's logits finite."""
    _, path = exported
    model = OnnxModel(path, threads=1)
    prompts = [[5 + i, 40, 77, 120, 9 + 2 * i, 31] for i in range(3)]
    _, alone, _ = model.generate(prompts[:1], output_len=5)
    _, together, rows = model.generate(prompts, output_len=5)
    assert together == alone and np.isfinite(np.stack(rows)).all()
    rate, toks = model.decode_rate(prompts, 4)
    assert rate > 0 and toks == alone[:4]


def test_export_is_cached_by_content(exported, tmp_path, monkeypatch):
    """The first call exports, a second finds the file; another model's content gets another file."""
    folder, _ = exported
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake_export(model_path, out):  # noqa: ANN001, ANN202
        calls.append(model_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"graph")
        return out

    monkeypatch.setattr("brisk.bench.onnx_baseline.export_onnx", fake_export)
    out = cached_onnx(folder)
    assert out == onnx_cache_path(folder) and out.parent == tmp_path / "brisk" / "onnx"
    assert cached_onnx(folder) == out and len(calls) == 1
    other = tmp_path / "other"
    make_tiny_hf_model(other, "llama", num_kv_heads=2, seed=12)
    assert onnx_cache_path(other) != out
    assert cached_onnx(other) != out and len(calls) == 2


def test_unsupported_models_are_named():
    with pytest.raises(ValueError, match="'gemma3'.*leave onnxruntime out"):
        check_exportable(SimpleNamespace(architecture="gemma3", rope_scaling=None))
    with pytest.raises(ValueError, match="RoPE.*'dynamic'"):
        check_exportable(SimpleNamespace(architecture="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
    check_exportable(SimpleNamespace(architecture="qwen2", rope_scaling={"rope_type": "llama3"}))


def test_a_quantized_checkpoint_is_refused(exported):
    from brisk.bench.onnx_baseline import build_graph

    loaded = load_model(exported[0], fuse=False, sparse=False, show_progress=False)
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    q_proj.weight = torch.nn.Parameter(q_proj.weight.to(torch.int8), requires_grad=False)  # int8 codes
    with pytest.raises(ValueError, match="float weights.*q_proj.weight.*quantized"):
        build_graph(loaded.model, loaded.config)


def test_missing_onnxruntime_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime -> ImportError
    with pytest.raises(OnnxRuntimeMissingError, match=r"onnxruntime.*pip install 'brisk\[onnx\]'"):
        require_onnxruntime()
    monkeypatch.setitem(sys.modules, "llama_cpp", object())
    result = CliRunner().invoke(main, ["bench", "compare", "--baselines", "llamacpp,onnxruntime"])
    assert result.exit_code == 1 and "brisk[onnx]" in result.output


def test_bench_compare_checks_the_baselines(monkeypatch, tmp_path):
    from gguf import GGMLQuantizationType
    from gguf_utils import random_state_dict, tiny_config, write_tiny_model

    monkeypatch.setitem(sys.modules, "llama_cpp", object())
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "compare", "--baselines", "llamacpp,tensorrt"])
    assert result.exit_code == 1 and "unknown baseline(s) tensorrt" in result.output
    config = tiny_config()
    source = write_tiny_model(tmp_path / "tiny.gguf", random_state_dict(config, seed=3), config,
                              qtype=GGMLQuantizationType.F16)
    result = runner.invoke(main, ["bench", "compare", "--model", str(source), "--baselines", "onnxruntime",
                                  "--precisions", "q8_0"])
    assert result.exit_code == 1 and "add f32 to --precisions" in result.output


def test_run_compare_measures_onnxruntime_on_the_f32_row(tmp_path, monkeypatch):
    """brisk against onnxruntime alone on a tiny GGUF (each run a child process): the f32 row has both engines'
    figures and brisk's ratios to onnxruntime, the same greedy tokens; the export is cached for the next run."""
    from gguf import GGMLQuantizationType
    from gguf_utils import random_state_dict, tiny_config, write_tiny_model

    from brisk.bench.compare import _export_onnx_in_child, compare_table, run_compare
    from brisk.model.gguf_convert import retype_gguf
    from brisk.ops import kernels

    # the graph cached under tmp_path; the children's kernels where they are built already (not rebuilt there)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(kernels.settings.cache_dir))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = tiny_config()
    source = write_tiny_model(tmp_path / "tiny.gguf", random_state_dict(config, seed=3), config,
                              qtype=GGMLQuantizationType.F16)
    prompt = list(range(3, 19))
    logs: list[str] = []
    rows = run_compare(source, ["f32"], prompt, prompt * 2, [1, 2], output_len=4, runs=1, threads=1,
                       log=logs.append, workdir=tmp_path, membw_gbps=10.0, baselines=("onnxruntime",))
    (row,) = rows
    ort = row.onnxruntime
    assert ort is not None and ort.error is None and row.brisk.error is None and ort.runs == 1
    assert set(ort.decode_tok_s) == {1, 2} and ort.prefill_s > 0 and ort.peak_rss_bytes > 0
    assert ort.greedy_b1 == row.brisk.greedy_b1 and len(ort.greedy_b1) == 4
    assert row.llama_cpp.runs == 0  # not asked for
    d = row.to_dict()
    assert d["ratios_onnxruntime"]["decode_b1"] == pytest.approx(row.brisk.decode_tok_s[1] / ort.decode_tok_s[1])
    assert any("exporting" in m for m in logs)
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(compare_table(rows, [1, 2], "t", ("onnxruntime",)))
    text = console.export_text()
    assert "brisk / onnxruntime" in text and "llama.cpp" not in text.replace("llama.cpp type", "")
    logs.clear()  # the next compare of the same file: no export (the f32 file is written the same way again)
    f32 = retype_gguf(source, tmp_path / "again.gguf", "f32")
    assert _export_onnx_in_child(f32, logs.append) == onnx_cache_path(f32)
    assert any("cached" in m for m in logs) and not any("exporting" in m for m in logs)
