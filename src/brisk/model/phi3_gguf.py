"""Phi-3 in GGUF (llama.cpp's `phi3` architecture): fused tensors split by rows, LongRoPE factors from tensors.

llama.cpp's converter writes Phi-3 as

    blk.{i}.attn_qkv.weight  [q + 2 kv, hidden]   rows: | q heads | k heads | v heads |  (no Q/K permutation:
    blk.{i}.ffn_up.weight    [2 I, hidden]        rows: | gate | up |                     phi3 runs NEOX RoPE)
    rope_factors_long.weight, rope_factors_short.weight   [head_dim / 2] float32 (the 128k models)
    phi3.rope.scaling.original_context_length, phi3.rope.scaling.attn_factor   (no rope.scaling.type)

A ggml tensor stores each row as its own run of blocks, so a row range of a fused tensor is itself a tensor of
the same type: `split_phi3_tensors` rewrites the file's tensor table into attn_q / attn_k / attn_v and
ffn_gate / ffn_up entries (offsets into the fused data), and everything after it (dequantization, repacking
into brisk's kernel formats, memory-mapped views) treats them as any Llama file's tensors. The two factor tensors
become the HF `rope_scaling` dict (`phi3_rope_scaling`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType

from brisk.model.gguf_dequant import GGUFError

if TYPE_CHECKING:
    from brisk.model.gguf import GGUFFile

ROPE_FACTOR_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
_FACTORS_KEY = "phi3.rope.scaling.factors"  # where split_phi3_tensors leaves the two lists in the metadata


def _row_split(f: GGUFFile, name: str, parts: list[tuple[str, int]]) -> None:
    info = f.tensors.pop(name)
    rows = info.shape[0]
    if sum(n for _, n in parts) != rows:
        raise GGUFError(f"{f.path}: tensor {name!r} has {rows} rows, expected "
                        f"{' + '.join(str(n) for _, n in parts)} from the file's metadata")
    row_bytes, rest = divmod(info.n_bytes, rows)
    assert rest == 0, f"{name}: {info.n_bytes} bytes do not split into {rows} rows"
    start = 0
    for part, n in parts:
        f.tensors[part] = dataclasses.replace(info, name=part, shape=(n, *info.shape[1:]),
                                              offset=info.offset + start * row_bytes, n_bytes=n * row_bytes)
        start += n


def split_phi3_tensors(f: GGUFFile) -> None:
    """In place: fused attn_qkv / ffn_up entries -> llama.cpp's per-projection names; the LongRoPE factor
    tensors -> `phi3.rope.scaling.factors` metadata ([short, long] lists)."""
    md, a = f.metadata, "phi3"
    heads = int(md.get(f"{a}.attention.head_count", 0))
    kv_heads = int(md.get(f"{a}.attention.head_count_kv", heads))
    hidden, inter = int(md.get(f"{a}.embedding_length", 0)), int(md.get(f"{a}.feed_forward_length", 0))
    if not heads or not hidden or not inter:
        return  # _config_from_gguf names the missing key
    head_dim = int(md.get(f"{a}.attention.key_length", 0)) or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    for name in [n for n in f.tensors if n.endswith(".attn_qkv.weight")]:
        blk = name.removesuffix("attn_qkv.weight")
        _row_split(f, name, [(blk + "attn_q.weight", q), (blk + "attn_k.weight", kv), (blk + "attn_v.weight", kv)])
    for name in [n for n in f.tensors if n.endswith(".ffn_up.weight")]:
        blk = name.removesuffix("ffn_up.weight")
        if f.tensors[name].shape[0] == 2 * inter and blk + "ffn_gate.weight" not in f.tensors:
            _row_split(f, name, [(blk + "ffn_gate.weight", inter), (blk + "ffn_up.weight", inter)])
    present = [n for n in ROPE_FACTOR_TENSORS if n in f.tensors]
    if present and len(present) != 2:
        raise GGUFError(f"{f.path}: has {present[0]!r} but not its partner; LongRoPE needs both "
                        f"{' and '.join(ROPE_FACTOR_TENSORS)}")
    if present:
        factors = []
        for n in ROPE_FACTOR_TENSORS:
            info = f.tensors.pop(n)
            if info.qtype != GGMLQuantizationType.F32 or len(info.shape) != 1:
                raise GGUFError(f"{f.path}: {n!r} must be a 1-D F32 tensor, got {info.qtype.name} {info.shape}")
            factors.append(np.frombuffer(f.buffer, dtype=np.float32, count=info.shape[0],
                                         offset=info.offset).tolist())
        md[_FACTORS_KEY] = factors


def phi3_rope_scaling(md: dict[str, Any], max_position: int) -> dict[str, Any] | None:
    """The HF `rope_scaling` of a phi3 file: longrope when it has the factor tensors, else None (plain RoPE).

    attention_factor is the file's own (llama.cpp computes it as transformers does, from the context ratio)."""
    factors = md.get(_FACTORS_KEY)
    if factors is None:
        return None
    original = md.get("phi3.rope.scaling.original_context_length")
    if original is None:
        raise GGUFError("phi3 file with LongRoPE factor tensors but no phi3.rope.scaling.original_context_length; "
                        "the file is incomplete")
    scaling: dict[str, Any] = {"rope_type": "longrope", "short_factor": factors[0], "long_factor": factors[1],
                               "original_max_position_embeddings": int(original),
                               "factor": max_position / int(original)}
    if (attn := md.get("phi3.rope.scaling.attn_factor")) is not None:
        scaling["attention_factor"] = float(attn)
    return scaling
