"""GGUF loading: dequantization vs the gguf package, header parsing vs GGUFReader, round trips through files
written like llama.cpp writes them, error messages, and the real default model vs transformers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf_utils import (
    hf_to_gguf_tensors,
    model_metadata,
    random_state_dict,
    tiny_config,
    tiny_gpt2_tokenizer_metadata,
    tiny_llama_tokenizer_metadata,
    write_gguf,
    write_tiny_model,
)

from brisk.model.gguf import GGUFError, load_gguf, read_gguf, read_gguf_config
from brisk.model.gguf_dequant import SUPPORTED_TYPES, dequantize

T = GGMLQuantizationType

# byte offsets of the fp16 scale/min fields inside one block of each format (ggml-common.h)
_F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
               T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}


def _random_blocks(qtype: GGMLQuantizationType, rows: int, row_len: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for a [rows, row_len] tensor, every fp16 field overwritten with a finite value
    (random bytes would give inf/NaN scales, whose products are not worth comparing)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * row_len // block_size
    if qtype in (T.F32, T.F16, T.BF16):
        values = rng.standard_normal(rows * row_len).astype(np.float32)
        if qtype == T.F16:
            return values.astype(np.float16).view(np.uint8).reshape(rows, -1)
        if qtype == T.BF16:
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
        return values.view(np.uint8).reshape(rows, -1)
    blocks = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    for offset in _F16_FIELDS[qtype]:
        scale = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact_vs_gguf_package(qtype):
    rng = np.random.default_rng(int(qtype))
    block_size = GGML_QUANT_SIZES[qtype][0]
    rows, row_len = 5, 4 * max(block_size, 32)
    raw = _random_blocks(qtype, rows, row_len, rng)
    expected = gguf.quants.dequantize(raw, qtype)  # [rows, row_len] float32
    got = dequantize(raw, qtype, (rows, row_len))
    assert got.dtype == torch.float32 and got.shape == (rows, row_len)
    assert np.isfinite(expected).all()
    # compare bit patterns: equal floats, and equal signs of zero
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))
    # a torch uint8 input gives the same result, and the result does not alias the input (F32 included)
    raw_t = torch.from_numpy(raw.copy())
    from_torch = dequantize(raw_t, qtype, (rows, row_len))
    raw_t.zero_()
    assert torch.equal(from_torch, got)


def test_dequantize_rejects_unsupported_type_and_wrong_size():
    with pytest.raises(GGUFError, match=r"IQ4_NL is not supported; supported types: F32, .*Q4_K"):
        dequantize(np.zeros(18, np.uint8), T.IQ4_NL, (32,))
    with pytest.raises(GGUFError, match="Q8_0 tensor of shape \\(2, 32\\) needs 68 bytes, got 34"):
        dequantize(np.zeros(34, np.uint8), T.Q8_0, (2, 32))


# ------------------------------------------------------------------------------------------ header parsing

def test_header_matches_gguf_reader(tmp_path):
    config = tiny_config()
    metadata = model_metadata(config) | tiny_gpt2_tokenizer_metadata() | {
        "test.int8": (-3, GGUFValueType.INT8), "test.uint64": (2**40, GGUFValueType.UINT64),
        "test.float64": (0.1, GGUFValueType.FLOAT64), "test.bools": [True, False, True],
        "test.floats": [0.5, -1.25], "test.unicode": "héllo 🙂"}
    tensors = hf_to_gguf_tensors(random_state_dict(config), config)
    path = write_gguf(tmp_path / "m.gguf", "llama", metadata, tensors, T.Q8_0)

    ours = read_gguf(path)
    reader = gguf.GGUFReader(path)
    assert ours.version == 3
    reference = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == reference  # float32 values compare exactly: both widen the same bits
    assert ours.metadata["test.unicode"] == "héllo 🙂" and ours.metadata["test.int8"] == -3
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape)) and info.qtype == t.tensor_type
        np.testing.assert_array_equal(ours.tensor_bytes(t.name), t.data.reshape(-1).view(np.uint8))


# ------------------------------------------------------------------------------------------ config and weights

@pytest.mark.parametrize("architecture,bias,tied", [("llama", False, False), ("llama", True, True),
                                                    ("qwen2", True, False), ("mistral", False, True),
                                                    ("qwen3", False, False),  # qwen3: q/k norm tensors
                                                    ("smollm3", False, True)])  # every 4th layer without RoPE
def test_f32_round_trip_is_exact(tmp_path, architecture, bias, tied):
    """Weights written as F32 (Q/K permuted like llama.cpp does) come back exactly: names and un-permutation."""
    config = tiny_config(architecture, attention_bias=bias, tie_word_embeddings=tied)
    if architecture == "smollm3":  # what llama.cpp's smollm3 graph does; its files carry no key for it
        config = replace(config, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])
    state = random_state_dict(config, seed=1)
    ckpt = load_gguf(write_tiny_model(tmp_path / "m.gguf", state, config))
    assert ckpt.tensors.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(ckpt.tensors[name], t), name
    # the file stores eps as float32 and adds the tokenizer's BOS/EOS ids
    assert ckpt.config == replace(config, rms_norm_eps=float(np.float32(1e-6)), bos_token_id=1, eos_token_id=[2])


def test_quantized_load_equals_reference_dequant_unpermuted(tmp_path):
    config = tiny_config()
    state = random_state_dict(config, seed=2)
    path = write_tiny_model(tmp_path / "m.gguf", state, config, T.Q8_0)
    ckpt = load_gguf(path)
    reader = gguf.GGUFReader(path)
    ref = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()) for t in reader.tensors}
    q = ref["blk.1.attn_q.weight"]  # [heads * head_dim, hidden], rows interleaved per head
    unpermuted = q.view(4, 4, 2, 32).transpose(1, 2).reshape(32, 32)
    assert torch.equal(ckpt.tensors["model.layers.1.self_attn.q_proj.weight"], unpermuted)
    assert torch.equal(ckpt.tensors["model.layers.1.mlp.down_proj.weight"], ref["blk.1.ffn_down.weight"])
    # and Q8_0 keeps each weight within half a step (max|block| / 127 / 2, fp16 scale rounding aside)
    w = state["model.layers.1.self_attn.q_proj.weight"]
    step = w.abs().view(-1, 32).amax(dim=1, keepdim=True) / 127
    assert ((ckpt.tensors["model.layers.1.self_attn.q_proj.weight"] - w).view(-1, 32).abs() <= 0.51 * step).all()


@pytest.mark.parametrize("qtype", [T.Q8_0, T.F16])  # F16: the C++ half -> bfloat16 pass, against through float32
def test_load_in_bfloat16(tmp_path, qtype):
    config = tiny_config()
    path = write_tiny_model(tmp_path / "m.gguf", random_state_dict(config), config, qtype)
    f32, bf16 = load_gguf(path).tensors, load_gguf(path, dtype=torch.bfloat16).tensors
    for name, t in f32.items():
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], t.to(torch.bfloat16))


def test_config_from_metadata(tmp_path):
    config = tiny_config(vocab_size=len(tiny_gpt2_tokenizer_metadata()["tokenizer.ggml.tokens"]))
    md = model_metadata(config) | tiny_gpt2_tokenizer_metadata()
    del md["llama.vocab_size"]  # then the vocabulary size is the token count
    md |= {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0,
           "llama.rope.scaling.original_context_length": 32, "tokenizer.ggml.eot_token_id": (0, GGUFValueType.UINT32)}
    path = write_gguf(tmp_path / "m.gguf", "llama", md, hf_to_gguf_tensors(random_state_dict(config), config))
    got = read_gguf_config(path)
    assert got.vocab_size == config.vocab_size and got.head_dim == 8 and got.num_key_value_heads == 2
    assert got.rope_scaling == {"rope_type": "linear", "factor": 4.0, "original_max_position_embeddings": 32}
    assert got.bos_token_id == 1 and got.eos_token_id == [2, 0]
    assert not got.tie_word_embeddings and not got.attention_bias and got.rms_norm_eps == pytest.approx(1e-6)


# ------------------------------------------------------------------------------------------ tokenizer

_TEXTS = ["Hello world, the 12 code\n\n", "<|im_start|>user\nhi<|im_end|>\n<think> café 🙂 \t x",
          " hello world at 12", "<ctl x> <|endoftext|>"]


def _transformers_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_tokenizer_matches_transformers(tmp_path, kind):
    md = tiny_gpt2_tokenizer_metadata() if kind == "gpt2" else tiny_llama_tokenizer_metadata()
    config = tiny_config(vocab_size=len(md["tokenizer.ggml.tokens"]))
    path = write_tiny_model(tmp_path / "m.gguf", random_state_dict(config), config, tokenizer_metadata=md)
    ours, ref = load_gguf(path).tokenizer, _transformers_tokenizer(path)
    for text in _TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.add_bos_token == (kind == "llama") and ours.bos_token_id == 1 and ours.eos_token_ids == [2]


def test_gpt2_tokenizer_special_tokens_and_chat_template(tmp_path):
    config = tiny_config()
    tok = load_gguf(write_tiny_model(tmp_path / "m.gguf", random_state_dict(config), config)).tokenizer
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<think>") == [3]
    ids = tok.encode("<|im_start|>user\nHello<|im_end|>")
    assert tok.decode(ids) == "user\nHello" and tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>")
    assert tok.pad_token_id == 2 and "<|im_start|>" in tok.chat_template


# ------------------------------------------------------------------------------------------ errors

def _malformed(tmp_path: Path, case: str) -> Path:
    config = tiny_config()
    tensors = hf_to_gguf_tensors(random_state_dict(config), config)
    md, arch, qtypes = model_metadata(config) | tiny_gpt2_tokenizer_metadata(), "llama", {}
    path = tmp_path / f"{case}.gguf"
    if case == "bad magic":
        path.write_bytes(b"PK\x03\x04" + bytes(100))
        return path
    if case == "unknown architecture":
        arch, md = "gpt2", {k.replace("llama.", "gpt2."): v for k, v in md.items()}
    elif case == "unsupported tensor type":
        qtypes["blk.0.ffn_up.weight"] = T.MXFP4
    elif case == "missing tensor":
        del tensors["blk.1.ffn_gate.weight"]
    elif case == "wrong shape":
        tensors["blk.0.attn_k.weight"] = tensors["blk.0.attn_k.weight"][:8]
    elif case == "extra tensor":
        tensors["rope_freqs.weight"] = np.ones(4, np.float32)
    elif case == "unsupported tokenizer":
        md["tokenizer.ggml.model"] = "bert"
    write_gguf(path, arch, md, tensors, qtypes=qtypes)
    if case == "truncated in half":
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    elif case == "truncated header":  # inside the token list, which starts after ~500 bytes of metadata
        path.write_bytes(path.read_bytes()[:1500])
    return path


@pytest.mark.parametrize("case,message", [
    ("bad magic", r"not a GGUF file \(bad magic b'PK\\x03\\x04'"),
    ("truncated header", r"truncated file: reading metadata 'tokenizer\.ggml\.\w+' needs bytes"),
    ("truncated in half", r"truncated file: tensor '[\w.]+' needs bytes \d+\.\.\d+ but the file has only \d+ bytes"),
    ("unknown architecture", r"unknown architecture 'gpt2'; brisk supports GGUF architectures llama, mistral, qwen2"),
    ("unsupported tensor type", r"tensor 'blk\.0\.ffn_up\.weight' has type MXFP4, which is not supported"),
    ("missing tensor", r"missing tensor 'blk\.1\.ffn_gate\.weight' \(model\.layers\.1\.mlp\.gate_proj\.weight\)"),
    ("wrong shape", r"tensor 'blk\.0\.attn_k\.weight' has shape \(8, 32\), expected \(16, 32\)"),
    ("extra tensor", r"unexpected tensor\(s\) 'rope_freqs\.weight' .*Llama-3\.1-style RoPE"),
    ("unsupported tokenizer", r"tokenizer\.ggml\.model 'bert' is not supported"),
])
def test_malformed_files_raise_gguf_error(tmp_path, case, message):
    path = _malformed(tmp_path, case)
    with pytest.raises(GGUFError, match=message) as err:
        load_gguf(path)
    assert str(path) in str(err.value)


# ------------------------------------------------------------------------------------------ the real model

@pytest.fixture(scope="module")
def real(default_gguf_path, hf_default_model):
    """brisk's load of the default model, with transformers' (the session-wide model from conftest, and its
    tokenizer, loaded here once for this module)."""
    transformers = pytest.importorskip("transformers")
    path = default_gguf_path
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return load_gguf(path), hf_default_model, tokenizer


@pytest.mark.slow
def test_real_model_weights_and_config_match_transformers(real):
    ours, model, _ = real
    reference = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied: a view
    assert ours.tensors.keys() == reference.keys()
    for name, t in reference.items():
        if not torch.equal(ours.tensors[name], t):  # both dequantize the same bits; allow float noise only
            torch.testing.assert_close(ours.tensors[name], t, rtol=0, atol=1e-6, msg=name)
    c, hf = ours.config, model.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.vocab_size) == (30, 576, 1536, 9, 3, 64, 49152)
    assert c.tie_word_embeddings and hf.tie_word_embeddings
    assert c.rope_theta == hf.rope_parameters["rope_theta"] and c.rms_norm_eps == hf.rms_norm_eps
    assert c.max_position_embeddings == hf.max_position_embeddings


@pytest.mark.slow
def test_real_tokenizer_matches_transformers(real):
    ours, _, reference = real
    tok = ours.tokenizer
    text = ("The quick brown fox, in 2024, paid $12345.67 for naïve café crème brûlée 🦊🙂!\n"
            "def f(x):\n    return {'a': x ** 2}  # comment\n\t\tindented\r\n"
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n日本語のテキスト   spaces")
    ids = tok.encode(text)
    assert ids == reference.encode(text)
    assert tok.encode("<|im_start|>") == [1]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id, tok.add_bos_token) == (1, [2], 2, False)
    assert tok.chat_template == reference.chat_template
