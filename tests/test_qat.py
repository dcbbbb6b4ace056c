"""QAT: the straight-through fake-quant against hand-computed gradients, training on a tiny model, the export."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from hf_utils import TRAINING_TEXT, make_tiny_hf_model
from test_model import prefill_logits

from brisk.cli import main
from brisk.model.loader import load_model
from brisk.quant.checkpoint import save_quantized
from brisk.quant.config import LayerQuant
from brisk.quant.qat import QATConfig, fake_quantize_ste, qat_quantize
from brisk.quant.rtn import plan_layers
from brisk.train.data import TextWindows
from brisk.train.forward import causal_lm_forward
from brisk.train.losses import next_token_ce
from brisk.train.trainer import TrainConfig

IDS = torch.tensor([5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 120])


def test_fake_quantize_ste_gradients_by_hand():
    # 3 bits (qmax 7), s = 0.5, z = 4; w / s = [0.6, -2.2, 1.8, 10, -6] -> round + z = [5, 2, 6, 14, -2]
    # -> clamp [5, 2, 6, 7, 0]: the last two are clipped
    w = torch.tensor([[0.3, -1.1, 0.9, 5.0, -3.0]], dtype=torch.float64, requires_grad=True)
    s = torch.tensor([[0.5]], dtype=torch.float64, requires_grad=True)
    z = torch.tensor([[4.0]], dtype=torch.float64)
    w_hat = fake_quantize_ste(w, s, z, bits=3)
    torch.testing.assert_close(w_hat.detach(), torch.tensor([[0.5, -1.0, 1.0, 1.5, -2.0]], dtype=torch.float64))
    c = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]], dtype=torch.float64)
    (w_hat * c).sum().backward()
    # STE: the gradient passes to w inside the grid and stops at clipped weights
    torch.testing.assert_close(w.grad, torch.tensor([[1.0, 2.0, 3.0, 0.0, 0.0]], dtype=torch.float64))
    # LSQ: d w_hat / d s = round(w/s) - w/s inside = [0.4, 0.2, 0.2]; clipped: qmax - z = 3, 0 - z = -4
    want = 1 * 0.4 + 2 * 0.2 + 3 * 0.2 + 4 * 3.0 + 5 * -4.0
    assert float(s.grad) == pytest.approx(want, abs=1e-12)


def test_fake_quantize_ste_per_group_scales_get_their_own_gradient():
    w = torch.tensor([[0.3, 0.7, -0.2, 0.1]], requires_grad=True)
    s = torch.tensor([[0.25, 0.1]], requires_grad=True)
    fake_quantize_ste(w, s, torch.tensor([[2.0, 2.0]]), bits=2).sum().backward()
    # group 0: w/s = [1.2, 2.8] -> round + z = [3, 5 -> 3 clipped]: (1 - 1.2) + (3 - 2) = 0.8
    # group 1: w/s = [-2, 1] -> [0, 3]: both exactly on the grid, gradient 0
    torch.testing.assert_close(s.grad, torch.tensor([[0.8, 0.0]]))
    torch.testing.assert_close(w.grad, torch.tensor([[1.0, 0.0, 1.0, 1.0]]))


def _setup(tmp_path, spec: LayerQuant, tied: bool = False):
    make_tiny_hf_model(tmp_path / "float", tie_word_embeddings=tied, seed=1)
    loaded = load_model(tmp_path / "float", fuse=False)
    plan = plan_layers(loaded.model, loaded.config.tie_word_embeddings, spec)
    data = TextWindows.from_text(TRAINING_TEXT, loaded.tokenizer, seq_len=32, seed=0)
    return loaded, plan, data


def _text_ce(model, data: TextWindows) -> float:
    with torch.no_grad():
        return float(next_token_ce(causal_lm_forward(model, data.windows).logits, data.windows))


SPEC = LayerQuant(bits=2, group_size=32, sym=False)
STEPS = TrainConfig(max_steps=8, batch_size=4, lr=2e-3, checkpoint_every=0, progress=False)


def test_qat_reduces_the_loss_deterministically_and_beats_rtn(tmp_path):
    runs = []
    for i in range(2):
        loaded, plan, data = _setup(tmp_path / str(i), SPEC)
        tensors, _ = qat_quantize(loaded, plan, SPEC, QATConfig(), STEPS, data, tmp_path / str(i) / "out")
        runs.append((loaded, tensors))
    (loaded, tensors), (_, again) = runs
    assert tensors.keys() == again.keys() and all(torch.equal(tensors[k], again[k]) for k in tensors)
    log = [line for line in (tmp_path / "0" / "out" / "train_log.jsonl").read_text().splitlines() if '"loss"' in line]
    losses = [float(line.split('"loss": ')[1].split(",")[0]) for line in log]
    assert len(losses) == 8 and losses[-1] < losses[0]
    # on the training text, the QAT model (all of it, at 2 bits) beats RTN's codes, which are QAT's step 0
    rtn, plan, data = _setup(tmp_path / "rtn", SPEC)
    from brisk.quant.qat import prepare_qat

    prepare_qat(rtn, plan)
    assert _text_ce(loaded.model, data) < _text_ce(rtn.model, data)


@pytest.mark.parametrize("tied", [False, True])
def test_exported_checkpoint_equals_the_fake_quant_model(tmp_path, tied):
    spec = LayerQuant(bits=4, group_size=32, sym=tied)
    loaded, plan, data = _setup(tmp_path, spec, tied=tied)
    config = TrainConfig(max_steps=3, batch_size=2, lr=2e-3, checkpoint_every=0, progress=False)
    tensors, qconfig = qat_quantize(loaded, plan, spec, QATConfig(alpha=0.5, temperature=2.0), config, data,
                                    tmp_path / "out")
    folder = save_quantized(tmp_path / "q", loaded.config, loaded.tokenizer, qconfig, tensors)
    # after export `loaded.model` holds the fake-quantized weights the last step trained, as float tensors
    want = prefill_logits(loaded, IDS)
    got = prefill_logits(load_model(folder), IDS)
    torch.testing.assert_close(got, want, atol=2e-4 * want.abs().max().item(), rtol=1e-4)
    assert qconfig.method == "qat" and qconfig.method_config["training"]["steps"] == 3


def test_quantize_cli_qat_end_to_end(tmp_path):
    make_tiny_hf_model(tmp_path / "float", seed=2)
    text = tmp_path / "train.txt"
    text.write_text(TRAINING_TEXT)
    args = ["quantize", str(tmp_path / "float"), str(tmp_path / "q"), "--method", "qat", "--bits", "3",
            "--group-size", "32", "--text", str(text), "--steps", "2", "--seq-len", "32", "--batch-size", "2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert load_model(tmp_path / "q").config.num_hidden_layers == 2
    size = CliRunner().invoke(main, ["eval", "size", "--model", str(tmp_path / "q")])
    assert size.exit_code == 0, size.output
    short = tmp_path / "short.txt"
    short.write_text("Emma.")
    bad = CliRunner().invoke(main, [*args[:-6], "--text", str(short), "--force", "--seq-len", "32"])
    assert bad.exit_code != 0 and "fewer than one window" in bad.output
    gptq = CliRunner().invoke(main, [*args, "--force", "--init", "gptq", "--num-samples", "2"])
    assert gptq.exit_code == 0, gptq.output
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["method_config"][
        "init"] == "gptq"
    bf16 = CliRunner().invoke(main, [*args, "--force", "--bf16"])  # matmuls in bfloat16 autocast
    assert bf16.exit_code == 0, bf16.output
    training = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["method_config"][
        "training"]
    assert training["config"]["bf16_autocast"] is True
    nf4 = CliRunner().invoke(main, [*args, "--force", "--scheme", "nf4", "--bits", "4"])
    assert nf4.exit_code != 0 and "int" in nf4.output


def test_init_gptq_distills_from_the_float_model_not_from_gptqs(tmp_path, monkeypatch):
    # GPTQ writes its quantized weights into the model it calibrates; the teacher QAT distills from must be the
    # model as it was before (a copy of the GPTQ model would make the loss ~0 from the first step)
    import brisk.quant.qat as qat_module

    make_tiny_hf_model(tmp_path / "float", seed=2)
    original = {k: v.clone() for k, v in load_model(tmp_path / "float", fuse=False).model.state_dict().items()}
    seen = {}
    real = qat_module.qat_quantize

    def spy(loaded, plan, default, qat, config, data, out, init=None, teacher=None):  # noqa: ANN001, ANN202
        seen["teacher"] = {k: v.clone() for k, v in teacher.state_dict().items()}
        seen["student"] = {k: v.clone() for k, v in loaded.model.state_dict().items()}
        return real(loaded, plan, default, qat, config, data, out, init=init, teacher=teacher)

    monkeypatch.setattr(qat_module, "qat_quantize", spy)
    text = tmp_path / "train.txt"
    text.write_text(TRAINING_TEXT)
    result = CliRunner().invoke(main, ["quantize", str(tmp_path / "float"), str(tmp_path / "q"), "--method", "qat",
                                       "--bits", "3", "--group-size", "32", "--text", str(text), "--steps", "1",
                                       "--seq-len", "32", "--batch-size", "2", "--init", "gptq",
                                       "--num-samples", "2"])
    assert result.exit_code == 0, result.output
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(seen["teacher"][name], original[name])  # the float weights
    assert not torch.equal(seen["student"][name], original[name])  # GPTQ's, where the student starts
