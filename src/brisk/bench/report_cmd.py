"""`brisk report`: the guide's speed-up table, measured for this machine and model in one command.

Every row is a same-run ratio: the technique and its baseline are built in one process and measured in
alternating rounds (the best round of each counts), so load on a shared machine hits both alike. Each row gives
the speed-up, the perplexity cost on held-apart text (the evaluation text; calibration draws from another book)
and the memory the technique changes. Then `brisk advise` gives the best combination for latency and for
throughput. Output: report.md, report.json and PNG plots in --out.

    weights      float32 -> bfloat16, int8 RTN, int4 g64 RTN / GPTQ / AWQ     batch-1 and batch-8 decode
    speculative  plain -> self:int8, ngram                                    batch-1 decode (bench spec)
    paged        static batches, contiguous KV of max_model_len per request    offline throughput, one KV budget
                 -> paged KV + continuous batching
    sparsity     dense float32 -> 50% / 2:4 magnitude-pruned, sparse kernels   batch-1 decode
    fusion       plain PyTorch modules -> brisk's fused C++ layer loop         batch-1 decode
    KV cache     float32 -> int8 / int4 (KIVI) cache                           batch-8 decode at a long prompt
    gqa          KV heads -> fewer, mean-pooled (GQA / MQA conversion)          decode at batch 1 and 8
    streaming    full KV cache -> StreamingLLM (sinks + window)                 batch-1 decode at a long context
    onnxruntime  ONNX Runtime on the same float32 weights -> brisk              decode at batch 1 and 8
The last three are in report_sections.py.
"""

from __future__ import annotations

import gc
import json
import random
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click

from brisk.console import machine_info, stderr_console

# the guide's summary table: technique -> (the claim, low, high)
GUIDE = {
    "int8": ("INT8 quantization", 2.0, 2.0),
    "int4": ("INT4 quantization", 3.0, 4.0),
    "speculative": ("speculative decoding", 2.0, 3.0),
    "paged": ("PagedAttention (throughput)", 2.0, 4.0),
    "sparsity": ("sparsity", 1.5, 2.0),
    "fusion": ("operator fusion", 1.5, 2.0),
    "kv": ("KV cache quantization (memory)", None, None),
    "gqa": ("GQA / MQA conversion (KV memory)", None, None),
    "streaming": ("StreamingLLM (bounded KV)", None, None),
    "onnxruntime": ("against ONNX Runtime", None, None),
}


@dataclass
class Params:
    """What a run measures; `quick()` is the short run (~19 minutes on one thread for the default model)."""

    input_len: int = 128
    output_len: int = 64
    runs: int = 3
    batch: int = 8
    ppl_window: int = 1024
    ppl_windows: int = 16
    spec_prompts: int = 4
    spec_tokens: int = 96
    paged_requests: int = 48
    paged_max_len: int = 1024
    kv_prompt: int = 1024
    calibrated: bool = True  # GPTQ and AWQ rows
    calib_samples: int = 16  # their calibration windows (`brisk quantize --num-samples / --seq-len`)
    calib_seq_len: int = 256
    calib_text: str | None = None  # default: the bundled calibration text
    sparsity: bool = True
    stream_context: int = 4096  # StreamingLLM: the context its decode and perplexity are measured at
    stream_budget: int = 1024  # its KV budget (4 sinks included)

    @classmethod
    def quick(cls) -> Params:
        return cls(input_len=64, output_len=24, runs=2, batch=8, ppl_window=256, ppl_windows=4, spec_prompts=1,
                   spec_tokens=48, paged_requests=16, paged_max_len=512, kv_prompt=384, stream_context=1024,
                   stream_budget=256)


@dataclass
class Row:
    group: str  # a GUIDE key
    setting: str
    baseline: str
    figure: str  # what the speed-up is of
    speedup: float | None
    ppl: float | None = None
    ppl_base: float | None = None
    memory: str = ""
    memory_bytes: int | None = None
    note: str = ""

    @property
    def ppl_cost(self) -> float | None:
        return None if self.ppl is None or self.ppl_base is None else self.ppl / self.ppl_base - 1


@dataclass
class Report:
    model: str
    params: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    best: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "params": self.params, "guide": GUIDE, "best": self.best,
                "failures": self.failures, "seconds": self.seconds,
                "rows": [{**asdict(r), "ppl_cost": r.ppl_cost} for r in self.rows]}


# ---------------------------------------------------------------------------- helpers
def _engine(loaded: Any, **settings: Any) -> Any:
    from brisk.engine.llm_engine import LLMEngine
    from brisk.engine.settings import build_engine_config

    kw = {"kv_cache_memory": "64MiB", "enable_prefix_caching": False, "max_model_len": 1024, **settings}
    return SimpleNamespace(engine=LLMEngine(build_engine_config(model=str(loaded.path), **kw), loaded))


def _weight_bytes(loaded: Any) -> int:
    seen: dict[int, int] = {}
    for t in loaded.model.state_dict(keep_vars=True).values():
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def _ppl(loaded: Any, p: Params, kv_cache_dtype: str = "auto", block_size: int = 16) -> float:
    from brisk.data import evaluation_text_path
    from brisk.eval.ppl import perplexity

    window = min(p.ppl_window, loaded.config.max_position_embeddings)
    text = evaluation_text_path().read_text(encoding="utf-8")
    return perplexity(loaded, text, window=window, max_windows=p.ppl_windows, progress=False,
                      kv_cache_dtype=kv_cache_dtype, block_size=block_size).ppl


def _rounds(engines: dict[str, Any], prompt: list[int], batches: tuple[int, ...], output_len: int, runs: int
            ) -> dict[tuple[str, int], float]:
    """Best decode tok/s of every engine at every batch size, engines alternating within each round."""
    from brisk.bench.quant import decode_rate

    for llm in engines.values():
        decode_rate(llm, prompt, 1, 4)  # warm-up: kernels built, caches touched
    best: dict[tuple[str, int], float] = {}
    for _ in range(runs):
        for name, llm in engines.items():
            for b in batches:
                rate = decode_rate(llm, prompt, b, output_len)[0]
                best[(name, b)] = max(best.get((name, b), 0.0), rate)
    return best


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


# ---------------------------------------------------------------------------- sections
def weights_rows(model: str | None, p: Params, tmp: Path, log: Callable[[str], None]) -> list[Row]:
    import torch

    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.model.loader import load_model, resolve_model
    from brisk.quant.cli import quantize
    from brisk.quant.layers import set_quant_activations

    src = str(resolve_model(model))
    builds = {"int8 RTN per channel": ["--method", "rtn", "--bits", "8", "--group-size", "-1"],
              "int4 RTN g64": ["--method", "rtn", "--bits", "4", "--group-size", "64"]}
    if p.calibrated:
        calib = ["--num-samples", str(p.calib_samples), "--seq-len", str(p.calib_seq_len)]
        if p.calib_text:
            calib += ["--calib-text", p.calib_text]
        builds |= {"int4 GPTQ g64": ["--method", "gptq", "--bits", "4", "--group-size", "64", *calib],
                   "int4 AWQ g64": ["--method", "awq", "--bits", "4", "--group-size", "64", *calib]}
    loaded = {"float32": load_model(model, show_progress=False),
              "bfloat16": load_model(model, dtype=torch.bfloat16, show_progress=False)}
    for i, (name, args) in enumerate(builds.items()):
        log(f"report: quantizing {name} ...")
        folder = tmp / f"w{i}"
        quantize.main([src, str(folder), *args, "--force"], standalone_mode=False)
        loaded[name] = load_model(folder, show_progress=False)
        set_quant_activations(loaded[name].model, "auto")
    ppl = {}
    for name, lm in loaded.items():
        log(f"report: perplexity of {name} ...")
        ppl[name] = _ppl(lm, p)
    engines = {name: _engine(lm) for name, lm in loaded.items()}
    tok = loaded["float32"].tokenizer
    prompt = make_prompt(tok, text_token_ids(tok), 0, p.input_len)
    log("report: decode rounds (weights) ...")
    best = _rounds(engines, prompt, (1, p.batch), p.output_len, p.runs)
    rows = []
    base_bytes = _weight_bytes(loaded["float32"])
    for name, lm in loaded.items():
        if name == "float32":
            continue
        group = "int8" if name.startswith("int8") else "int4" if name.startswith("int4") else "int8"
        if name == "bfloat16":
            group = "weights"
        wb = _weight_bytes(lm)
        for b in (1, p.batch):
            rows.append(Row(group, name, "float32", f"decode b={b}", best[(name, b)] / best[("float32", b)],
                            ppl[name], ppl["float32"], f"weights {_mb(wb)} vs {_mb(base_bytes)}", wb))
    engines.clear()
    loaded.clear()
    gc.collect()
    return rows


def spec_rows(model: str | None, p: Params, log: Callable[[str], None]) -> list[Row]:
    from brisk.model.loader import load_model
    from brisk.spec.bench import run_spec_bench

    loaded = load_model(model, max_model_len=1536, show_progress=False)
    runs = run_spec_bench(loaded, ["self:int8", "ngram"], p.spec_prompts, p.spec_tokens, 1, 4,
                          ["grounded", "chat"], progress=lambda r: log(f"report: spec {r.prompt_set} {r.method} "
                                                                       f"{r.tokens_per_s:.1f} tok/s"), rounds=p.runs)
    rows = []
    for method in ("self:int8", "ngram"):
        mine = [r for r in runs if r.method == method and r.batch == "1" and r.speedup]
        if not mine:
            continue
        sets = ", ".join(f"{r.prompt_set} {r.speedup:.2f}x" for r in mine)
        same = all(r.identical_to_plain for r in mine)
        mean = sum(r.speedup for r in mine) / len(mine)
        rows.append(Row("speculative", method, "plain decoding", "decode b=1 (mean of sets)", mean,
                        note=f"{sets}; greedy output {'identical' if same else 'DIFFERENT'}: no quality cost"
                        if same else sets,
                        memory="+ an int8 copy of the weights" if method == "self:int8" else "none"))
    return rows


def paged_rows(model: str | None, p: Params, log: Callable[[str], None]) -> list[Row]:
    """The same KV budget, the same requests (64-token prompts, output lengths spread over the context): static
    batches of as many requests as contiguous max_model_len slots fit in the budget, run to completion one batch
    after the other, against all of them submitted at once to the paged pool (continuous batching)."""
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.engine.sampling_params import SamplingParams
    from brisk.model.loader import load_model

    loaded = load_model(model, show_progress=False)
    c = loaded.config
    slots = 4
    per_token = c.kv_bytes_per_token(4)
    budget = slots * p.paged_max_len * per_token
    rng = random.Random(0)
    tok = loaded.tokenizer
    ids = text_token_ids(tok)
    prompts = [make_prompt(tok, ids, 113 * i, 64) for i in range(p.paged_requests)]
    outs = [rng.randint(16, p.paged_max_len // 4) for _ in prompts]
    static = _engine(loaded, kv_cache_memory=budget, max_model_len=p.paged_max_len, max_num_seqs=slots)
    paged = _engine(loaded, kv_cache_memory=budget, max_model_len=p.paged_max_len, max_num_seqs=256)

    def run(llm: Any, batches: list[list[int]]) -> tuple[float, int]:
        engine = llm.engine
        start, tokens = time.perf_counter(), 0
        for batch in batches:
            for i in batch:
                engine.add_request(None, prompts[i], SamplingParams(temperature=0.0, max_tokens=outs[i],
                                                                    ignore_eos=True))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        tokens += len(out.outputs[0].token_ids)
        return time.perf_counter() - start, tokens

    idx = list(range(len(prompts)))
    static_batches = [idx[i:i + slots] for i in range(0, len(idx), slots)]
    run(static, [idx[:2]])
    run(paged, [idx[:2]])  # warm-up
    best = {"static": float("inf"), "paged": float("inf")}
    tokens = 0
    for r in range(max(1, p.runs - 1)):
        log(f"report: paged vs static round {r + 1} ...")
        s, tokens = run(static, static_batches)
        best["static"] = min(best["static"], s)
        s, _ = run(paged, [idx])
        best["paged"] = min(best["paged"], s)
    peak_running = len(prompts)
    return [Row("paged", "paged KV + continuous batching", f"static batches of {slots}, contiguous KV",
                f"offline tok/s, {len(prompts)} requests", best["static"] / best["paged"],
                memory=f"the same KV budget ({budget / 2**20:.0f} MiB): {slots} contiguous slots of "
                       f"{p.paged_max_len} tokens vs {budget // per_token} paged tokens",
                memory_bytes=budget,
                note=f"{tokens} output tokens; up to {peak_running} requests admitted at once; lossless")]


def sparsity_rows(model: str | None, p: Params, log: Callable[[str], None]) -> list[Row]:
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.bench.sparse import prune_decoder_
    from brisk.model.loader import load_model
    from brisk.ops.sparse import sparsify_model

    dense = load_model(model, sparse=False, show_progress=False)
    base_ppl = _ppl(dense, p)
    loaded = {"float32": dense}
    ppl = {}
    for pattern, label in (("0.5", "50% magnitude"), ("2:4", "2:4 magnitude")):
        lm = load_model(model, sparse=False, show_progress=False)
        prune_decoder_(lm.model, pattern)
        log(f"report: perplexity of {label} ...")
        ppl[label] = _ppl(lm, p)
        sparsify_model(lm.model)
        loaded[label] = lm
    engines = {n: _engine(lm, max_model_len=512) for n, lm in loaded.items()}
    tok = dense.tokenizer
    prompt = make_prompt(tok, text_token_ids(tok), 0, p.input_len)
    log("report: decode rounds (sparsity) ...")
    best = _rounds(engines, prompt, (1,), p.output_len, p.runs)
    base_bytes = _weight_bytes(dense)
    return [Row("sparsity", f"float32 {label}, sparse kernels", "dense float32", "decode b=1",
                best[(label, 1)] / best[("float32", 1)], ppl[label], base_ppl,
                f"weights {_mb(_weight_bytes(loaded[label]))} vs {_mb(base_bytes)}", _weight_bytes(loaded[label]),
                note="magnitude pruning, no recovery; wanda / sparsegpt cost less (`brisk prune`)")
            for label in ppl]


def fusion_rows(model: str | None, p: Params, log: Callable[[str], None]) -> list[Row]:
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.model.loader import load_model

    loaded = load_model(model, show_progress=False)
    engines = {"fused": _engine(loaded), "modules": _engine(loaded, execution="modules")}
    tok = loaded.tokenizer
    prompt = make_prompt(tok, text_token_ids(tok), 0, p.input_len)
    log("report: decode rounds (fusion) ...")
    best = _rounds(engines, prompt, (1, p.batch), p.output_len, p.runs)
    return [Row("fusion", "fused C++ layer loop (execution auto)", "plain PyTorch modules", f"decode b={b}",
                best[("fused", b)] / best[("modules", b)], memory="none", note="same math (lossless)")
            for b in (1, p.batch)]


def kv_rows(model: str | None, p: Params, log: Callable[[str], None]) -> list[Row]:
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.kvcache.quant import kv_bytes_per_token
    from brisk.model.loader import load_model

    loaded = load_model(model, show_progress=False)
    c = loaded.config
    base_ppl = _ppl(loaded, p)
    settings = {"float32": ("auto", 16), "int8": ("int8", 16), "int4": ("int4", 64)}
    ppl = {}
    for name, (dtype, block) in settings.items():
        if name != "float32":
            log(f"report: perplexity with the {name} KV cache ...")
            ppl[name] = _ppl(loaded, p, dtype, block)
    max_len = p.kv_prompt + p.output_len + 64
    per = {name: kv_bytes_per_token(dtype, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block, 4)
           for name, (dtype, block) in settings.items()}
    # one pool for all three, large enough that the float cache holds the whole batch at once (a smaller one
    # would queue requests behind the others and time something else)
    pool = f"{int(p.batch * max_len * per['float32'] / 2**20) + 16}MiB"
    engines = {name: _engine(loaded, kv_cache_dtype=dtype, block_size=block, max_model_len=max_len,
                             kv_cache_memory=pool) for name, (dtype, block) in settings.items()}
    tok = loaded.tokenizer
    prompt = make_prompt(tok, text_token_ids(tok), 0, p.kv_prompt)
    log("report: decode rounds (KV cache) ...")
    best = _rounds(engines, prompt, (p.batch,), p.output_len, p.runs)
    return [Row("kv", f"KV cache {name}", "float32 KV cache", f"decode b={p.batch}, {p.kv_prompt}-token prompt",
                best[(name, p.batch)] / best[("float32", p.batch)], ppl[name], base_ppl,
                f"{per[name]:,.0f} B/token vs {per['float32']:,.0f} ({per['float32'] / per[name]:.1f}x the tokens "
                "per byte)", int(per[name]))
            for name in ("int8", "int4")]


def best_combinations(model: str | None, log: Callable[[str], None]) -> dict[str, Any]:
    from brisk.advise.advisor import advise, calibrate_model
    from brisk.engine.memory import available_memory
    from brisk.model.gguf import read_gguf_config
    from brisk.model.loader import resolve_model

    budget, _ = available_memory()
    path = resolve_model(model)
    if path.suffix == ".gguf":
        max_pos = read_gguf_config(path).max_position_embeddings
    else:
        max_pos = json.loads((path / "config.json").read_text(encoding="utf-8"))["max_position_embeddings"]
    context = min(2048, max_pos)
    cal = calibrate_model(model, log=log)  # one probe for both goals
    out = {}
    for goal, concurrency in (("latency", 1), ("throughput", 32)):
        a = advise(model, budget, goal, 0.02, context=context, concurrency=concurrency, calibration=cal, log=log)
        top = a.ranked[0]
        out[goal] = {"name": top.name, "weights": top.precision.label, "memory_bytes": top.memory.total,
                     "ppl_increase": top.quality, "predicted_tok_s": top.figure(goal), "commands": a.commands,
                     "budget_bytes": budget, "concurrency": concurrency, "context": context,
                     "quality_source": a.quality_source}
    return out


SECTIONS = ("weights", "speculative", "paged", "sparsity", "fusion", "kv", "gqa", "streaming", "onnxruntime", "best")


def run_report(model: str | None, p: Params, sections: tuple[str, ...] = SECTIONS,
               log: Callable[[str], None] = print, on_section: Callable[[Report], None] | None = None) -> Report:
    """Every section in turn; `on_section` sees the report after each (the CLI saves it, so a run stopped midway
    keeps what it measured)."""
    from brisk.bench.report_sections import section_runners
    from brisk.model.loader import resolve_model

    report = Report(resolve_model(model).name, asdict(p))
    with tempfile.TemporaryDirectory(prefix="brisk-report-") as tmp:
        runners: dict[str, Callable[[], Any]] = {
            "weights": lambda: weights_rows(model, p, Path(tmp), log),
            "speculative": lambda: spec_rows(model, p, log),
            "paged": lambda: paged_rows(model, p, log),
            "sparsity": lambda: sparsity_rows(model, p, log),
            "fusion": lambda: fusion_rows(model, p, log),
            "kv": lambda: kv_rows(model, p, log),
            **section_runners(model, p, Path(tmp), log),
            "best": lambda: best_combinations(model, log),
        }
        for name in sections:
            start = time.perf_counter()
            try:
                result = runners[name]()
            except Exception as e:  # one failing section must not lose the others' minutes
                report.failures.append(f"{name}: {type(e).__name__}: {e}")
                log(f"report: {name} failed: {traceback.format_exc()}")
                result = None
            if name == "best" and result is not None:
                report.best = result
            elif result is not None:
                report.rows += result
            report.seconds[name] = round(time.perf_counter() - start, 1)
            gc.collect()
            if on_section is not None:
                on_section(report)
    return report


# ---------------------------------------------------------------------------- output
def _guide_text(group: str) -> str:
    claim, lo, hi = GUIDE.get(group, (group, None, None))
    if lo is None:
        return "—"
    return f"{lo:g}x" if lo == hi else f"{lo:g}-{hi:g}x"


def render_markdown(report: Report, machine: dict[str, Any], load: str, plots: list[str]) -> str:
    lines = [f"# brisk report: {report.model}", "",
             f"Machine: {machine.get('cpu_model')}, {machine.get('torch_threads')} torch threads, "
             f"{machine.get('memory_bytes', 0) / 2**30:.0f} GiB; load average at the start: {load}.", "",
             "Every speed-up is a same-run ratio (technique and baseline alternating in this invocation, best "
             "round each); perplexity on held-apart text "
             f"({report.params['ppl_windows']} windows of {report.params['ppl_window']} tokens of the evaluation "
             "text), its cost relative to the baseline's.", "",
             "| technique | guide | setting | baseline | figure | speed-up here | ppl cost | memory |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report.rows:
        cost = "—" if r.ppl_cost is None else f"{100 * r.ppl_cost:+.2f}%"
        claim = GUIDE.get(r.group, (r.group,))[0]
        speed = "—" if r.speedup is None else f"{r.speedup:.2f}x"
        lines.append(f"| {claim} | {_guide_text(r.group)} | {r.setting} | {r.baseline} | {r.figure} | {speed} | "
                     f"{cost} | {r.memory} |")
    notes = [f"- {r.setting}: {r.note}" for r in report.rows if r.note]
    if notes:
        lines += ["", *notes]
    if report.best:
        lines += ["", "## Best combination (within +2% perplexity, `brisk advise`)", ""]
        for goal, b in report.best.items():
            lines.append(f"- **{goal}** ({b['concurrency']} x {b['context']} tokens, "
                         f"{b['budget_bytes'] / 2**30:.1f} GiB available): {b['name']} — predicted "
                         f"{b['predicted_tok_s']:.0f} tok/s, {b['memory_bytes'] / 2**20:.0f} MiB, ppl "
                         f"{100 * (b['ppl_increase'] or 0):+.2f}%")
            lines += [f"  - `{c}`" for c in b["commands"]]
    if report.failures:
        lines += ["", "## Sections that failed", "", *[f"- {f}" for f in report.failures]]
    lines += ["", "Seconds per section: " + ", ".join(f"{k} {v:.0f}" for k, v in report.seconds.items())]
    lines += ["", *[f"![{Path(p).stem}]({Path(p).name})" for p in plots]]
    return "\n".join(lines) + "\n"


def plot_report(report: Report, out: Path) -> list[str]:
    """speedups.png: each row's speed-up beside the guide's range; quality.png: speed-up against ppl cost."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise click.ClickException("brisk report writes its plots with matplotlib, which is not installed; "
                                   "pip install 'brisk[bench]'") from e
    rows = [r for r in report.rows if r.speedup is not None]
    paths = []
    if rows:
        fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
        labels = [f"{r.setting} ({r.figure})" for r in rows]
        y = list(range(len(rows)))
        ax.barh(y, [r.speedup for r in rows], color="tab:blue", label="measured here")
        for i, r in enumerate(rows):
            _, lo, hi = GUIDE.get(r.group, (None, None, None))
            if lo is not None:
                ax.plot([lo, hi if hi != lo else lo + 0.02], [i, i], color="tab:orange", linewidth=6, alpha=0.7,
                        label="guide" if i == 0 or "guide" not in ax.get_legend_handles_labels()[1] else None)
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_yticks(y, labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("speed-up over the baseline (same run)")
        ax.set_title(f"{report.model}: measured vs the guide")
        ax.legend(loc="lower right")
        fig.tight_layout()
        path = out / "speedups.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    costed = [r for r in rows if r.ppl_cost is not None]
    if costed:
        fig, ax = plt.subplots(figsize=(7, 5))
        for r in costed:
            ax.scatter(100 * max(r.ppl_cost, 1e-4), r.speedup)
            ax.annotate(f"{r.setting} ({r.figure})", (100 * max(r.ppl_cost, 1e-4), r.speedup), fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("perplexity cost (%, log)")
        ax.set_ylabel("speed-up")
        ax.set_title("speed against quality")
        fig.tight_layout()
        path = out / "quality.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


@click.command("report")
@click.option("--model", "-m", default=None, help="Float model or GGUF file (default: SmolLM2-135M-Instruct).")
@click.option("--quick", is_flag=True, help="Fewer tokens, rounds and perplexity windows (about 19 minutes on one "
                                            "thread for the default model).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="brisk-report", show_default=True,
              help="Folder for report.md, report.json and the plots.")
@click.option("--sections", default=",".join(SECTIONS), show_default=True,
              help="Comma-separated sections to run.")
@click.option("--no-calibrated", is_flag=True, help="Leave out the GPTQ and AWQ rows (they calibrate first).")
def report_command(model: str | None, quick: bool, out_dir: str, sections: str, no_calibrated: bool) -> None:
    """Measure the guide's techniques on this machine and model: same-run speed-up, perplexity cost and memory
    of each; then the best combination for latency and for throughput."""
    import os


    names = tuple(s.strip() for s in sections.split(",") if s.strip())
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise click.BadParameter(f"unknown section(s) {', '.join(unknown) or '(none)'}; choose from "
                                 f"{', '.join(SECTIONS)}", param_hint="--sections")
    p = Params.quick() if quick else Params()
    if no_calibrated:
        p.calibrated = False
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    console = stderr_console()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    start = time.perf_counter()
    partial = out / "report.partial.json"
    report = run_report(model, p, names, log=lambda m: console.print(f"[dim]{m}"),
                        on_section=lambda r: partial.write_text(json.dumps(r.to_dict(), indent=2, default=str),
                                                                encoding="utf-8"))
    partial.unlink(missing_ok=True)
    report.seconds["total"] = round(time.perf_counter() - start, 1)
    plots = plot_report(report, out)
    machine = machine_info()
    (out / "report.md").write_text(render_markdown(report, machine, load, plots), encoding="utf-8")
    doc = {"command": "brisk report" + (" --quick" if quick else ""), "machine": machine, "load_start": load,
           "load_end": ", ".join(f"{x:.2f}" for x in os.getloadavg()), **report.to_dict()}
    (out / "report.json").write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    click.echo((out / "report.md").read_text(encoding="utf-8"))
    click.echo(f"wrote {out / 'report.md'}, {out / 'report.json'}" + "".join(f", {q}" for q in plots), err=True)
    if report.failures:
        raise click.ClickException(f"{len(report.failures)} section(s) failed: " + "; ".join(report.failures))
