"""`brisk bench compare`: brisk against llama.cpp on the same GGUF weights, at each matched precision.

Precision pairs (brisk setting <-> llama.cpp file type):

    f32   brisk float32                             <-> F32  (the GGUF re-typed: model/gguf_convert.py)
    f16   brisk bfloat16 (16-bit weights)           <-> F16
    q8_0  brisk RTN int8, per channel, symmetric    <-> Q8_0 (32-weight blocks)
    q4_1  brisk RTN int4, 32-weight groups, zero pt <-> Q4_1 (the default model's own file)

Both engines load the same weights (the source GGUF re-typed to each llama.cpp type; at Q8_0 / Q4_1 brisk
loads that very file and keeps its codes, or with `--brisk-weights rtn` quantizes the source itself) and run
with the same number of threads. Each run of each engine is a child process that loads, warms up and measures,
alternated brisk, llama.cpp, brisk, ... (bench/compare_child.py: one model in memory at a time, a killed child
reported instead of the whole benchmark dying); best of `runs`: a stray process only ever slows a run.

`baselines` adds ONNX Runtime (bench/onnx_baseline.py) on the f32 row: the same F32 file, loaded by brisk in
float32 and exported to one ONNX graph with the KV cache as inputs and outputs, run by onnxruntime's CPU provider
with the same threads. It has float weights only, so the other rows have no onnxruntime figures.
"""

from __future__ import annotations

import functools
import gc
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from brisk.bench.compare_child import EngineRun
from brisk.quant.config import LayerQuant

FILE = "file"
# name -> (brisk dtype, brisk RTN setting or None, llama.cpp GGUF type); the dtype is that of an RTN row's
# activations, a "gguf"-weights int row loads the llama.cpp file itself at --dtype auto (its own codes)
PRECISIONS: dict[str, tuple[str, LayerQuant | None, str]] = {
    "f32": ("float32", None, "f32"),
    "f16": ("bfloat16", None, "f16"),
    "q8_0": ("float32", LayerQuant(bits=8, group_size=-1, sym=True), "q8_0"),
    "q4_1": ("float32", LayerQuant(bits=4, group_size=32, sym=False), "q4_1"),
    "file": ("auto", None, FILE),  # the --model file as it is (any type), both engines on its own codes
}
BRISK_LABELS = {"f32": "float32", "f16": "bfloat16", "q8_0": "int8 (per channel)", "q4_1": "int4 g32 asym",
                "file": "the file's own codes (--dtype auto)"}
GGUF_LABELS = {"q8_0": "int8 g32 (the Q8_0 codes)", "q4_1": "int4 g32 + min (the Q4_1 codes)"}
BRISK_WEIGHTS = ("gguf", "rtn")  # int rows: the llama.cpp file's own codes, or brisk's RTN of the source
# --baselines name -> (CompareRow attribute, label); onnxruntime runs on the f32 row only (float weights)
BASELINES = {"llamacpp": ("llama_cpp", "llama.cpp"), "onnxruntime": ("onnxruntime", "onnxruntime")}
ONNX_PRECISION = "f32"


@dataclass
class EngineFigures:
    """Best of an engine's runs (each run a child process: its load, a warm-up, prefill and every batch size)."""

    prefill_s: float | None = None
    decode_tok_s: dict[int, float] = field(default_factory=dict)  # batch size -> decode tokens/s
    greedy_b1: list[int] = field(default_factory=list)
    load_s: float | None = None  # wall seconds from the file to an engine ready to run (best run)
    # brisk: the best load that converted the file (None: every run mapped its weights from the cache), and whether
    # any run mapped them (model/weights_cache.py: a file's first load converts and writes it, the next ones map it)
    load_converting_s: float | None = None
    weights_cache_hit: bool = False
    rss_bytes: int | None = None  # resident memory the load and warm-up added to the engine's process
    peak_rss_load_bytes: int | None = None  # the process's peak during the load, above its RSS before it
    peak_rss_bytes: int | None = None  # the process's peak from the load on, interpreter and libraries included
    runs: int = 0  # runs that finished
    error: str | None = None  # why a run did not finish (the engine's child was killed, crashed or raised)

    def add(self, run: EngineRun) -> None:
        """Fold in one run: best times and rates (a stray process only ever slows a run), largest memory."""
        self.prefill_s = min(self.prefill_s or run.prefill_s, run.prefill_s)
        self.load_s = min(self.load_s or run.load_s, run.load_s)
        if run.weights_cache_hit:
            self.weights_cache_hit = True
        else:
            self.load_converting_s = min(self.load_converting_s or run.load_s, run.load_s)
        for b, rate in run.decode_tok_s.items():
            self.decode_tok_s[b] = max(self.decode_tok_s.get(b, 0.0), rate)
        self.greedy_b1 = run.greedy_b1 or self.greedy_b1
        self.rss_bytes = max(self.rss_bytes or 0, run.rss_bytes)
        self.peak_rss_load_bytes = max(self.peak_rss_load_bytes or 0, run.peak_rss_load_bytes)
        self.peak_rss_bytes = max(self.peak_rss_bytes or 0, run.peak_rss_bytes)
        self.runs += 1


@dataclass
class CompareRow:
    precision: str
    brisk_setting: str
    brisk: EngineFigures
    llama_cpp: EngineFigures
    weight_bytes_per_token: float | None = None  # weights one batch-1 step reads at this precision
    membw_gbps: float | None = None  # the machine's measured read bandwidth
    onnxruntime: EngineFigures | None = None  # the onnxruntime baseline (f32 row, when asked for)

    def baseline(self, attr: str) -> EngineFigures | None:
        return getattr(self, attr)

    def ratio(self, batch: int | None, other: str = "llama_cpp") -> float | None:
        """brisk / `other` decode rate at `batch`, or `other` / brisk prefill time (batch None)."""
        theirs = self.baseline(other)
        if theirs is None:
            return None
        if batch is None:
            a, b = self.brisk.prefill_s, theirs.prefill_s
            return b / a if a and b else None
        a, b = self.brisk.decode_tok_s.get(batch), theirs.decode_tok_s.get(batch)
        return a / b if a and b else None

    def achieved_gbps(self, figures: EngineFigures) -> float | None:
        """Batch-1 weight bytes read per second: weight bytes per token x decode tokens/s."""
        rate = figures.decode_tok_s.get(1)
        return self.weight_bytes_per_token * rate / 1e9 if rate and self.weight_bytes_per_token else None

    def bandwidth_fraction(self, figures: EngineFigures) -> float | None:
        """achieved_gbps as a fraction of the measured read bandwidth (the batch-1 limit)."""
        gbps = self.achieved_gbps(figures)
        return gbps / self.membw_gbps if gbps and self.membw_gbps else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        batches = sorted(set(self.brisk.decode_tok_s) | set(self.llama_cpp.decode_tok_s))
        d["ratios"] = {"prefill": self.ratio(None), **{f"decode_b{b}": self.ratio(b) for b in batches}}
        d["batch1_gbps"] = {"brisk": self.achieved_gbps(self.brisk), "llama_cpp": self.achieved_gbps(self.llama_cpp)}
        d["batch1_bandwidth_fraction"] = {"brisk": self.bandwidth_fraction(self.brisk),
                                          "llama_cpp": self.bandwidth_fraction(self.llama_cpp)}
        if self.onnxruntime is not None:
            d["ratios_onnxruntime"] = {"prefill": self.ratio(None, "onnxruntime"),
                                       **{f"decode_b{b}": self.ratio(b, "onnxruntime") for b in batches}}
            d["batch1_gbps"]["onnxruntime"] = self.achieved_gbps(self.onnxruntime)
            d["batch1_bandwidth_fraction"]["onnxruntime"] = self.bandwidth_fraction(self.onnxruntime)
        return d


def _source_type(source: Path):  # noqa: ANN202 - gguf.LlamaFileType | None
    from gguf import GGUFReader, LlamaFileType

    field_ = GGUFReader(source).fields.get("general.file_type")
    return LlamaFileType(int(field_.contents())) if field_ is not None else None


def check_baselines(source: Path, precisions: list[str], baselines: list[str]) -> None:
    """ValueError, before any work, for an unknown baseline, or onnxruntime without the f32 row or with a model
    the ONNX export does not support; OnnxRuntimeMissingError when onnxruntime is asked for but not installed."""
    unknown = [b for b in baselines if b not in BASELINES]
    if unknown or not baselines:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(BASELINES)}")
    if "onnxruntime" in baselines:
        from brisk.bench.onnx_baseline import check_exportable, require_onnxruntime
        from brisk.model.gguf import read_gguf_config

        require_onnxruntime()
        if ONNX_PRECISION not in precisions:
            raise ValueError(f"the onnxruntime baseline runs float32 weights, on the {ONNX_PRECISION} row: add "
                             f"{ONNX_PRECISION} to --precisions")
        check_exportable(read_gguf_config(source))


def check_precisions(source: Path, precisions: list[str], files: dict[str, Path] | None = None) -> None:
    """ValueError, before any work, for a precision that is unknown or that brisk cannot write from `source`
    (a type in `files` is already written)."""
    from brisk.model.gguf_convert import OUT_TYPES

    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise ValueError(f"unknown precision(s) {', '.join(unknown)}; choose from {', '.join(PRECISIONS)}")
    if not precisions:
        raise ValueError(f"--precisions is empty; choose from {', '.join(PRECISIONS)}")
    file_type = _source_type(source)
    for name in precisions:
        gguf_type = PRECISIONS[name][2]
        if gguf_type == FILE or gguf_type in (files or {}):
            continue
        if gguf_type not in OUT_TYPES and not (file_type is not None and file_type.name.lower().endswith(gguf_type)):
            raise ValueError(f"the source GGUF is {file_type.name if file_type else 'of unknown type'}; brisk can "
                             f"write {', '.join(OUT_TYPES)} but not {gguf_type}: drop {gguf_type} from --precisions "
                             f"or pass a {gguf_type.upper()} GGUF as --model")


def gguf_for(source: Path, gguf_type: str, workdir: Path, log: Callable[[str], None],
             files: dict[str, Path] | None = None) -> Path:
    """The llama.cpp file at `gguf_type`: one of `files` (already written at that type), the source itself when
    it already is, else a re-typed copy."""
    from brisk.model.gguf_convert import retype_gguf

    if gguf_type in (files or {}):
        return files[gguf_type]
    file_type = _source_type(source)
    if gguf_type == FILE or (file_type is not None and file_type.name.lower().endswith(gguf_type)):
        return source
    out = workdir / f"{source.stem}.{gguf_type}.gguf"
    log(f"{gguf_type}: writing the llama.cpp file {out.name} ...")
    return retype_gguf(source, out, gguf_type)


def run_compare(source: Path, precisions: list[str], prompt_ids: list[int], prefill_ids: list[int],
                batch_sizes: list[int], output_len: int, runs: int, threads: int,
                log: Callable[[str], None] = print, workdir: Path | None = None,
                kv_cache_dtype: str = "auto", quant_activations: str = "auto",
                prepack_weights: str = "auto", brisk_weights: str = "gguf", membw_gbps: float | None = None,
                on_update: Callable[[list[CompareRow]], None] | None = None,
                baselines: tuple[str, ...] = ("llamacpp",),
                files: dict[str, Path] | None = None) -> list[CompareRow]:
    """One CompareRow per precision; `prompt_ids` is the decode prompt (batch b uses b rotated copies).
    `kv_cache_dtype` and `quant_activations` are brisk's (llama.cpp keeps its defaults: an f16 cache, and
    activations rounded to 8 bits for its quantized dot products). `brisk_weights` picks the int rows' weights:
    "gguf" = the llama.cpp file itself (brisk keeps its codes), "rtn" = brisk's RTN of the source.

    Every run of every engine is a child process of its own (bench/compare_child.py), alternated brisk,
    llama.cpp, brisk, ...: only one model is in memory at a time, and a child that the kernel kills is reported
    (in the row's `error` and through `log`) while the other rows still run. `on_update` gets the rows after
    every run, so a caller can write what is measured so far.

    `baselines` names the engines brisk is run against (BASELINES): llamacpp on every row, onnxruntime on the f32
    row (its graph exported once per model and cached: bench/onnx_baseline.py). `files` maps a llama.cpp type to
    a file of that type already written (a shape's random codes: bench/shape_gguf.py), used instead of a re-typed
    copy of the source; the source then only gives the shape and tokenizer, and the RTN rows still quantize it."""
    from brisk.bench.compare_child import EngineChildError, EngineJob, run_in_child
    from brisk.bench.llamacpp import require_llama_cpp

    check_baselines(source, precisions, list(baselines))
    if "llamacpp" in baselines:
        require_llama_cpp()
    check_precisions(source, precisions, files)  # every one of them, before the first is measured
    if brisk_weights not in BRISK_WEIGHTS:
        raise ValueError(f"--brisk-weights must be one of {', '.join(BRISK_WEIGHTS)}, got {brisk_weights!r}")
    if runs < 1 or output_len < 2:
        raise ValueError(f"--runs must be >= 1 and --output-len >= 2, got {runs} and {output_len}")
    seq_len = max(len(prompt_ids) + output_len, len(prefill_ids)) + 16
    rows: list[CompareRow] = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for name in precisions:
            dtype, setting, gguf_type = PRECISIONS[name]
            rtn = setting is not None and brisk_weights == "rtn"
            row = CompareRow(name, BRISK_LABELS[name] if rtn or setting is None else GGUF_LABELS[name],
                             EngineFigures(), EngineFigures(), weight_bytes_per_token(source, name), membw_gbps,
                             EngineFigures() if "onnxruntime" in baselines and name == ONNX_PRECISION else None)
            rows.append(row)
            try:
                gguf_path = gguf_for(source, gguf_type, Path(tmp), log, files)
                brisk_path = str(gguf_path)
                if rtn:
                    brisk_path = str(Path(tmp) / f"brisk-{name}")
                    log(f"{name}: quantizing brisk's {BRISK_LABELS[name]} checkpoint ...")
                    _build_checkpoint_in_child(setting, Path(brisk_path), str(source))
                elif setting is not None:
                    dtype = "auto"  # the file's own Q8_0 / Q4_1 codes
            except (EngineChildError, OSError, ValueError) as e:
                row.brisk.error = row.llama_cpp.error = f"{type(e).__name__}: {e}"
                if row.onnxruntime is not None:
                    row.onnxruntime.error = row.brisk.error
                log(f"{name}: [red]skipped[/red]: {e}")
                continue
            onnx_path = ""
            if row.onnxruntime is not None:
                try:
                    onnx_path = str(_export_onnx_in_child(gguf_path, log))
                except EngineChildError as e:
                    row.onnxruntime.error = str(e)
                    log(f"{name}: onnxruntime [red]skipped[/red]: {e}")
            common = dict(prompt_ids=prompt_ids, prefill_ids=prefill_ids, batch_sizes=batch_sizes,
                          output_len=output_len, threads=threads, seq_len=seq_len)
            jobs = {"brisk": EngineJob("brisk", brisk_path, dtype, **common,
                                       kv_cache_memory=_kv_bytes(source, max(batch_sizes), seq_len),
                                       kv_cache_dtype=kv_cache_dtype, quant_activations=quant_activations,
                                       prepack_weights=prepack_weights),
                    "llama.cpp": EngineJob("llama.cpp", str(gguf_path), "", **common),
                    "onnxruntime": EngineJob("onnxruntime", onnx_path, "float32", **common)}
            engines = [("brisk", row.brisk)]
            if "llamacpp" in baselines:
                engines.append(("llama.cpp", row.llama_cpp))
            if row.onnxruntime is not None:
                engines.append(("onnxruntime", row.onnxruntime))
            for r in range(runs):
                for who, figures in engines:
                    if figures.error:
                        continue  # a child that was killed once would be again: the row keeps what it has
                    log(f"{name}: {who} run {r + 1}/{runs} ...")
                    try:
                        figures.add(run_in_child(jobs[who]))
                    except EngineChildError as e:
                        figures.error = str(e)
                        log(f"{name}: [red]{e}[/red]")
                    if on_update:
                        on_update(rows)
            gc.collect()
    from brisk.model import weights_cache

    weights_cache.evict(weights_cache.Settings.from_env())  # the entries of the files written in `tmp`: gone now
    return rows


def _build_checkpoint_in_child(setting: LayerQuant, out: Path, source: str) -> None:
    """brisk's RTN checkpoint of `source`, written by a child (quantizing loads the whole model in float32)."""
    import multiprocessing

    from brisk.bench.compare_child import EngineChildError
    from brisk.bench.quant import build_checkpoint

    proc = multiprocessing.get_context("spawn").Process(target=build_checkpoint, args=(setting, out, source))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise EngineChildError(f"quantizing {source} at {setting} failed in its child process (exit status "
                               f"{proc.exitcode}; negative = killed by that signal, -9 most likely out of memory)")


def _export_onnx_in_child(model: Path, log: Callable[[str], None]) -> Path:
    """The cached ONNX graph of `model` (bench/onnx_baseline.py), exported by a child when it is not cached yet
    (the export holds the float32 model and its traced graph: its memory goes with the child)."""
    import multiprocessing

    from brisk.bench.compare_child import EngineChildError
    from brisk.bench.onnx_baseline import export_onnx, onnx_cache_path

    out = onnx_cache_path(model)
    if out.exists():
        log(f"onnxruntime: the exported graph is cached ({out.name})")
        return out
    log(f"onnxruntime: exporting {model.name} to ONNX (once; cached as {out}) ...")
    proc = multiprocessing.get_context("spawn").Process(target=export_onnx, args=(str(model), out))
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not out.exists():
        raise EngineChildError(f"exporting {model} to ONNX failed in its child process (exit status "
                               f"{proc.exitcode}; negative = killed by that signal, -9 most likely out of memory)")
    return out


def _kv_bytes(source: Path, batch: int, seq_len: int) -> str:
    """brisk's KV pool: `batch` sequences of `seq_len` tokens of the source's shape in float32, half again as
    much to spare (the pool is allocated up front: the figure must fit, not just hold the largest batch)."""
    layers, kv_dim = _kv_shape(str(source))
    per_token = layers * 2 * kv_dim * 4  # K and V, float32
    return f"{max(256, batch * seq_len * per_token * 3 // 2 // 2**20)}MiB"


@functools.cache
def _kv_shape(source: str) -> tuple[int, int]:
    """(layers, kv heads x head dim) from a GGUF file's metadata."""
    from gguf import GGUFReader

    fields = GGUFReader(source).fields
    arch = fields["general.architecture"].contents()

    def get(key: str) -> int | None:
        f = fields.get(f"{arch}.{key}")
        return int(f.contents()) if f is not None else None

    heads = get("attention.head_count") or 1
    head_dim = get("attention.key_length") or (get("embedding_length") or 0) // heads
    return get("block_count") or 0, (get("attention.head_count_kv") or heads) * head_dim


# bytes per weight of each llama.cpp type: F32, F16, Q8_0 (32 int8 + an f16 scale), Q4_1 (32 nibbles + f16 d, m)
BYTES_PER_WEIGHT = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_1": 20 / 32}


def weight_bytes_per_token(source: Path, precision: str) -> float:
    """Bytes of weights one batch-1 decode step reads at `precision`: every matrix once (the embedding as the
    tied output head), norms in float32. The roofline is bandwidth / this."""
    if precision == FILE:  # every tensor as stored (the embedding read once, as the tied head)
        return float(_stored_bytes(str(source)))
    matrices, vectors = _element_counts(str(source))
    return BYTES_PER_WEIGHT[precision] * matrices + 4.0 * vectors


@functools.cache
def _stored_bytes(source: str) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(source).tensors)


@functools.cache
def _element_counts(source: str) -> tuple[int, int]:
    """(elements of the matrices, elements of the vectors) of a GGUF file; parsed once per file."""
    from gguf import GGUFReader

    tensors = GGUFReader(source).tensors
    return (sum(int(t.n_elements) for t in tensors if len(t.shape) > 1),
            sum(int(t.n_elements) for t in tensors if len(t.shape) == 1))


def plot_compare(rows: list[CompareRow], path: str | Path, membw_gbps: float | None = None,
                 weight_bytes: dict[str, float] | None = None, title: str = "decode") -> None:
    """Decode tokens/s against batch size, one line per engine and precision (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = dict(zip(PRECISIONS, ["tab:blue", "tab:orange", "tab:green", "tab:red"], strict=True))
    for row in rows:
        c = colors[row.precision]
        engines = [(row.brisk, "-o", "brisk"), (row.llama_cpp, "--s", "llama.cpp")]
        if row.onnxruntime is not None:
            engines.append((row.onnxruntime, ":^", "onnxruntime"))
        for figs, style, who in engines:
            bs = sorted(figs.decode_tok_s)
            if bs:
                ax.plot(bs, [figs.decode_tok_s[b] for b in bs], style, color=c,
                        label=f"{who} {row.brisk_setting if who == 'brisk' else row.precision.upper()}")
        if membw_gbps and weight_bytes and row.precision in weight_bytes:
            ax.axhline(membw_gbps * 1e9 / weight_bytes[row.precision], color=c, lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent sequences (batch size)")
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.set_title(f"{title}: brisk vs its baselines\n(dotted: batch-1 bandwidth roofline)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare_table(rows: list[CompareRow], sizes: list[int], title: str,
                  baselines: tuple[str, ...] = ("llamacpp",)):  # noqa: ANN201 - a rich Table
    """The rows of `bench compare` as a table, a value and a ratio column per baseline; a figure that was not
    measured (its engine's child died, or the baseline does not run at that precision) is '-'."""
    from rich.table import Table

    def fmt(x: float | None, spec: str, suffix: str = "") -> str:
        return "-" if x is None else f"{x:{spec}}{suffix}"

    def mib(x: int | None) -> str:
        return fmt(None if x is None else x / 2**20, ".0f")

    def gbps(r: CompareRow, f: EngineFigures) -> str:
        return f"{fmt(r.achieved_gbps(f), '.1f')} ({fmt(r.bandwidth_fraction(f), '.0%')})"

    others = [BASELINES[b] for b in BASELINES if b in baselines]  # (attribute, label), in BASELINES' order
    table = Table(title=title, title_justify="left")
    for col in ("llama.cpp type", "brisk setting", "figure", "brisk"):
        table.add_column(col, justify="left" if col != "brisk" else "right")
    for _, label in others:
        table.add_column(label, justify="right")
        table.add_column(f"brisk / {label}", justify="right")

    def add(first: tuple[str, str, str], ours: str, cells: list[tuple[str, str]]) -> None:
        table.add_row(*first, ours, *[c for pair in cells for c in pair])

    for r in rows:
        ours = r.brisk
        theirs = [(attr, r.baseline(attr) or EngineFigures()) for attr, _ in others]
        add((r.precision.upper(), r.brisk_setting, "prefill (s)"), fmt(ours.prefill_s, ".3f"),
            [(fmt(f.prefill_s, ".3f"), fmt(r.ratio(None, a), ".2f", "x")) for a, f in theirs])
        for b in sizes:
            add(("", "", f"decode b={b} (tok/s)"), fmt(ours.decode_tok_s.get(b), ".1f"),
                [(fmt(f.decode_tok_s.get(b), ".1f"), fmt(r.ratio(b, a), ".2f", "x")) for a, f in theirs])
        if 1 in sizes:
            add(("", "", "b=1 weights GB/s (fraction of the bandwidth)"), gbps(r, ours),
                [(gbps(r, f), "") for _, f in theirs])
            if ours.greedy_b1 and any(f.greedy_b1 for _, f in theirs):
                add(("", "", "greedy b=1 tokens equal to brisk's"), "",
                    [("yes" if f.greedy_b1 == ours.greedy_b1 else "no" if f.greedy_b1 else "", "")
                     for _, f in theirs])
        add(("", "", "load (s)" + (", weights cache hit" if ours.weights_cache_hit else "")), fmt(ours.load_s, ".2f"),
            [(fmt(f.load_s, ".2f"), fmt(f.load_s / ours.load_s if f.load_s and ours.load_s else None, ".2f", "x"))
             for _, f in theirs])
        if ours.weights_cache_hit and ours.load_converting_s is not None:
            add(("", "", "first load, converting the file (s)"), fmt(ours.load_converting_s, ".2f"),
                [("", "") for _ in theirs])
        add(("", "", "RSS added by load + warm-up (MiB)"), mib(ours.rss_bytes),
            [(mib(f.rss_bytes), "") for _, f in theirs])
        add(("", "", "peak RSS of the engine's process (MiB)"), mib(ours.peak_rss_bytes),
            [(mib(f.peak_rss_bytes), "") for _, f in theirs])
        for who, f in [("brisk", ours), *[(label, r.baseline(a)) for a, label in others]]:
            if f is not None and f.error:
                add(("", "", f"{who}: not measured"), f.error.splitlines()[0][:100], [("", "") for _ in theirs])
    return table
