"""brisk prune end to end on a tiny model: every method writes a folder that reloads, generates, reports its
sparsity and can be quantized further; bad flags fail with a message that says what to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hf_utils import TRAINING_TEXT, make_tiny_hf_model
from test_model import prefill_logits

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.eval.sparsity import sparsity_report
from brisk.model.loader import load_model
from brisk.prune.masks import nm_conforms

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_hf_model(path, num_kv_heads=2, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                       tie_word_embeddings=True)
    return path


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TRAINING_TEXT * 3)
    return path


def _prune(args: list[str]) -> str:
    result = CliRunner().invoke(main, ["prune", *args])
    assert result.exit_code == 0, result.output
    return result.output


CASES = [
    ("magnitude", []),
    ("magnitude-2:4", ["--pattern", "2:4"]),
    ("wanda", []),
    ("wanda-4:8", ["--pattern", "4:8"]),
    ("sparsegpt", ["--sparsity", "0.6"]),
    ("sparsegpt-2:4", ["--pattern", "2:4"]),
]


@pytest.mark.parametrize("name,flags", CASES, ids=[c[0] for c in CASES])
def test_pruned_checkpoint_reloads_and_generates(tiny, calib_text, tmp_path, name, flags):
    method = name.split("-")[0]
    out = tmp_path / name
    calib = [] if method == "magnitude" else ["--calib-text", str(calib_text), "--num-samples", "4",
                                               "--seq-len", "32"]
    _prune([str(tiny), str(out), "--method", method, *flags, *calib])

    config = json.loads((out / "config.json").read_text())
    record = config["sparsity_config"]
    assert record["method"] == method and record["format"] == "brisk"
    want = 0.6 if "0.6" in flags else 0.5
    # SparseGPT removes floor(s * rows * block) per 128-column block: 0.6 of 64 x 64 is 2457.6 -> 2457
    assert record["sparsity"] == pytest.approx(want)
    assert record["measured_sparsity"] == pytest.approx(want, abs=2e-4)
    assert len(record["modules"]) == 14  # 7 linears x 2 layers
    assert (record["calibration"] is None) == (method == "magnitude")

    report = sparsity_report(str(out))
    assert report.linear_sparsity == pytest.approx(record["measured_sparsity"], abs=1e-6)
    assert all(m.sparsity == pytest.approx(want, abs=5e-4) for m in report.modules)
    pattern = record["pattern"]
    if pattern != "unstructured":
        n, m = map(int, pattern.split(":"))
        assert pattern in report.patterns
        for mod in report.modules:
            assert nm_conforms(load_model(out, fuse=False).model.get_submodule(mod.name).weight, n, m)
    else:
        assert report.patterns == []

    loaded = load_model(out)  # an ordinary folder: the plain loader, no flags
    dense = load_model(tiny)
    ids = torch.randint(3, loaded.config.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    got = prefill_logits(loaded, ids)
    assert torch.isfinite(got).all()
    assert not torch.allclose(got, prefill_logits(dense, ids), atol=1e-3)  # pruning changed the model
    llm = LLM(str(out), max_model_len=128, kv_cache_memory="4MiB")
    text = llm.generate(["Emma Woodhouse"], GREEDY)[0].outputs[0]
    assert len(text.token_ids) == 12


def test_magnitude_checkpoint_holds_the_masked_weights(tiny, tmp_path):
    """Oracle: the saved weights are the original ones with exactly the lowest |W| of each matrix zeroed."""
    out = tmp_path / "mag"
    _prune([str(tiny), str(out), "--method", "magnitude", "--sparsity", "0.3"])
    dense = load_model(tiny, fuse=False).model
    pruned = load_model(out, fuse=False).model
    w, p = dense.model.layers[1].mlp.up_proj.weight, pruned.model.layers[1].mlp.up_proj.weight
    removed = p == 0
    assert int(removed.sum()) == int(0.3 * w.numel())
    torch.testing.assert_close(p[~removed], w[~removed], rtol=0, atol=0)
    assert w[removed].abs().max() <= w[~removed].abs().min()
    torch.testing.assert_close(pruned.model.embed_tokens.weight, dense.model.embed_tokens.weight, rtol=0, atol=0)


def test_structured_checkpoint_reloads_and_generates(tiny, calib_text, tmp_path):
    out = tmp_path / "structured"
    output = _prune([str(tiny), str(out), "--method", "structured", "--sparsity", "0.25", "--drop-head-groups", "1",
                     "--calib-text", str(calib_text), "--num-samples", "4", "--seq-len", "32"])
    assert "head groups" in output
    config = json.loads((out / "config.json").read_text())
    assert config["num_key_value_heads"] == 1 and config["num_attention_heads"] == 2
    assert config["intermediate_size"] < 128 and config["num_hidden_layers"] == 2
    record = config["sparsity_config"]
    assert record["method"] == "structured"
    assert record["num_parameters_after"] < record["num_parameters_before"]
    loaded = load_model(out)
    assert loaded.model.model.layers[0].self_attn.num_kv_heads == 1
    llm = LLM(str(out), max_model_len=128, kv_cache_memory="4MiB")
    assert len(llm.generate(["Emma"], GREEDY)[0].outputs[0].token_ids) == 12


def test_prune_then_quantize_composes(tiny, tmp_path):
    pruned, quantized = tmp_path / "pruned", tmp_path / "pruned-int8"
    _prune([str(tiny), str(pruned), "--method", "magnitude", "--pattern", "2:4"])
    result = CliRunner().invoke(main, ["quantize", str(pruned), str(quantized), "--bits", "8", "--group-size", "-1"])
    assert result.exit_code == 0, result.output
    report = sparsity_report(str(quantized))
    assert report.linear_sparsity == pytest.approx(0.5)  # 0 is on every grid: the zeros survive quantization
    assert "2:4" in report.patterns
    llm = LLM(str(quantized), max_model_len=128, kv_cache_memory="4MiB")
    assert len(llm.generate(["Emma"], GREEDY)[0].outputs[0].token_ids) == 12


def test_sparsegpt_joint_quantization_writes_a_quantized_folder(tiny, calib_text, tmp_path):
    out = tmp_path / "sgpt-int4"
    _prune([str(tiny), str(out), "--method", "sparsegpt", "--bits", "4", "--group-size", "32",
            "--calib-text", str(calib_text), "--num-samples", "4", "--seq-len", "32"])
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["method"] == "sparsegpt"
    assert config["quantization_config"]["bits"] == 4 and config["sparsity_config"]["method"] == "sparsegpt"
    assert sparsity_report(str(out)).linear_sparsity >= 0.5  # read from the codes (q == zero point)
    llm = LLM(str(out), max_model_len=128, kv_cache_memory="4MiB")
    assert len(llm.generate(["Emma"], GREEDY)[0].outputs[0].token_ids) == 12


@pytest.mark.parametrize("flags,message", [
    (["--method", "magnitude", "--pattern", "2-4"], "N:M"),
    (["--method", "magnitude", "--pattern", "4:2"], "N < M"),
    (["--method", "magnitude", "--sparsity", "1.2"], "[0, 1)"),
    (["--method", "wanda", "--calib-text", "missing-calibration.txt"], "--calib-text"),
    (["--method", "magnitude", "--bits", "4"], "--method sparsegpt"),
    (["--method", "structured", "--pattern", "2:4"], "drop --pattern"),
    (["--method", "wanda", "--drop-layers", "1"], "--method structured"),
])
def test_bad_flags_fail_with_a_clear_message(tiny, tmp_path, flags, message):
    result = CliRunner().invoke(main, ["prune", str(tiny), str(tmp_path / "out"), *flags])
    assert result.exit_code != 0
    assert message in result.output
    assert not (tmp_path / "out").exists()


def test_refuses_to_overwrite_a_checkpoint(tiny, tmp_path):
    _prune([str(tiny), str(tmp_path / "out"), "--method", "magnitude"])
    result = CliRunner().invoke(main, ["prune", str(tiny), str(tmp_path / "out"), "--method", "magnitude"])
    assert result.exit_code != 0 and "--force" in result.output


def test_eval_sparsity_command(tiny, tmp_path):
    _prune([str(tiny), str(tmp_path / "out"), "--method", "magnitude", "--pattern", "4:8"])
    result = CliRunner().invoke(main, ["eval", "sparsity", "--model", str(tmp_path / "out"), "--json",
                                       str(tmp_path / "s.json")])
    assert result.exit_code == 0, result.output
    assert "50.00%" in result.output and "4:8" in result.output
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["linear_sparsity"] == pytest.approx(0.5) and data["patterns"] == ["4:8"]
    dense = CliRunner().invoke(main, ["eval", "sparsity", "--model", str(tiny)])
    assert dense.exit_code == 0 and "0.00%" in dense.output
