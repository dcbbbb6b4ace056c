"""GGUF checkpoints (llama.cpp's single-file format): model config, weights and tokenizer from one file.

File layout (little-endian; GGUF v2/v3)::

    | "GGUF" | version u32 | n_tensors u64 | n_kv u64 | n_kv x (key, type, value) | n_tensors x tensor info |
    | padding to `general.alignment` (32) | tensor data (each tensor at its info's offset, aligned) |

The header is parsed here with `struct` over a memory map rather than with `gguf.GGUFReader`: the reader
builds a numpy memmap view per metadata element, which for a 49k-token vocabulary (tokens + merges) takes
~3.3 s, while the whole header parses in ~0.1 s this way. A float tensor loaded in its own dtype is a view of
the file's memory map (model/mapped.py); every other tensor is read straight from the map and dequantized once
(`gguf_dequant.dequantize`) into its final buffer, so loading costs about one pass over the weights.

Weights are renamed to the Hugging Face transformers convention (`model.layers.{i}.self_attn.q_proj.weight`,
...) and llama.cpp's row permutation of Q/K is undone, so the tensors equal what transformers loads.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from brisk.model import mapped, weights_cache
from brisk.model.config import ModelConfig, UnsupportedModelError
from brisk.model.fuse import FusedBuffers
from brisk.model.generation_config import generation_config_from_gguf_metadata
from brisk.model.gguf_dequant import SUPPORTED_TYPES, GGUFError, dequantize
from brisk.model.gguf_repack import repack, repackable_tensor
from brisk.model.gguf_tokenizer import tokenizer_from_gguf_metadata
from brisk.model.moe import gguf_moe_config, gguf_moe_layer_tensors, place_gguf_moe_tensor
from brisk.model.phi3_gguf import phi3_rope_scaling, split_phi3_tensors
from brisk.model.tokenizer import Tokenizer
from brisk.ops.kernels import get_op
from brisk.ops.qlinear import PackedWeight

__all__ = ["GGUFCheckpoint", "GGUFError", "GGUFFile", "load_gguf", "read_gguf", "read_gguf_config"]

# llama: + mixtral (expert_count)
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "smollm3", "qwen2moe",
                                "qwen3moe")
# llama.cpp's converter permutes the Q/K rows of Llama-family models (mistral is written as "llama") for
# its interleaved RoPE; Qwen2 and Qwen3 are converted without permutation.
_PERMUTED_QK_ARCHS = ("llama", "mistral", "mixtral", "smollm3")
_SMOLLM3_NO_ROPE_STEP = 4

# ----------------------------------------------------------------------------------------- header parsing

# GGUFValueType id -> struct format of one scalar (8 = string, 9 = array are handled apart)
_SCALAR_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: ggml's ne reversed, so shape[-1] is the innermost dim
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    buffer: mmap.mmap  # the whole file, read-only

    def tensor_bytes(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return np.frombuffer(self.buffer, dtype=np.uint8, count=info.n_bytes, offset=info.offset)


class _HeaderCursor:
    """Reads header fields in order; any read past the end of the file is a truncated file."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def _need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise GGUFError(f"{self.path}: truncated file: reading {what} needs bytes {self.pos}..{self.pos + n} "
                            f"but the file has only {self.size} bytes")

    def scalar(self, vtype: int, what: str) -> Any:
        fmt = _SCALAR_FMT[vtype]
        n = struct.calcsize(fmt)
        self._need(n, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        n = self.scalar(10, what)
        self._need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({e}); the file is damaged") from None

    def _strings(self, count: int, what: str) -> list[str]:
        """`count` strings in one loop (a tokenizer's vocabulary: 50-260 k of them), as `string` reads each."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, struct.Struct("<Q").unpack_from
        out = []
        try:
            for _ in range(count):
                if pos + 8 > size:
                    break
                (n,) = unpack(buf, pos)
                end = pos + 8 + n
                if end > size:
                    break
                out.append(buf[pos + 8:end].decode("utf-8"))
                pos = end
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 ({e}); the file is damaged") from None
        self.pos = pos
        if len(out) < count:  # the same error as `string` would give
            self.string(what)
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, count = self.scalar(4, what), self.scalar(10, what)
            if etype in _SCALAR_FMT:  # numeric arrays in one numpy read
                itemsize = struct.calcsize(_SCALAR_FMT[etype])
                self._need(count * itemsize, what)
                dtype = np.dtype(_SCALAR_FMT[etype].replace("?", "B"))
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * itemsize
                return (arr.astype(bool) if etype == 7 else arr).tolist()
            self._need(count * 8, what)  # every string or array element is at least 8 bytes long
            if etype == _STRING:
                return self._strings(count, what)
            return [self.value(etype, what) for _ in range(count)]
        if vtype not in _SCALAR_FMT:
            raise GGUFError(f"{self.path}: {what} has unknown value type {vtype}; the file is damaged")
        return self.scalar(vtype, what)


# The last few parsed headers: `generate` reads the header for its memory check and again to load, and a header's
# tokenizer vocabulary (128 k strings at Llama-3's size) takes ~0.2-0.4 s to parse. A cached header is used only if
# the file's header bytes still hash to what was parsed (a few ms), so a file rewritten in place is parsed again.
# Each call maps the file afresh and gets its own metadata dict and tensor records.
_Records = list[tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]]
_HEADERS: dict[tuple[str, int], tuple[int, bytes, tuple[int, dict[str, Any], _Records]]] = {}
_HEADERS_KEPT = 2


def _header_digest(buf: mmap.mmap, end: int) -> bytes:
    return hashlib.blake2b(memoryview(buf)[:end], digest_size=16).digest()


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF header (metadata + tensor directory) and memory-map the file; reads no tensor data."""
    path = Path(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 4:
            raise GGUFError(f"{path}: not a GGUF file (only {size} bytes long)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    key = (str(path.resolve()), size)
    cached = _HEADERS.get(key)
    if cached is None or _header_digest(buf, cached[0]) != cached[1]:
        header, end = _parse_header(path, buf, size)
        while len(_HEADERS) >= _HEADERS_KEPT:
            _HEADERS.pop(next(iter(_HEADERS)))
        cached = _HEADERS[key] = (end, _header_digest(buf, end), header)
    version, metadata, records = cached[2]
    tensors = {name: GGUFTensorInfo(name, shape, qtype, start, n_bytes)
               for name, shape, qtype, start, n_bytes in records}
    f = GGUFFile(path, version, dict(metadata), tensors, buf)
    if metadata.get("general.architecture") == "phi3":  # fused qkv / gate_up -> row ranges; LongRoPE factors
        split_phi3_tensors(f)
    return f


def _parse_header(path: Path, buf: mmap.mmap, size: int) -> tuple[tuple[int, dict[str, Any], _Records], int]:
    """The header's version, metadata and tensor records (name, shape, type, absolute offset, bytes), checked, and
    where the header ends."""
    if buf[:4] != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (bad magic {bytes(buf[:4])!r}, expected b'GGUF'); "
                        "pass a .gguf file or a Hugging Face model folder")
    cur = _HeaderCursor(buf, path)
    cur.pos = 4
    version = cur.scalar(4, "the version")
    if version & 0xFFFF == 0 and version >> 24 in (2, 3):
        raise GGUFError(f"{path}: big-endian GGUF files are not supported; convert it to little-endian")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (brisk reads versions 2 and 3); "
                        "re-convert the model with a current llama.cpp")
    n_tensors, n_kv = cur.scalar(10, "the tensor count"), cur.scalar(10, "the metadata count")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        metadata[key] = cur.value(cur.scalar(4, f"the type of {key!r}"), f"metadata {key!r}")

    infos = []
    for i in range(n_tensors):
        name = cur.string(f"tensor name #{i}")
        n_dims = cur.scalar(4, f"tensor {name!r}")
        ne = [cur.scalar(10, f"tensor {name!r}") for _ in range(min(n_dims, 4))]
        type_id, offset = cur.scalar(4, f"tensor {name!r}"), cur.scalar(10, f"tensor {name!r}")
        if n_dims > 4 or any(d <= 0 for d in ne):
            raise GGUFError(f"{path}: tensor {name!r} has an invalid shape (ne={ne}, n_dims={n_dims})")
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown tensor type id {type_id}; the file is damaged "
                            "or newer than the installed gguf package") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if ne[0] % block_size:
            raise GGUFError(f"{path}: tensor {name!r}: row length {ne[0]} is not a multiple of the "
                            f"{qtype.name} block size {block_size}")
        n_bytes = math.prod(ne) // block_size * type_size
        infos.append((name, tuple(reversed(ne)), qtype, offset, n_bytes))

    alignment = int(metadata.get("general.alignment", 32))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment must be a power of two, got {alignment}")
    data_start = -(-cur.pos // alignment) * alignment
    records = []
    for name, shape, qtype, offset, n_bytes in infos:
        start = data_start + offset
        if start + n_bytes > size:
            raise GGUFError(f"{path}: truncated file: tensor {name!r} needs bytes {start}..{start + n_bytes} "
                            f"but the file has only {size} bytes")
        records.append((name, shape, qtype, start, n_bytes))
    return (version, metadata, records), cur.pos


# ----------------------------------------------------------------------------------------- config

def _config_from_gguf(f: GGUFFile) -> ModelConfig:
    md = f.metadata
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise GGUFError(f"{f.path}: unknown architecture {arch!r}; brisk supports GGUF architectures "
                        f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")

    def key(name: str, default: Any = KeyError) -> Any:
        value = md.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise GGUFError(f"{f.path}: metadata key {arch}.{name} is missing; the file is incomplete")
        if isinstance(value, list):
            raise GGUFError(f"{f.path}: {arch}.{name} differs per layer ({value[:4]} ...), which brisk's "
                            f"{arch} model does not support")
        return value

    num_heads = key("attention.head_count")
    head_dim = key("attention.key_length", 0)
    if not head_dim and arch in _PERMUTED_QK_ARCHS:
        head_dim = key("rope.dimension_count", 0)  # llama/mistral rotate the whole head
    vocab_size = key("vocab_size", None) or len(md.get("tokenizer.ggml.tokens", ()))
    if not vocab_size:
        raise GGUFError(f"{f.path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
    rope_scaling = None
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor", 1.0))}
        if (original := key("rope.scaling.original_context_length", None)) is not None:
            rope_scaling["original_max_position_embeddings"] = int(original)
    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md]
    extra: dict[str, Any] = {}
    if arch == "phi3":
        rope_scaling = phi3_rope_scaling(md, int(key("context_length", 2048)))
        extra = {"sliding_window": md.get("phi3.attention.sliding_window")}
    if arch == "smollm3":  # llama.cpp's: every 4th layer without RoPE (its files carry no key for it)
        extra = {"no_rope_layers": [int((i + 1) % _SMOLLM3_NO_ROPE_STEP != 0) for i in range(key("block_count"))]}
    if arch == "gemma3":
        from brisk.model.gemma import gemma_gguf_config_fields

        extra = gemma_gguf_config_fields(md, arch)
    moe = gguf_moe_config(md, arch, key("block_count"), lambda i: f"blk.{i}.ffn_gate_inp.weight" in f.tensors)
    if arch.endswith("moe") and not moe:
        raise GGUFError(f"{f.path}: metadata key {arch}.expert_count is missing; the file is incomplete")
    try:
        fields = dict(
            architecture=arch,
            vocab_size=int(vocab_size),
            hidden_size=key("embedding_length"),
            intermediate_size=key("feed_forward_length", 0) if moe else key("feed_forward_length"),
            num_hidden_layers=key("block_count"),
            num_attention_heads=num_heads,
            num_key_value_heads=key("attention.head_count_kv", num_heads),
            head_dim=int(head_dim),
            max_position_embeddings=key("context_length", 2048),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6 if arch == "qwen2" else 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings="output.weight" not in f.tensors,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in f.tensors,
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=list(dict.fromkeys(eos)),
            **extra,
        )
        return ModelConfig(**(fields | moe))  # mixture of experts (model/moe.py): architecture, expert counts, sizes
    except UnsupportedModelError as e:
        raise GGUFError(f"{f.path}: {e}") from None


def read_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """Just the tokenizer of a GGUF file (its metadata), without reading any weights."""
    f = read_gguf(path)
    return tokenizer_from_gguf_metadata(f.metadata, f.path)


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The model config from a GGUF file's metadata (reads the header only)."""
    return _config_from_gguf(read_gguf(path))


# ----------------------------------------------------------------------------------------- tensors

_LAYER_TENSORS = {  # llama.cpp name inside blk.{i} -> transformers name inside model.layers.{i}
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_BIASES = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
           "attn_v.bias": "self_attn.v_proj.bias"}


def _expected_tensors(c: ModelConfig, shared_gate_shape: tuple[int, ...] | None = None
                      ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """llama.cpp tensor name -> (transformers name, torch shape) for this config (model/moe.py names MoE layers'
    feed-forward tensors)."""
    h, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    out = {"token_embd.weight": ("model.embed_tokens.weight", (c.vocab_size, h)),
           "output_norm.weight": ("model.norm.weight", (h,))}
    if not c.tie_word_embeddings:
        out["output.weight"] = ("lm_head.weight", (c.vocab_size, h))
    shapes = {"attn_norm.weight": (h,), "attn_q.weight": (q, h), "attn_k.weight": (kv, h),
              "attn_v.weight": (kv, h), "attn_output.weight": (h, q), "ffn_norm.weight": (h,),
              "ffn_gate.weight": (c.intermediate_size, h), "ffn_up.weight": (c.intermediate_size, h),
              "ffn_down.weight": (h, c.intermediate_size),
              "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
              "attn_q_norm.weight": (c.head_dim,), "attn_k_norm.weight": (c.head_dim,)}
    names = _LAYER_TENSORS | (_BIASES if c.attention_bias else {}) | (_QK_NORMS if c.qk_norm else {})
    if c.is_gemma:
        from brisk.model.gemma import GGUF_LAYER_TENSORS

        names = names | GGUF_LAYER_TENSORS
        shapes |= {n: (h,) for n in GGUF_LAYER_TENSORS}
    for i in range(c.num_hidden_layers):
        moe = c.is_moe_layer(i)
        for gguf_name, hf_name in names.items():
            if not (moe and gguf_name.startswith(("ffn_gate.", "ffn_up.", "ffn_down."))):
                out[f"blk.{i}.{gguf_name}"] = (f"model.layers.{i}.{hf_name}", shapes[gguf_name])
        if moe:
            out |= gguf_moe_layer_tensors(c, i, shared_gate_shape)
    return out


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (its `permute()` in convert_hf_to_gguf.py).

    HF's rotate_half pairs dim i with i + d/2 of each head; ggml's RoPE pairs adjacent dims. So the converter
    reorders each head's rows from [x0 .. x(d/2-1) | y0 .. y(d/2-1)] to [x0 y0 x1 y1 ...]; this reverses it.
    """
    rest = w.shape[1:]
    # w: [n_heads * d, *rest] -> [n_heads, d/2, 2, *rest] -> [n_heads, 2, d/2, *rest]
    return w.reshape(n_heads, -1, 2, *rest).transpose(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------------------- loading

@dataclass
class GGUFCheckpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]  # transformers names, dequantized
    tokenizer: Tokenizer
    generation_config: dict[str, Any] = field(default_factory=dict)  # its general.sampling.* values, HF names
    mapped: list[torch.Tensor] = field(default_factory=list)  # the file's memory map the weights view (mapped.py)
    # keep_quantized: module name (transformers, without ".weight") -> its tensor repacked (model/gguf_repack.py),
    # and the GGUF type it came from; model/gguf_native.py turns them into quantized layers
    packed: dict[str, PackedWeight] = field(default_factory=dict)
    packed_types: dict[str, str] = field(default_factory=dict)
    # buffers the packed weights were written into in their final place (a huge-page arena): to_huge_pages skips them
    placed: list[torch.Tensor] = field(default_factory=list)
    # model/weights_cache.py: "hit" (the converted weights were mapped from the cache), "written" (this load wrote
    # its entry), None (not cached: off, or too little converted)
    cached: str | None = None


# ggml float types a tensor can be mapped from, when the model runs in that dtype
_FLOAT_TYPES = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
                GGMLQuantizationType.BF16: torch.bfloat16}


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, fuse: bool = False,
              mmap_weights: bool = True, progress: Callable[[int], None] | None = None,
              keep_quantized: bool = False, huge_pages: bool = False) -> GGUFCheckpoint:
    """Config, dequantized weights (transformers names, `dtype`) and tokenizer of a GGUF file.

    `mmap_weights`: float tensors stored in `dtype` (and needing no Q/K un-permutation) are views of the memory-
    mapped file. `fuse`: q/k/v and gate/up parts are dequantized into one buffer per layer (fuse.FusedBuffers), for
    fuse_projections to take without a copy. `progress(nbytes)`: after each tensor, its bytes in the file.
    `keep_quantized`: matrices of a type with a packed form (model/gguf_repack.py) are repacked, not
    dequantized, into `packed` (the file's own precision), each in one pass into its final layout (model/
    gguf_place.py: q/k/v and gate/up fused under the fused module's name when `fuse` is on, tiled where the
    model's kernels will read it tiled), and with `huge_pages` into one huge-page arena (`placed`)."""
    f = read_gguf(path)
    config = _config_from_gguf(f)
    expected = _expected_tensors(config, (info.shape if (info := f.tensors.get("blk.0.ffn_gate_inp_shexp.weight"))
                                          else None))
    missing = [n for n in expected if n not in f.tensors]
    if missing:
        raise GGUFError(f"{f.path}: missing tensor {missing[0]!r} ({expected[missing[0]][0]})"
                        + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                        + f"; a {config.architecture} model with these settings needs it")
    extra = [n for n in f.tensors if n not in expected]
    if extra:
        hint = (" (rope_freqs holds Llama-3.1-style RoPE frequency factors, which brisk does not support)"
                if "rope_freqs.weight" in extra else "")
        raise GGUFError(f"{f.path}: unexpected tensor(s) {', '.join(repr(n) for n in extra[:5])}"
                        + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
                        + f" that brisk's {config.architecture} model does not use{hint}; the file is probably "
                        "a different architecture or variant")
    for name, (_, shape) in expected.items():
        info = f.tensors[name]
        if info.shape != shape:
            raise GGUFError(f"{f.path}: tensor {name!r} has shape {info.shape}, expected {shape} "
                            "from the file's metadata")
        if info.qtype not in SUPPORTED_TYPES:
            raise GGUFError(f"{f.path}: tensor {name!r} has type {info.qtype.name}, which is not supported; "
                            f"supported types: {', '.join(t.name for t in SUPPORTED_TYPES)}")
    tokenizer = tokenizer_from_gguf_metadata(f.metadata, f.path)
    # what this load converts (repacked, fused, re-typed) is cached on disk: a later load maps it (weights_cache.py)
    cache = weights_cache.Settings.from_env()
    options = {"dtype": str(dtype), "fuse": fuse, "mmap": mmap_weights, "own_precision": keep_quantized}
    entry = weights_cache.key(f.path, options) if cache.folder is not None else None  # hashed once a load
    if (hit := weights_cache.lookup(cache, f.path, options, entry)) is not None:
        if progress is not None:
            progress(sum(info.n_bytes for info in f.tensors.values()))
        return GGUFCheckpoint(config, hit.tensors, tokenizer, generation_config_from_gguf_metadata(f.metadata),
                              mapped=hit.mapped, packed=hit.packed, packed_types=hit.packed_types, cached="hit")

    permuted = config.architecture in _PERMUTED_QK_ARCHS
    if config.is_gemma:
        from brisk.model.gemma import GGUF_NORM_SHIFT, is_gguf_norm
    to_pack = {name for name, (hf, shape) in expected.items()
               if keep_quantized and repackable_tensor(f.tensors[name].qtype, hf, shape)}
    from brisk.model import gguf_place

    in_place = gguf_place.placeable(to_pack, expected) if to_pack else set()
    packed, packed_types, placed = (gguf_place.place_packed(f, config, expected, in_place, fuse, huge_pages,
                                                            lambda name, rows: _row_perm(config, name, rows),
                                                            progress)
                                    if in_place else ({}, {}, []))
    if to_pack - in_place:  # stacked experts; every matrix where the C++ kernels are not built
        rest, rest_types = _repack_tensors(f, config, expected, to_pack - in_place)
        packed, packed_types = packed | rest, packed_types | rest_types
    # a float part whose layer also has packed parts is not fused (its siblings are quantized layers)
    unfused_layers = {hf.rsplit(".", 2)[0] for name, (hf, _) in expected.items() if name in to_pack}
    fused = FusedBuffers(config, dtype) if fuse else None
    base = mapped.map_file(f.path) if mmap_weights else None
    fh = open(f.path, "rb")  # noqa: SIM115 - closed below, after the loop
    tensors, used, trim = {}, False, _Trim()
    for name, (hf_name, shape) in expected.items():
        if name in to_pack:
            continue
        info = f.tensors[name]
        unpermute = permuted and (".attn_q." in name or ".attn_k." in name)
        shifted = config.is_gemma and is_gguf_norm(name)  # stored as 1 + w
        place = fused is not None and fused.takes(hf_name) and hf_name.rsplit(".", 2)[0] not in unfused_layers
        if (base is not None and _FLOAT_TYPES.get(info.qtype) == dtype and not unpermute and not shifted
                and not place and (w := mapped.view(base, info.offset, shape, dtype)) is not None):
            if ".mlp." in hf_name and config.is_moe:  # stacked experts, router: views too (model/moe.py)
                place_gguf_moe_tensor(tensors, hf_name, w, config.hidden_size)
            else:
                tensors[hf_name] = w  # stored as it runs: a view of the file
            used = True
            if progress is not None:
                progress(info.n_bytes)
            continue
        with _intra_op_threads(1 if np.prod(shape) < _PARALLEL_MIN_NUMEL else torch.get_num_threads()):
            if not shifted and not (".mlp." in hf_name and config.is_moe):
                # read with read(2) and dequantized a chunk of rows at a time into the final buffer (the fused
                # slot, or the tensor's own at `dtype`): no float32 copy of the tensor, no mapped pages
                slot = fused.slot(hf_name, shape) if place and fused is not None and not unpermute else None
                out = slot if slot is not None else torch.empty(shape, dtype=dtype)
                _dequantize_into(fh, info, out)
                trim.done(info.n_bytes)
                if unpermute:
                    heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
                    out = _unpermute_rows(out, heads)
                    out = fused.place(hf_name, out) if place and fused is not None else out
                tensors[hf_name] = out
                if progress is not None:
                    progress(info.n_bytes)
                continue
            w = dequantize(f.tensor_bytes(name), info.qtype, shape)
            if permuted and ".attn_q." in name:
                w = _unpermute_rows(w, config.num_attention_heads)
            elif permuted and ".attn_k." in name:
                w = _unpermute_rows(w, config.num_key_value_heads)
            elif shifted:
                w = w.float() - GGUF_NORM_SHIFT
            if ".mlp." in hf_name and config.is_moe:  # stacked experts, router (model/moe.py)
                place_gguf_moe_tensor(tensors, hf_name, w.to(dtype), config.hidden_size)
            else:
                tensors[hf_name] = fused.place(hf_name, w) if place and fused is not None else w.to(dtype)
        if progress is not None:
            progress(info.n_bytes)
    fh.close()
    written = weights_cache.store(cache, f.path, options, tensors, packed, packed_types, base if used else None,
                                  entry)
    return GGUFCheckpoint(config, tensors, tokenizer, generation_config_from_gguf_metadata(f.metadata),
                          mapped=[base] if used and base is not None else [], packed=packed,
                          packed_types=packed_types, placed=placed, cached="written" if written else None)


def _repack_tensors(f: GGUFFile, config: ModelConfig, expected: dict[str, tuple[str, tuple[int, ...]]],
                    names: set[str]) -> tuple[dict[str, PackedWeight], dict[str, str]]:
    """Repack the named tensors one at a time into the blocked layout (the loader fuses and tiles them after), each
    read with read(2) (page cache, not this process's resident set) into a transient buffer; Q/K rows take
    llama.cpp's permutation back as they are repacked."""
    packed, types = {}, {}
    trim = _Trim()
    with open(f.path, "rb") as fh:
        for name in (n for n in expected if n in names):
            hf_name, shape = expected[name]
            info = f.tensors[name]
            perm = _row_perm(config, name, shape[0])
            raw = mapped.read_tensor(fh, info.offset, (info.n_bytes,), torch.uint8)
            module = hf_name.removesuffix(".weight")
            # stacked experts [E, N, K] (model/moe.py): one packed weight per expert, from its run of bytes
            parts = ([(module.replace("*", str(j)), raw.view(shape[0], -1)[j], shape[1:]) for j in range(shape[0])]
                     if "*" in module else [(module, raw, shape)])
            for part, part_raw, part_shape in parts:
                try:
                    packed[part] = repack(part_raw, info.qtype, part_shape, rows_perm=perm)
                except GGUFError as e:
                    raise GGUFError(f"{f.path}: tensor {name!r}: {e}") from None
                types[part] = info.qtype.name
            del raw
            trim.done(info.n_bytes)
    return packed, types


def _row_perm(config: ModelConfig, name: str, rows: int) -> torch.Tensor | None:
    """The row order that undoes llama.cpp's Q/K permutation of GGUF tensor `name` (out row i = stored row
    perm[i]), or None where there is none."""
    if config.architecture not in _PERMUTED_QK_ARCHS or not (".attn_q." in name or ".attn_k." in name):
        return None
    heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
    return _unpermute_rows(torch.arange(rows), heads)


_CHUNK_BYTES = 1 << 24  # raw bytes read and dequantized at a time


class _Trim:
    """Free heap pages back to the kernel every `every` bytes of tensors converted: the chunks' temporaries sit
    between the final buffers, and glibc keeps their pages resident otherwise (model/hugepages.py)."""

    def __init__(self, every: int = 32 << 20) -> None:
        self.every, self.since = every, 0

    def done(self, nbytes: int) -> None:
        self.since += nbytes
        if self.since >= self.every:
            from brisk.model.hugepages import release_free_memory

            release_free_memory()
            self.since = 0


def _dequantize_into(fh: BinaryIO, info: GGUFTensorInfo, out: torch.Tensor) -> None:
    """Tensor `info` of the open file, dequantized into `out` (contiguous, its shape; any float dtype) a chunk of
    rows at a time: the same values as `dequantize(...).to(out.dtype)` (ggml blocks never straddle rows)."""
    shape = info.shape
    if _FLOAT_TYPES.get(info.qtype) == out.dtype:  # stored as it runs: read(2) straight into the buffer
        mapped.read_tensor(fh, info.offset, tuple(shape), out.dtype, out=out)
        return
    rows = shape[0] if len(shape) > 1 else 1
    row_bytes = info.n_bytes // rows
    step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
    flat = out.view(rows, -1)
    # float16 -> bfloat16 (an F16 file run in bfloat16): one pass by the C++ kernel from a read buffer used for every
    # chunk, the same values as through float32 (ATen's direct copy is scalar; the float32 way is two passes)
    f16_to_bf16 = info.qtype == GGMLQuantizationType.F16 and out.dtype == torch.bfloat16
    convert = get_op("half_to_bfloat16") if f16_to_bf16 else None
    buf = torch.empty(min(rows, step) * row_bytes, dtype=torch.uint8) if convert is not None else None
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if convert is not None and buf is not None:
            raw = mapped.read_tensor(fh, info.offset + r0 * row_bytes, ((r1 - r0) * row_bytes,), torch.uint8,
                                     out=buf[:(r1 - r0) * row_bytes])
            convert(raw.view(torch.float16), flat[r0:r1])
            continue
        raw = mapped.read_tensor(fh, info.offset + r0 * row_bytes, ((r1 - r0) * row_bytes,), torch.uint8)
        part = (r1 - r0, *shape[1:]) if len(shape) > 1 else shape
        flat[r0:r1].copy_(dequantize(raw, info.qtype, part).view(r1 - r0, -1))


# Dequantizing one tensor is ~10 elementwise ops. Below this size each op is short enough that the intra-op
# threads' end-of-op barrier dominates: on the 2-core machine with one core busy elsewhere every barrier waits
# for a scheduler slice, and loading SmolLM2-135M took 3-16 s with 2 threads against 1.3 s with 1.
_PARALLEL_MIN_NUMEL = 1 << 24


@contextmanager
def _intra_op_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    if n != previous:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != previous:
            torch.set_num_threads(previous)
