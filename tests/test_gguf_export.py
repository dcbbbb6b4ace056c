"""`brisk export gguf`: the file's tensors, decoded by gguf's reference dequantization, are brisk's weights (bit
for bit where brisk's codes are kept, within the type's error where re-encoded); brisk loads the file back and
generates what the source generates; tokenizer, chat template and architecture metadata travel."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize
from hf_utils import make_tiny_hf_model
from test_model import prefill_logits

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.model.gguf import read_gguf
from brisk.model.gguf_export import ExportError, export_gguf, permute_qk
from brisk.model.gguf_kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k
from brisk.model.hf import load_hf_folder
from brisk.model.loader import load_model
from brisk.quant import primitives
from brisk.quant.checkpoint import save_quantized
from brisk.quant.config import LayerQuant
from brisk.quant.rtn import plan_layers, rtn_quantize

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPT = "Emma Woodhouse, handsome, clever"


def _decoded(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file through gguf's own reader and reference dequantization, float32 [rows, cols]."""
    return {t.name: dequantize(t.data, t.tensor_type).astype(np.float32) for t in GGUFReader(path).tensors}


def _types(path: Path) -> dict[str, T]:
    return {t.name: T(t.tensor_type) for t in GGUFReader(path).tensors}


def _brisk_weights(folder: Path) -> dict[str, np.ndarray]:
    """Float weights of a brisk checkpoint (dequantized with the primitives), under llama.cpp names, Q/K permuted."""
    ckpt = load_hf_folder(folder)
    c, tensors, out = ckpt.config, ckpt.tensors, {}
    for name, spec in ckpt.quantization.modules.items():
        codes = primitives.unpack(tensors[f"{name}.qweight"], spec.bits, tensors[f"{name}.qweight"].shape[1] * 8
                                  // spec.bits)
        scales = tensors[f"{name}.scales"].float()
        zeros = tensors.get(f"{name}.qzeros")
        zeros = torch.full_like(scales, 2 ** (spec.bits - 1)) if zeros is None else zeros.float()
        w = primitives.dequantize(codes, scales, zeros).numpy()
        if name.endswith("q_proj"):
            w = permute_qk(w, c.num_attention_heads)
        elif name.endswith("k_proj"):
            w = permute_qk(w, c.num_key_value_heads)
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        leaf = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}.get(name.rsplit(".", 1)[-1])
        out[f"blk.{layer}.{leaf}.weight" if layer else {"model.embed_tokens": "token_embd",
                                                        "lm_head": "output"}[name] + ".weight"] = w
    return out


def _quantized(root: Path, spec: LayerQuant, head: LayerQuant | None, **model: object) -> Path:
    make_tiny_hf_model(root / "float", "llama", seed=3, **model)
    loaded = load_model(root / "float", fuse=False)
    plan = plan_layers(loaded.model, loaded.config.tie_word_embeddings, spec, head=head)
    tensors, qconfig = rtn_quantize(loaded, plan, spec, progress=False)
    return save_quantized(root / "q", loaded.config, loaded.tokenizer, qconfig, tensors)


KEPT = [  # brisk's grid -> the GGUF type that holds it
    (LayerQuant(bits=4, group_size=32, sym=True), "q4_0", T.Q4_0),
    (LayerQuant(bits=4, group_size=64, sym=True), "q4_0", T.Q4_0),  # a group of 64 is two blocks of one scale
    (LayerQuant(bits=8, group_size=-1, sym=True), "q8_0", T.Q8_0),
    (LayerQuant(bits=4, group_size=32, sym=True), "q4_1", T.Q4_1),  # minimum -8 * scale: exact
]


@pytest.mark.parametrize("spec,outtype,qtype", KEPT, ids=[f"{k[0].label}-{k[1]}" for k in KEPT])
def test_codes_are_kept_when_the_grid_matches(tmp_path, spec, outtype, qtype):
    folder = _quantized(tmp_path, spec, LayerQuant(bits=8, group_size=-1, sym=True))
    report = export_gguf(folder, tmp_path / "out.gguf", outtype)
    want, got, types = _brisk_weights(folder), _decoded(tmp_path / "out.gguf"), _types(tmp_path / "out.gguf")
    layers = [n for n in want if n.startswith("blk.")]
    assert len(layers) == 14  # 7 linears x 2 layers
    for name in layers + ([n for n in want if not n.startswith("blk.")] if qtype == T.Q8_0 else []):
        assert types[name] == qtype and report.how[name] == f"kept as {qtype.name}", (name, report.how[name])
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)  # bit for bit


def test_q4_1_keeps_asymmetric_codes_with_float16_minimums(tmp_path):
    folder = _quantized(tmp_path, LayerQuant(bits=4, group_size=32, sym=False), None)
    report = export_gguf(folder, tmp_path / "out.gguf", "q4_1")
    want, got = _brisk_weights(folder), _decoded(tmp_path / "out.gguf")
    for name, w in want.items():
        assert report.how[name].startswith("kept as Q4_1"), report.how[name]
        # w = d q + m with m = -scale * zero rounded to float16: at most half an ulp of |m| <= 15 * scale apart
        assert np.abs(got[name] - w).max() <= np.abs(w).max() * 2.0**-11 * 2, name


def test_grids_that_differ_are_re_encoded_and_said_so(tmp_path):
    folder = _quantized(tmp_path, LayerQuant(bits=4, group_size=32, sym=False), None)
    report = export_gguf(folder, tmp_path / "out.gguf", "q4_0")
    assert report.how["blk.0.ffn_up.weight"] == "dequantized from int4-g32-asym and re-encoded as Q4_0"
    assert "re-encoded" in report.summary()


def _sqnr(ref: np.ndarray, approx: np.ndarray) -> float:
    return 10 * math.log10(float((ref.astype(np.float64) ** 2).sum()) / float(((ref - approx) ** 2).sum()))


# SQNR floors on normal weights: ~6 dB per bit of a uniform grid with per-block scales; measured 22.3 / 28.5 / 34.7 dB
# for Q4_K / Q5_K / Q6_K and 21.5 / 22.3 / 45.6 dB for Q4_0 / Q4_1 / Q8_0 with these encoders; floors 1.5 dB below
FLOORS = {"q4_k": 20.5, "q5_k": 27.0, "q6_k": 33.0, "q4_0": 20.0, "q4_1": 20.5, "q8_0": 44.0, "f16": 70.0}


@pytest.mark.parametrize("outtype", list(FLOORS))
def test_re_encoded_float_model_is_within_the_types_error(tmp_path, outtype):
    make_tiny_hf_model(tmp_path / "float", "llama", seed=2, hidden_size=256, intermediate_size=512,
                       num_attention_heads=4, vocab_size=384)
    report = export_gguf(tmp_path / "float", tmp_path / "out.gguf", outtype)
    got, types = _decoded(tmp_path / "out.gguf"), _types(tmp_path / "out.gguf")
    ckpt = load_hf_folder(tmp_path / "float")
    w = ckpt.tensors["model.layers.1.mlp.down_proj.weight"].numpy()
    name = "blk.1.ffn_down.weight"
    assert types[name].name.lower() == outtype and report.how[name] == f"re-encoded as {outtype.upper()}"
    assert _sqnr(w, got[name]) > FLOORS[outtype]
    assert types["blk.0.attn_norm.weight"] == T.F32


@pytest.mark.parametrize("encode,qtype", [(quantize_q4_k, T.Q4_K), (quantize_q5_k, T.Q5_K), (quantize_q6_k, T.Q6_K)])
def test_k_quant_encoders_write_what_the_reference_decoder_reads(encode, qtype):
    """Encoding what the reference decoder read back gives the same values again (the encoder's byte layout is
    the decoder's: a misplaced bit field would move the values on the second pass), close to the weights."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 512)).astype(np.float32)
    once = dequantize(encode(w), qtype).reshape(w.shape)
    twice = dequantize(encode(once), qtype).reshape(w.shape)
    np.testing.assert_array_equal(twice, once)
    assert np.abs(once - w).max() < np.abs(w).max() / 8


@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_exported_file_loads_and_generates_the_sources_tokens(tmp_path, outtype):
    make_tiny_hf_model(tmp_path / "float", "llama", seed=6)
    export_gguf(tmp_path / "float", tmp_path / "out.gguf", outtype)
    src, out = load_model(tmp_path / "float"), load_model(tmp_path / "out.gguf")
    assert out.config.architecture == "llama" and out.config.num_key_value_heads == src.config.num_key_value_heads
    assert out.config.hidden_size == src.config.hidden_size and out.config.rope_theta == src.config.rope_theta
    msgs = [{"role": "user", "content": "Emma was clever"}]
    assert out.tokenizer.encode(PROMPT) == src.tokenizer.encode(PROMPT)
    assert out.tokenizer.encode_chat(msgs) == src.tokenizer.encode_chat(msgs)
    assert out.tokenizer.chat_template == src.tokenizer.chat_template
    assert out.tokenizer.eos_token_ids[0] == src.tokenizer.eos_token_ids[0]
    a = LLM(tmp_path / "float", kv_cache_memory="8MiB").generate([PROMPT], GREEDY, use_tqdm=False)[0]
    b = LLM(tmp_path / "out.gguf", kv_cache_memory="8MiB").generate([PROMPT], GREEDY, use_tqdm=False)[0]
    ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
    if outtype == "f16" or ta == tb:
        assert ta == tb
        return
    # Q8_0's rounding may flip a near-tie of this random model: at the first divergence each side's token is in
    # the other's top 3, and the two agree up to there
    first = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y)
    assert first >= 8, (ta, tb)
    ids = torch.tensor(src.tokenizer.encode(PROMPT) + ta[:first])
    top_src = prefill_logits(src, ids)[-1].topk(3).indices.tolist()
    top_out = prefill_logits(out, ids)[-1].topk(3).indices.tolist()
    assert tb[first] in top_src and ta[first] in top_out


def test_default_model_exports_with_its_metadata_and_answers_alike(tmp_path, default_gguf_path):
    result = CliRunner().invoke(main, ["export", "gguf", "--type", "q8_0", str(default_gguf_path),
                                       str(tmp_path / "smol.gguf")])
    assert result.exit_code == 0, result.output
    assert "re-encoded as Q8_0" in result.output
    src, out = read_gguf(default_gguf_path).metadata, read_gguf(tmp_path / "smol.gguf").metadata
    for key in [k for k in src if k.startswith(("tokenizer.", "llama."))]:
        assert out[key] == src[key], key
    assert out["general.file_type"] == 7  # MOSTLY_Q8_0
    prompt = "The capital of France is"
    a = LLM(default_gguf_path).generate([prompt], GREEDY, use_tqdm=False)[0]
    b = LLM(tmp_path / "smol.gguf").generate([prompt], GREEDY, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids  # the Q4_1 weights are exact at Q8_0 up to ~1e-3


def test_export_refusals_name_what_is_supported(tmp_path):
    make_tiny_hf_model(tmp_path / "m", "mistral", seed=1, sliding_window=16)
    with pytest.raises(ExportError, match="sliding-window attention .* brisk exports full-attention"):
        export_gguf(tmp_path / "m", tmp_path / "o.gguf", "q8_0")
    with pytest.raises(ExportError, match="unknown GGUF type 'q3_k'; brisk exports f16, q8_0, q4_0, q4_1, q4_k"):
        export_gguf(tmp_path / "m", tmp_path / "o.gguf", "q3_k")
    result = CliRunner().invoke(main, ["export", "gguf", "--type", "q2_k", str(tmp_path / "m"), "o.gguf"])
    assert result.exit_code != 0 and "'q2_k' is not one of" in result.output


def test_llama_cpp_scores_the_same_perplexity_as_brisk(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the optional extra) is not installed; "
                                                        "the llama.cpp cross-check needs it")
    make_tiny_hf_model(tmp_path / "float", "llama", seed=6)
    export_gguf(tmp_path / "float", tmp_path / "out.gguf", "q8_0")
    text = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition"
    llm = llama_cpp.Llama(str(tmp_path / "out.gguf"), vocab_only=True, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=False)
    # brisk's wrapper of llama.cpp's C API: with its extra buffer types left off on AMX CPUs, where llama-cpp-python
    # 0.3.36's AMX matmul crashes on multi-token batches (bench/llamacpp.py cpu_has_amx)
    from brisk.bench.llamacpp import LlamaCppModel

    with LlamaCppModel(tmp_path / "out.gguf", seq_len=128) as lc:
        logits = torch.from_numpy(lc.prompt_logits(ids))
    nll_cpp = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()
    loaded = load_model(tmp_path / "out.gguf")
    ours = prefill_logits(loaded, torch.tensor(ids))
    nll_brisk = torch.nn.functional.cross_entropy(ours[:-1], torch.tensor(ids[1:])).item()
    assert abs(math.exp(nll_cpp) / math.exp(nll_brisk) - 1) < 0.005
