"""Distillation: the loss against a direct formula, layer-copy students, tokenizer checks, the CLI end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model
from test_gemma import make_tiny_gemma3
from test_moe import make_tiny_moe

from brisk.cli import main
from brisk.data import calibration_text_path
from brisk.model.loader import load_model
from brisk.train.distill import DistillError, check_same_tokenizer, parse_layers, teacher_layers_student
from brisk.train.forward import causal_lm_forward
from brisk.train.losses import distillation_loss


def write_texts(folder: Path) -> tuple[Path, Path]:
    """A short training text and a held-out one from the bundled book, as files in `folder`."""
    book = calibration_text_path().read_text(encoding="utf-8")
    text, held = folder / "train.txt", folder / "held.txt"
    text.write_text(book[:20000])
    held.write_text(book[40000:45000])
    return text, held


def test_distillation_loss_matches_the_formula():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(1, 3, 5, generator=g), torch.randn(1, 3, 5, generator=g)
    ids = torch.tensor([[1, 4, 2]])
    temp, alpha = 2.0, 0.3
    kl = 0.0
    for pos in range(3):
        p = [math.exp(x / temp) for x in t[0, pos].tolist()]
        q = [math.exp(x / temp) for x in s[0, pos].tolist()]
        p = [x / sum(p) for x in p]
        q = [x / sum(q) for x in q]
        kl += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True)) / 3
    ce = 0.0
    for pos in range(2):  # position t predicts ids[t + 1]
        row = s[0, pos].tolist()
        ce += (math.log(sum(math.exp(x) for x in row)) - row[ids[0, pos + 1]]) / 2
    loss, parts = distillation_loss(s, t, ids, alpha, temp)
    assert float(loss) == pytest.approx(alpha * temp**2 * kl + (1 - alpha) * ce, rel=1e-5)
    assert parts["ce"] == pytest.approx(ce, rel=1e-5)
    same, _ = distillation_loss(t, t, ids, 1.0, temp)
    assert float(same) == pytest.approx(0.0, abs=1e-6)


def test_parse_layers():
    assert parse_layers("every:3", 8) == [0, 3, 6]
    assert parse_layers("layers:0,5,7", 8) == [0, 5, 7]
    for bad in ("every:0", "layers:3,1", "layers:9", "half"):
        with pytest.raises(DistillError):
            parse_layers(bad, 8)


def test_layer_copy_student_equals_teacher_with_all_layers(tmp_path):
    make_tiny_hf_model(tmp_path, num_hidden_layers=3)
    teacher = load_model(tmp_path, fuse=False)
    ids = torch.arange(10)[None]
    full = teacher_layers_student(teacher, [0, 1, 2])
    torch.testing.assert_close(causal_lm_forward(full.model, ids).logits, causal_lm_forward(teacher.model, ids).logits)
    short = teacher_layers_student(teacher, [0, 2])
    assert short.config.num_hidden_layers == 2
    assert torch.equal(short.model.model.layers[1].mlp.up_proj.weight, teacher.model.model.layers[2].mlp.up_proj.weight)
    with torch.no_grad():
        short.model.model.layers[1].mlp.up_proj.weight.add_(1.0)  # a copy: the teacher is untouched
    assert not torch.equal(short.model.model.layers[1].mlp.up_proj.weight,
                           teacher.model.model.layers[2].mlp.up_proj.weight)


def test_student_with_another_tokenizer_is_refused(tmp_path):
    make_tiny_hf_model(tmp_path / "t")
    make_tiny_hf_model(tmp_path / "s", vocab_size=320)
    with pytest.raises(DistillError, match="tokenizer"):
        check_same_tokenizer(load_model(tmp_path / "t", fuse=False), load_model(tmp_path / "s", fuse=False))


def test_distill_cli_end_to_end(tmp_path):
    make_tiny_hf_model(tmp_path / "teacher", num_hidden_layers=4, tie_word_embeddings=True)
    text, held = write_texts(tmp_path)
    args = [str(tmp_path / "teacher"), "every:2", str(tmp_path / "out"), "--text", str(text), "--eval-text",
            str(held), "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--lr", "1e-3", "--eval-windows", "1",
            "--eval-window", "64", "--hidden-weight", "0.5"]
    result = CliRunner().invoke(main, ["distill", *args])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "out" / "config.json").read_text())["training"]
    assert record["method"] == "distill" and record["student_layers"] == [0, 2] and record["steps"] == 4
    assert load_model(tmp_path / "out").config.num_hidden_layers == 2
    again = CliRunner().invoke(main, ["distill", *args])
    assert again.exit_code != 0 and "--resume" in again.output
    short = tmp_path / "short.txt"
    short.write_text("Emma.")
    bad = CliRunner().invoke(main, ["distill", *args[:3], "--text", str(short), "--force", "--seq-len", "32"])
    assert bad.exit_code != 0 and "fewer than one window" in bad.output


@pytest.mark.parametrize("arch", ["gemma3", "qwen2_moe"])
def test_distill_cli_layer_copy_student_keeps_each_layers_kind(tmp_path, arch):
    """A layer-copy student of gemma3 keeps each copied layer's sliding / global kind, one of a MoE model which
    layers are dense; the run lowers held-out perplexity and the student folder loads as that model."""
    if arch == "gemma3":  # layers: sliding, sliding, global, sliding
        make_tiny_gemma3(tmp_path / "teacher", seed=1)
        layers, want = [0, 2], {"layer_types": ["sliding_attention", "full_attention"]}
    else:  # layer 1 of 3 keeps a dense MLP
        make_tiny_moe(tmp_path / "teacher", arch, seed=1, num_hidden_layers=3, mlp_only_layers=[1])
        layers, want = [1, 2], {"mlp_only_layers": [0], "num_experts": 8}
    text, held = write_texts(tmp_path)
    args = [str(tmp_path / "teacher"), "layers:" + ",".join(map(str, layers)), str(tmp_path / "out"), "--text",
            str(text), "--eval-text", str(held), "--steps", "6", "--batch-size", "2", "--seq-len", "32", "--lr",
            "3e-3", "--eval-windows", "1", "--eval-window", "64"]
    result = CliRunner().invoke(main, ["distill", *args])
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "out" / "config.json").read_text())["training"]
    assert record["student_layers"] == layers and record["eval_ppl_after"] < record["eval_ppl_before"]
    student = load_model(tmp_path / "out").config
    assert student.architecture == arch and student.num_hidden_layers == 2
    assert {k: getattr(student, k) for k in want} == want
