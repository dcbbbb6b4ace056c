"""The GGUF file of a random-weight shape, for `brisk bench compare --shape NAME`: llama.cpp needs a file, and
both engines then load the same weights from it.

The weights are `model/dummy.py`'s (seeded), written at F16 under llama.cpp's names, with its Q/K row order; the
metadata are the shape's hyper-parameters and the default model's tokenizer, its token list padded with unused
tokens up to the shape's vocabulary (llama.cpp sizes the embedding from the token list). Llama-3's RoPE frequency
factors (the `rope_freqs` tensor) are not written, so both engines rotate at the plain `rope_theta`: the cost of a
step is the same. Files are cached by shape and seed (`cached_shape_gguf`); writing the 1B shape takes a while.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from brisk.model.config import ModelConfig

_HF_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
               "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.o_proj.weight": "attn_output.weight",
               "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_UNUSED_TOKEN = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "brisk" / "shapes"


def cached_shape_gguf(shape: str, seed: int = 0, folder: Path | None = None,
                      log: Callable[[str], None] = print) -> Path:
    """The shape's GGUF in the cache, written first when it is not there yet."""
    from brisk.model.dummy import shape_name

    folder = folder or cache_dir()
    out = folder / f"{shape_name(shape)}.seed{seed}.f16.gguf"
    if out.is_file():
        log(f"using the cached {out}")
        return out
    folder.mkdir(parents=True, exist_ok=True)
    log(f"writing random weights of {shape_name(shape)} to {out} (once; cached for the next runs) ...")
    tmp = out.with_suffix(".partial")
    write_shape_gguf(shape, tmp, seed)
    tmp.replace(out)  # a file under the final name is always complete
    return out


def _permute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's Q/K rows -> llama.cpp's (the inverse of model/gguf.py `_unpermute_rows`)."""
    rest = w.shape[1:]
    # w: [n_heads * d, *rest] -> [n_heads, 2, d/2, *rest] -> [n_heads, d/2, 2, *rest]
    return w.reshape(n_heads, 2, -1, *rest).transpose(1, 2).reshape(w.shape)


def write_shape_gguf(shape: str, out: Path, seed: int = 0) -> Path:
    """Write the random-weight model of `shape` (a SHAPES name or an HF config.json) to `out` as an F16 GGUF."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

    from brisk.model.dummy import random_tensors, shape_config
    from brisk.model.loader import default_model_path

    config = shape_config(shape)
    if config.architecture != "llama":
        raise ValueError(f"bench compare --shape writes llama GGUF files; {shape} is a {config.architecture} model")
    writer = GGUFWriter(out, "llama")
    _write_hparams(writer, config)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    reader = GGUFReader(default_model_path())
    for key, field in reader.fields.items():  # the default model's tokenizer, padded to the shape's vocabulary
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"<unused_{i}>" for i in range(len(value), config.vocab_size)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [_UNUSED_TOKEN] * (config.vocab_size - len(value))
        elif key == "tokenizer.ggml.scores":
            value = value + [0.0] * (config.vocab_size - len(value))
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, field.types[0])
    n = len(reader.fields["tokenizer.ggml.tokens"].contents())
    if n > config.vocab_size:
        raise ValueError(f"the default tokenizer has {n} tokens, more than the {config.vocab_size} of {shape}")
    tensors = random_tensors(config, torch.float16, seed)  # drawn at the file's type: one copy of the model
    for name in list(tensors):
        t = tensors.pop(name)
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{i}.{_HF_TO_GGUF[rest]}"
        else:
            gguf_name = _TOP[name]
        if ".attn_q.weight" in gguf_name:
            t = _permute_rows(t, config.num_attention_heads)
        elif ".attn_k.weight" in gguf_name:
            t = _permute_rows(t, config.num_key_value_heads)
        # matrices at F16; vectors (norms, biases) stay F32 as llama.cpp's converter keeps them
        writer.add_tensor(gguf_name, t.float().numpy() if t.ndim == 1 else t.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_hparams(writer, c: ModelConfig) -> None:  # noqa: ANN001 - gguf.GGUFWriter
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
