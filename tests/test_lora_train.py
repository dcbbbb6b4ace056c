"""LoRA / QLoRA training: the frozen quantized base's backward, double quantization, chat masks, the CLI run."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from hf_utils import TRAINING_TEXT, make_tiny_hf_model
from test_gemma import make_tiny_gemma3
from test_moe import make_tiny_moe

from brisk.cli import main
from brisk.lora.data import encode_conversation
from brisk.lora.frozen import FrozenQuantLinear, double_dequantize, double_quantize
from brisk.lora.train import _frozen_from_float
from brisk.model.loader import load_model
from brisk.ops.qlinear import dequantize_packed
from brisk.quant.config import LayerQuant
from brisk.train.forward import causal_lm_forward

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("spec", [LayerQuant(4, 64, scheme="nf4"), LayerQuant(4, 64), LayerQuant(8, -1, sym=True)])
def test_frozen_quant_backward_equals_dense(spec):
    """grad_input from the packed codes, chunk by chunk, equals autograd through the dequantized float weight."""
    lin = torch.nn.Linear(128, 96, bias=True)
    layer = _frozen_from_float(lin.weight, lin.bias, spec, double_quant=False)
    w = dequantize_packed(layer.packed())  # [96, 128] the weight it stands for
    x = torch.randn(3, 5, 128, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    y2 = torch.nn.functional.linear(x2, w, lin.bias.detach())
    (y2 * g).sum().backward()
    torch.testing.assert_close(y, y2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-4, rtol=1e-4)


def test_double_quantization_of_scales():
    absmax = torch.rand(96, 7) * 0.5 + 0.01
    codes, scale, mean = double_quantize(absmax)
    assert codes.dtype == torch.int8 and scale.numel() == -(-absmax.numel() // 256)
    back = double_dequantize(codes, scale, mean, tuple(absmax.shape))
    # int8 over each block's centred range: error at most half a step of that block
    assert float((back - absmax).abs().max()) <= float(scale.max()) / 2 + 1e-7
    lin = torch.nn.Linear(128, 96)
    dq = _frozen_from_float(lin.weight, lin.bias, LayerQuant(4, 64, scheme="nf4"), double_quant=True)
    assert dq.scales is None and dq.scale_codes.dtype == torch.int8  # no float16 absmax kept
    assert isinstance(dq, FrozenQuantLinear) and dq.nbytes() < 128 * 96 * 0.6  # ~0.5 byte per weight


def test_chat_loss_only_on_assistant_turns(tmp_path):
    make_tiny_hf_model(tmp_path / "m", "llama", seed=0)
    tok = load_model(tmp_path / "m").tokenizer
    msgs = [{"role": "user", "content": "Who is Emma?"}, {"role": "assistant", "content": "A clever girl."}]
    row = encode_conversation(tok, msgs, 256)
    labelled = [t for t in row if t >= 0]
    assert tok.decode(labelled).startswith("A clever girl.") and 2 in labelled  # the reply and its <|im_end|>
    context = [-1 - t for t in row if t < 0]
    assert "Who is Emma?" in tok.decode(context) and "A clever" not in tok.decode(context)


def test_finetune_cli_qlora_peft_loads_the_adapter(tmp_path):
    make_tiny_hf_model(tmp_path / "m", "llama", seed=0)
    lines = [{"messages": [{"role": "user", "content": f"Who is person {i}?"},
                           {"role": "assistant", "content": "Emma Woodhouse, handsome and clever."}]} for i in range(6)]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "ad"
    res = CliRunner().invoke(main, ["finetune", str(tmp_path / "m"), str(out), "--data", str(data), "--eval-data",
                                    str(data), "--qlora", "--steps", "12", "--lr", "1e-2", "--seq-len", "64",
                                    "--batch-size", "2", "--lora-rank", "4", "--target-modules", "q,v,down"])
    assert res.exit_code == 0, res.output
    record = json.loads((out / "training.json").read_text())
    assert record["double_quant"] and record["eval_loss_after"] < 0.7 * record["eval_loss_before"]
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    pm = peft.PeftModel.from_pretrained(base, out)
    sd = {k: v for k, v in pm.state_dict().items() if "lora_B" in k}
    assert len(sd) == 2 * 3 and all(float(v.abs().sum()) > 0 for v in sd.values())  # trained, loaded under PEFT's keys
    bad = CliRunner().invoke(main, ["finetune", str(tmp_path / "m"), str(tmp_path / "x"), "--data", str(data),
                                    "--target-modules", "q,lm_head"])
    assert bad.exit_code != 0 and "not a projection" in bad.output


def test_quantized_gguf_base_is_converted_layer_by_layer(tmp_path):
    # a Q4_1 file loaded in its own precision and converted to NF4 one layer at a time gives the same frozen base
    # as the whole float model dequantized first (the path that held the float decoder whole)
    from gguf import GGMLQuantizationType
    from gguf_utils import random_state_dict, tiny_config, write_tiny_model

    from brisk.lora.train import prepare_base

    config = tiny_config(hidden_size=256, intermediate_size=256, head_dim=64)
    path = write_tiny_model(tmp_path / "m.gguf", random_state_dict(config, seed=1), config,
                            qtype=GGMLQuantizationType.Q4_1)
    bases = []
    for streamed in (False, True):
        loaded = load_model(path, fuse=False, sparse=False, keep_quantized=streamed, show_progress=False)
        info = prepare_base(loaded, "nf4", requantize=streamed)
        assert info["quantized_at_load"] == config.num_hidden_layers * 7 and info["double_quant"]
        bases.append({n: m for n, m in loaded.model.named_modules() if isinstance(m, FrozenQuantLinear)})
    (name, ref), *_ = bases[0].items()
    assert bases[0].keys() - {"lm_head"} == bases[1].keys() - {"lm_head"} and "nf4" in ref.extra_repr()
    for n, m in bases[0].items():
        if n != "lm_head":
            assert all(torch.equal(a, b) for a, b in zip(m.buffers(), bases[1][n].buffers(), strict=True)), n


@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma3"])
def test_finetune_each_architecture_and_serve_the_adapter(tmp_path, arch):
    """A float-base LoRA run lowers the held-out loss, and the adapter, served by the engine's LoRA layers over the
    fused model, gives the logits of the training forward over the base with the adapter merged."""
    from test_lora import prefill_logits

    from brisk.lora.adapter import load_adapter, merge_adapter
    from brisk.lora.finetune import finetune_lora
    from brisk.lora.layers import LoRAMapping
    from brisk.lora.manager import LoRAManager
    from brisk.lora.request import LoRARequest
    from brisk.train.trainer import TrainConfig

    if arch == "gemma3":
        make_tiny_gemma3(tmp_path / "m", seed=2)
    else:
        make_tiny_hf_model(tmp_path / "m", arch, seed=2)
    text = tmp_path / "emma.txt"
    text.write_text(TRAINING_TEXT)
    config = TrainConfig(max_steps=8, batch_size=2, lr=1e-2, checkpoint_every=0, progress=False)
    record = finetune_lora(str(tmp_path / "m"), tmp_path / "ad", str(text), config, rank=4, alpha=8, dropout=0.0,
                           use_rslora=False, target_modules="q,k,v,o,gate,up,down", base="float", seq_len=32,
                           eval_data=str(text))
    assert record["eval_loss_after"] < 0.98 * record["eval_loss_before"]
    ids = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(0))
    served = load_model(tmp_path / "m")
    mgr = LoRAManager(served.model, max_loras=1, max_lora_rank=4)
    slot, _ = mgr.acquire(LoRARequest("ad", 1, str(tmp_path / "ad")))
    mgr.state.mapping = LoRAMapping.from_row_slots([slot] * ids.shape[0])
    merged = load_model(tmp_path / "m", fuse=False)
    assert merge_adapter(merged.model, load_adapter(tmp_path / "ad")) == merged.config.num_hidden_layers * 7
    with torch.no_grad():
        want = causal_lm_forward(merged.model, ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(served, ids), want, atol=1e-4, rtol=1e-4)


def test_finetune_refuses_moe_models(tmp_path):
    make_tiny_moe(tmp_path / "m", "qwen3_moe", seed=0)
    (tmp_path / "emma.txt").write_text(TRAINING_TEXT)
    res = CliRunner().invoke(main, ["finetune", str(tmp_path / "m"), str(tmp_path / "ad"), "--data",
                                    str(tmp_path / "emma.txt"), "--steps", "1", "--seq-len", "32"])
    assert res.exit_code != 0 and "mixture-of-experts models (qwen3_moe)" in res.output
    assert not (tmp_path / "ad" / "adapter_config.json").exists()
