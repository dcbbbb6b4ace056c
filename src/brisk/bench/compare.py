"""`brisk bench compare`: brisk against llama.cpp on the same GGUF weights, at each matched precision.

Precision pairs (brisk setting <-> llama.cpp file type):

    f32   brisk float32                             <-> F32  (the GGUF re-typed: model/gguf_convert.py)
    f16   brisk bfloat16 (16-bit weights)           <-> F16
    q8_0  brisk RTN int8, per channel, symmetric    <-> Q8_0 (32-weight blocks)
    q4_1  brisk RTN int4, 32-weight groups, zero pt <-> Q4_1 (the default model's own file)

Both engines load the same weights (the source GGUF decoded, then re-typed for each side) and run with the
same number of threads. For each pair the two engines are loaded side by side and measured alternately
(brisk, llama.cpp, brisk, ...), best of `runs`: a stray process on a 2-core machine only ever slows a run.
"""

from __future__ import annotations

import functools
import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from brisk.bench import report
from brisk.quant.config import LayerQuant

# name -> (brisk dtype, brisk RTN setting or None, llama.cpp GGUF type)
PRECISIONS: dict[str, tuple[str, LayerQuant | None, str]] = {
    "f32": ("float32", None, "f32"),
    "f16": ("bfloat16", None, "f16"),
    "q8_0": ("float32", LayerQuant(bits=8, group_size=-1, sym=True), "q8_0"),
    "q4_1": ("float32", LayerQuant(bits=4, group_size=32, sym=False), "q4_1"),
}
BRISK_LABELS = {"f32": "float32", "f16": "bfloat16", "q8_0": "int8 (per channel)", "q4_1": "int4 g32 asym"}


@dataclass
class EngineFigures:
    prefill_s: float | None = None
    decode_tok_s: dict[int, float] = field(default_factory=dict)  # batch size -> decode tokens/s
    greedy_b1: list[int] = field(default_factory=list)
    load_s: float | None = None  # wall seconds from the file to an engine ready to run
    # resident memory this engine added to the process over its load and warm-up (brisk loads and warms up first,
    # then llama.cpp: each figure is the growth of the process's RSS over its own phase)
    rss_bytes: int | None = None
    peak_rss_load_bytes: int | None = None  # brisk: the process's peak during its load, above the RSS before it


@dataclass
class CompareRow:
    precision: str
    brisk_setting: str
    brisk: EngineFigures
    llama_cpp: EngineFigures
    peak_rss_bytes: int | None = None  # the process's peak over the row (both engines), above the RSS before it

    def ratio(self, batch: int | None) -> float | None:
        """brisk / llama.cpp decode rate at `batch`, or llama.cpp / brisk prefill time (batch None)."""
        if batch is None:
            a, b = self.brisk.prefill_s, self.llama_cpp.prefill_s
            return b / a if a and b else None
        a, b = self.brisk.decode_tok_s.get(batch), self.llama_cpp.decode_tok_s.get(batch)
        return a / b if a and b else None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratios"] = {"prefill": self.ratio(None),
                       **{f"decode_b{b}": self.ratio(b) for b in self.brisk.decode_tok_s}}
        return d


def _source_type(source: Path):  # noqa: ANN202 - gguf.LlamaFileType | None
    from gguf import GGUFReader, LlamaFileType

    field_ = GGUFReader(source).fields.get("general.file_type")
    return LlamaFileType(int(field_.contents())) if field_ is not None else None


def check_precisions(source: Path, precisions: list[str]) -> None:
    """ValueError, before any work, for a precision that is unknown or that brisk cannot write from `source`."""
    from brisk.model.gguf_convert import OUT_TYPES

    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise ValueError(f"unknown precision(s) {', '.join(unknown)}; choose from {', '.join(PRECISIONS)}")
    if not precisions:
        raise ValueError(f"--precisions is empty; choose from {', '.join(PRECISIONS)}")
    file_type = _source_type(source)
    for name in precisions:
        gguf_type = PRECISIONS[name][2]
        if gguf_type not in OUT_TYPES and not (file_type is not None and file_type.name.lower().endswith(gguf_type)):
            raise ValueError(f"the source GGUF is {file_type.name if file_type else 'of unknown type'}; brisk can "
                             f"write {', '.join(OUT_TYPES)} but not {gguf_type}: drop {gguf_type} from --precisions "
                             f"or pass a {gguf_type.upper()} GGUF as --model")


def gguf_for(source: Path, gguf_type: str, workdir: Path, log: Callable[[str], None]) -> Path:
    """The llama.cpp file at `gguf_type`: the source itself when it already is, else a re-typed copy."""
    from brisk.model.gguf_convert import retype_gguf

    file_type = _source_type(source)
    if file_type is not None and file_type.name.lower().endswith(gguf_type):
        return source
    out = workdir / f"{source.stem}.{gguf_type}.gguf"
    log(f"{gguf_type}: writing the llama.cpp file {out.name} ...")
    return retype_gguf(source, out, gguf_type)


def _brisk_prefill_seconds(llm, prompt: list[int]) -> float:  # noqa: ANN001
    from brisk.engine.sampling_params import SamplingParams

    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def run_compare(source: Path, precisions: list[str], prompt_ids: list[int], prefill_ids: list[int],
                batch_sizes: list[int], output_len: int, runs: int, threads: int,
                log: Callable[[str], None] = print, workdir: Path | None = None,
                kv_cache_dtype: str = "auto", quant_activations: str = "auto",
                prepack_weights: str = "auto") -> list[CompareRow]:
    """One CompareRow per precision; `prompt_ids` is the decode prompt (batch b uses b shifted copies).
    `kv_cache_dtype` and `quant_activations` are brisk's (llama.cpp keeps its defaults: an f16 cache, and
    activations rounded to 8 bits for its quantized dot products)."""
    from brisk.bench.llamacpp import LlamaCppModel, require_llama_cpp
    from brisk.bench.quant import build_checkpoint, decode_rate
    from brisk.engine.llm import LLM

    require_llama_cpp()
    check_precisions(source, precisions)  # every one of them, before the first is measured
    if runs < 1 or output_len < 2:
        raise ValueError(f"--runs must be >= 1 and --output-len >= 2, got {runs} and {output_len}")
    seq_len = max(len(prompt_ids) + output_len, len(prefill_ids)) + 16
    rows: list[CompareRow] = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for name in precisions:
            dtype, setting, gguf_type = PRECISIONS[name]
            gguf_path = gguf_for(source, gguf_type, Path(tmp), log)
            brisk_path = str(gguf_path) if setting is None else str(Path(tmp) / f"brisk-{name}")
            if setting is not None:
                log(f"{name}: quantizing brisk's {BRISK_LABELS[name]} checkpoint ...")
                build_checkpoint(setting, Path(brisk_path), str(source))
            ours, theirs = EngineFigures(), EngineFigures()
            gc.collect()
            report.reset_peak_rss()
            rss0 = report.current_rss_bytes()
            start = time.perf_counter()
            llm = LLM(brisk_path, dtype=dtype, enable_prefix_caching=False, num_threads=threads,
                      max_model_len=seq_len, kv_cache_memory=_kv_bytes(max(batch_sizes), seq_len),
                      kv_cache_dtype=kv_cache_dtype, quant_activations=quant_activations,
                      prepack_weights=prepack_weights)
            ours.load_s = time.perf_counter() - start
            ours.peak_rss_load_bytes = report.peak_rss_bytes() - rss0
            decode_rate(llm, prompt_ids, 1, 4)  # warm-up: kernels built, pages touched
            ours.rss_bytes = report.current_rss_bytes() - rss0
            rss1 = report.current_rss_bytes()
            start = time.perf_counter()
            with LlamaCppModel(gguf_path, seq_len, n_seq_max=max(batch_sizes), threads=threads) as lc:
                theirs.load_s = time.perf_counter() - start
                lc.decode_rate([prompt_ids], 4)
                theirs.rss_bytes = report.current_rss_bytes() - rss1
                for r in range(runs):
                    log(f"{name}: run {r + 1}/{runs} ...")
                    t = _brisk_prefill_seconds(llm, prefill_ids)
                    ours.prefill_s = min(ours.prefill_s or t, t)
                    t = lc.prefill_seconds(prefill_ids)
                    theirs.prefill_s = min(theirs.prefill_s or t, t)
                    for b in batch_sizes:
                        prompts = [prompt_ids[i:] + prompt_ids[:i] for i in range(b)]
                        rate, toks = decode_rate(llm, prompt_ids, b, output_len)
                        ours.decode_tok_s[b] = max(ours.decode_tok_s.get(b, 0.0), rate)
                        rate_lc, toks_lc = lc.decode_rate(prompts, output_len)
                        theirs.decode_tok_s[b] = max(theirs.decode_tok_s.get(b, 0.0), rate_lc)
                        if b == 1:
                            ours.greedy_b1, theirs.greedy_b1 = toks, toks_lc
            rows.append(CompareRow(name, BRISK_LABELS[name], ours, theirs, report.peak_rss_bytes() - rss0))
            del llm
            gc.collect()
    return rows


def _kv_bytes(batch: int, seq_len: int) -> str:
    """A KV pool for `batch` sequences of `seq_len` tokens of the default model's size, with room to spare."""
    return f"{max(256, batch * seq_len * 30 * 2 * 192 * 4 * 3 // 2 // 2**20)}MiB"


# bytes per weight of each llama.cpp type: F32, F16, Q8_0 (32 int8 + an f16 scale), Q4_1 (32 nibbles + f16 d, m)
BYTES_PER_WEIGHT = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_1": 20 / 32}


def weight_bytes_per_token(source: Path, precision: str) -> float:
    """Bytes of weights one batch-1 decode step reads at `precision`: every matrix once (the embedding as the
    tied output head), norms in float32. The roofline is bandwidth / this."""
    matrices, vectors = _element_counts(str(source))
    return BYTES_PER_WEIGHT[precision] * matrices + 4.0 * vectors


@functools.cache
def _element_counts(source: str) -> tuple[int, int]:
    """(elements of the matrices, elements of the vectors) of a GGUF file; parsed once per file."""
    from gguf import GGUFReader

    tensors = GGUFReader(source).tensors
    return (sum(int(t.n_elements) for t in tensors if len(t.shape) > 1),
            sum(int(t.n_elements) for t in tensors if len(t.shape) == 1))


def plot_compare(rows: list[CompareRow], path: str | Path, membw_gbps: float | None = None,
                 weight_bytes: dict[str, float] | None = None) -> None:
    """Decode tokens/s against batch size, one line per engine and precision (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = dict(zip(PRECISIONS, ["tab:blue", "tab:orange", "tab:green", "tab:red"], strict=True))
    for row in rows:
        c = colors[row.precision]
        for figs, style, who in ((row.brisk, "-o", "brisk"), (row.llama_cpp, "--s", "llama.cpp")):
            bs = sorted(figs.decode_tok_s)
            ax.plot(bs, [figs.decode_tok_s[b] for b in bs], style, color=c,
                    label=f"{who} {row.brisk_setting if who == 'brisk' else row.precision.upper()}")
        if membw_gbps and weight_bytes and row.precision in weight_bytes:
            ax.axhline(membw_gbps * 1e9 / weight_bytes[row.precision], color=c, lw=0.6, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent sequences (batch size)")
    ax.set_ylabel("decode tokens/s (all sequences)")
    ax.set_title("SmolLM2-135M decode on 2 CPU cores: brisk vs llama.cpp\n(dotted: batch-1 bandwidth roofline)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
