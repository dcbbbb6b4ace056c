"""GPTQ and AWQ: each beats RTN where it should, folds are exact, and their checkpoints load in RTN's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model
from test_model import prefill_logits

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.data import calibration_text_path
from brisk.model.loader import load_model
from brisk.quant import primitives
from brisk.quant.awq import (
    AWQConfig,
    ModuleError,
    OutputError,
    awq_scale_block,
    fake_quantize,
    search_clip,
    search_scale,
)
from brisk.quant.calib import CalibConfig, load_calibration_ids, run_layerwise
from brisk.quant.checkpoint import save_quantized
from brisk.quant.cli import calibrated_quantize
from brisk.quant.config import LayerQuant
from brisk.quant.gptq import GPTQConfig, gptq_quantize_weight
from brisk.quant.rtn import plan_layers

TEXT = calibration_text_path()
IDS = torch.tensor([5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 120])


def outlier_layer(seed: int = 0, n: int = 96, k: int = 256, tokens: int = 2048
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A toy linear layer (w [n, k]) and inputs x [tokens, k] whose 4 "outlier" input channels are ~30x the
    rest and correlated with each other, as LLM activations are; H = 2/T xᵀx."""
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(tokens, 16, generator=gen)
    x = latent @ torch.randn(16, k, generator=gen) * 0.3 + torch.randn(tokens, k, generator=gen)  # correlated
    x[:, [3, 77, 150, 201]] *= 30.0
    w = torch.randn(n, k, generator=gen) * 0.05
    return w, x, 2 / tokens * x.t() @ x


def output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    return float((x @ (w - w_hat).t()).square().mean())


@pytest.mark.parametrize("bits", [4, 3])
def test_gptq_beats_rtn_on_outlier_channels(bits: int) -> None:
    w, x, h = outlier_layer()
    spec = LayerQuant(bits=bits, group_size=64)
    rtn = output_error(w, fake_quantize(w, spec), x)
    for act_order in (False, True):
        codes, scale, zero, w_hat = gptq_quantize_weight(w, h, spec, GPTQConfig(act_order=act_order))
        torch.testing.assert_close(primitives.dequantize(codes, scale, zero), w_hat)  # what the checkpoint holds
        # GPTQ minimises exactly this error; on correlated inputs it should remove well over a third of RTN's
        assert output_error(w, w_hat, x) < 0.6 * rtn, (act_order, output_error(w, w_hat, x), rtn)


@pytest.mark.parametrize("bits", [4, 3])
def test_awq_beats_rtn_on_outlier_channels(bits: int) -> None:
    w, x, h = outlier_layer(seed=1)
    spec = LayerQuant(bits=bits, group_size=64)
    rtn = output_error(w, fake_quantize(w, spec), x)
    s, alpha, errors = search_scale([w], x.abs().mean(0), OutputError(h), spec, n_grid=20)
    assert alpha > 0 and min(errors) < errors[0]  # errors[0] is α = 0: plain RTN
    w_scaled = w * s  # what the linear holds after the fold; its input is x / s
    bound = search_clip(w_scaled, h / (s[:, None] * s[None, :]), spec, n_grid=20, max_shrink=0.5)
    b = bound.repeat_interleave(64, dim=1)
    w_hat = fake_quantize(torch.maximum(torch.minimum(w_scaled, b), -b), spec) / s
    # protecting 4 channels that carry most of the output's energy: a clear gain, not a rounding accident
    assert output_error(w, w_hat, x) < 0.8 * rtn, (output_error(w, w_hat, x), rtn)


def test_awq_linear_objective_is_the_output_error_over_the_calibration_tokens() -> None:
    w, x, h = outlier_layer(seed=2)
    dw = w - fake_quantize(w, LayerQuant(bits=3, group_size=64))
    # tr(ΔW H ΔWᵀ) with H = 2/n XᵀX is 2/n ||X ΔWᵀ||²
    assert OutputError(h)(dw) == pytest.approx(2 * float((x @ dw.t()).square().sum()) / x.shape[0], rel=1e-4)


def test_awq_module_error_scores_candidates_and_restores_the_weights() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 4, bias=False)
    x = torch.randn(32, 16)
    saved = (a.weight.detach().clone(), b.weight.detach().clone())

    def run() -> list[torch.Tensor]:
        with torch.no_grad():
            return [torch.nn.functional.silu(a(x)).sum(1, keepdim=True) * b(x)]  # a nonlinear module of both
    error = ModuleError([a, b], run)
    assert error(torch.zeros(12, 16)) == 0.0
    dw = torch.randn(12, 16) * 0.1
    with torch.no_grad():
        expect = (torch.nn.functional.silu(x @ (saved[0] - dw[:8]).t()).sum(1, keepdim=True)
                  * (x @ (saved[1] - dw[8:]).t()) - run()[0]).square().sum()
    assert error(dw) == pytest.approx(float(expect), rel=1e-5)
    assert torch.equal(a.weight, saved[0]) and torch.equal(b.weight, saved[1])  # the float weights are back


def test_gptq_with_an_identity_hessian_is_rtn() -> None:
    """With uncorrelated unit inputs no column can compensate another: GPTQ must give RTN's codes."""
    w, _, _ = outlier_layer(seed=3)
    for spec in (LayerQuant(4, 64), LayerQuant(3, -1), LayerQuant(8, 32, sym=True)):
        codes, scale, zero, _ = gptq_quantize_weight(w, torch.eye(w.shape[1]), spec, GPTQConfig(act_order=False))
        group = None if spec.group_size == -1 else spec.group_size
        s_ref, z_ref = primitives.choose_qparams(w, spec.bits, group, spec.sym)
        s_ref = s_ref.half().float()
        assert torch.equal(codes, primitives.quantize(w, s_ref, z_ref, spec.bits))
        assert torch.equal(scale, s_ref) and torch.equal(zero, z_ref)


def test_gptq_dead_columns_become_zero() -> None:
    w, x, _ = outlier_layer(seed=4)
    x[:, 10] = 0  # an input channel that never fires
    h = 2 / x.shape[0] * x.t() @ x
    _, _, _, w_hat = gptq_quantize_weight(w, h, LayerQuant(4, 64), GPTQConfig())
    assert torch.isfinite(w_hat).all()
    assert torch.equal(w_hat[:, 10], torch.zeros(w.shape[0]))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    # GQA (4 heads, 2 kv heads) so AWQ's shared v -> o scales are exercised; tied embeddings as in SmolLM2
    make_tiny_hf_model(path, num_kv_heads=2, num_attention_heads=4, tie_word_embeddings=True)
    (path / "calib.txt").write_text(TEXT.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


def test_awq_scale_folding_leaves_the_float_model_unchanged(tiny: Path) -> None:
    loaded = load_model(tiny, fuse=False)
    before = prefill_logits(loaded, IDS)
    weights = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    spec = LayerQuant(bits=3, group_size=32)
    plan = plan_layers(loaded.model, True, spec)
    ids = load_calibration_ids(loaded.tokenizer, CalibConfig(str(tiny / "calib.txt"), num_samples=4, seq_len=32))
    run_layerwise(loaded.model, ids, lambda ctx: awq_scale_block(ctx, plan, AWQConfig(alpha=0.5)), progress=False)
    changed = {k for k, v in loaded.model.state_dict().items() if not torch.equal(v, weights[k])}
    for i in range(2):  # every fold happened: norms, v rows (GQA-shared scales) and up rows were divided
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            assert f"model.layers.{i}.{name}" in changed
    torch.testing.assert_close(prefill_logits(loaded, IDS), before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("objective", ["module", "linear"])
def test_awq_searched_scales_leave_the_float_model_unchanged(tiny: Path, objective: str) -> None:
    loaded = load_model(tiny, fuse=False)
    before = prefill_logits(loaded, IDS)
    plan = plan_layers(loaded.model, True, LayerQuant(bits=3, group_size=32))
    ids = load_calibration_ids(loaded.tokenizer, CalibConfig(str(tiny / "calib.txt"), num_samples=4, seq_len=32))
    config = AWQConfig(objective=objective, module_samples=2)
    run_layerwise(loaded.model, ids, lambda ctx: awq_scale_block(ctx, plan, config), progress=False)
    torch.testing.assert_close(prefill_logits(loaded, IDS), before, rtol=1e-4, atol=1e-4)
    assert all(not p.requires_grad or p.grad is None for p in loaded.model.parameters())


def test_awq_config_rejects_unknown_objectives() -> None:
    with pytest.raises(ValueError, match="objective"):
        AWQConfig(objective="kl")


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibrated_checkpoint_reloads_and_generates(tiny: Path, tmp_path: Path, method: str) -> None:
    loaded = load_model(tiny, fuse=False)
    spec = LayerQuant(bits=4, group_size=32)
    plan = plan_layers(loaded.model, True, spec)
    calib = CalibConfig(str(tiny / "calib.txt"), num_samples=4, seq_len=32, batch_size=3)
    tensors, qconfig = calibrated_quantize(loaded, plan, spec, method, calib, progress=False)
    out = save_quantized(tmp_path / method, loaded.config, loaded.tokenizer, qconfig, tensors)
    written = json.loads((out / "config.json").read_text())["quantization_config"]
    assert written["method"] == method
    assert written["calibration"] == {"calib_text": "calib.txt", "num_samples": 4, "seq_len": 32, "seed": 0}
    assert "model.layers.0.self_attn.q_proj.qweight" in tensors and "model.embed_tokens.qweight" in tensors
    # the calibrated model (its weights now Ŵ, AWQ's folds included) holds exactly what the checkpoint decodes to
    for name, spec_ in plan.items():
        k = loaded.model.get_submodule(name).weight.shape[1]
        q = primitives.unpack(tensors[f"{name}.qweight"], spec_.bits, k)
        scale = tensors[f"{name}.scales"].float()
        zero = tensors[f"{name}.qzeros"].float() if f"{name}.qzeros" in tensors else \
            torch.full_like(scale, 2 ** (spec_.bits - 1))
        w_hat = primitives.dequantize(q, scale, zero)
        if name == "model.embed_tokens":  # RTN int8, not calibrated: put it into the float twin
            loaded.model.model.embed_tokens.weight.data.copy_(w_hat)
        else:
            assert torch.equal(loaded.model.get_submodule(name).weight, w_hat), name
    # ... and the kernels' model loaded from the folder computes what that float twin computes
    qloaded = load_model(out)
    torch.testing.assert_close(prefill_logits(qloaded, IDS), prefill_logits(loaded, IDS),
                               rtol=1e-3, atol=1e-3)
    llm = LLM(model=str(out))
    got = llm.generate(["Emma was"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(got[0].outputs[0].token_ids) == 6


def test_quantize_cli_gptq_and_its_errors(tiny: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(main, ["quantize", str(tiny), str(tmp_path / "a"), "--method", "gptq",
                               "--calib-text", str(tmp_path / "missing.txt")])
    assert res.exit_code != 0 and "--calib-text" in res.output
    res = runner.invoke(main, ["quantize", str(tiny), str(tmp_path / "b"), "--method", "awq", "--scheme", "nf4",
                               "--calib-text", str(tiny / "calib.txt")])
    assert res.exit_code != 0 and "--scheme int" in res.output
    res = runner.invoke(main, ["quantize", str(tiny), str(tmp_path / "c"), "--method", "gptq", "--bits", "3",
                               "--group-size", "32", "--calib-text", str(tiny / "calib.txt"), "--num-samples", "3",
                               "--seq-len", "16", "--seed", "7", "--no-act-order"])
    assert res.exit_code == 0, res.output
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert qc["method"] == "gptq" and qc["bits"] == 3 and qc["group_size"] == 32
    assert qc["calibration"]["seed"] == 7 and qc["method_config"]["act_order"] is False
