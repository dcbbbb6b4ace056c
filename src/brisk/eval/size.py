"""How big a model is, by tensor kind: parameters, bytes and bytes per parameter.

Sources, read without loading or dequantizing any weights:
- a GGUF file: the tensor directory of its header (`brisk.model.gguf.read_gguf`);
- a Hugging Face / brisk safetensors folder (or one .safetensors file): each file's JSON header;
- a loaded model (`LoadedModel`): its state dict as it sits in memory (a GGUF model is dequantized there).

Bytes are split in two:
- payload: the values themselves. For a float tensor that is all of it. For a quantized one it is the
  codes: a brisk module's packed `qweight` (`packed_data` once loaded), or the q-bits of a GGML block
  (Q8_0 = 32 of its 34 bytes per 32 values, Q4_1 = 16 of 20).
- overhead: what the codes need to be decoded: a brisk module's `scales` and `qzeros` (once loaded: float32
  scales and mins), a SqueezeLLM module's per-row tables (`lut`), a GGML block's scales and minimums.
  Other GGML block formats (IQ*, TQ*, ...) are counted as payload only.
- a SqueezeLLM module's outliers (its sparse float part: `outlier_values`, `outlier_cols`, `outlier_row_ptr`)
  are weights kept aside, so they count as payload, their column indices and row pointers included.

Parameters are logical weights: a brisk quantized module with `qweight` [N, K * bits / 8] counts N * K.
The count comes from `in_features` / `out_features` (the loaded module's, or its config entry's when it
records them), else from the packed size and the module's bits in the checkpoint's `quantization_config`
(schema in brisk/quant/config.py: run defaults `bits`, `group_size`, `sym`, `scheme`, and a `modules` map
of module name -> its own settings). Quantized rows are labelled as brisk names the setting: int4-g64-asym,
int8-ch-sym, nf4-g64.

Kinds group tensors by role: embedding, attention (q/k/v/o and their biases), mlp (gate/up/down),
lm_head, norms, other. A tied lm_head is not stored, so it has no row.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich import box
from rich.console import Console
from rich.table import Table

from brisk.model.loader import LoadedModel, resolve_model
from brisk.quant.config import LayerQuant, QuantConfigError

KINDS = ("embedding", "attention", "mlp", "lm_head", "norms", "other")
# a quantized module's tensors: the checkpoint's (and QuantEmbedding's) qweight / scales / qzeros, and a
# loaded QuantLinear's runtime buffers (ops/qlinear.py PackedWeight: data, scales, zeros, codebook)
_PAYLOAD_SUFFIXES = ("qweight", "packed_data")
_OVERHEAD_SUFFIXES = ("scales", "qzeros", "packed_scales", "packed_zeros", "packed_codebook", "lut", "packed_lut")
# SqueezeLLM's outliers (quant/checkpoint.py, ops/layers.py LutLinear): a CSR matrix counted with the codes
_SPARSE_SUFFIXES = ("outlier_values", "outlier_cols", "outlier_row_ptr")

# checked in order: "attn_norm" is a norm, "output_norm" is not the lm_head
_KIND_PATTERNS = [
    ("embedding", re.compile(r"embed_tokens|token_embd|(^|\.)wte\.")),
    ("norms", re.compile(r"norm")),
    ("lm_head", re.compile(r"(^|\.)lm_head\.|^output\.")),
    ("attention", re.compile(r"self_attn\.|(^|\.)attn_|(^|\.)(q|k|v|o|qkv)_proj")),
    ("mlp", re.compile(r"(^|\.)mlp\.|(^|\.)ffn_|(^|\.)(gate|up|down|gate_up)_proj")),
]

# q-bits per value of the GGML "Q" block formats; the rest of each block is scales / minimums
_GGML_CODE_BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q8_1": 8,
                   "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q8_K": 8}

# safetensors header dtype -> the name torch gives it (bytes come from each entry's data_offsets)
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
              "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


class SizeError(ValueError):
    """A checkpoint whose size cannot be worked out (unreadable header, quantized tensor of unknown bits)."""


@dataclass
class TensorSize:
    """One stored tensor, or one quantized linear (its qweight + scales + qzeros) under the linear's name."""

    name: str
    kind: str
    dtype: str  # storage: "float16", "Q4_1", "4-bit g64", ...
    params: int
    payload_bytes: int
    overhead_bytes: int = 0


@dataclass
class KindSize:
    kind: str
    num_tensors: int = 0
    params: int = 0
    payload_bytes: int = 0
    overhead_bytes: int = 0
    dtypes: list[str] = field(default_factory=list)  # storage types seen, most bytes first

    @property
    def bytes(self) -> int:
        return self.payload_bytes + self.overhead_bytes

    @property
    def payload_bytes_per_param(self) -> float:
        return self.payload_bytes / self.params if self.params else float("nan")

    @property
    def overhead_bytes_per_param(self) -> float:
        return self.overhead_bytes / self.params if self.params else float("nan")

    @property
    def bytes_per_param(self) -> float:
        return self.bytes / self.params if self.params else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes": self.bytes,
                "payload_bytes_per_param": self.payload_bytes_per_param,
                "overhead_bytes_per_param": self.overhead_bytes_per_param,
                "bytes_per_param": self.bytes_per_param}


@dataclass
class SizeReport:
    source: str  # file or folder, or the loaded model's name
    format: str  # "gguf" | "safetensors" | "loaded"
    tensors: list[TensorSize]
    file_bytes: int | None = None  # on disk, headers and metadata (e.g. a GGUF's tokenizer) included

    def __post_init__(self) -> None:
        self.kinds = summarize(self.tensors)
        self.total = _sum_kinds("total", self.tensors)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "format": self.format, "file_bytes": self.file_bytes,
                "total": self.total.to_dict(), "kinds": {k: v.to_dict() for k, v in self.kinds.items()},
                "tensors": [asdict(t) for t in self.tensors]}


def tensor_kind(name: str) -> str:
    """The role of a tensor from its name (transformers, GGUF, or brisk's fused qkv_proj / gate_up_proj)."""
    lowered = name.lower()
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(lowered):
            return kind
    return "other"


def summarize(tensors: Iterable[TensorSize]) -> dict[str, KindSize]:
    """Per-kind totals, in KINDS order, kinds with no tensors left out."""
    by_kind: dict[str, list[TensorSize]] = {}
    for t in tensors:
        by_kind.setdefault(t.kind, []).append(t)
    return {k: _sum_kinds(k, by_kind[k]) for k in KINDS if k in by_kind}


def _sum_kinds(kind: str, tensors: list[TensorSize]) -> KindSize:
    out = KindSize(kind)
    dtype_bytes: dict[str, int] = {}
    for t in tensors:
        out.num_tensors += 1
        out.params += t.params
        out.payload_bytes += t.payload_bytes
        out.overhead_bytes += t.overhead_bytes
        dtype_bytes[t.dtype] = dtype_bytes.get(t.dtype, 0) + t.payload_bytes + t.overhead_bytes
    out.dtypes = sorted(dtype_bytes, key=lambda d: -dtype_bytes[d])
    return out


# ---------------------------------------------------------------------------------------------- sources

def model_size(model: str | Path | LoadedModel | None) -> SizeReport:
    """Size report of a checkpoint on disk (path, model name, None = default model) or of a loaded model."""
    if isinstance(model, LoadedModel):
        return _loaded_size(model)
    path = resolve_model(model)
    if path.is_dir():
        return _safetensors_size(path, _weight_files(path), _read_quant_config(path))
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return _gguf_size(path)
    if path.suffix == ".safetensors":
        return _safetensors_size(path, [path], _read_quant_config(path.parent))
    raise SizeError(f"{path} is neither a GGUF file, a .safetensors file nor a model folder")


def _gguf_size(path: Path) -> SizeReport:
    from brisk.model.gguf import read_gguf

    f = read_gguf(path)
    try:
        out = []
        for name, info in f.tensors.items():
            params = math.prod(info.shape)
            bits = _GGML_CODE_BITS.get(info.qtype.name)  # read_gguf checked that rows are whole blocks
            payload = info.n_bytes if bits is None else params * bits // 8
            out.append(TensorSize(name, tensor_kind(name), info.qtype.name, params, payload,
                                  info.n_bytes - payload))
    finally:
        f.buffer.close()
    return SizeReport(str(path), "gguf", out, path.stat().st_size)


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        return [folder / name for name in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SizeError(f"{folder} holds no .safetensors files; pass a model folder, a .gguf or a "
                        ".safetensors file")
    return files


def _read_quant_config(folder: Path) -> dict[str, Any]:
    config = folder / "config.json"
    if not config.is_file():
        return {}
    return json.loads(config.read_text(encoding="utf-8")).get("quantization_config") or {}


def read_safetensors_header(file: Path) -> dict[str, dict[str, Any]]:
    """name -> {"dtype", "shape", "data_offsets"} from a safetensors file's header, reading no tensor data.

    Layout: | header length N (u64 little-endian) | N bytes of JSON | tensor data |.
    """
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise SizeError(f"{file} is not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > file.stat().st_size - 8:
            raise SizeError(f"{file}: header length {n} runs past the end of the file; the file is "
                            "truncated or corrupt")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SizeError(f"{file}: the safetensors header is not valid JSON ({e})") from e
    header.pop("__metadata__", None)
    return header


@dataclass
class _Stored:
    """One stored tensor: what the report needs of it."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _safetensors_size(source: Path, files: list[Path], qcfg: dict[str, Any]) -> SizeReport:
    stored: dict[str, _Stored] = {}
    for file in files:
        for name, entry in read_safetensors_header(file).items():
            dtype = _ST_DTYPES.get(entry["dtype"], entry["dtype"].lower())
            start, end = entry["data_offsets"]
            stored[name] = _Stored(dtype, tuple(entry["shape"]), end - start)
    return SizeReport(str(source), "safetensors", _group(stored, qcfg), sum(f.stat().st_size for f in files))


def _loaded_size(loaded: LoadedModel) -> SizeReport:
    stored: dict[str, _Stored] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    # the state dict has persistent buffers (a quantized linear's qweight / scales) besides parameters;
    # a tied lm_head shares the embedding's storage and is counted once, as on disk
    for name, t in loaded.model.state_dict(keep_vars=True).items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        dtype = str(t.dtype).removeprefix("torch.")
        stored[name] = _Stored(dtype, tuple(t.shape), t.numel() * t.element_size())
    modules = dict(loaded.model.named_modules())
    qcfg = _read_quant_config(loaded.path) if loaded.path.is_dir() else {}
    return SizeReport(loaded.name, "loaded", _group(stored, qcfg, modules))


def _group(stored: dict[str, _Stored], qcfg: dict[str, Any],
           modules: dict[str, torch.nn.Module] | None = None) -> list[TensorSize]:
    """Stored tensors -> TensorSize rows, each quantized module's codes and scales folded into one row."""
    out = []
    for name, s in stored.items():
        module, _, suffix = name.rpartition(".")
        if suffix in _PAYLOAD_SUFFIXES:
            out.append(_quantized_module(module, suffix, stored, qcfg, (modules or {}).get(module)))
        elif not (suffix in _OVERHEAD_SUFFIXES + _SPARSE_SUFFIXES
                  and any(f"{module}.{p}" in stored for p in _PAYLOAD_SUFFIXES)):
            out.append(TensorSize(name, tensor_kind(name), s.dtype, math.prod(s.shape), s.nbytes))
    return out


def _quantized_module(module: str, payload_suffix: str, stored: dict[str, _Stored], qcfg: dict[str, Any],
                      mod: torch.nn.Module | None) -> TensorSize:
    """One quantized module: codes as payload, scales / zeros / mins / codebook as overhead, N * K params."""
    payload = stored[f"{module}.{payload_suffix}"]  # codes: [N, K * bits / 8] uint8 (or a blocked layout)
    overhead = sum(stored[f"{module}.{s}"].nbytes for s in _OVERHEAD_SUFFIXES if f"{module}.{s}" in stored)
    sparse = sum(stored[f"{module}.{s}"].nbytes for s in _SPARSE_SUFFIXES if f"{module}.{s}" in stored)
    defaults = {k: v for k, v in qcfg.items() if k != "modules"}
    entry = {**defaults, **(qcfg.get("modules") or {}).get(module, {})}
    spec = getattr(mod, "spec", None)  # a loaded QuantLinear / QuantEmbedding's LayerQuant
    bits = entry.get("bits", getattr(spec, "bits", None))
    if "in_features" in entry and "out_features" in entry:
        params = int(entry["in_features"]) * int(entry["out_features"])
    elif hasattr(mod, "in_features") and hasattr(mod, "out_features"):
        params = int(mod.in_features) * int(mod.out_features)
    elif hasattr(mod, "num_embeddings") and hasattr(mod, "embedding_dim"):
        params = int(mod.num_embeddings) * int(mod.embedding_dim)
    elif bits is not None:
        if (payload.nbytes * 8) % int(bits):
            raise SizeError(f"{module}.{payload_suffix} holds {payload.nbytes} bytes, not a whole number of "
                            f"{bits}-bit values")
        params = payload.nbytes * 8 // int(bits)
    else:
        raise SizeError(f"{module} is quantized (it has a {payload_suffix}) but neither its bits nor its "
                        "in/out features are recorded; its config.json needs a quantization_config with "
                        "'bits' (or per-module 'in_features' / 'out_features')")
    label = _quant_label(module, entry, spec, params, payload, stored) + (" + outliers" if sparse else "")
    return TensorSize(module, tensor_kind(module + ".weight"), label, params, payload.nbytes + sparse, overhead)


def _quant_label(module: str, entry: dict[str, Any], spec: Any, params: int, payload: _Stored,
                 stored: dict[str, _Stored]) -> str:
    """The module's format as brisk's LayerQuant names it (int4-g64-asym, nf4-g64, int8-ch-sym) when known."""
    if spec is not None and hasattr(spec, "label"):
        return str(spec.label)
    if all(k in entry for k in ("bits", "group_size", "sym")):
        try:
            return LayerQuant(bits=entry["bits"], group_size=entry["group_size"], sym=entry["sym"],
                              scheme=entry.get("scheme", "int")).label
        except QuantConfigError:
            pass  # not a setting brisk writes: describe it from the tensors below
    bits = entry.get("bits")
    label = f"{bits if bits is not None else round(payload.nbytes * 8 / params, 3)}-bit"
    scales = stored.get(f"{module}.scales") or stored.get(f"{module}.packed_scales")
    if scales is not None and len(scales.shape) == 2 and scales.shape[1] and payload.shape:
        # scales: [N, K / G]  ->  G = K / (K / G), with K = params / N
        label += f" g{params // payload.shape[0] // scales.shape[1]}"
    return label


# ---------------------------------------------------------------------------------------------- printing

def size_table(report: SizeReport) -> Table:
    """One row per kind and a total: parameters, payload and overhead bytes, and bytes per parameter."""
    title = f"{report.source} ({report.format})"
    if report.file_bytes is not None:
        title += f", {format_bytes(report.file_bytes)} on disk"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, caption_justify="left",
                  caption="B/param: bytes per parameter; overhead: scales, zero points, block minimums, tables")
    headers = ("kind", "params", "payload", "overhead", "total", "payload\nB/param", "overhead\nB/param",
               "total\nB/param", "storage")
    for header in headers:
        table.add_column(header, justify="left" if header in ("kind", "storage") else "right", no_wrap=True)
    kinds = list(report.kinds.values())
    for i, k in enumerate([*kinds, report.total]):
        table.add_row(k.kind, format_count(k.params), format_bytes(k.payload_bytes),
                      format_bytes(k.overhead_bytes), format_bytes(k.bytes),
                      f"{k.payload_bytes_per_param:.4f}", f"{k.overhead_bytes_per_param:.4f}",
                      f"{k.bytes_per_param:.4f}", ", ".join(k.dtypes),
                      end_section=i == len(kinds) - 1)  # a rule above the total
    return table


def print_size_report(report: SizeReport, console: Console | None = None) -> None:
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 132)  # a file or a pipe has no width to fit; rich assumes 80
    console.print(size_table(report))


def format_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
