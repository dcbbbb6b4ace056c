"""brisk eval: perplexity against transformers' own loss, size reports against exact byte counts."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from hf_utils import TRAINING_TEXT, make_tiny_hf_model
from safetensors.torch import save_file
from tokenizers import Tokenizer

from brisk.eval.cli import eval_group
from brisk.eval.ppl import perplexity, sequence_logits
from brisk.eval.size import SizeError, model_size, tensor_kind
from brisk.model.gguf import read_gguf_config
from brisk.model.loader import load_model

TEXT = TRAINING_TEXT  # ~1k tokens for the tiny BPE, which was trained on this text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama whose tokenizer prepends BOS by default, so scoring with BOS would change the result."""
    path = tmp_path_factory.mktemp("tiny-eval")
    ref = make_tiny_hf_model(path, "llama", add_bos_token=True, seed=5)
    return path, ref


def hf_window_losses(ref, ids: list[int], window: int, max_windows: int | None) -> tuple[float, int]:
    """(mean NLL, predicted tokens) from transformers' loss; windows cut here, each weighted by its count."""
    num_windows = len(ids) // window if max_windows is None else min(len(ids) // window, max_windows)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(num_windows):
            w = torch.tensor([ids[i * window:(i + 1) * window]])
            total += float(ref(input_ids=w, labels=w).loss) * (window - 1)  # loss: mean of window - 1 NLLs
            count += window - 1
    return total / count, count


@pytest.mark.parametrize("window,max_windows", [(64, None), (100, 3)])
def test_perplexity_equals_transformers_loss(tiny, window, max_windows):
    path, ref = tiny
    loaded = load_model(path)
    # the oracle's ids come from the tokenizer file itself, with no special tokens (no BOS)
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(TEXT, add_special_tokens=False).ids
    assert loaded.tokenizer.encode(TEXT)[0] != ids[0]  # brisk's default encode adds BOS; ppl must not
    want_nll, want_count = hf_window_losses(ref, ids, window, max_windows)

    got = perplexity(loaded, TEXT, window=window, max_windows=max_windows, progress=False)
    assert got.num_windows == (len(ids) // window if max_windows is None else max_windows)
    assert got.num_tokens == want_count == got.num_windows * (window - 1)
    assert got.window == window
    assert got.ppl == pytest.approx(math.exp(want_nll), rel=1e-4)
    assert got.nll == pytest.approx(want_nll, rel=1e-4)
    assert got.to_dict()["ppl"] == got.ppl


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "dynamic", "factor": 2.0}])
def test_sequence_logits_match_transformers(tmp_path, rope_scaling):
    # dynamic NTK with 96 tokens > max_position 64: the sequence length must reach RoPE as HF passes it
    ref = make_tiny_hf_model(tmp_path, "llama", rope_scaling=rope_scaling, max_position_embeddings=64, seed=6)
    loaded = load_model(tmp_path, max_model_len=128)
    ids = torch.randint(3, loaded.config.vocab_size, (96,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got = sequence_logits(loaded, ids)
    assert got.dtype == torch.float32 and got.shape == (96, loaded.config.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_perplexity_of_given_token_ids(tiny):
    path, _ = tiny
    loaded = load_model(str(path))
    ids = loaded.tokenizer.encode(TRAINING_TEXT, add_special_tokens=False)
    plain = perplexity(loaded, TRAINING_TEXT, window=32, max_windows=3, progress=False)
    given = perplexity(loaded, TRAINING_TEXT, window=32, max_windows=3, progress=False, token_ids=ids)
    assert given.ppl == plain.ppl and given.num_tokens == plain.num_tokens
    # the ids are what is scored, not the text
    shifted = perplexity(loaded, TRAINING_TEXT, window=32, max_windows=3, progress=False, token_ids=ids[7:])
    assert shifted.ppl != plain.ppl


def test_perplexity_rejects_bad_windows(tiny):
    loaded = load_model(tiny[0])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        perplexity(loaded, TEXT, window=513, progress=False)  # the tiny model has 512 positions
    with pytest.raises(ValueError, match="fewer than one window"):
        perplexity(loaded, "Emma", window=64, progress=False)
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(loaded, TEXT, window=1, progress=False)


def test_cli_ppl_and_size_end_to_end(tiny, tmp_path):
    path = tiny[0]
    text = tmp_path / "text.txt"
    short = TEXT[:1200]  # ~5 windows of 64 tokens: --max-windows 0 scores them all
    text.write_text(short, encoding="utf-8")
    out = tmp_path / "ppl.json"
    r = CliRunner().invoke(eval_group, ["ppl", "--model", str(path), "--text", str(text), "--window", "64",
                                        "--max-windows", "0", "--json", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    want = perplexity(load_model(path), short, window=64, max_windows=None, progress=False)
    assert doc["ppl"] == pytest.approx(want.ppl, rel=1e-9)
    assert doc["num_windows"] == want.num_windows and doc["params"]["max_windows"] == 0
    assert f"{want.ppl:.4f}" in r.output

    out = tmp_path / "size.json"
    r = CliRunner().invoke(eval_group, ["size", "--model", str(path), "--json", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["total"]["params"] == sum(p.numel() for p in tiny[1].parameters())
    assert "attention" in r.output and "total" in r.output

    r = CliRunner().invoke(eval_group, ["ppl", "--model", str(path), "--text", str(text), "--window", "4096"])
    assert r.exit_code == 1 and "max_position_embeddings" in r.output and "Traceback" not in r.output


def test_cli_ppl_quantized_activations(tiny, tmp_path):
    """An int4 model scored as the engine runs it: auto rounds its 4-bit layers' activations, float does not."""
    from test_quant_checkpoint import quantize_folder

    from brisk.quant.config import LayerQuant

    qfolder = quantize_folder(tiny[0], tmp_path / "q4", LayerQuant(bits=4, group_size=32, sym=False))
    text = tmp_path / "text.txt"
    text.write_text(TEXT[:1200], encoding="utf-8")
    docs = {}
    for mode in ("auto", "float", "int8"):
        out = tmp_path / f"{mode}.json"
        r = CliRunner().invoke(eval_group, ["ppl", "--model", str(qfolder), "--text", str(text), "--window", "64",
                                            "--quant-activations", mode, "--json", str(out)], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        docs[mode] = json.loads(out.read_text())
    layers = docs["int8"]["int8_activation_layers"]
    assert docs["float"]["int8_activation_layers"] == 0 and docs["auto"]["int8_activation_layers"] == layers - 1
    assert docs["auto"]["ppl"] != docs["float"]["ppl"]
    assert docs["auto"]["ppl"] == pytest.approx(docs["float"]["ppl"], rel=0.05)



def test_cli_ppl_scores_a_gguf_in_its_own_codes(tmp_path):
    """--dtype auto scores a quantized GGUF as generate runs it (its codes, where --quant-activations reaches);
    --dtype float32 dequantizes it: the same weights, so float activations give the same perplexity."""
    from gguf import GGMLQuantizationType
    from gguf_utils import random_state_dict, tiny_config, write_tiny_model

    config = tiny_config(hidden_size=256, intermediate_size=256, head_dim=64)
    path = write_tiny_model(tmp_path / "m.gguf", random_state_dict(config, seed=2), config,
                            qtype=GGMLQuantizationType.Q8_0)
    text = tmp_path / "text.txt"
    text.write_text(TEXT[:1200], encoding="utf-8")
    docs = {}
    for dtype, mode in (("auto", "float"), ("auto", "int8"), ("float32", "int8")):
        out = tmp_path / f"{dtype}-{mode}.json"
        r = CliRunner().invoke(eval_group, ["ppl", "--model", str(path), "--text", str(text), "--window", "64",
                                            "--dtype", dtype, "--quant-activations", mode, "--json", str(out)],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
        docs[dtype, mode] = json.loads(out.read_text())
    assert docs["auto", "int8"]["int8_activation_layers"] > 0
    assert docs["auto", "float"]["int8_activation_layers"] == docs["float32", "int8"]["int8_activation_layers"] == 0
    # mean NLLs (this random model's perplexity is ~1e18): "float" on the tiled 8-bit kernel meets x rounded to
    # int16 per 32 columns, int8 activations round 256 times coarser
    nll = {key: math.log(doc["ppl"]) for key, doc in docs.items()}
    assert nll["auto", "float"] == pytest.approx(nll["float32", "int8"], rel=1e-4)
    assert abs(nll["auto", "int8"] - nll["float32", "int8"]) > abs(nll["auto", "float"] - nll["float32", "int8"])


# ------------------------------------------------------------------------------------------------ size

def test_kinds_from_names():
    cases = {
        "model.embed_tokens.weight": "embedding", "token_embd.weight": "embedding",
        "model.layers.3.self_attn.q_proj.weight": "attention", "blk.3.attn_k.weight": "attention",
        "model.layers.0.self_attn.qkv_proj.weight": "attention", "blk.0.attn_output.weight": "attention",
        "model.layers.0.self_attn.q_proj.bias": "attention",
        "model.layers.1.mlp.gate_up_proj.weight": "mlp", "blk.1.ffn_down.weight": "mlp",
        "lm_head.weight": "lm_head", "output.weight": "lm_head",
        "model.norm.weight": "norms", "output_norm.weight": "norms", "blk.2.attn_norm.weight": "norms",
        "model.layers.2.post_attention_layernorm.weight": "norms", "something.else": "other",
    }
    assert {name: tensor_kind(name) for name in cases} == cases


def _quantized(n: int, k: int, bits: int, group: int, zeros: bool = True) -> dict[str, torch.Tensor]:
    out = {"qweight": torch.zeros(n, k * bits // 8, dtype=torch.uint8),  # packed: [N, K * bits / 8]
           "scales": torch.ones(n, k // group, dtype=torch.float16)}
    if zeros:
        out["qzeros"] = torch.zeros(n, k // group, dtype=torch.uint8)
    return out


def test_size_of_a_quantized_folder_is_exact(tmp_path):
    n, k, g = 32, 256, 64
    layer = "model.layers.0"
    modules = {f"{layer}.self_attn.q_proj": 8, f"{layer}.self_attn.k_proj": 4, f"{layer}.self_attn.v_proj": 3,
               f"{layer}.self_attn.o_proj": 2}
    tensors = {"model.embed_tokens.weight": torch.zeros(100, k, dtype=torch.float16),
               "model.norm.weight": torch.ones(k, dtype=torch.float32)}
    for name, bits in modules.items():
        tensors.update({f"{name}.{s}": t for s, t in _quantized(n, k, bits, g).items()})
    tensors.update({f"{layer}.mlp.down_proj.{s}": t for s, t in _quantized(n, k, 4, g, zeros=False).items()})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    # quant/config.py's schema: run defaults, then every module's settings; v_proj also records its shape
    asym = {"group_size": g, "sym": False, "scheme": "int"}
    qcfg = {"quant_method": "brisk", "format_version": 1, "method": "rtn", "bits": 4, **asym, "modules": {
        **{name: {"bits": bits, **asym} for name, bits in modules.items()},
        f"{layer}.self_attn.v_proj": {"bits": 3, **asym, "in_features": k, "out_features": n},
        f"{layer}.mlp.down_proj": {"bits": 4, "group_size": g, "sym": True, "scheme": "int"}}}
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qcfg}))

    report = model_size(tmp_path)
    rows = {t.name: t for t in report.tensors}
    assert rows["model.embed_tokens.weight"].payload_bytes / rows["model.embed_tokens.weight"].params == 2.0
    for name, bits in modules.items():
        row = rows[name]
        assert row.kind == "attention" and row.params == n * k and row.dtype == f"int{bits}-g{g}-asym"
        assert row.payload_bytes / row.params == {8: 1.0, 4: 0.5, 3: 0.375, 2: 0.25}[bits]
        assert row.overhead_bytes / row.params == (2 + 1) / 64  # fp16 scale + uint8 zero per 64 weights
    down = rows[f"{layer}.mlp.down_proj"]
    assert down.dtype == "int4-g64-sym" and down.payload_bytes / down.params == 0.5
    assert down.overhead_bytes / down.params == 2 / 64  # symmetric: no zero points stored

    attn = report.kinds["attention"]
    assert attn.params == 4 * n * k and attn.num_tensors == 4
    assert attn.payload_bytes_per_param == (1 + 0.5 + 0.375 + 0.25) / 4
    assert attn.overhead_bytes_per_param == 3 / 64
    assert report.kinds["norms"].bytes_per_param == 4.0
    assert list(report.kinds) == ["embedding", "attention", "mlp", "norms"]
    assert report.total.params == 100 * k + 5 * n * k + k
    assert report.file_bytes == (tmp_path / "model.safetensors").stat().st_size

    # without bits anywhere, a packed qweight's parameter count is unknown: say so, do not guess
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"modules": {}}}))
    with pytest.raises(SizeError, match="_proj is quantized .* neither its bits"):
        model_size(tmp_path)


def test_size_of_a_brisk_quantized_checkpoint_and_its_loaded_model(tiny, tmp_path):
    from brisk.quant.checkpoint import save_quantized
    from brisk.quant.config import LayerQuant
    from brisk.quant.rtn import plan_layers, rtn_quantize

    path, ref = tiny
    float_model = load_model(path, fuse=False)
    default = LayerQuant(bits=4, group_size=32, sym=False)
    plan = plan_layers(float_model.model, float_model.config.tie_word_embeddings, default)
    tensors, qcfg = rtn_quantize(float_model, plan, default, progress=False)
    save_quantized(tmp_path, float_model.config, float_model.tokenizer, qcfg, tensors)

    num_params = sum(p.numel() for p in ref.parameters())
    on_disk, loaded = model_size(tmp_path), model_size(load_model(tmp_path))
    for report in (on_disk, loaded):
        assert report.total.params == num_params  # packed codes counted as N * K weights
        assert report.kinds["attention"].payload_bytes_per_param == 0.5
        assert report.kinds["mlp"].dtypes == ["int4-g32-asym"]
        assert report.kinds["embedding"].dtypes == ["int8-ch-sym"]  # plan_layers' head default
        assert report.kinds["embedding"].payload_bytes_per_param == 1.0
    assert on_disk.kinds["mlp"].overhead_bytes_per_param == (2 + 1) / 32  # fp16 scale + uint8 zero
    h = float_model.config.hidden_size
    assert on_disk.kinds["embedding"].overhead_bytes_per_param == 2 / h  # one fp16 scale per row
    # in memory the kernels keep the same float16 scales and uint8 zero points
    assert loaded.kinds["mlp"].overhead_bytes_per_param == (2 + 1) / 32


def test_size_of_a_float_folder_and_of_the_loaded_model(tiny):
    path, ref = tiny
    hf = dict(ref.named_parameters())
    want_attn = sum(p.numel() for name, p in hf.items() if ".self_attn." in name)
    on_disk = model_size(path)
    loaded = model_size(load_model(path))  # fused q/k/v and gate/up, same counts
    for report in (on_disk, loaded):
        assert report.total.params == sum(p.numel() for p in hf.values())
        assert report.total.bytes_per_param == 4.0 and report.total.overhead_bytes == 0
        assert report.kinds["attention"].params == want_attn
        assert set(report.kinds) == {"embedding", "attention", "mlp", "lm_head", "norms"}
    assert on_disk.format == "safetensors" and loaded.format == "loaded"
    assert {t.name for t in loaded.tensors} >= {"model.layers.0.self_attn.qkv_proj.weight"}


def test_size_of_the_default_gguf(default_gguf_path):
    report = model_size(default_gguf_path)
    c = read_gguf_config(default_gguf_path)
    h, q, kv, i = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h  # q, o, k, v, gate, up, down, two norms
    assert c.tie_word_embeddings
    assert report.total.params == c.vocab_size * h + c.num_hidden_layers * per_layer + h == 134_515_008
    assert "lm_head" not in report.kinds  # tied: not stored

    emb = report.kinds["embedding"]
    assert emb.dtypes == ["Q8_0"] and emb.bytes_per_param == 34 / 32
    assert emb.payload_bytes_per_param == 1.0 and emb.overhead_bytes_per_param == 2 / 32
    for kind in ("attention", "mlp"):
        k = report.kinds[kind]
        assert k.dtypes == ["Q4_1"] and k.bytes_per_param == 20 / 32 and k.overhead_bytes_per_param == 4 / 32
    assert report.kinds["norms"].dtypes == ["F32"] and report.kinds["norms"].bytes_per_param == 4.0
    assert report.file_bytes == default_gguf_path.stat().st_size > report.total.bytes
