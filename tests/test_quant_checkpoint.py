"""Quantized checkpoints: brisk quantize -> folder -> load -> generate, against a fake-quantized float model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model
from safetensors.torch import load_file, save_file
from test_model import prefill_logits

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.model.loader import build_model, load_model
from brisk.ops.layers import QuantLinear
from brisk.quant import primitives
from brisk.quant.checkpoint import save_quantized
from brisk.quant.config import LayerQuant, QuantConfigError
from brisk.quant.layers import QuantEmbedding
from brisk.quant.rtn import HEAD_DEFAULT, plan_layers, rtn_quantize

IDS = torch.tensor([5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 120])
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def quantize_folder(src: Path, out: Path, spec: LayerQuant, head: LayerQuant | None = HEAD_DEFAULT,
                    skip: tuple[str, ...] = ()) -> Path:
    loaded = load_model(src, fuse=False)
    plan = plan_layers(loaded.model, loaded.config.tie_word_embeddings, spec, head=head, skip=skip)
    tensors, qconfig = rtn_quantize(loaded, plan, spec, progress=False)
    return save_quantized(out, loaded.config, loaded.tokenizer, qconfig, tensors)


def fake_quant_reference(src: Path, qfolder: Path) -> torch.nn.Module:
    """The float model with every quantized weight replaced by its dequantized codes, read from the quantized
    folder with the primitives alone (no brisk.quant loading code): the oracle for the whole load path."""
    float_loaded = load_model(src, fuse=False)
    config = json.loads((qfolder / "config.json").read_text())["quantization_config"]
    packed = load_file(str(qfolder / "model.safetensors"))
    tensors = dict(float_loaded.model.state_dict())
    for name, spec in config["modules"].items():
        q = primitives.unpack(packed[f"{name}.qweight"], spec["bits"], tensors[f"{name}.weight"].shape[1])
        scale = packed[f"{name}.scales"].float()
        if spec.get("scheme") == "nf4":
            w = primitives.dequantize_nf4(q, scale)
        else:
            zero = packed[f"{name}.qzeros"].float() if f"{name}.qzeros" in packed else \
                torch.full_like(scale, 2 ** (spec["bits"] - 1))
            w = primitives.dequantize(q, scale, zero)
        tensors[f"{name}.weight"] = w
    if float_loaded.config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    model = build_model(float_loaded.config, tensors, torch.float32)
    model.init_rope(float_loaded.config.max_position_embeddings)
    return type(float_loaded)(model, float_loaded.config, float_loaded.tokenizer, src, torch.float32, 0.0)


SPECS = [
    LayerQuant(bits=8, group_size=-1, sym=True),
    LayerQuant(bits=4, group_size=32, sym=False),
    LayerQuant(bits=3, group_size=32, sym=False),
    LayerQuant(bits=2, group_size=64, sym=True),
    LayerQuant(bits=4, group_size=32, sym=True, scheme="nf4"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label)
@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_quantized_model_equals_fake_quantized_float_model(tmp_path, spec, arch, tied):
    src = tmp_path / "float"
    make_tiny_hf_model(src, arch, tie_word_embeddings=tied, seed=3)
    qfolder = quantize_folder(src, tmp_path / "q", spec)
    quant = load_model(qfolder)
    # q/k/v and gate/up fused in packed form; every linear quantized, the table too
    attn, mlp = quant.model.model.layers[0].self_attn, quant.model.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(mlp.gate_up_proj, QuantLinear)
    assert isinstance(attn.o_proj, QuantLinear) and isinstance(mlp.down_proj, QuantLinear)
    assert isinstance(quant.model.lm_head, QuantLinear)
    assert isinstance(quant.model.model.embed_tokens, QuantEmbedding)
    reference = fake_quant_reference(src, qfolder)
    got, want = prefill_logits(quant, IDS), prefill_logits(reference, IDS)
    torch.testing.assert_close(got, want, atol=2e-4 * want.abs().max().item(), rtol=1e-4)
    # greedy decode through the engine (decode path = small-M kernels) with float activations agrees token for
    # token ("auto", the default, rounds a 4-bit layer's activations to int8: tests/test_qlinear_q8.py)
    llm = LLM(qfolder, kv_cache_memory="8MiB", quant_activations="float")
    assert llm.engine.num_int8_activation_layers == 0
    a = llm.generate([IDS.tolist()], GREEDY, use_tqdm=False)[0]
    ref_tokens = _greedy_float(reference, IDS.tolist(), 16)
    assert a.outputs[0].token_ids == ref_tokens
    # the default: int8 activations exactly on the affine 4-bit layers (not NF4, 3 or 2 bits, nor the int8 head)
    n_layers = sum(type(m) is QuantLinear for m in quant.model.modules())  # the head included
    auto = LLM(qfolder, kv_cache_memory="8MiB").engine.num_int8_activation_layers
    assert auto == (n_layers - 1 if spec.bits == 4 and spec.scheme != "nf4" else 0), (auto, n_layers)


def _greedy_float(loaded, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full re-prefill each step (slow and obviously right)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(prefill_logits(loaded, torch.tensor(ids))[-1].argmax()))
    return ids[len(prompt):]


def test_saved_and_reloaded_checkpoint_generates_the_same_tokens(tmp_path):
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=5)
    qfolder = quantize_folder(src, tmp_path / "q", LayerQuant(bits=4, group_size=64))
    first = LLM(qfolder, kv_cache_memory="8MiB").generate(["hello world"], GREEDY, use_tqdm=False)[0]
    copy = tmp_path / "copy"
    shutil.copytree(qfolder, copy)
    again = LLM(copy, kv_cache_memory="8MiB", dtype="bfloat16").generate(["hello world"], GREEDY, use_tqdm=False)
    second = LLM(copy, kv_cache_memory="8MiB").generate(["hello world"], GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert len(again[0].outputs[0].token_ids) == 16  # bfloat16 activations over the same codes run too
    # the tokenizer and chat template travelled with it
    q, f = load_model(qfolder), load_model(src)
    msgs = [{"role": "user", "content": "hi"}]
    assert q.tokenizer.encode_chat(msgs) == f.tokenizer.encode_chat(msgs)
    assert q.tokenizer.eos_token_ids == f.tokenizer.eos_token_ids


def test_skip_patterns_and_float_head_keep_float_layers(tmp_path):
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=2)
    qfolder = quantize_folder(src, tmp_path / "q", LayerQuant(bits=8), head=None,
                              skip=("model.layers.0.*", "*.down_proj"))
    config = json.loads((qfolder / "config.json").read_text())["quantization_config"]
    assert not any(n.startswith("model.layers.0.") or n.endswith("down_proj") for n in config["modules"])
    assert "model.embed_tokens" not in config["modules"] and "lm_head" not in config["modules"]
    quant = load_model(qfolder)
    layer0, layer1 = quant.model.model.layers
    assert not isinstance(layer0.self_attn.qkv_proj, QuantLinear)  # float, fused as usual
    assert isinstance(layer1.self_attn.qkv_proj, QuantLinear) and not isinstance(layer1.mlp.down_proj, QuantLinear)
    torch.testing.assert_close(prefill_logits(quant, IDS), prefill_logits(fake_quant_reference(src, qfolder), IDS),
                               atol=1e-3, rtol=1e-4)


def test_group_size_that_does_not_divide_is_refused_before_work(tmp_path):
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama")
    loaded = load_model(src, fuse=False)
    with pytest.raises(QuantConfigError, match="group size 48 does not divide the input dimension 64"):
        plan_layers(loaded.model, False, LayerQuant(bits=4, group_size=48))


# ------------------------------------------------------------------------------- broken checkpoints
@pytest.fixture(scope="module")
def good_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("qgood")
    make_tiny_hf_model(root / "float", "llama", seed=4)
    return quantize_folder(root / "float", root / "q", LayerQuant(bits=4, group_size=32))


def _broken(good: Path, tmp_path: Path, edit_config=None, edit_tensors=None) -> Path:
    out = tmp_path / "broken"
    shutil.copytree(good, out)
    if edit_config:
        cfg = json.loads((out / "config.json").read_text())
        edit_config(cfg["quantization_config"])
        (out / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        tensors = load_file(str(out / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out


def _set(d: dict, key: str, value) -> None:
    d[key] = value


BROKEN = [
    ("quant_method hqq", lambda c: _set(c, "quant_method", "hqq"), None, "quant_method 'hqq', which brisk does not"),
    ("brisk tensors under gptq", lambda c: _set(c, "quant_method", "gptq"), None,
     "checkpoint lacks lm_head.qzeros, which the GPTQ layout needs"),
    ("future version", lambda c: _set(c, "format_version", 9), None, "format_version 9 is not supported"),
    ("unknown method", lambda c: _set(c, "method", "magic"), None, "unknown quantization method 'magic'"),
    ("bad bits", lambda c: c["modules"]["lm_head" if "lm_head" in c["modules"] else "model.embed_tokens"].update(
        bits=5), None, "bits must be one of"),
    ("bits disagree with tensors", lambda c: c["modules"]["model.layers.0.mlp.up_proj"].update(bits=8), None,
     r"model.layers.0.mlp.up_proj.qweight is uint8 \[128, 32\].*needs uint8 \[128, 64\]"),
    ("group disagrees", lambda c: c["modules"]["model.layers.1.self_attn.o_proj"].update(group_size=16), None,
     r"o_proj.scales .* needs float \[64, 4\]"),
    ("sym but zeros present", lambda c: c["modules"]["model.layers.0.self_attn.q_proj"].update(sym=True), None,
     "qzeros is present but quantization_config says .* is symmetric"),
    ("missing zeros", None, lambda t: t.pop("model.layers.1.mlp.gate_proj.qzeros"),
     "lacks model.layers.1.mlp.gate_proj.qzeros"),
    ("no such module", lambda c: _set(c["modules"], "model.layers.7.mlp.up_proj", dict(
        bits=4, group_size=32, sym=False)), None, "model.layers.7.mlp.up_proj"),
    ("not a module", lambda c: _set(c["modules"], "model.norm", dict(bits=4, group_size=32, sym=False)), None,
     "'model.norm', which is not a linear layer"),
    ("empty modules", lambda c: _set(c, "modules", {}), None, "list at least one module"),
    ("not an object", lambda c: c["modules"].update({"lm_head": 4}), None, "must be an object"),
]


@pytest.mark.parametrize("what,edit_config,edit_tensors,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_quantized_checkpoint_gives_a_clear_error(good_folder, tmp_path, what, edit_config, edit_tensors,
                                                         message):
    folder = _broken(good_folder, tmp_path, edit_config, edit_tensors)
    with pytest.raises(QuantConfigError, match=message):
        load_model(folder)


def test_quantize_cli_writes_a_folder_that_generates(tmp_path):
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=6)
    out = tmp_path / "q4"
    runner = CliRunner()
    result = runner.invoke(main, ["quantize", "--method", "rtn", "--bits", "4", "--group-size", "32", str(src),
                                  str(out)])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["method"], config["bits"], config["group_size"], config["sym"]) == ("rtn", 4, 32, False)
    assert config["modules"]["model.embed_tokens"] == {"bits": 8, "group_size": -1, "sym": True, "scheme": "int"}
    result = runner.invoke(main, ["generate", "--model", str(out), "--max-tokens", "4", "--no-stream", "hello"])
    assert result.exit_code == 0, result.output
    # a second run into the same folder is refused; bad combinations are refused with a reason
    again = runner.invoke(main, ["quantize", str(src), str(out)])
    assert again.exit_code != 0 and "--force" in again.output
    bad = runner.invoke(main, ["quantize", "--scheme", "nf4", "--bits", "8", str(src), str(tmp_path / "x")])
    assert bad.exit_code != 0 and "4-bit format" in bad.output
    bad = runner.invoke(main, ["quantize", "--group-size", "48", str(src), str(tmp_path / "y")])
    assert bad.exit_code != 0 and "does not divide" in bad.output


def test_default_model_quantized_keeps_its_answers(tmp_path, default_gguf_path):
    """The real model: at int8 per channel the float model's next-token argmax survives at >= 90% of the positions
    of real text (measured 97%: 8-bit RTN only flips near-ties); at int4 g64 the chat answer is still right.
    (int4 RTN agrees at only ~65%: the float weights are themselves dequantized Q4_1, and re-rounding them onto
    another 4-bit grid doubles the error; that cost is reported as perplexity in BENCHMARKS.md.)"""
    ref = load_model(default_gguf_path)
    text = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
            "want of a wife. However little known the feelings or views of such a man may be on his first entering "
            "a neighbourhood, this truth is so well fixed in the minds of the surrounding families.")
    ids = torch.tensor(ref.tokenizer.encode(text, add_special_tokens=False))
    int8 = load_model(quantize_folder(default_gguf_path, tmp_path / "q8", LayerQuant(bits=8, sym=True)))
    agree = (prefill_logits(int8, ids).argmax(-1) == prefill_logits(ref, ids).argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
    llm = LLM(quantize_folder(default_gguf_path, tmp_path / "q4", LayerQuant(bits=4, group_size=64)),
              kv_cache_memory="32MiB", max_model_len=512)
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert "Paris" in answer


@pytest.mark.parametrize("group", [-1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_embedding_kernel_equals_the_torch_path(kernel_settings, group, dtype):
    """QuantEmbedding's one-op lookup for symmetric 8-bit tables (ops/csrc/fused_ops.cpp embedding_q8) against its
    pure-PyTorch path, bit for bit, for [T] and [B, T] ids; an id outside the table is refused by both."""
    from brisk.quant import primitives

    table = torch.randn(300, 128, generator=torch.Generator().manual_seed(group))
    q, scale, _ = primitives.quantize_tensor(table, 8, None if group == -1 else group, sym=True)
    emb = QuantEmbedding(q, scale, None, LayerQuant(bits=8, group_size=group, sym=True), 128, dtype)
    ids = torch.tensor([[0, 299, 17], [5, 5, 128]])
    fast = [emb(ids), emb(ids[0])]
    kernel_settings(enabled=False)
    slow = [emb(ids), emb(ids[0])]
    for a, b in zip(fast, slow, strict=True):
        assert a.dtype == dtype and a.shape == b.shape and torch.equal(a, b)
    with pytest.raises(IndexError):
        emb(torch.tensor([300]))
    kernel_settings(enabled=True)
    with pytest.raises(RuntimeError, match="id 300 is out of range for a table of 300 rows"):
        emb(torch.tensor([300]))


def _mappings(path: Path) -> tuple[int, list[tuple[int, int]]]:
    """Resident bytes of this process's mappings of `path` and their address ranges (/proc/self/smaps)."""
    total, inside, ranges = 0, False, []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms offset dev inode [path]
            inside = line.rstrip().endswith(str(path))
            if inside:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                ranges.append((lo, hi))
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total, ranges


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_repacked_source_pages_leave_the_resident_set(tmp_path):
    """The codes, scales and zero points are read through the file's map into the kernels' layout; afterwards only
    the pages of tensors the model still views (the int8 embedding, the norms) stay mapped in."""
    from brisk.model.hugepages import model_tensors

    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=2, hidden_size=512, intermediate_size=1536, num_attention_heads=4)
    qfolder = quantize_folder(src, tmp_path / "q", LayerQuant(bits=4, group_size=64))
    loaded = load_model(qfolder)
    file = (qfolder / "model.safetensors").resolve()
    stored = sum(t.nbytes for k, t in load_file(file).items() if ".layers." in k and "norm" not in k)
    assert stored > 2_000_000  # the decoder linears' codes, scales and zero points as stored
    resident, ranges = _mappings(file)
    assert ranges, "the folder's weights are not memory-mapped"
    on_map = {t.data_ptr(): t.nbytes for t in model_tensors(loaded.model)
              if any(lo <= t.data_ptr() < hi for lo, hi in ranges)}
    assert resident <= sum(on_map.values()) + 64 * 1024, (resident, sum(on_map.values()), stored)
    again = load_model(qfolder)  # (a second load reads the dropped pages again from the page cache: same model)
    assert torch.equal(prefill_logits(loaded, IDS), prefill_logits(again, IDS))
