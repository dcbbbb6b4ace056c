"""Writing tiny GGUF files for tests, the way llama.cpp's converter does (names, Q/K permutation, quantization).

Uses the `gguf` package's own writer and quantizers, so the files are independent of brisk's reader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType

from brisk.model.config import ModelConfig

# transformers name inside model.layers.{i} -> llama.cpp name inside blk.{i}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def tiny_config(architecture: str = "llama", vocab_size: int = 300, **overrides: Any) -> ModelConfig:
    """A 2-layer model: hidden 32, 4 heads of 8 (2 KV heads), FFN 64; every row length a multiple of 32."""
    settings = dict(architecture=architecture, vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
                    tie_word_embeddings=False, attention_bias=architecture == "qwen2")
    settings.update(overrides)
    return ModelConfig(**settings)


# the extra settings each mixture-of-experts architecture needs in tiny_arch_config
MOE_EXTRAS = {"mixtral": {}, "qwen2_moe": {"shared_expert_intermediate_size": 32}, "qwen3_moe": {}}


def tiny_arch_config(arch: str) -> ModelConfig:
    """tiny_config of `arch` with what the architecture needs: 4 experts (top 2) for MoE, tanh-GELU for gemma3."""
    extra: dict[str, Any] = {}
    if arch in MOE_EXTRAS:
        extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **MOE_EXTRAS[arch])
    if arch == "gemma3":
        extra = dict(hidden_act="gelu_pytorch_tanh")
    return tiny_config(arch, **extra)


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random float32 weights for `config`."""
    g = torch.Generator().manual_seed(seed)
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv, inter = config.num_key_value_heads * config.head_dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                   p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                   p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (config.head_dim,), p + "self_attn.k_norm.weight":
                       (config.head_dim,)}
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rows [first half | second half] -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf_tensors(state_dict: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, np.ndarray]:
    """HF-named tensors -> llama.cpp-named float32 arrays, Q/K permuted for llama/mistral (not for qwen2)."""
    out = {}
    for name, t in state_dict.items():
        w = t.detach().float().numpy().copy()
        if name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        if config.architecture in ("llama", "mistral", "smollm3"):
            if rest.startswith("self_attn.q_proj."):
                w = llama_cpp_permute(w, config.num_attention_heads)
            elif rest.startswith("self_attn.k_proj."):
                w = llama_cpp_permute(w, config.num_key_value_heads)
        out[f"blk.{layer}.{_LAYER_NAMES[rest]}"] = w
    return out


def model_metadata(config: ModelConfig) -> dict[str, Any]:
    """The `{arch}.*` hyper-parameter keys llama.cpp writes for a Llama-family model."""
    a = config.architecture
    md: dict[str, Any] = {
        f"{a}.block_count": config.num_hidden_layers,
        f"{a}.context_length": config.max_position_embeddings,
        f"{a}.embedding_length": config.hidden_size,
        f"{a}.feed_forward_length": config.intermediate_size,
        f"{a}.attention.head_count": config.num_attention_heads,
        f"{a}.attention.head_count_kv": config.num_key_value_heads,
        f"{a}.rope.freq_base": float(config.rope_theta),
        f"{a}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        f"{a}.vocab_size": config.vocab_size,
    }
    if a not in ("qwen2", "qwen3"):
        md[f"{a}.rope.dimension_count"] = config.head_dim
    return md


# a SmolLM2-like byte-level BPE vocabulary: control tokens, the 256 byte symbols, and a few merges
_GPT2_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "l l", "o r", "Ġ w", "Ġw or", "Ġwor l", "Ġworl d",
                "H e", "He ll", "Hell o", "1 2", "Ġ 1", "c o", "co d", "cod e", "Ċ Ċ"]


def _byte_symbols() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    symbol = {b: chr(b) for b in printable} | {b: chr(0x100 + i) for i, b in enumerate(others)}
    return [symbol[b] for b in range(256)]


def tiny_gpt2_tokenizer_metadata() -> dict[str, Any]:
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "<ctl x>"]
    types = [3, 3, 3, 4, 3]  # CONTROL x3, USER_DEFINED, CONTROL (spelled outside the byte alphabet)
    tokens += _byte_symbols()
    tokens += ["".join(m.split(" ")) for m in _GPT2_MERGES]
    types += [1] * (len(tokens) - len(types))
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": list(_GPT2_MERGES),
        "tokenizer.ggml.bos_token_id": (1, GGUFValueType.UINT32),
        "tokenizer.ggml.eos_token_id": (2, GGUFValueType.UINT32),
        "tokenizer.ggml.unknown_token_id": (0, GGUFValueType.UINT32),
        "tokenizer.ggml.padding_token_id": (2, GGUFValueType.UINT32),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                                   "<|im_end|>\n{% endfor %}",
    }


def tiny_llama_tokenizer_metadata() -> dict[str, Any]:
    """A SentencePiece-style vocabulary (llama.cpp model "llama"): scores, no merges, byte fallback."""
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "t", "1", "2", "▁h", "he", "ll", "▁he", "llo",
              "▁hello", "▁w", "or", "▁wor", "▁world", "▁t", "at", "▁a", "12"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces)]  # UNKNOWN, CONTROL x2, BYTE x256, NORMAL
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": (1, GGUFValueType.UINT32),
        "tokenizer.ggml.eos_token_id": (2, GGUFValueType.UINT32),
        "tokenizer.ggml.unknown_token_id": (0, GGUFValueType.UINT32),
    }


def _add_metadata(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, tuple):  # (value, explicit GGUFValueType)
        w.add_key_value(key, value[0], value[1])
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        w.add_array(key, value)
    else:
        raise TypeError(f"cannot write metadata {key}={value!r}")


def write_gguf(path: str | Path, architecture: str, metadata: dict[str, Any], tensors: dict[str, np.ndarray],
               qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
               qtypes: dict[str, GGMLQuantizationType] | None = None) -> Path:
    """Write a GGUF file. 2-D tensors are stored as `qtype` (or `qtypes[name]`), 1-D ones as F32 (as llama.cpp
    does for norms and biases). `metadata` values may be (value, GGUFValueType) to force a type."""
    path = Path(path)
    w = gguf.GGUFWriter(path, architecture)
    for key, value in metadata.items():
        _add_metadata(w, key, value)
    for name, t in tensors.items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        ttype = (qtypes or {}).get(name, qtype if t.ndim == 2 else GGMLQuantizationType.F32)
        if ttype == GGMLQuantizationType.F32:
            w.add_tensor(name, t)
        else:
            w.add_tensor(name, gguf.quants.quantize(t, ttype), raw_dtype=ttype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_model(path: str | Path, state_dict: dict[str, torch.Tensor], config: ModelConfig,
                     qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
                     tokenizer_metadata: dict[str, Any] | None = None) -> Path:
    """A complete GGUF model file from HF-named weights, as llama.cpp's converter would write it."""
    metadata = model_metadata(config) | (tokenizer_metadata or tiny_gpt2_tokenizer_metadata())
    return write_gguf(path, config.architecture, metadata, hf_to_gguf_tensors(state_dict, config), qtype)
