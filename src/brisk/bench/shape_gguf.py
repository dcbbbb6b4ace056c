"""The GGUF file of a random-weight shape, for `brisk bench compare --shape NAME`: llama.cpp needs a file, and
both engines then load the same weights from it.

The weights are `model/dummy.py`'s (seeded), written at F16 under llama.cpp's names, with its Q/K row order; or,
for a quantized file (`qtype` Q8_0, Q4_0 or Q4_1), random codes with one scale per tensor chosen so that the values
span the same uniform range as dummy.py's (a quantized uniform draw), written without any float copy. Either way
the file is written one tensor at a time (header and tensor directory first), so the writer holds one tensor in
memory, not the model: an 8B shape is written on a machine with room for its file's largest tensor. The
metadata are the shape's hyper-parameters and the default model's tokenizer, its token list padded with unused
tokens up to the shape's vocabulary (llama.cpp sizes the embedding from the token list). Llama-3's RoPE frequency
factors (the `rope_freqs` tensor) are not written, so both engines rotate at the plain `rope_theta`: the cost of a
step is the same. Files are cached by shape and seed (`cached_shape_gguf`); writing the 1B shape takes a while.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
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
                      log: Callable[[str], None] = print, qtype: str = "F16") -> Path:
    """The shape's GGUF (matrices of `qtype`) in the cache, written first when it is not there yet."""
    from brisk.model.dummy import shape_name

    folder = folder or cache_dir()
    out = folder / f"{shape_name(shape)}.seed{seed}.{qtype.lower()}.gguf"
    if out.is_file():
        log(f"using the cached {out}")
        return out
    folder.mkdir(parents=True, exist_ok=True)
    log(f"writing random weights of {shape_name(shape)} to {out} (once; cached for the next runs) ...")
    tmp = out.with_suffix(".partial")
    write_shape_gguf(shape, tmp, seed, qtype)
    tmp.replace(out)  # a file under the final name is always complete
    return out


def _permute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's Q/K rows -> llama.cpp's (the inverse of model/gguf.py `_unpermute_rows`)."""
    rest = w.shape[1:]
    # w: [n_heads * d, *rest] -> [n_heads, 2, d/2, *rest] -> [n_heads, d/2, 2, *rest]
    return w.reshape(n_heads, 2, -1, *rest).transpose(1, 2).reshape(w.shape)


# the types written as random codes: (block weights, block bytes, llama.cpp file type); the tensors' float values
# are uniform on [-b, b] as dummy.py's are, b = sqrt(3 / fan_in)
_CODE_TYPES = {"Q8_0": (32, 34, 7), "Q4_0": (32, 18, 2), "Q4_1": (32, 20, 3)}
_FLOAT_TYPES = {"F16": (torch.float16, 1), "BF16": (torch.bfloat16, 32), "F32": (torch.float32, 0)}
FILE_TYPES = tuple(_FLOAT_TYPES) + tuple(_CODE_TYPES)


def _random_blocks(qtype: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, cols / 32 * block bytes] uint8: random codes of a GGML block type, the scale (and minimum) of every
    block set so that the codes cover [-b, b], b = sqrt(3 / cols)."""
    block, size, _ = _CODE_TYPES[qtype]
    bound = math.sqrt(3.0 / cols)
    n = rows * (cols // block)
    if qtype == "Q8_0":  # x = d q, q int8 in -128..127
        head = torch.tensor([bound / 128], dtype=torch.float16)
    elif qtype == "Q4_0":  # x = d (q - 8), q in 0..15
        head = torch.tensor([bound / 8], dtype=torch.float16)
    else:  # Q4_1: x = d q + m
        head = torch.tensor([2 * bound / 15, -bound], dtype=torch.float16)
    out = torch.empty(n, size, dtype=torch.uint8)
    hb = head.view(torch.uint8)
    out[:, :hb.numel()] = hb
    out[:, hb.numel():].random_(0, 256, generator=gen)
    return out.view(rows, -1)


def write_shape_gguf(shape: str, out: Path, seed: int = 0, qtype: str = "F16") -> Path:
    """Write the random-weight model of `shape` (a SHAPES name or an HF config.json) to `out` as a GGUF whose
    matrices are of `qtype` (FILE_TYPES; vectors stay F32 as llama.cpp's converter keeps them), one tensor at a
    time."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    from brisk.model.dummy import shape_config
    from brisk.model.llama import LlamaForCausalLM
    from brisk.model.loader import default_model_path

    if qtype not in FILE_TYPES:
        raise ValueError(f"shape GGUF type {qtype!r} is not one brisk writes; use one of {', '.join(FILE_TYPES)}")
    config = shape_config(shape)
    if config.architecture != "llama":
        raise ValueError(f"bench compare --shape writes llama GGUF files; {shape} is a {config.architecture} model")
    writer = GGUFWriter(out, "llama")
    _write_hparams(writer, config)
    writer.add_file_type(_FLOAT_TYPES[qtype][1] if qtype in _FLOAT_TYPES else _CODE_TYPES[qtype][2])
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
    del reader
    if n > config.vocab_size:
        raise ValueError(f"the default tokenizer has {n} tokens, more than the {config.vocab_size} of {shape}")
    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    shapes = [(name, tuple(p.shape)) for name, p in meta.state_dict().items()
              if not (name == "lm_head.weight" and config.tie_word_embeddings)]
    del meta

    def gguf_name(name: str) -> str:
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            return f"blk.{i}.{_HF_TO_GGUF[rest]}"
        return _TOP[name]

    # the directory first (names, shapes, types, sizes), then each tensor's bytes as it is made
    for name, dims in shapes:
        if len(dims) == 1:
            writer.add_tensor_info(gguf_name(name), dims, np.dtype(np.float32), dims[0] * 4)
        elif qtype in _CODE_TYPES:
            block, size, _ = _CODE_TYPES[qtype]
            byte_shape = (dims[0], dims[1] // block * size)
            writer.add_tensor_info(gguf_name(name), byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                                   raw_dtype=GGMLQuantizationType[qtype])
        else:
            dtype = _FLOAT_TYPES[qtype][0]
            nbytes = dims[0] * dims[1] * dtype.itemsize
            if dtype == torch.bfloat16:  # numpy has no bfloat16: its bytes, as the gguf package writes them
                writer.add_tensor_info(gguf_name(name), (dims[0], dims[1] * 2), np.dtype(np.uint8), nbytes,
                                       raw_dtype=GGMLQuantizationType.BF16)
            else:
                writer.add_tensor_info(gguf_name(name), dims, np.dtype(torch.empty((), dtype=dtype).numpy().dtype),
                                       nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    # the same draws, in the same order, as dummy.random_tensors: an F16 file holds the dummy loader's weights
    gen = torch.Generator().manual_seed(seed)
    for name, dims in shapes:
        if len(dims) == 1:
            t = torch.full(dims, 0.0 if name.endswith(".bias") else 1.0)
        elif qtype in _CODE_TYPES:
            t = _random_blocks(qtype, dims[0], dims[1], gen)
        else:
            t = torch.empty(dims, dtype=_FLOAT_TYPES[qtype][0])
            bound = math.sqrt(3.0 / dims[-1])
            t.uniform_(-bound, bound, generator=gen)
            g = gguf_name(name)
            if ".attn_q.weight" in g:
                t = _permute_rows(t, config.num_attention_heads)
            elif ".attn_k.weight" in g:
                t = _permute_rows(t, config.num_key_value_heads)
        t = t.contiguous()
        writer.write_tensor_data(t.view(torch.uint8).numpy() if t.dtype == torch.bfloat16 else t.numpy())
        del t
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


def main(argv: list[str] | None = None) -> None:
    """python -m brisk.bench.shape_gguf SHAPE OUT [--type Q4_1] [--seed 0]: write a shape's random-weight GGUF."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m brisk.bench.shape_gguf", description=main.__doc__)
    parser.add_argument("shape", help="a shape name (model/dummy.py SHAPES) or an HF config.json")
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument("--type", default="F16", choices=FILE_TYPES, help="the matrices' GGML type")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_shape_gguf(args.shape, args.out, args.seed, args.type)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
