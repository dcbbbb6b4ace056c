"""The memory a configuration needs, estimated before anything loads, against the memory this machine has.

    needed = weights in the runtime format (+ oneDNN-packed float32 copies, --prepack-weights)
           + KV pool (--kv-cache-memory or --num-kv-blocks)
           + activations of one step (--max-num-batched-tokens tokens, logits of --max-num-seqs rows)
           + runtime (RoPE tables, kernel and allocator workspace)

Every tensor is priced in the precision it runs in: a GGUF file's quantized matrices that brisk repacks
(model/gguf_repack.py, under `--dtype auto`) at their packed size, codes and group parameters; every other GGUF
tensor, an HF folder's float tensors and random weights at the runtime dtype; a quantized checkpoint's packed
codes and scales as stored. Everything comes from headers and settings: the GGUF header, the HF config.json and
safetensors headers, or the dummy shape; no weight is read. `check_memory` refuses a configuration whose estimate
exceeds the available memory (psutil's, and the cgroup's limit when one is set) with the estimate and the settings
that would fit, instead of the kernel killing the process midway through loading. `--no-memory-check` skips it.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from brisk.kvcache.quant import Int4KVCache
from brisk.kvcache.sizing import kv_bytes_per_block, num_kv_blocks

if TYPE_CHECKING:
    from brisk.engine.config import CacheConfig, EngineConfig
    from brisk.model.config import ModelConfig

GiB, MiB = 2**30, 2**20
RUNTIME_BYTES = 256 * MiB  # oneDNN primitives, thread pools, kernel workspace, the engine's own objects
_SMALL_M = 8  # ops.linear.MAX_SMALL_M: batches above it use the packed copies (not imported: it loads kernels)
# --prepack-weights auto keeps oneDNN-packed float32 copies only up to this many bytes of them: they double the
# float weights, which on the default model is 0.5 GB for 1.2-2x faster prefill and large batches, and on a 1B
# model at float32 would be 4.9 GB more than the weights (peak RSS 2.7x the file instead of ~1.1x)
PREPACK_AUTO_MAX_BYTES = 1 << 30


def prepack_auto(max_num_seqs: int, packed_bytes: int) -> bool:
    """Whether --prepack-weights auto packs: batches can exceed the small-M kernel's rows, and the float32 copies
    (`packed_bytes`) are at most PREPACK_AUTO_MAX_BYTES."""
    return max_num_seqs > _SMALL_M and packed_bytes <= PREPACK_AUTO_MAX_BYTES
_FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
                 "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class InsufficientMemoryError(ValueError):
    """The configuration's estimated memory exceeds what the machine has available."""


@dataclass(frozen=True)
class ModelFootprint:
    """What the weights of a model take, from its headers: the parts that follow the runtime dtype and the parts
    stored as they are (packed integer codes, their scales)."""

    config: ModelConfig
    float_params: int  # converted to the runtime dtype at load
    fixed_bytes: int  # kept in their stored dtype (quantized checkpoints)
    float_linear_params: int  # float weights of linear layers (lm_head included): what --prepack-weights copies
    source: str  # what was measured, for the message
    # a GGUF file loaded with a float --dtype: its footprint under --dtype auto (the file's own precision), for the
    # message to offer; None elsewhere
    native: ModelFootprint | None = None

    def weight_bytes(self, dtype: torch.dtype) -> int:
        return self.float_params * _itemsize(dtype) + self.fixed_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    packed: int
    kv_pool: int
    activations: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.packed + self.kv_pool + self.activations + self.runtime

    def describe(self) -> str:
        parts = [f"weights {_gib(self.weights)}"] + ([f"packed float32 copies {_gib(self.packed)}"]
                                                      if self.packed else [])
        parts += [f"KV pool {_gib(self.kv_pool)}", f"activations {_gib(self.activations)}",
                  f"runtime {_gib(self.runtime)}"]
        return f"{_gib(self.total)} ({' + '.join(parts)})"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


# ---------------------------------------------------------------------------- the model's weights
def model_footprint(model: str | None, load_format: str = "auto", shape: str | None = None,
                    keep_quantized: bool = False) -> ModelFootprint:
    """The weights' footprint of what `load_model(model, load_format=..., shape=..., keep_quantized=...)` would
    build (`keep_quantized`: a GGUF file in its own precision, as `--dtype auto` loads it)."""
    from brisk.model.loader import model_shape, resolve_model

    if load_format == "dummy":
        config, name = model_shape(model, shape)
        return _float_footprint(config, f"shape {name}, random weights")
    path = resolve_model(model)
    if path.is_dir():
        return _safetensors_footprint(path)
    native = gguf_footprint(path, keep_quantized=True)
    return native if keep_quantized else replace(gguf_footprint(path, keep_quantized=False), native=native)


def gguf_footprint(path: Path, keep_quantized: bool) -> ModelFootprint:
    """From the GGUF header: with `keep_quantized`, each matrix of a type brisk repacks (a stack of experts
    [E, N, K] as E matrices; MoE routers stay float) at its packed size (codes + group parameters,
    gguf_repack.packed_bytes_per_weight), every other tensor at the runtime dtype."""
    from brisk.model.gguf import _config_from_gguf, read_gguf
    from brisk.model.gguf_repack import packed_bytes_per_weight, repackable

    f = read_gguf(path)
    config = _config_from_gguf(f)
    float_params = fixed = linear = 0
    embedding_packed = False
    for name, info in f.tensors.items():
        numel = 1
        for d in info.shape:
            numel *= d
        shape = tuple(info.shape)
        matrix = shape[1:] if len(shape) == 3 and "_exps." in name else shape
        if keep_quantized and "ffn_gate_inp" not in name and repackable(info.qtype, matrix):
            fixed += math.ceil(numel * packed_bytes_per_weight(info.qtype))
            embedding_packed |= name == "token_embd.weight"
            continue
        float_params += numel
        if len(info.shape) == 2 and name != "token_embd.weight":
            linear += numel
    if config.tie_word_embeddings and not embedding_packed:
        linear += config.vocab_size * config.hidden_size  # the head is a float linear on the embedding's weight
    kind = ", in its own precision" if keep_quantized and fixed else ""
    return ModelFootprint(config, float_params, fixed, linear, f"{path.name}{kind}")


def _float_footprint(config: ModelConfig, source: str) -> ModelFootprint:
    # every tensor becomes a float of the runtime dtype; the linears are all but the embedding (the head's weight
    # is the embedding's when tied, and a linear either way) and the norm vectors
    c = config
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
    biases = c.num_hidden_layers * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim \
        if c.attention_bias else 0
    embedding = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return ModelFootprint(c, c.num_params, 0, c.num_params - norms - biases - embedding, source)


def _safetensors_footprint(folder: Path) -> ModelFootprint:
    """From config.json and the safetensors headers (the first 8 bytes give the header's length)."""
    from brisk.model.config import ModelConfig

    raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config = ModelConfig.from_hf_dict(raw)
    # SqueezeLLM layers (scheme "lut"): 3-bit codes run as 4-bit nibbles, the float16 tables as float32
    lut_bits: dict[str, int] = {}
    qc = raw.get("quantization_config")
    if isinstance(qc, dict) and qc.get("method") == "squeezellm":
        from brisk.quant.config import QuantConfigError, QuantizationConfig

        try:
            lut_bits = {m: q.bits for m, q in QuantizationConfig.from_dict(qc).modules.items() if q.scheme == "lut"}
        except QuantConfigError:
            pass  # the loader says what is wrong with it
    float_params = fixed = linear = 0
    tied_codes = 0  # a quantized tied embedding's codes: the head holds a copy of its own once loaded
    files = sorted(folder.glob("*.safetensors"))
    if not files:  # the loader says what is missing
        return _float_footprint(config, folder.name)
    for file in files:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in info["shape"]:
                numel *= d
            module, _, leaf = name.rpartition(".")
            if module in lut_bits and leaf in ("qweight", "lut"):
                rows, cols = info["shape"]
                fixed += rows * -(-(cols * 8 // lut_bits[module]) // 2) if leaf == "qweight" else numel * 4
                continue
            if info["dtype"] in _FLOAT_DTYPES and not name.endswith(".scales"):
                float_params += numel
                linear += numel if len(info["shape"]) == 2 and "embed_tokens" not in name else 0
            else:
                fixed += numel * _STORED_BYTES.get(info["dtype"], 4)
                if name.startswith("model.embed_tokens."):
                    tied_codes += numel * _STORED_BYTES.get(info["dtype"], 4)
    if config.tie_word_embeddings:
        if tied_codes:
            fixed += tied_codes  # the quantized head's own table (the lookup keeps the embedding's)
        else:
            linear += config.vocab_size * config.hidden_size  # the head is a linear on the embedding's weight
    return ModelFootprint(config, float_params, fixed, linear, folder.name)


# ---------------------------------------------------------------------------- the estimate
def estimate_memory(config: EngineConfig, footprint: ModelFootprint, *, dtype: torch.dtype | None = None,
                    prepack_weights: str | None = None, cache: CacheConfig | None = None,
                    max_num_seqs: int | None = None) -> MemoryEstimate:
    """Bytes `config` needs with the model `footprint` describes; `dtype`, `prepack_weights`, `cache` and
    `max_num_seqs` replace the config's own (to price an alternative)."""
    mc = footprint.config
    dtype = dtype or config.torch_dtype
    prepack_weights = prepack_weights or config.prepack_weights
    cache = cache or config.cache
    assert config.scheduler is not None
    max_model_len = config.max_model_len or min(mc.max_position_embeddings, 2048)
    sched = config.scheduler.resolve(max_model_len)
    if max_num_seqs is not None:
        sched = replace(sched, max_num_seqs=max_num_seqs)
    assert sched.max_num_batched_tokens is not None
    packed = 0
    copies = footprint.float_linear_params * 4  # oneDNN's copy is float32 whatever the model's dtype
    if prepack_weights == "on" or (prepack_weights == "auto" and dtype == torch.float32
                                   and prepack_auto(sched.max_num_seqs, copies)):
        packed = copies
    kv = num_kv_blocks(cache, mc, dtype) * kv_bytes_per_block(cache, mc, dtype)
    if cache.kv_cache_dtype == "int4":
        kv += cache.num_residual_blocks * mc.num_hidden_layers * Int4KVCache.residual_bytes_per_block(
            mc.num_key_value_heads, mc.head_dim, cache.block_size)
    # one step: the residual stream, normed input, attention and MLP outputs, q/k/v and gate/up/act per token,
    # in the runtime dtype (float32 for quantized layers, which run float32 activations); logits and
    # probabilities of every sampled row in float32; twice that for the allocator's free blocks
    q, kvh = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    per_token = 4 * mc.hidden_size + q + 2 * kvh + 3 * mc.intermediate_size
    logits = 2 * sched.max_num_seqs * mc.vocab_size
    activations = 2 * (_itemsize(dtype) * sched.max_num_batched_tokens * per_token + 4 * logits)
    rope = 2 * 4 * max(max_model_len, mc.max_position_embeddings) * mc.head_dim  # cos and sin tables
    return MemoryEstimate(footprint.weight_bytes(dtype), packed, kv, activations, RUNTIME_BYTES + rope)


# ---------------------------------------------------------------------------- what the machine has
def available_memory() -> tuple[int, str]:
    """Bytes this process can still allocate, and where that figure comes from: psutil's available memory, or the
    cgroup's limit less its usage (page cache it could reclaim counted as free) when that is lower."""
    import psutil

    avail, source = int(psutil.virtual_memory().available), "available system memory"
    cgroup = _cgroup_headroom()
    if cgroup is not None and cgroup < avail:
        avail, source = cgroup, "the cgroup memory limit less its usage"
    return avail, source


def _cgroup_headroom() -> int | None:
    root = Path("/sys/fs/cgroup")
    for limit_f, usage_f, stat_f, key in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                          ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                           "memory/memory.stat", "total_inactive_file")):
        try:
            limit = (root / limit_f).read_text().strip()
            usage = int((root / usage_f).read_text())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 2**60:  # no limit set
            return None
        reclaimable = 0
        try:
            for line in (root / stat_f).read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    reclaimable = int(value)
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - usage + reclaimable)
    return None


# ---------------------------------------------------------------------------- the check
def check_memory(config: EngineConfig, available: int | None = None) -> MemoryEstimate | None:
    """InsufficientMemoryError, with the estimate and settings that would fit, when `config` needs more than
    `available` bytes (default: measured). Returns the estimate; None when config.memory_check is off."""
    if not config.memory_check:
        return None
    footprint = model_footprint(config.model, config.load_format, config.shape,
                                keep_quantized=config.dtype == "auto")  # as llm_engine.load_engine_model loads it
    estimate = estimate_memory(config, footprint)
    source = "given"
    if available is None:
        available, source = available_memory()
    if estimate.total <= available:
        return estimate
    dtype_name = str(config.torch_dtype).removeprefix("torch.")
    lines = [f"not enough memory for {footprint.source} at {dtype_name}: it needs about {estimate.describe()}, "
             f"and {_gib(available)} is available ({source})."]
    fits = fitting_options(config, footprint, available)
    if fits:
        lines.append("Settings that fit:")
        lines += [f"  {flags}   (about {_gib(est.total)})" for flags, est in fits]
    if not footprint.fixed_bytes and footprint.native is None and config.load_format != "dummy":
        # a float model: quantizing it is another way
        linear = footprint.float_linear_params
        int4 = footprint.weight_bytes(torch.bfloat16) - linear * 2 + linear * (0.5 + 4 / 64)
        lines.append(f"Or quantize it first (weights about {_gib(int(int4))} at 4 bits): "
                     "brisk quantize MODEL OUT --bits 4, then --model OUT.")
    lines.append("--no-memory-check starts anyway (the estimate is conservative; the kernel may still kill "
                 "the process).")
    raise InsufficientMemoryError("\n".join(lines))


def fitting_options(config: EngineConfig, footprint: ModelFootprint, available: int,
                    limit: int = 3) -> list[tuple[str, MemoryEstimate]]:
    """Up to `limit` changes of dtype, packed copies, batch width and KV pool under which the estimate fits,
    fewest changes first: (the flags, the estimate).

    Fewer sequences (`--max-num-seqs 8`) matter under `--prepack-weights auto`: at most 8 rows run on brisk's
    small-M kernel, so no packed float32 copy of the weights is made (and the logits rows shrink). A KV pool too
    small for one sequence of max_model_len is offered with the `--max-model-len` it does hold."""
    mc, cache = footprint.config, config.cache
    assert config.scheduler is not None
    max_model_len = config.max_model_len or min(mc.max_position_embeddings, 2048)
    # (flag, runtime dtype, footprint): the configured one; bfloat16 for a float32 float model; the file's own
    # precision for a GGUF file given a float --dtype (its quantized matrices stay packed: usually the smallest)
    dtypes: list[tuple[str | None, torch.dtype | None, ModelFootprint]] = [(None, None, footprint)]
    if config.torch_dtype == torch.float32 and not footprint.fixed_bytes:
        dtypes.append(("--dtype bfloat16", torch.bfloat16, footprint))
    if footprint.native is not None and footprint.native.fixed_bytes:
        dtypes.append(("--dtype auto", torch.float32, footprint.native))
    prepacks = [None] + (["off"] if config.prepack_weights != "off" else [])
    seqs = [None] + ([_SMALL_M] if config.scheduler.max_num_seqs > _SMALL_M else [])
    found: list[tuple[int, str, MemoryEstimate]] = []
    for (flag, dtype, fp), prepack, num_seqs, shrink_kv in itertools.product(dtypes, prepacks, seqs, (False, True)):
        changes = ([flag] if flag else []) + ([f"--prepack-weights {prepack}"] if prepack else []) \
            + ([f"--max-num-seqs {num_seqs}"] if num_seqs else [])
        est = estimate_memory(config, fp, dtype=dtype, prepack_weights=prepack, max_num_seqs=num_seqs)
        if prepack and not estimate_memory(config, fp, dtype=dtype, max_num_seqs=num_seqs).packed:
            continue  # no packed copies to drop under this dtype: the same option without the flag
        if num_seqs and (prepack or not estimate_memory(config, fp, dtype=dtype).packed):
            continue  # it drops no packed copy here (or two flags would drop the same ones): not worth a change
        if shrink_kv:
            # the largest pool that leaves a tenth of the headroom spare; if it holds less than one sequence of
            # max_model_len, the longest power-of-two length it holds (at least 256 tokens), with --max-model-len
            pool = int((available - (est.total - est.kv_pool)) * 0.9) // MiB * MiB
            per_block = kv_bytes_per_block(cache, mc, dtype or config.torch_dtype)
            holds = pool // per_block * cache.block_size if pool > 0 else 0
            if pool >= est.kv_pool or holds < 256:
                continue
            smaller = replace(cache, kv_cache_memory=f"{pool // MiB}MiB", num_blocks=None)
            changes.append(f"--kv-cache-memory {pool // MiB}MiB")
            if holds < max_model_len:
                changes.append(f"--max-model-len {1 << (holds.bit_length() - 1)}")
            est = estimate_memory(config, fp, dtype=dtype, prepack_weights=prepack, cache=smaller,
                                  max_num_seqs=num_seqs)
        if changes and est.total <= available:
            found.append((len(changes), " ".join(changes), est))
    found.sort(key=lambda f: (f[0], f[2].total))
    return [(flags, est) for _, flags, est in found[:limit]]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers a model (or one rank's shard) holds, each tensor counted once (tied
    weights share one). Counted per tensor, not per storage: a loader may place many tensors in one buffer, of
    which a pipeline stage keeps only its layers'."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta":
            continue
        key = (t.data_ptr(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
