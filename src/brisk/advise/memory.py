"""Memory of a candidate configuration before anything is built: the weights in the candidate's format (codes,
scales, zero points), the KV pool its context and concurrency need, one step's activations and the runtime.

The activation term is `brisk.engine.memory.estimate_memory`'s, on a footprint of the candidate's format; the
weights term is priced here, per format, from the model's shape:

    float32 / bfloat16     4 / 2 bytes per parameter
    int8 (RTN, per channel, symmetric)   1 byte per weight + a float16 scale per output row
    int4 gG (asymmetric)   0.5 byte per weight + a float16 scale and a uint8 zero point per G weights
    GGUF codes             brisk's repacked form of each tensor's type (model/gguf_repack.py's table);
                           types it cannot repack are dequantized to the runtime dtype

Quantized formats keep the embedding (and an untied lm_head) at int8 per channel, as `brisk quantize` writes them;
a tied table is held twice once loaded (the lookup's and lm_head's copies).

A quantized checkpoint folder is memory-mapped at load (model/mapped.py): the embedding and the norms stay views of
the file's map, and the decoder linears' stored codes, scales and zero points are read through it into the kernels'
repacked layout, after which the loader unmaps those source pages (`mapped.drop_unused_pages`): the linears are
held once. A GGUF file's load unmaps its source pages as it goes (model/gguf_place.py), and a float model is held
as it is read.

The runtime term is measured, not the engine's conservative allowance: `PROCESS_BASE_BYTES`, what a Python process
holds resident after importing the engine (interpreter, torch, brisk), plus `LOADED_RUNTIME_BYTES`, what a load
adds besides the weights and the KV pool (the kernels' shared objects, the tokenizer, the engine's objects), plus
the RoPE tables (docs/advise.md, BENCHMARKS.md "Memory estimate against measured peak RSS").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from brisk.advise.quality import STREAM_SINKS
from brisk.engine.memory import (
    RUNTIME_BYTES,
    GiB,
    MemoryEstimate,
    MiB,
    ModelFootprint,
    estimate_memory,
    model_footprint,
)

# resident bytes after `import brisk.engine.llm` (memprobe's after_import: 238 MiB in every configuration), and
# what a load adds on top of the weights, the KV pool and the RoPE tables (after_load less those: 29-33 MiB over
# the six configurations of advise/memcheck.py; measured on the default model, BENCHMARKS.md)
PROCESS_BASE_BYTES = 238 * MiB
LOADED_RUNTIME_BYTES = 32 * MiB
# step token budgets (max_num_batched_tokens) a candidate may take, largest first: a smaller one holds smaller
# activations (the prefill goes in smaller chunks) when the engine's default 2,048 does not fit the budget
STEP_TOKENS = (2048, 1024, 512, 256)

# GGUF type -> bytes per weight of brisk's repacked form (model/gguf_repack.py); other types are dequantized
GGUF_REPACKED_BYTES = {"Q8_0": 1.0625, "Q4_0": 0.5625, "Q4_1": 0.625, "Q5_0": 1.0625, "Q5_1": 1.125,
                       "Q4_K": 0.75, "Q5_K": 1.25}
GGUF_FLOAT = ("F32", "F16", "BF16", "F64")


@dataclass(frozen=True)
class Precision:
    """One weight format a candidate runs in."""

    name: str  # float32, bfloat16, gguf, int8, int4-rtn-g64, ...
    dtype: torch.dtype  # runtime dtype of activations and float tensors
    bits: int | None = None  # quantized decoder linears; None = float (or the GGUF's own codes)
    group_size: int = -1
    method: str = "rtn"
    gguf: bool = False  # the GGUF file's own codes (--dtype auto)
    sparsity: str | None = None  # wanda-50, wanda-2:4: pruned float32 weights through the sparse kernels

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def label(self) -> str:
        if self.gguf:
            return "GGUF codes"
        if self.sparsity:
            return f"float32, {self.sparsity} pruned"
        if self.bits is None:
            return str(self.dtype).removeprefix("torch.")
        group = "per channel" if self.group_size == -1 else f"g{self.group_size}"
        return f"int{self.bits} {self.method.upper()} {group}"


@dataclass(frozen=True)
class ModelShape:
    """The parts of a model the formats price differently."""

    footprint: ModelFootprint  # of the model as given
    decoder_linear: int  # weights of the decoder's linear layers
    tables: int  # embedding (+ untied lm_head) weights
    other: int  # norms, biases
    gguf_types: dict[str, tuple[int, int]] | None  # GGUF: type -> (weights of that type in linears, in tables)
    path: Path | None


def model_shape(model: str | None) -> ModelShape:
    from brisk.model.loader import resolve_model

    fp = model_footprint(model)
    c = fp.config
    table = c.vocab_size * c.hidden_size
    tables = table * (1 if c.tie_word_embeddings else 2)
    # float_linear_params counts the decoder's linears plus one [vocab, hidden] head (tied or not)
    decoder_linear = fp.float_linear_params - table if not fp.fixed_bytes else _decoder_linear(c)
    other = c.num_params - decoder_linear - tables
    path = resolve_model(model)
    return ModelShape(fp, decoder_linear, tables, max(0, other), _gguf_types(path), path)


def _decoder_linear(c) -> int:  # noqa: ANN001 - ModelConfig
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h = c.hidden_size
    per_layer = h * (q + 2 * kv) + q * h
    mlp = c.num_params - c.vocab_size * h * (1 if c.tie_word_embeddings else 2) \
        - c.num_hidden_layers * (per_layer + 2 * h) - h
    return c.num_hidden_layers * per_layer + max(0, mlp)


def _gguf_types(path: Path) -> dict[str, tuple[int, int]] | None:
    if path.suffix != ".gguf":
        return None
    from brisk.model.gguf import read_gguf

    f = read_gguf(path)
    try:
        out: dict[str, list[int]] = {}
        for name, info in f.tensors.items():
            if len(info.shape) != 2:
                continue
            numel = info.shape[0] * info.shape[1]
            slot = out.setdefault(info.qtype.name, [0, 0])
            slot[1 if name.startswith(("token_embd", "output.")) else 0] += numel
        return {k: (v[0], v[1]) for k, v in out.items()}
    finally:
        f.buffer.close()


def is_quantized_gguf(shape: ModelShape) -> bool:
    return bool(shape.gguf_types) and any(t not in GGUF_FLOAT for t in shape.gguf_types)


def int_bytes_per_weight(bits: int, group_size: int, in_features: int, sym: bool = False) -> float:
    """Codes + float16 scales (+ uint8 zero points when asymmetric) per weight, as `brisk quantize` stores them."""
    groups_per_weight = 1 / (in_features if group_size == -1 else group_size)
    return bits / 8 + groups_per_weight * (2 + (0 if sym else 1))


def weight_bytes(shape: ModelShape, p: Precision) -> int:
    """Bytes the weights take in memory in format `p`."""
    c = shape.footprint.config
    item = torch.finfo(p.dtype).bits // 8
    if p.gguf:
        assert shape.gguf_types is not None
        total = shape.other * 4  # norms stay float32 in a GGUF model
        for qtype, (linear, tables) in shape.gguf_types.items():
            per = GGUF_REPACKED_BYTES.get(qtype, item)
            # the embedding lookup reads float rows: a quantized table is kept in its codes (one row decoded per
            # token) like the linears
            total += int((linear + tables) * per)
        return total
    if p.bits is None:
        return (shape.decoder_linear + shape.tables + shape.other) * item
    linear = int(shape.decoder_linear * int_bytes_per_weight(p.bits, p.group_size, c.hidden_size))
    # a tied table is quantized once on disk, but the lookup and lm_head each hold their own int8 copy in memory
    # (measured: the loaded int8 / int4 default model's tensors are one [vocab, hidden] int8 table over the file)
    copies = shape.tables * (2 if c.tie_word_embeddings else 1)
    tables = int(copies * int_bytes_per_weight(8, -1, c.hidden_size, sym=True))
    return linear + tables + shape.other * item


def footprint_for(shape: ModelShape, p: Precision) -> ModelFootprint:
    """A footprint in `p`'s format, for `estimate_memory`'s activation, runtime and packed-copy terms."""
    fp = shape.footprint
    if fp.fixed_bytes:  # an already-quantized checkpoint: as it is
        return fp
    item = torch.finfo(p.dtype).bits // 8
    if p.bits is None and not p.gguf:
        return fp
    fixed = weight_bytes(shape, p) - shape.other * item
    return replace(fp, float_params=shape.other, fixed_bytes=fixed, float_linear_params=0,
                   source=f"{fp.source} as {p.label}")


def estimate(shape: ModelShape, p: Precision, kv_cache_dtype: str, context: int, concurrency: int,
             extra_weights: int = 0, stream_budget: int | None = None, step_tokens: int = STEP_TOKENS[0]
             ) -> tuple[MemoryEstimate, dict[str, object]]:
    """The candidate's memory and the engine settings it was priced at (max_model_len, max_num_seqs, the KV pool
    that holds `concurrency` sequences of `context` tokens)."""
    from brisk.engine.settings import build_engine_config

    settings = engine_settings(shape, p, kv_cache_dtype, context, concurrency, stream_budget, step_tokens)
    config = build_engine_config(**settings)
    est = estimate_memory(config, footprint_for(shape, p), dtype=p.dtype)
    rope = est.runtime - RUNTIME_BYTES  # the engine's runtime term is its allowance plus the RoPE tables
    est = replace(est, weights=est.weights + extra_weights,
                  runtime=PROCESS_BASE_BYTES + LOADED_RUNTIME_BYTES + rope)
    return est, settings


def kv_pool_bytes(shape: ModelShape, p: Precision, kv_cache_dtype: str, context: int, concurrency: int,
                  block_size: int = 16, stream_budget: int | None = None, sink_tokens: int = STREAM_SINKS,
                  max_num_batched_tokens: int = 2048) -> int:
    """The KV budget that holds `concurrency` sequences of `context` tokens (whole blocks each). Under StreamingLLM
    (`stream_budget` tokens kept, sinks included) a sequence holds its sinks' blocks, its window's, a partial block
    at each end of the window and the block its newest token opens; one step's prefill chunk
    (`max_num_batched_tokens`, shared by the batch) comes on top (kvcache/sizing.py `min_blocks_evicting`)."""
    from brisk.engine.config import CacheConfig
    from brisk.kvcache.quant import Int4KVCache
    from brisk.kvcache.sizing import kv_bytes_per_block

    c = shape.footprint.config
    cache = CacheConfig(block_size=block_size, kv_cache_dtype=kv_cache_dtype)
    blocks = -(-context // block_size) * concurrency
    if stream_budget is not None and stream_budget < context:
        held = -(-sink_tokens // block_size) + -(-(stream_budget - sink_tokens) // block_size) + 3
        blocks = min(blocks, held * concurrency + -(-max_num_batched_tokens // block_size))
    pool = blocks * kv_bytes_per_block(cache, c, p.dtype)
    if kv_cache_dtype == "int4":
        pool += cache.num_residual_blocks * c.num_hidden_layers * Int4KVCache.residual_bytes_per_block(
            c.num_key_value_heads, c.head_dim, block_size)
    return -(-pool // MiB) * MiB


def kv_block_size(kv_cache_dtype: str) -> int:
    """The block size a candidate runs its KV cache dtype at: int4 (KIVI) groups keys by 64 tokens."""
    return 64 if kv_cache_dtype == "int4" else 16


def draft_kv_bytes(shape: ModelShape, p: Precision, kv_cache_dtype: str, context: int, concurrency: int,
                   step_tokens: int = STEP_TOKENS[0]) -> int:
    """A draft model's own KV pool (spec/draft_model.py): as many blocks as the target's, in the runtime dtype's
    float cache (a quantized target cache is not matched)."""
    from brisk.engine.config import CacheConfig
    from brisk.kvcache.sizing import kv_bytes_per_block, num_kv_blocks

    c = shape.footprint.config
    block = kv_block_size(kv_cache_dtype)
    pool = kv_pool_bytes(shape, p, kv_cache_dtype, context, concurrency, block, max_num_batched_tokens=step_tokens)
    target = CacheConfig(block_size=block, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=f"{pool // MiB}MiB")
    blocks = num_kv_blocks(target, c, p.dtype)
    draft = CacheConfig(block_size=block, kv_cache_dtype="bfloat16" if kv_cache_dtype == "bfloat16" else "auto")
    return blocks * kv_bytes_per_block(draft, c, p.dtype)


def engine_settings(shape: ModelShape, p: Precision, kv_cache_dtype: str, context: int, concurrency: int,
                    stream_budget: int | None = None, step_tokens: int = STEP_TOKENS[0]) -> dict[str, object]:
    """LLM keywords of the candidate (the model path is the caller's: a quantized copy is written first).
    `step_tokens`: the engine's token budget per step (max_num_batched_tokens), which sizes one step's
    activations and the prefill chunk."""
    block = kv_block_size(kv_cache_dtype)
    dtype = "auto" if p.gguf else str(p.dtype).removeprefix("torch.")
    pool = kv_pool_bytes(shape, p, kv_cache_dtype, context, concurrency, block, stream_budget,
                         max_num_batched_tokens=step_tokens)
    out: dict[str, object] = {"dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "block_size": block,
                              "max_model_len": context, "max_num_seqs": concurrency,
                              "max_num_batched_tokens": step_tokens, "kv_cache_memory": f"{pool // MiB}MiB"}
    if stream_budget is not None:
        out.update(kv_policy="streaming", kv_budget=stream_budget, sink_tokens=STREAM_SINKS)
    return out


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"
