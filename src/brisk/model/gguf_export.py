"""Export any brisk-loadable model to a GGUF file llama.cpp reads: `brisk export gguf --type TYPE MODEL OUT.gguf`.

    report = export_gguf("ckpt-gptq-4bit-g32-sym", "out.gguf", "q4_0")

Sources: a GGUF file (its metadata and tokenizer are copied, its weights re-encoded), a float Hugging Face
folder, or a quantized folder (brisk's own, GPTQ, AWQ, compressed-tensors). Tensors are written under llama.cpp's
names with its Q/K row permutation (llama), one-dimensional tensors as F32.

brisk's codes are kept when the target type holds the same grid, block by block (a group of G = 32 m columns
is m blocks of 32 with one scale):

    8-bit symmetric codes, any group multiple of 32  -> Q8_0   d = scale, q8 = q - 128           exact
    4-bit symmetric codes, any group multiple of 32  -> Q4_0   d = scale, q4 = q                 exact
    4-bit codes (integer zero), group multiple of 32 -> Q4_1   d = scale, m = -scale * zero      m rounded to float16

Every other tensor (a SqueezeLLM layer: its table lookups plus its outliers) is dequantized to float32 and
re-encoded: F16, Q8_0, Q4_0 and Q4_1 with the `gguf` package's reference quantizers, Q4_K, Q5_K and Q6_K with the
encoders of model/gguf_kquants.py (gguf has none). A K-quant
tensor whose rows are not a multiple of 256 takes llama.cpp's fallback type (Q4_K -> Q5_0, Q5_K -> Q5_1,
Q6_K -> Q8_0), as llama-quantize does. The report says which tensor went which way.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import quantize as gguf_quantize

from brisk.model.config import ModelConfig
from brisk.model.gguf_kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k
from brisk.model.tokenizer import Tokenizer
from brisk.quant import primitives
from brisk.quant.config import QuantizationConfig

T = GGMLQuantizationType
EXPORT_TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f16": (T.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (T.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (T.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (T.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q4_k": (T.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    "q5_k": (T.Q5_K, LlamaFileType.MOSTLY_Q5_K_S),
    "q6_k": (T.Q6_K, LlamaFileType.MOSTLY_Q6_K),
}
_K_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}  # rows not a multiple of 256 (llama.cpp's choice)
_K_ENCODERS = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}
_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}  # llama.cpp writes mistral as llama
_PERMUTED_QK = ("llama",)

_LAYER_NAMES = {  # transformers name inside model.layers.{i} -> llama.cpp name inside blk.{i}
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


class ExportError(ValueError):
    """The model cannot be written as the requested GGUF (the message says what is unsupported and what is)."""


@dataclass
class ExportReport:
    path: Path
    outtype: str
    how: dict[str, str] = field(default_factory=dict)  # gguf tensor name -> "kept Q4_0", "re-encoded Q4_K", ...

    def summary(self) -> str:
        counts = Counter(self.how.values())
        return ", ".join(f"{n} tensor(s) {how}" for how, n in sorted(counts.items()))


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest not in _LAYER_NAMES:
        raise ExportError(f"tensor {hf_name} has no llama.cpp name; brisk exports the Llama-family tensors "
                          f"({', '.join(sorted(_LAYER_NAMES))})")
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's `permute`: each head's rows [first half | second half] -> interleaved pairs (rows only)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ------------------------------------------------------------------------------------------ kept codes
def _blocks_of(t: np.ndarray, group: int) -> np.ndarray:
    """[N, K / G] per-group values -> [N * K / 32] per-block values (a group of G = 32 m is m blocks)."""
    return np.repeat(t, group // 32, axis=1).reshape(-1)


def encode_kept(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, bits: int, group: int,
                qtype: GGMLQuantizationType) -> tuple[np.ndarray, bool] | None:
    """brisk's codes [N, K] (uint8), float16 scales and zeros [N, K / G] as `qtype` blocks, or None when the
    grid differs. Returns (bytes [N, K / 32 * block bytes], exact)."""
    n, k = codes.shape
    if group % 32:
        return None
    d = _blocks_of(scales.astype(np.float16), group).view(np.uint8).reshape(-1, 2)  # [N * K/32, 2]
    q = codes.reshape(-1, 32)  # [N * K/32, 32]
    if qtype == T.Q8_0 and bits == 8 and zeros is None:
        body = (q.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
        return np.concatenate([d, body], axis=1).reshape(n, -1), True
    if qtype in (T.Q4_0, T.Q4_1) and bits == 4:
        packed = q[:, :16] | (q[:, 16:] << 4)  # byte j: element j (low nibble), element j + 16 (high nibble)
        if qtype == T.Q4_0:
            return (None if zeros is not None else (np.concatenate([d, packed], axis=1).reshape(n, -1), True))
        z = np.full(scales.shape, 8.0, dtype=np.float32) if zeros is None else zeros.astype(np.float32)
        m32 = -scales.astype(np.float32) * z  # [N, K / G], exact in float32
        m16 = m32.astype(np.float16)
        exact = bool((m16.astype(np.float32) == m32).all())
        m = _blocks_of(m16, group).view(np.uint8).reshape(-1, 2)
        return np.concatenate([d, m, packed], axis=1).reshape(n, -1), exact
    return None


# ------------------------------------------------------------------------------------------ re-encoding
def encode_float(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType]:
    """float32 [N, K] -> (bytes or float16 array, the type written)."""
    if qtype == T.F16:
        return w.astype(np.float16), T.F16
    if qtype in _K_ENCODERS:
        if w.shape[-1] % 256:
            qtype = _K_FALLBACK[qtype]
        else:
            return _K_ENCODERS[qtype](w), qtype
    return gguf_quantize(w, qtype), qtype


def _dequantized(tensors: dict[str, torch.Tensor], name: str, spec: Any, k: int) -> torch.Tensor:
    """The float32 weight [N, K] of a quantized module in brisk's checkpoint form (input order undone; a SqueezeLLM
    layer's table lookups plus its outliers)."""
    if spec.scheme == "lut":
        from brisk.ops.lut import dequantize_lut
        from brisk.quant.checkpoint import LUT_SUFFIXES, lut_weight

        parts = {s: tensors[f"{name}.{s}"] for s in ("qweight", *LUT_SUFFIXES) if f"{name}.{s}" in tensors}
        return dequantize_lut(lut_weight([parts], spec, k))
    codes = primitives.unpack(tensors[f"{name}.qweight"], spec.bits, k)
    scales = tensors[f"{name}.scales"].float()
    if spec.scheme == "nf4":
        w = primitives.dequantize_nf4(codes, scales)
    else:
        zeros = tensors.get(f"{name}.qzeros")
        zeros = torch.full_like(scales, 2 ** (spec.bits - 1)) if zeros is None else zeros.float()
        w = primitives.dequantize(codes, scales, zeros)
    order = tensors.get(f"{name}.input_order")
    if order is not None:  # column j of the codes is input feature order[j]
        w = torch.empty_like(w).index_copy_(1, order.to(torch.int64), w)
    return w


# ------------------------------------------------------------------------------------------ metadata
def _arch_metadata(writer: GGUFWriter, c: ModelConfig) -> None:
    if c.sliding_window is not None:
        raise ExportError(f"the model uses sliding-window attention ({c.sliding_window}), which llama.cpp's llama "
                          "metadata cannot express; brisk exports full-attention llama / mistral / qwen2 models")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    writer.add_rope_freq_base(float(c.rope_theta))
    writer.add_vocab_size(c.vocab_size)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    if _GGUF_ARCH[c.architecture] == "llama":
        writer.add_rope_dimension_count(c.head_dim)
    if c.rope_scaling:
        kind = c.rope_scaling.get("rope_type", c.rope_scaling.get("type"))
        if kind != "linear":
            raise ExportError(f"RoPE scaling {kind!r} cannot be exported; brisk exports none or linear")
        writer.add_key_value(f"{writer.arch}.rope.scaling.type", "linear", GGUFValueType.STRING)
        writer.add_key_value(f"{writer.arch}.rope.scaling.factor", float(c.rope_scaling["factor"]),
                             GGUFValueType.FLOAT32)


def _tokenizer_metadata(writer: GGUFWriter, tok: Tokenizer, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (tokenizer.json) as llama.cpp's "gpt2" tokenizer metadata."""
    spec = json.loads(tok.hf_tokenizer.to_str())
    model = spec.get("model", {})
    pre = json.dumps(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or "ByteLevel" not in pre:
        raise ExportError(f"the tokenizer is a {model.get('type')} model without byte-level pre-tokenization; brisk "
                          "exports byte-level BPE tokenizers (llama.cpp 'gpt2') from Hugging Face folders, and "
                          "copies any tokenizer from a GGUF source")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {}
    for added in spec.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        special[added["id"]] = added.get("special", True)
    size = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [5] * size  # UNUSED, for the padding rows of a vocabulary wider than the tokenizer
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = (3 if special[i] else 4) if i in special else 1  # CONTROL, USER_DEFINED, NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if tok.bos_token_id is not None:
        writer.add_bos_token_id(tok.bos_token_id)
    if tok.eos_token_id is not None:
        writer.add_eos_token_id(tok.eos_token_id)
    if tok.pad_token_id is not None:
        writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(bool(tok.add_bos_token))
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def _copy_metadata(writer: GGUFWriter, md: dict[str, Any]) -> None:
    """Every key of a GGUF source but the ones the writer sets itself (architecture, file type, alignment)."""
    for key, value in md.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type", "general.alignment"):
            continue
        writer.add_key_value(key, *_typed(value))


def _typed(value: Any) -> tuple[Any, GGUFValueType] | tuple[Any, GGUFValueType, GGUFValueType]:
    if isinstance(value, list):
        first = value[0] if value else ""
        return (value, GGUFValueType.ARRAY, _typed(first)[1]) if not isinstance(first, list) else \
            (value, GGUFValueType.ARRAY, GGUFValueType.ARRAY)
    if isinstance(value, bool):
        return value, GGUFValueType.BOOL
    if isinstance(value, int):
        return value, GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT64
    if isinstance(value, float):
        return value, GGUFValueType.FLOAT32
    return str(value), GGUFValueType.STRING


# ------------------------------------------------------------------------------------------ export
def export_gguf(model: str | Path | None, out: str | Path, outtype: str) -> ExportReport:
    """Write `model` (anything brisk loads) to `out` with every matrix at `outtype` (EXPORT_TYPES)."""
    from brisk.model.loader import resolve_model

    if outtype not in EXPORT_TYPES:
        raise ExportError(f"unknown GGUF type {outtype!r}; brisk exports {', '.join(EXPORT_TYPES)}")
    qtype, ftype = EXPORT_TYPES[outtype]
    src, out = resolve_model(model), Path(out)
    if out.exists() and out.resolve() == src.resolve():
        raise ExportError(f"the output {out} is the input; choose another path")
    source_md: dict[str, Any] | None = None
    quantization: QuantizationConfig | None = None
    if src.is_dir():
        from brisk.model.hf import load_hf_folder

        ckpt = load_hf_folder(src)
        quantization = ckpt.quantization
    else:
        from brisk.model.gguf import load_gguf, read_gguf

        ckpt = load_gguf(src)
        source_md = read_gguf(src).metadata
    config, tensors = ckpt.config, dict(ckpt.tensors)
    if config.architecture not in _GGUF_ARCH:
        raise ExportError(f"architecture {config.architecture!r} cannot be exported; brisk exports "
                          f"{', '.join(_GGUF_ARCH)}")
    writer = GGUFWriter(out, _GGUF_ARCH[config.architecture])
    if source_md is not None:
        _copy_metadata(writer, source_md)
    else:
        writer.add_name(src.name)
        _arch_metadata(writer, config)
        _tokenizer_metadata(writer, ckpt.tokenizer, config.vocab_size)
    writer.add_file_type(ftype)
    report = ExportReport(out, outtype)
    for hf_name, array, how in _tensors(config, tensors, quantization, qtype):
        name = gguf_name(hf_name)
        report.how[name] = how
        if isinstance(array, tuple):
            data, raw = array
            writer.add_tensor(name, data, raw_dtype=raw)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return report


def _tensors(config: ModelConfig, tensors: dict[str, torch.Tensor], quantization: QuantizationConfig | None,
             qtype: GGMLQuantizationType):
    """(HF name, array or (bytes, type), how) for every tensor in llama.cpp's order (global, then per layer)."""
    from brisk.quant.checkpoint import module_shape

    modules = dict(quantization.modules) if quantization else {}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
        modules.pop("lm_head", None)
    names = [n for n in tensors if n.endswith((".weight", ".bias"))]
    names += [f"{m}.weight" for m in modules]
    permuted = _GGUF_ARCH[config.architecture] in _PERMUTED_QK
    for hf_name in sorted(set(names), key=_llama_cpp_order):
        module = hf_name.rsplit(".", 1)[0]
        heads = (config.num_attention_heads if ".q_proj." in hf_name else
                 config.num_key_value_heads if ".k_proj." in hf_name else 0) if permuted else 0
        if hf_name.endswith(".weight") and module in modules:
            spec = modules[module]
            _, k = module_shape(config, module)
            if spec.scheme == "int" and f"{module}.input_order" not in tensors:
                codes = primitives.unpack(tensors[f"{module}.qweight"], spec.bits, k).numpy()
                scales = tensors[f"{module}.scales"].numpy()
                zeros = tensors.get(f"{module}.qzeros")
                zeros = None if zeros is None else zeros.numpy()
                if heads:  # row permutation: codes and their group parameters move together
                    codes, scales = permute_qk(codes, heads), permute_qk(scales, heads)
                    zeros = None if zeros is None else permute_qk(zeros, heads)
                kept = encode_kept(codes, scales, zeros, spec.bits, k if spec.group_size == -1 else spec.group_size,
                                   qtype)
                if kept is not None:
                    data, exact = kept
                    yield hf_name, (data, qtype), f"kept as {qtype.name}" + ("" if exact else
                                                                              " (minimums rounded to float16)")
                    continue
            w = _dequantized(tensors, module, spec, k).numpy()
            how = f"dequantized from {spec.label} and re-encoded"
        else:
            w = tensors[hf_name].float().numpy()
            how = "re-encoded"
        if heads:
            w = permute_qk(w, heads)
        if w.ndim == 1:
            yield hf_name, np.ascontiguousarray(w, dtype=np.float32), "F32"
            continue
        data, written = encode_float(np.ascontiguousarray(w, dtype=np.float32), qtype)
        yield hf_name, (data if written == T.F16 else (data, written)), f"{how} as {written.name}"


def _llama_cpp_order(hf_name: str) -> tuple[int, str]:
    if hf_name.startswith("model.layers."):
        return int(hf_name.split(".")[2]) + 1, hf_name
    return (0 if "embed" in hf_name else 10**9), hf_name
