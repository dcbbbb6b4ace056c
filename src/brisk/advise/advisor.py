"""`brisk advise`: the guide's method as a command. For a model, a memory budget, a goal (latency or throughput)
and a quality budget, every candidate configuration is priced (memory), predicted (speed) and costed (quality);
the ones that fit both budgets are ranked by the goal's figure, and the first is given as command lines.

    candidates = weight format x KV cache dtype x speculative decoding (float targets) x sparsity (float32)
                 x KV policy (the full cache, or StreamingLLM keeping N < context tokens: 4 sinks + a window)
    memory     = advise/memory.py (the engine's estimate on the candidate's format, KV pool sized to
                 context x concurrency)
    speed      = advise/speed.py (roofline calibrated by a probe of the real model)
    quality    = advise/quality.py (stored table for the default model, or measured with --measure-quality)
"""

from __future__ import annotations

import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from brisk.advise import memory as mem
from brisk.advise import quality as qual
from brisk.advise import speed as spd
from brisk.engine.memory import MemoryEstimate

GOALS = ("latency", "throughput")
KV_DTYPES = ("auto", "int8", "int4")
INT4_METHODS = ("rtn", "gptq", "awq")
GROUPS = (32, 64, 128)
SPEC_METHOD = "self:int8"
# what --memory bounds: the whole process (peak RSS: interpreter, torch, brisk and the model), or the engine's own
# memory (weights, KV pool, one step's activations), as vLLM's memory settings count it
MEMORY_SCOPES = ("process", "engine")


class NothingFitsError(ValueError):
    """No candidate fits the memory (or quality) budget."""


def charged_bytes(est: MemoryEstimate, scope: str) -> int:
    """The bytes of `est` that --memory bounds under `scope`."""
    return est.total - (est.runtime if scope == "engine" else 0)


@dataclass
class Candidate:
    precision: mem.Precision
    kv_cache_dtype: str
    speculative: str | None
    memory: MemoryEstimate
    settings: dict[str, Any]
    quality: float | None  # relative perplexity increase; None = unknown
    prediction: spd.Prediction
    measured: dict[str, float] | None = None
    stream_budget: int | None = None  # StreamingLLM: tokens of KV kept per sequence (sinks included); None = full

    @property
    def name(self) -> str:
        parts = [self.precision.name]
        if self.kv_cache_dtype != "auto":
            parts.append(f"kv-{self.kv_cache_dtype}")
        if self.speculative:
            parts.append(self.speculative)
        if self.stream_budget is not None:
            parts.append(f"streaming-{self.stream_budget}")
        return " + ".join(parts)

    def charged(self, scope: str = "process") -> int:
        return charged_bytes(self.memory, scope)

    def figure(self, goal: str) -> float:
        """The goal's figure: measured when measured, else predicted."""
        return self.measured["tok_s"] if self.measured is not None else self.figure_predicted(goal)

    def figure_predicted(self, goal: str) -> float:
        return self.prediction.decode_b1_tok_s if goal == "latency" else self.prediction.decode_batch_tok_s

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "weights": self.precision.label, "kv_cache_dtype": self.kv_cache_dtype,
                "speculative": self.speculative, "stream_budget": self.stream_budget,
                "memory_bytes": self.memory.total,
                "memory": {"weights": self.memory.weights, "packed": self.memory.packed,
                           "kv_pool": self.memory.kv_pool, "activations": self.memory.activations,
                           "runtime": self.memory.runtime},
                "settings": self.settings, "ppl_increase": self.quality, "prediction": self.prediction.to_dict(),
                "measured": self.measured}


@dataclass
class Advice:
    model: str
    goal: str
    memory_budget: int
    max_ppl_increase: float
    context: int
    concurrency: int
    memory_scope: str
    quality_source: str
    calibration: spd.Calibration
    ranked: list[Candidate]  # fit both budgets, best first
    rejected: list[tuple[Candidate, str]]  # and why
    commands: list[str] = field(default_factory=list)
    validated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "goal": self.goal, "memory_budget_bytes": self.memory_budget,
                "max_ppl_increase": self.max_ppl_increase, "context": self.context,
                "concurrency": self.concurrency, "memory_scope": self.memory_scope,
                "quality_source": self.quality_source,
                "calibration": self.calibration.to_dict(), "validated": self.validated,
                "ranked": [c.to_dict() for c in self.ranked],
                "rejected": [{**c.to_dict(), "reason": why} for c, why in self.rejected],
                "commands": self.commands}


def parse_percent(text: str) -> float:
    """'2%' or '0.02' -> 0.02."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"--max-ppl-increase must be a percentage like 2% or a fraction like 0.02, "
                         f"got {text!r}") from None
    if not 0 <= value < 10:
        raise ValueError(f"--max-ppl-increase must be between 0% and 1000%, got {text!r}")
    return value


def precisions(shape: mem.ModelShape) -> list[mem.Precision]:
    """The weight formats this model can run in."""
    if shape.footprint.fixed_bytes:  # an already-quantized checkpoint: only as it is
        return [mem.Precision("given", torch.float32)]
    c = shape.footprint.config
    out = [mem.Precision("float32", torch.float32), mem.Precision("bfloat16", torch.bfloat16)]
    if mem.is_quantized_gguf(shape):
        out.append(mem.Precision("gguf", torch.float32, gguf=True))
    out.append(mem.Precision("int8", torch.float32, 8, -1))
    for method in INT4_METHODS:
        for g in GROUPS:
            if qual.applies(f"int4-{method}-g{g}", c.hidden_size, c.intermediate_size):
                out.append(mem.Precision(f"int4-{method}-g{g}", torch.float32, 4, g, method))
    out += [mem.Precision(s, torch.float32, sparsity=s) for s in ("wanda-50", "wanda-2:4")]
    return out


def _quality(table: dict[str, Any] | None, p: mem.Precision, kv: str, stream_budget: int | None = None
             ) -> float | None:
    if p.name in ("float32", "given") and kv == "auto" and stream_budget is None:
        return 0.0
    if table is None:
        return None
    techniques = [] if p.name in ("float32", "given") else [p.name]
    if kv != "auto":
        techniques.append(f"kv-{kv}")
    if stream_budget is not None:
        techniques.append(f"streaming-{stream_budget}")
    return qual.combined_cost(table, techniques)


def build_candidates(shape: mem.ModelShape, cal: spd.Calibration, factors: dict[str, Any],
                     table: dict[str, Any] | None, context: int, concurrency: int, memory_budget: int | None = None,
                     scope: str = "process") -> list[Candidate]:
    """Every candidate, priced at the engine's default step budget (2,048 tokens), or at the largest smaller one
    (mem.STEP_TOKENS, at least `concurrency`) whose activations bring it within `memory_budget`."""
    from brisk.kvcache.quant import kv_bytes_per_token

    c = shape.footprint.config
    spec_speedup = factors["techniques"]["speculative"]["self:int8"]
    int8 = mem.Precision("int8", torch.float32, 8, -1)
    out = []
    for p in precisions(shape):
        weights = mem.weight_bytes(shape, p) if p.name != "given" else shape.footprint.weight_bytes(p.dtype)
        sparse = factors["techniques"]["sparsity"].get(p.sparsity, 1.0) if p.sparsity else 1.0
        for kv in KV_DTYPES:
            block = mem.kv_block_size(kv)
            item = torch.finfo(p.dtype).bits // 8
            kv_token = int(kv_bytes_per_token(kv, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, block,
                                              item))
            specs: list[str | None] = [None]
            if p.name in ("float32", "bfloat16") and not p.sparsity and kv != "int4":  # the engine refuses int4
                specs.append(SPEC_METHOD)
            for s in specs:
                # the draft: an int8 copy of the weights and its own float KV pool, as many blocks as the target's
                extra = mem.weight_bytes(shape, int8) + mem.draft_kv_bytes(shape, p, kv, context, concurrency) \
                    if s else 0
                # StreamingLLM runs without drafts: a draft's own cache keeps every token (measured on the default
                # model at 16k tokens: 0.74x of the best streaming candidate, and twice the memory)
                for n in [None, *qual.stream_budgets(context)] if not s else [None]:
                    est, settings = _fitted(shape, p, kv, context, concurrency, extra, n, memory_budget, scope)
                    if s:
                        settings = {**settings, "speculative": s}
                    pred = spd.predict(cal, factors, p.name, weights, kv_token, context, concurrency,
                                       spec_speedup=spec_speedup if s else 1.0, sparse_speedup=sparse,
                                       kv_cache_dtype=kv, num_layers=c.num_hidden_layers, stream_budget=n)
                    out.append(Candidate(p, kv, s, est, settings, _quality(table, p, kv, n), pred,
                                         stream_budget=n))
    return out


def _fitted(shape: mem.ModelShape, p: mem.Precision, kv: str, context: int, concurrency: int, extra: int,
            stream_budget: int | None, memory_budget: int | None, scope: str
            ) -> tuple[MemoryEstimate, dict[str, Any]]:
    """The estimate and settings at the largest step budget that fits `memory_budget` (the default when none
    does)."""
    steps = [t for t in mem.STEP_TOKENS if t >= concurrency] or [mem.STEP_TOKENS[0]]
    for step in steps:
        est, settings = mem.estimate(shape, p, kv, context, concurrency, extra, stream_budget, step)
        if memory_budget is None or charged_bytes(est, scope) <= memory_budget:
            return est, settings
    return mem.estimate(shape, p, kv, context, concurrency, extra, stream_budget, steps[0])


def rank(cands: list[Candidate], goal: str, budget: int, max_ppl: float, context: int = 0, max_positions: int = 0,
         scope: str = "process") -> tuple[list[Candidate], list[tuple[Candidate, str]]]:
    """The candidates that fit both budgets, best first, and the rest with the reason. Past the model's trained
    positions (`context` > `max_positions`) only StreamingLLM candidates run: a full cache would extrapolate RoPE,
    at a quality cost nothing here measured."""
    ok, rejected = [], []
    for cand in cands:
        if max_positions and context > max_positions and cand.stream_budget is None:
            rejected.append((cand, f"a full cache of {context} tokens is past the model's {max_positions} "
                                   "positions; StreamingLLM (--kv-policy streaming) keeps attention within them"))
        elif cand.charged(scope) > budget:
            rejected.append((cand, f"needs {mem.gib(cand.charged(scope))} > {mem.gib(budget)}"))
        elif cand.quality is None:
            rejected.append((cand, "quality cost unknown (no table for this model: --measure-quality)"))
        elif cand.quality > max_ppl + 1e-12:
            rejected.append((cand, f"ppl +{100 * cand.quality:.2f}% > +{100 * max_ppl:.2f}%"))
        else:
            ok.append(cand)
    ok.sort(key=lambda c: (-c.figure(goal), c.quality or 0.0, c.charged(scope)))
    return ok, rejected


def commands(cand: Candidate, model: str | None, goal: str) -> list[str]:
    """The command lines that build and run `cand`."""
    src = "default" if model is None else model
    p = cand.precision
    lines = []
    target = src
    if p.bits is not None:
        target = f"./{_folder_name(src, p)}"
        lines.append(f"brisk quantize --method {p.method} --bits {p.bits} --group-size {p.group_size} "
                     f"{shlex.quote(src)} {target}")
    elif p.sparsity:
        target = f"./{_folder_name(src, p)}"
        pattern = "--pattern 2:4" if p.sparsity.endswith("2:4") else "--sparsity 0.5"
        lines.append(f"brisk prune --method wanda {pattern} {shlex.quote(src)} {target}")
    s = cand.settings
    flags = [] if target == "default" else ["--model", shlex.quote(target)]
    if s["dtype"] != "auto":
        flags += ["--dtype", s["dtype"]]
    if cand.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", cand.kv_cache_dtype]
    if s["block_size"] != 16:
        flags += ["--block-size", str(s["block_size"])]
    flags += ["--max-model-len", str(s["max_model_len"]), "--max-num-seqs", str(s["max_num_seqs"]),
              "--kv-cache-memory", s["kv_cache_memory"]]
    if s["max_num_batched_tokens"] != mem.STEP_TOKENS[0]:
        flags += ["--max-num-batched-tokens", str(s["max_num_batched_tokens"])]
    if cand.speculative:
        flags += ["--speculative", cand.speculative]
    if cand.stream_budget is not None:
        flags += ["--kv-policy", "streaming", "--kv-budget", str(cand.stream_budget), "--sink-tokens",
                  str(s["sink_tokens"])]
    lines.append("brisk serve " + " ".join(flags))
    lines.append("brisk generate " + " ".join(flags) + " 'Hello'")
    return lines


def _folder_name(src: str, p: mem.Precision) -> str:
    stem = "smollm2" if src == "default" else Path(src).name.removesuffix(".gguf")
    return f"{stem}-{p.name.replace(':', '-')}"


def advise(model: str | None, memory_budget: int, goal: str, max_ppl_increase: float, context: int = 4096,
           concurrency: int | None = None, measure_quality: bool = False, validate: bool = False,
           validate_seconds: float = 60.0, read_gbps: float | None = None,
           quality_window: int = 512, quality_windows: int = 8, calibration: spd.Calibration | None = None,
           memory_scope: str = "process", validate_top_n: int = 3,
           log: Callable[[str], None] = lambda m: None) -> Advice:
    """Rank every candidate for `model`; NothingFitsError when none fits the budgets (before any probe runs when
    none fits the memory). `calibration`: a probe of this model already made (else one runs now)."""
    if goal not in GOALS:
        raise ValueError(f"--goal must be latency or throughput, got {goal!r}")
    if memory_scope not in MEMORY_SCOPES:
        raise ValueError(f"--memory-scope must be process or engine, got {memory_scope!r}")
    if validate_top_n < 1:
        raise ValueError(f"--validate-top must be at least 1, got {validate_top_n}")
    if concurrency is None:
        concurrency = 1 if goal == "latency" else 32
    if concurrency < 1 or context < 16:
        raise ValueError(f"--concurrency must be at least 1 and --context at least 16, got {concurrency} and "
                         f"{context}")
    shape = mem.model_shape(model)
    max_pos = shape.footprint.config.max_position_embeddings
    factors = spd.stored_factors()
    unprobed = spd.Calibration(read_gbps or 1.0, "float32", 1.0, 1.0, 1, 0, 0.0, 1.0)
    sized = build_candidates(shape, unprobed, factors, None, context, concurrency, memory_budget, memory_scope)
    if all(c.charged(memory_scope) > memory_budget for c in sized):  # refused before the quality and probe runs
        raise NothingFitsError(_refusal(sized, memory_budget, max_ppl_increase, context, concurrency,
                                        memory_scope))
    table, source = _quality_table(model, shape, measure_quality, quality_window, quality_windows, context, log)
    cal = calibration or calibrate_model(model, shape, read_gbps, log)
    cands = build_candidates(shape, cal, factors, table, context, concurrency, memory_budget, memory_scope)
    ranked, rejected = rank(cands, goal, memory_budget, max_ppl_increase, context, max_pos, memory_scope)
    name = shape.path.name if shape.path else str(model)
    if not ranked:
        runnable = [c for c in cands if context <= max_pos or c.stream_budget is not None]
        raise NothingFitsError(_refusal(runnable, memory_budget, max_ppl_increase, context, concurrency,
                                        memory_scope))
    advice = Advice(name, goal, memory_budget, max_ppl_increase, context, concurrency, memory_scope, source, cal,
                    ranked, rejected)
    if validate:
        validate_top(advice, model, validate_seconds, log, top=validate_top_n)
    advice.commands = commands(advice.ranked[0], model, goal)
    return advice


def _refusal(cands: list[Candidate], budget: int, max_ppl: float, context: int, concurrency: int,
             scope: str = "process") -> str:
    smallest = min(cands, key=lambda c: c.charged(scope))
    fitting = [c for c in cands if c.charged(scope) <= budget]
    where = f"{concurrency} sequence(s) of {context} tokens"
    if not fitting:
        hint = (f" (the runtime, {mem.gib(smallest.memory.runtime)}, is the Python process's own: --memory-scope "
                "engine leaves it out of the budget)" if scope == "process" else "")
        return (f"nothing fits in {mem.gib(budget)} for {where}: the smallest configuration, {smallest.name}, "
                f"needs {smallest.memory.describe()}. Give more --memory, or lower --context / --concurrency"
                f"{hint}.")
    known = [c for c in fitting if c.quality is not None]
    if not known:
        return (f"{len(fitting)} configuration(s) fit in {mem.gib(budget)}, but their quality cost is unknown for "
                "this model; pass --measure-quality to measure it.")
    best = min(known, key=lambda c: c.quality or 0.0)
    return (f"{len(fitting)} configuration(s) fit in {mem.gib(budget)} for {where}, but none within "
            f"+{100 * max_ppl:.2f}% perplexity: the least lossy that fits, {best.name}, costs "
            f"+{100 * (best.quality or 0):.2f}% ({mem.gib(best.charged(scope))}). Raise --max-ppl-increase or "
            "--memory.")


def _quality_table(model: str | None, shape: mem.ModelShape, measure: bool, window: int, windows: int,
                   context: int, log: Callable[[str], None]) -> tuple[dict[str, Any] | None, str]:
    if measure:
        window = min(window, shape.footprint.config.max_position_embeddings)
        table = qual.measure_quality_table(model, window=window, max_windows=windows, log=log)
        where = f"{windows} windows of {window} tokens of {table['protocol']['text']}"
        budgets = tuple(qual.stream_budgets(context))
        if budgets:  # StreamingLLM candidates: priced on one long stream
            streams = qual.measure_stream_quality(model, budgets, log=log)
            table["ppl"].update(streams["ppl"])
            table["protocol"].update(streams["stream_protocol"])
            where += f"; StreamingLLM on one stream of {streams['stream_protocol']['stream_tokens']} tokens"
        return table, f"measured now: brisk eval ppl protocol, {where}"
    table = qual.stored_table(model)
    if table is None:
        return None, "none stored for this model (only lossless candidates are ranked; --measure-quality measures)"
    p = table["protocol"]
    streams = f"; StreamingLLM on one stream of {p['stream_tokens']} tokens" if "stream_tokens" in p else ""
    return table, (f"stored table for {table['model']} ({p['max_windows']} windows of {p['window']} tokens of "
                   f"{p['text']}{streams}, {table.get('date', '')})")


def calibrate_model(model: str | None, shape: mem.ModelShape | None = None, read_gbps: float | None = None,
                    log: Callable[[str], None] = lambda m: None) -> spd.Calibration:
    """The speed probe of `model` (speed.calibrate: batch 1, prefill, PROBE_BATCH sequences), float32 unless the
    checkpoint is already quantized."""
    from brisk.engine.llm import LLM

    shape = shape or mem.model_shape(model)
    probed = "given" if shape.footprint.fixed_bytes else "float32"
    llm = LLM(model, dtype="float32", kv_cache_memory="128MiB", max_model_len=min(
        512, shape.footprint.config.max_position_embeddings), enable_prefix_caching=False,
        max_num_seqs=spd.PROBE_BATCH)
    try:
        return spd.calibrate(llm, probed, read_gbps, prompt_len=min(128, llm.engine.max_model_len // 4),
                             batch=spd.PROBE_BATCH, log=log)
    finally:
        del llm


# ---------------------------------------------------------------------------- --validate
def build_model(model: str | None, p: mem.Precision, folder: Path) -> str | None:
    """The checkpoint `p` runs: the model itself, or a quantized / pruned copy written into `folder`."""
    from brisk.model.loader import resolve_model

    if p.bits is None and not p.sparsity:
        return model
    src = str(resolve_model(model))
    if p.bits is not None:
        from brisk.quant.cli import quantize

        quantize.main([src, str(folder), "--method", p.method, "--bits", str(p.bits), "--group-size",
                       str(p.group_size)], standalone_mode=False)
    else:
        from brisk.prune.cli import prune

        pattern = ["--pattern", "2:4"] if p.sparsity and p.sparsity.endswith("2:4") else ["--sparsity", "0.5"]
        prune.main([src, str(folder), "--method", "wanda", *pattern], standalone_mode=False)
    return str(folder)


def measure_candidate(llm: Any, goal: str, concurrency: int, seconds: float, prompt_len: int = 128,
                      output_len: int = 32) -> dict[str, float]:
    """Best decode tok/s over repeated runs until `seconds` pass (at least one): batch 1 for latency, the
    candidate's concurrency for throughput. The batch's prompts are prefilled over several steps while the first
    ones decode, so each request generates `output_len` tokens more than those steps (the clock starts when all
    have their first token)."""
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.bench.quant import decode_rate, output_len_together

    tok = llm.get_tokenizer()
    batch = 1 if goal == "latency" else concurrency
    output_len = output_len_together(llm, batch, prompt_len, output_len)
    prompt_len = min(prompt_len, llm.engine.max_model_len - output_len - 1)
    prompt = make_prompt(tok, text_token_ids(tok), 0, prompt_len)
    decode_rate(llm, prompt, 1, 4)  # warm-up
    best, runs = 0.0, 0
    deadline = time.perf_counter() + seconds
    while runs == 0 or time.perf_counter() < deadline:
        best = max(best, decode_rate(llm, prompt, batch, output_len)[0])
        runs += 1
    return {"tok_s": best, "runs": runs, "batch": batch}


def validate_top(advice: Advice, model: str | None, seconds: float, log: Callable[[str], None],
                 top: int = 3) -> None:
    """Run the first `top` candidates for `seconds` each and re-rank them on the measurement."""
    heads = advice.ranked[:top]
    measure_all(heads, advice, model, seconds, log)
    heads.sort(key=lambda c: -c.figure(advice.goal))
    advice.ranked[:top] = heads
    advice.validated = True


def measure_all(cands: list[Candidate], advice: Advice, model: str | None, seconds: float,
                log: Callable[[str], None]) -> None:
    """Build and run each of `cands` for `seconds` (sets `measured`). All decode after the same prompt, of the
    mean context the prediction assumes (half of --context: a StreamingLLM cache evicts in it when its budget is
    smaller)."""
    from brisk.engine.llm import LLM

    prompt_len = max(16, min(advice.context // 2, advice.context - 64))
    with tempfile.TemporaryDirectory(prefix="brisk-advise-") as tmp:
        for i, cand in enumerate(cands):
            log(f"measure {i + 1}/{len(cands)}: {cand.name} ...")
            path = build_model(model, cand.precision, Path(tmp) / f"c{i}")
            llm = LLM(path, enable_prefix_caching=False, **cand.settings)
            cand.measured = measure_candidate(llm, advice.goal, advice.concurrency, seconds, prompt_len)
            log(f"measure: {cand.name}: {cand.measured['tok_s']:.1f} tok/s measured, "
                f"{cand.figure_predicted(advice.goal):.1f} predicted")
            del llm


def fmt_pct(x: float | None) -> str:
    if x is None:
        return "?"
    return f"+{100 * x:.2f}%" if x < 10 else "unusable"

