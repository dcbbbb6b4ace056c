"""Re-typing a GGUF file (model/gguf_convert.py) and the llama.cpp comparison's input checks.

llama-cpp-python is an optional extra: these tests never need it (its absence is one of the cases)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import GGMLQuantizationType, GGUFReader
from gguf_utils import random_state_dict, tiny_config, write_tiny_model

from brisk.bench.compare import weight_bytes_per_token
from brisk.cli import main
from brisk.model.gguf import load_gguf, read_gguf_tokenizer
from brisk.model.gguf_convert import OUT_TYPES, retype_gguf

T = GGMLQuantizationType


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    config = tiny_config()
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf"
    return write_tiny_model(path, random_state_dict(config, seed=3), config, qtype=T.Q4_1)


@pytest.mark.parametrize(("outtype", "ttype", "atol"), [("f32", T.F32, 0.0), ("f16", T.F16, 2e-3),
                                                        ("bf16", T.BF16, 2e-2), ("q8_0", T.Q8_0, 2e-2),
                                                        ("q4_1", T.Q4_1, 1e-2)])
def test_retype_keeps_weights_metadata_and_tokenizer(source, tmp_path, outtype, ttype, atol):
    out = retype_gguf(source, tmp_path / f"tiny-{outtype}.gguf", outtype)
    src_reader, out_reader = GGUFReader(source), GGUFReader(out)
    # every matrix at the new type, every vector still F32
    for t in out_reader.tensors:
        assert t.tensor_type == (ttype if len(t.shape) == 2 else T.F32), t.name
    assert int(out_reader.fields["general.file_type"].contents()) == int(OUT_TYPES[outtype][1])
    # metadata copied field for field (but the file type)
    for key, field in src_reader.fields.items():
        if key.startswith("GGUF.") or key == "general.file_type":
            continue
        assert out_reader.fields[key].contents() == field.contents(), key
    a, b = load_gguf(source), load_gguf(out)
    assert a.config == b.config
    for name, w in a.tensors.items():
        torch.testing.assert_close(b.tensors[name], w, atol=atol, rtol=0, msg=name)
    assert read_gguf_tokenizer(out).encode("hello world") == a.tokenizer.encode("hello world")


def test_retype_errors(source, tmp_path):
    with pytest.raises(ValueError, match="unknown GGUF output type 'q3_k'.*f32, f16, bf16, q8_0"):
        retype_gguf(source, tmp_path / "x.gguf", "q3_k")
    with pytest.raises(ValueError, match="is the input file"):
        retype_gguf(source, source, "f16")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        retype_gguf(bad, tmp_path / "y.gguf", "f16")


def test_convert_gguf_cli(source, tmp_path):
    out = tmp_path / "tiny-f16.gguf"
    result = CliRunner().invoke(main, ["convert", "gguf", "--outtype", "f16", str(source), str(out)])
    assert result.exit_code == 0, result.output
    assert "F16" in result.output and out.exists()
    result = CliRunner().invoke(main, ["convert", "gguf", "--outtype", "q2", str(source), str(out)])
    assert result.exit_code != 0 and "q2" in result.output


def test_weight_bytes_per_token(source):
    reader = GGUFReader(source)
    matrices = sum(int(t.n_elements) for t in reader.tensors if len(t.shape) == 2)
    vectors = sum(int(t.n_elements) for t in reader.tensors if len(t.shape) == 1)
    assert weight_bytes_per_token(source, "f32") == 4 * (matrices + vectors)
    assert weight_bytes_per_token(source, "q4_1") == pytest.approx(matrices * 20 / 32 + 4 * vectors)
    assert np.isclose(weight_bytes_per_token(source, "q8_0"), matrices * 34 / 32 + 4 * vectors)


def test_bench_compare_without_llama_cpp_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    result = CliRunner().invoke(main, ["bench", "compare"])
    assert result.exit_code == 1
    assert "llama-cpp-python" in result.output and "pip install" in result.output


def test_bench_compare_rejects_bad_options(monkeypatch, source):
    monkeypatch.setitem(sys.modules, "llama_cpp", object())  # "installed": the checks after it run
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "compare", "--precisions", "f32,q5_k", "--model", str(source)])
    assert result.exit_code == 1 and "unknown precision(s) q5_k" in result.output
    result = runner.invoke(main, ["bench", "compare", "--batch-sizes", "1,x", "--model", str(source)])
    assert result.exit_code == 1 and "--batch-sizes" in result.output


def test_bench_compare_checks_every_precision_before_any_work(monkeypatch, source, tmp_path):
    from brisk.bench.compare import check_precisions

    check_precisions(source, ["f32", "f16", "q8_0", "q4_1"])  # all four can be written from this file
    with pytest.raises(ValueError, match="unknown precision"):
        check_precisions(source, ["f16", "q5_k"])
    monkeypatch.setitem(sys.modules, "llama_cpp", object())
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "compare", "--shape", "llama-9b"])
    assert result.exit_code == 1 and "unknown shape 'llama-9b'" in result.output
    result = runner.invoke(main, ["bench", "compare", "--shape", "llama-3.2-1b", "--precisions", "f16,q5_k"])
    assert result.exit_code == 1 and "unknown precision(s) q5_k" in result.output  # before the file is written
    result = runner.invoke(main, ["bench", "compare", "--shape", "llama-3.2-1b", "--model", str(source)])
    assert result.exit_code == 1 and "not both" in result.output


def test_run_compare_reports_load_time_memory_and_bandwidth(tmp_path):
    """Both engines on the tiny file at q8_0 (re-typed, then loaded by both), each run a child process: the figures
    are there, the JSON callback sees every run as it finishes, and each batch-1 row has its GB/s against the
    bandwidth given."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python (the optional extra) is not installed")
    from hf_utils import make_tiny_hf_model

    from brisk.bench.compare import run_compare
    from brisk.model.gguf_export import export_gguf

    make_tiny_hf_model(tmp_path / "float", "llama", seed=6)  # a file llama.cpp loads: tokenizer and all
    export_gguf(tmp_path / "float", tmp_path / "tiny.gguf", "f16")
    prompt = list(range(3, 19))
    seen: list[list[str]] = []
    rows = run_compare(tmp_path / "tiny.gguf", ["q8_0"], prompt, prompt * 2, [1, 2], output_len=3, runs=1,
                       threads=1, log=lambda m: None, workdir=tmp_path, membw_gbps=10.0,
                       on_update=lambda rows: seen.append([r.precision for r in rows]))
    assert seen == [["q8_0"], ["q8_0"]]  # after each engine's run
    for row in rows:
        assert row.brisk.error is None and row.llama_cpp.error is None
        assert row.brisk.load_s > 0 and row.llama_cpp.load_s > 0 and row.brisk.runs == row.llama_cpp.runs == 1
        assert 0 <= row.brisk.peak_rss_load_bytes <= row.brisk.peak_rss_bytes
        assert set(row.brisk.decode_tok_s) == set(row.llama_cpp.decode_tok_s) == {1, 2}
        assert row.achieved_gbps(row.brisk) == pytest.approx(
            row.weight_bytes_per_token * row.brisk.decode_tok_s[1] / 1e9)
        d = row.to_dict()
        assert d["batch1_bandwidth_fraction"]["brisk"] == pytest.approx(d["batch1_gbps"]["brisk"] / 10.0)
        assert {"load_s", "rss_bytes", "peak_rss_bytes", "error"} <= set(d["brisk"]) and "decode_b2" in d["ratios"]
    assert rows[0].brisk_setting.startswith("int8 g32")  # the Q8_0 file's own codes


def test_a_dead_engine_child_is_reported_with_its_signal(tmp_path):
    """A child that raises comes back with its traceback; a signal is named, SIGKILL as the likely OOM kill."""
    from brisk.bench.compare_child import EngineChildError, EngineJob, death_message, run_in_child

    job = EngineJob("brisk", str(tmp_path / "missing.gguf"), "float32", [1, 2], [1, 2], [1], 2, 1, 16)
    with pytest.raises(EngineChildError, match="failed in its child process"):
        run_in_child(job)
    assert "SIGKILL" in death_message("brisk", "m.gguf", -9) and "OOM" in death_message("brisk", "m.gguf", -9)
    assert "SIGSEGV" in death_message("llama.cpp", "m.gguf", -11)
    assert "status 3" in death_message("brisk", "m.gguf", 3)
    assert "within 5 s" in death_message("brisk", "m.gguf", None, 5)


def test_compare_file_precision_is_the_source_as_it_is(source, tmp_path):
    """`--precisions file`: both engines run the --model file itself (any type, no re-typing), and its batch-1
    roofline reads every tensor as stored."""
    from brisk.bench.compare import check_precisions, gguf_for

    check_precisions(source, ["file"])
    assert gguf_for(source, "file", tmp_path, lambda _m: None) == source
    assert list(tmp_path.iterdir()) == []  # nothing written
    stored = sum(int(t.n_bytes) for t in GGUFReader(source).tensors)
    assert weight_bytes_per_token(source, "file") == stored


def test_compare_shape_writes_code_files_directly(monkeypatch, tmp_path):
    """`--shape` with only q8_0 / q4_1 rows on the llama.cpp file's own codes writes random codes straight at
    those types (no F16 file: an 8B shape's would be 16 GB), and each row runs its own file; a float row brings
    the F16 source back."""
    import json

    import brisk.bench.compare as compare

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 49152, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True}
    (tmp_path / "tiny.json").write_text(json.dumps(config))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "llama_cpp", object())
    seen = {}

    def fake_run(source, names, *args, files=None, **kwargs):
        seen.update(source=source, names=names, files=files)
        return []

    monkeypatch.setattr(compare, "run_compare", fake_run)
    runner = CliRunner()
    args = ["bench", "compare", "--shape", str(tmp_path / "tiny.json"), "--membw", "10", "--batch-sizes", "1"]
    result = runner.invoke(main, [*args, "--precisions", "q8_0,q4_1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    files = seen["files"]
    assert set(files) == {"q8_0", "q4_1"} and seen["source"] == files["q8_0"]
    for gguf_type, path in files.items():
        assert {t.tensor_type for t in GGUFReader(path).tensors if len(t.shape) == 2} == {T[gguf_type.upper()]}
        assert compare.gguf_for(seen["source"], gguf_type, tmp_path, lambda _m: None, files) == path
    assert not list((tmp_path / "cache").rglob("*.f16.gguf"))
    result = runner.invoke(main, [*args, "--precisions", "f16,q4_1"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert seen["source"].name.endswith(".f16.gguf") and set(seen["files"]) == {"q4_1"}
