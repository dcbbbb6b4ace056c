"""`brisk report`'s sections for the KV-shrinking model changes and the compared runtime:

    gqa          the model's KV heads -> fewer, mean-pooled (`brisk convert gqa`)   decode at batch 1 and 8 after a
                                                                                    long prompt; KV bytes per token
    streaming    full KV cache -> StreamingLLM (sinks + window)                     batch-1 decode at a long context;
                                                                                    the KV blocks one stream holds
    onnxruntime  ONNX Runtime on the same float32 weights -> brisk float32          decode at batch 1 and 8

Each is a same-run ratio as in report_cmd.py (the two sides alternate within each round, the best round counts),
with the perplexity cost where the technique changes the output: GQA on the windows of the evaluation text every
other row uses; StreamingLLM on one stream of the evaluation text as long as the context it is measured at
(`brisk eval ppl --long`'s protocol), against the full cache on the same stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from brisk.bench.report_cmd import Params, Row, _engine, _ppl, _rounds


def _fewer_kv_heads(num_kv_heads: int) -> int:
    """The largest proper divisor of `num_kv_heads` (8 -> 4, 3 -> 1): one conversion step of GQA, MQA when the
    count is prime."""
    for d in range(2, num_kv_heads + 1):
        if num_kv_heads % d == 0:
            return num_kv_heads // d
    return num_kv_heads


def _num_kv_heads(model: str | None) -> int:
    from brisk.engine.memory import model_footprint

    return model_footprint(model).config.num_key_value_heads


def gqa_rows(model: str | None, p: Params, tmp: Path, log: Callable[[str], None]) -> list[Row]:
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.model.gqa import convert_gqa
    from brisk.model.loader import load_model

    k = _num_kv_heads(model)
    if k == 1:
        log("report: gqa: the model already has one KV head; nothing to convert")
        return []
    g = _fewer_kv_heads(k)
    log(f"report: converting {k} -> {g} KV heads ...")
    # the baseline is the same conversion at the model's own head count (exact: tests/test_gqa.py), so both sides
    # are float32 folders loaded the same way and differ only in their KV heads
    base = load_model(convert_gqa(model, tmp / f"kv{k}", k), show_progress=False)
    converted = load_model(convert_gqa(model, tmp / f"kv{g}", g), show_progress=False)
    c = base.config
    log("report: perplexity of the GQA conversion ...")
    ppl_base, ppl_conv = _ppl(base, p), _ppl(converted, p)
    max_len = p.kv_prompt + p.output_len + 64
    per_base, per_conv = c.kv_bytes_per_token(4), converted.config.kv_bytes_per_token(4)
    pool = f"{int(p.batch * max_len * per_base / 2**20) + 16}MiB"  # the base holds the whole batch at once
    engines = {"base": _engine(base, max_model_len=max_len, kv_cache_memory=pool),
               "gqa": _engine(converted, max_model_len=max_len, kv_cache_memory=pool)}
    tok = base.tokenizer
    prompt = make_prompt(tok, text_token_ids(tok), 0, p.kv_prompt)
    log("report: decode rounds (GQA) ...")
    best = _rounds(engines, prompt, (1, p.batch), p.output_len, p.runs)
    kind = "MQA" if g == 1 else "GQA"
    return [Row("gqa", f"{kind}: {k} -> {g} KV heads, mean-pooled", f"{k} KV heads", f"decode b={b}, "
                f"{p.kv_prompt}-token prompt", best[("gqa", b)] / best[("base", b)], ppl_conv, ppl_base,
                f"KV {per_conv:,} B/token vs {per_base:,} ({per_base / per_conv:.0f}x the tokens per byte)", per_conv,
                note="no uptraining (the paper uptrains ~5% of pretraining to recover quality)")
            for b in (1, p.batch)]


def streaming_rows(model: str | None, p: Params, log: Callable[[str], None]) -> list[Row]:
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.data import evaluation_text_path
    from brisk.eval.longppl import long_perplexity
    from brisk.model.loader import load_model

    loaded = load_model(model, show_progress=False)
    c = loaded.config
    context = min(p.stream_context, c.max_position_embeddings - p.output_len - 16)
    budget, sinks, block = min(p.stream_budget, context // 2), 4, 16
    text = evaluation_text_path().read_text(encoding="utf-8")
    runs = {}
    for mode in ("full", "streaming"):
        log(f"report: {context}-token stream, {mode} cache ...")
        runs[mode] = long_perplexity(loaded, text, mode, budget=budget, sink_tokens=sinks, max_tokens=context,
                                     block_size=block, progress=False)
    max_len = context + p.output_len + 16
    per_block = c.kv_bytes_per_token(4) * block
    # one pool for both, holding the full cache's sequence twice over; a 256-token step budget, so that the
    # streaming request's bound (sinks + window + one step's tokens) fits it at any context
    step = 256
    pool = 2 * max(max_len, budget + step + 4 * block) * per_block // block
    common = {"max_model_len": max_len, "kv_cache_memory": pool, "max_num_batched_tokens": step,
              "enable_chunked_prefill": True}
    engines = {"full": _engine(loaded, **common),
               "streaming": _engine(loaded, kv_policy="streaming", kv_budget=budget, sink_tokens=sinks, **common)}
    tok = loaded.tokenizer
    prompt = make_prompt(tok, text_token_ids(tok), 0, context)
    log("report: decode rounds (StreamingLLM) ...")
    best = {name: rate for (name, _), rate in _rounds(engines, prompt, (1,), p.output_len, p.runs).items()}
    held = {mode: r.max_blocks_held * per_block for mode, r in runs.items()}
    return [Row("streaming", f"StreamingLLM: {sinks} sinks + {budget - sinks}-token window",
                "full KV cache", f"decode b=1 at {context} tokens", best["streaming"] / best["full"],
                runs["streaming"].ppl, runs["full"].ppl,
                f"KV held {held['streaming'] / 2**20:.1f} MiB vs {held['full'] / 2**20:.1f} MiB at {context} tokens "
                "(bounded: it stays there at any length)", held["streaming"],
                note=f"ppl on one {context}-token stream of the evaluation text (`brisk eval ppl --long`); its "
                     "attention runs on the C++ kernel, its steps on the decode plan's Python layer loop (the full "
                     "cache's batch-1 steps take the C++ one)")]


def onnxruntime_rows(model: str | None, p: Params, log: Callable[[str], None]) -> list[Row]:
    """brisk float32 against ONNX Runtime on the same float32 weights (bench/onnx_baseline.py's graph, cached);
    one skipped row naming the missing extra when onnxruntime is not installed."""
    import torch

    from brisk.bench.onnx_baseline import (
        OnnxModel,
        OnnxRuntimeMissingError,
        cached_onnx,
        check_exportable,
        require_onnxruntime,
    )
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.bench.quant import decode_rate
    from brisk.model.loader import load_model, resolve_model

    try:
        require_onnxruntime()
    except OnnxRuntimeMissingError:
        log("report: onnxruntime not installed: its row is skipped (pip install 'brisk[onnx]')")
        return [Row("onnxruntime", "brisk float32", "ONNX Runtime float32", "decode", None,
                    note="skipped: onnxruntime not installed (pip install 'brisk[onnx]')")]
    loaded = load_model(model, show_progress=False)
    try:
        check_exportable(loaded.config)
    except ValueError as e:
        log(f"report: onnxruntime row skipped: {e}")
        return [Row("onnxruntime", "brisk float32", "ONNX Runtime float32", "decode", None, note=f"skipped: {e}")]
    onnx_path = cached_onnx(resolve_model(model), log=log)
    threads = torch.get_num_threads()
    ort = OnnxModel(onnx_path, threads)
    llm = _engine(loaded)
    tok = loaded.tokenizer
    prompt = make_prompt(tok, text_token_ids(tok), 0, p.input_len)
    batches = (1, p.batch)
    # the same rotated prompts as decode_rate's (one length: the graph has no padding)
    rotated = {b: [prompt[i:] + prompt[:i] for i in range(b)] for b in batches}
    ort.decode_rate(rotated[1], 4)  # warm-up
    decode_rate(llm, prompt, 1, 4)
    best: dict[tuple[str, int], float] = {}
    log("report: decode rounds (brisk vs onnxruntime) ...")
    for _ in range(p.runs):
        for b in batches:
            for name in ("brisk", "onnxruntime"):
                start = time.perf_counter()
                rate = decode_rate(llm, prompt, b, p.output_len)[0] if name == "brisk" else \
                    ort.decode_rate(rotated[b], p.output_len)[0]
                best[(name, b)] = max(best.get((name, b), 0.0), rate)
                log(f"report: {name} b={b}: {rate:.1f} tok/s ({time.perf_counter() - start:.1f} s)")
    return [Row("onnxruntime", "brisk float32", "ONNX Runtime float32 (CPU provider)", f"decode b={b}",
                best[("brisk", b)] / best[("onnxruntime", b)], memory="same float32 weights",
                note=f"b={b}: brisk {best[('brisk', b)]:.1f} tok/s, onnxruntime {best[('onnxruntime', b)]:.1f} tok/s "
                     f"({threads} threads each); lossless")
            for b in batches]


def section_runners(model: str | None, p: Params, tmp: Path, log: Callable[[str], None]
                    ) -> dict[str, Callable[[], Any]]:
    return {"gqa": lambda: gqa_rows(model, p, tmp, log),
            "streaming": lambda: streaming_rows(model, p, log),
            "onnxruntime": lambda: onnxruntime_rows(model, p, log)}
