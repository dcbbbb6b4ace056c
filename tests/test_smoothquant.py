"""SmoothQuant W8A8: the smoothing folds are exact, smoothing beats plain W8A8 on outlier channels, and the
checkpoint loads as Int8Linear layers (per-token or static per-tensor activations) that generate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model
from test_gptq_awq import outlier_layer
from test_model import prefill_logits

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.data import calibration_text_path
from brisk.model.loader import load_model
from brisk.ops.layers import LinearKind, QuantLinear
from brisk.ops.w8a8 import Int8Linear
from brisk.quant.calib import CalibConfig, load_calibration_ids, run_layerwise
from brisk.quant.smoothquant import SmoothQuantConfig, fake_w8a8, smooth_only, smoothing_scales

IDS = torch.tensor([5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 120])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_sq")
    make_tiny_hf_model(path, num_kv_heads=2, num_attention_heads=4, tie_word_embeddings=True)
    (path / "calib.txt").write_text(calibration_text_path().read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


def test_smoothing_scales_follow_the_formula() -> None:
    x_max, w_max = torch.tensor([8.0, 1.0, 0.0, 2.0]), torch.tensor([0.5, 2.0, 1.0, 0.0])
    s = smoothing_scales(x_max, w_max, 0.5)
    torch.testing.assert_close(s[:2], torch.tensor([(8 / 0.5) ** 0.5, (1 / 2.0) ** 0.5]))
    assert s[2] == 1.0 and s[3] == 1.0  # a dead activation or weight channel keeps its scale


@pytest.mark.parametrize("alpha", [None, 0.5, 0.85])
def test_smoothing_alone_leaves_the_float_model_unchanged(tiny: Path, alpha: float | None) -> None:
    loaded = load_model(tiny, fuse=False)
    before = prefill_logits(loaded, IDS)
    weights = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    ids = load_calibration_ids(loaded.tokenizer, CalibConfig(str(tiny / "calib.txt"), num_samples=4, seq_len=32))
    config = SmoothQuantConfig(alpha=alpha)
    run_layerwise(loaded.model, ids, lambda ctx: smooth_only(ctx, config), progress=False)
    changed = {k for k, v in loaded.model.state_dict().items() if not torch.equal(v, weights[k])}
    if alpha is not None:  # a fixed α folds every group: norms, v rows (GQA-shared scales) and up rows
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            assert f"model.layers.0.{name}" in changed
    assert len(config.chosen) == 8  # 4 groups x 2 blocks
    torch.testing.assert_close(prefill_logits(loaded, IDS), before, rtol=1e-4, atol=1e-4)


def test_smoothing_beats_plain_w8a8_on_outlier_channels() -> None:
    w, x, _ = outlier_layer(seed=5)
    calib, held = x[:1024], x[1024:]  # scales from one half, error on the other
    ref = held @ w.t()
    plain = float((fake_w8a8(held, w) - ref).square().mean())
    s = smoothing_scales(calib.abs().amax(0), w.abs().amax(0), 0.5)
    smoothed = float((fake_w8a8(held / s, w * s) - ref).square().mean())
    # four ~30x channels set the per-token scale of plain W8A8; migrated into the weights they no longer do
    assert smoothed < 0.5 * plain, (smoothed, plain)


@pytest.mark.parametrize("activations", ["token", "tensor"])
def test_checkpoint_loads_as_int8_layers_and_generates(tiny: Path, tmp_path: Path, activations: str) -> None:
    out = tmp_path / activations
    res = CliRunner().invoke(main, ["quantize", str(tiny), str(out), "--method", "smoothquant", "--activations",
                                    activations, "--calib-text", str(tiny / "calib.txt"), "--num-samples", "4",
                                    "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["method"] == "smoothquant" and qc["bits"] == 8 and qc["group_size"] == -1 and qc["sym"]
    assert qc["method_config"]["activations"] == activations
    qloaded = load_model(out)
    layer = qloaded.model.model.layers[0]
    for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(m, Int8Linear) and m.kernel().kind is LinearKind.W8A8
        assert (m.input_scale is not None) == (activations == "tensor")
    # W8A8 of a tiny random model stays close to the float model: per-token scales within 2% of the logits'
    # energy; one static scale per layer input (calibrated on 128 tokens, clamped beyond) within 15%
    ref = prefill_logits(load_model(tiny), IDS)
    got = prefill_logits(qloaded, IDS)
    rel = float((got - ref).square().mean() / ref.square().mean())
    assert rel < (0.02 if activations == "token" else 0.15), rel
    llm = LLM(model=str(out))
    got = llm.generate(["Emma was"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(got[0].outputs[0].token_ids) == 6
    # the 8-bit head of a W8A8 checkpoint takes int8 activations under "auto" (an RTN int8 head keeps float ones)
    assert isinstance(llm.engine.loaded.model.lm_head, QuantLinear)
    assert llm.engine.loaded.model.lm_head.quant_activations == "int8"
    floats = LLM(model=str(out), quant_activations="float")
    assert floats.engine.loaded.model.lm_head.quant_activations == "float"
    # the W8A8 layers join the decode plan and the C++ layer loop (kind 7): the same tokens on every path
    tokens = {}
    for execution in ("modules", "plan", "cpp"):
        run = LLM(model=str(out), execution=execution)
        assert run.engine.runner.executor.path == execution
        outs = run.generate(["Emma was", "The house"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        tokens[execution] = [o.outputs[0].token_ids for o in outs]
    assert tokens["plan"] == tokens["modules"] and tokens["cpp"] == tokens["modules"]


def test_quantize_cli_rejects_settings_smoothquant_does_not_take(tiny: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(main, ["quantize", str(tiny), str(tmp_path / "a"), "--method", "smoothquant", "--bits", "4",
                               "--calib-text", str(tiny / "calib.txt")])
    assert res.exit_code != 0 and "drop --bits" in res.output
    res = runner.invoke(main, ["quantize", str(tiny), str(tmp_path / "b"), "--method", "smoothquant", "--alpha",
                               "1.5", "--calib-text", str(tiny / "calib.txt")])
    assert res.exit_code != 0 and "[0, 1]" in res.output
