"""The quality cost of each technique for a model: perplexity on held-apart text, one technique at a time.

Every technique is measured against the same reference (the model's float32 weights; a quantized GGUF file is
dequantized for it) on the same windows of the evaluation text (Sense and Sensibility; calibration draws from
Emma, so nothing is scored on text a method saw). The cost is the relative perplexity increase. Techniques that
are lossless by construction (speculative decoding, the paged cache, fusion) cost nothing and are not measured.

A combination is priced by adding the techniques' log-perplexity increases (weights and KV cache errors compound
roughly independently); `brisk advise --validate` measures the combinations it recommends.

`stored_table(model)` is the table shipped for the default model (measured by `measure_quality_table`, the
protocol and command in the file); `measure_quality_table` computes one for any model.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

# technique -> what it is, how to build it (a `brisk quantize` / `brisk prune` argument list, or none: the weights
# as they are), and how to run it (load dtype, whether a GGUF keeps its codes, KV cache dtype)
WEIGHT_TECHNIQUES: dict[str, dict[str, Any]] = {
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "gguf": {"keep_quantized": True},  # a quantized GGUF file in its own codes
    "int8": {"quantize": ["--method", "rtn", "--bits", "8", "--group-size", "-1"]},
    **{f"int4-{m}-g{g}": {"quantize": ["--method", m, "--bits", "4", "--group-size", str(g)]}
       for m in ("rtn", "gptq", "awq") for g in (32, 64, 128)},
    "wanda-50": {"prune": ["--method", "wanda", "--sparsity", "0.5"]},
    "wanda-2:4": {"prune": ["--method", "wanda", "--pattern", "2:4"]},
}
KV_TECHNIQUES = {"kv-int8": "int8", "kv-int4": "int4"}
# StreamingLLM (4 sinks + a window, N tokens of KV kept in all) is priced on one long stream, not on windows:
# `streaming-N` against `stream-full` (the full cache) on the first STREAM_TOKENS tokens of the evaluation text,
# fed in chunks of STREAM_CHUNK through the engine's paged cache (eval/longppl.py)
STREAM_BUDGETS = (512, 1024, 2048, 4096)
STREAM_TOKENS = 8192
STREAM_CHUNK = 256
STREAM_SINKS = 4
STREAM_REFERENCE = "stream-full"
LOSSLESS = ("speculative", "paged", "fusion")
STORED_FILE = "quality_smollm2.json"


def applies(technique: str, hidden_size: int, intermediate_size: int) -> bool:
    """A group size must divide every linear layer's input dimension (hidden and MLP width)."""
    if "-g" not in technique:
        return True
    group = int(technique.rsplit("-g", 1)[1])
    return hidden_size % group == 0 and intermediate_size % group == 0


def stored_table(model: str | None) -> dict[str, Any] | None:
    """The shipped table when `model` is the default model (None, 'default' or its packaged path), else None."""
    from brisk.model.loader import default_model_path, resolve_model

    try:
        if resolve_model(model) != default_model_path():
            return None
    except Exception:  # the default model is not installed: nothing stored applies
        return None
    text = resources.files("brisk.advise").joinpath("data", STORED_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def relative_cost(table: dict[str, Any], technique: str) -> float | None:
    """Relative perplexity increase of one technique (0.02 = +2%), or None when the table lacks it."""
    if technique in LOSSLESS:
        return 0.0
    ppl = table["ppl"].get(technique)
    reference = table["ppl"].get(STREAM_REFERENCE) if technique.startswith("streaming-") else table["ppl"]["float32"]
    return None if ppl is None or reference is None else ppl / reference - 1.0


def stream_budgets(context: int) -> list[int]:
    """The StreamingLLM budgets worth pricing at `context`: those shorter than it (else nothing is evicted)."""
    return [n for n in STREAM_BUDGETS if n < context]


def measure_stream_quality(model: str | None, budgets: tuple[int, ...] = STREAM_BUDGETS,
                           stream_tokens: int = STREAM_TOKENS, chunk: int = STREAM_CHUNK,
                           log: Callable[[str], None] = print) -> dict[str, Any]:
    """`stream-full` and `streaming-N` perplexity on one stream of `stream_tokens` tokens of the evaluation text
    (at most the model's trained context, so the reference does not extrapolate RoPE)."""
    from brisk.data import evaluation_text_path
    from brisk.eval.longppl import long_perplexity
    from brisk.model.loader import load_model, resolve_model

    loaded = load_model(resolve_model(model), show_progress=False)
    tokens = min(stream_tokens, loaded.config.max_position_embeddings)
    text = evaluation_text_path().read_text(encoding="utf-8")
    ppl: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for name, mode, budget in [(STREAM_REFERENCE, "full", None),
                               *((f"streaming-{n}", "streaming", n) for n in budgets if n < tokens)]:
        log(f"quality: {name} ...")
        res = long_perplexity(loaded, text, mode, budget=budget, sink_tokens=STREAM_SINKS, max_tokens=tokens,
                              chunk=chunk, progress=False)
        ppl[name], seconds[name] = res.ppl, round(res.seconds, 1)
        log(f"quality: {name}: ppl {res.ppl:.4f} ({res.seconds:.0f} s)")
    return {"ppl": ppl, "seconds": seconds,
            "stream_protocol": {"stream_tokens": tokens, "chunk": chunk, "sink_tokens": STREAM_SINKS}}


def combined_cost(table: dict[str, Any], techniques: list[str]) -> float | None:
    """Relative increase of a combination: the techniques' log-perplexity increases added."""
    total = 0.0
    for t in techniques:
        cost = relative_cost(table, t)
        if cost is None:
            return None
        total += math.log1p(cost)
    return math.expm1(total)


def measure_quality_table(model: str | None, techniques: list[str] | None = None, window: int = 512,
                          max_windows: int = 8, workdir: str | Path | None = None,
                          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Perplexity of every technique (default: all that apply to `model`) on `max_windows` windows of `window`
    tokens of the evaluation text. Quantized and pruned checkpoints are built in a temporary folder and removed."""
    from brisk.data import evaluation_text_path
    from brisk.eval.ppl import perplexity
    from brisk.model.loader import resolve_model

    source = resolve_model(model)
    quantized_gguf = source.suffix == ".gguf" and _gguf_is_quantized(source)
    from brisk.model.gguf import read_gguf_config

    if techniques is None:
        config = read_gguf_config(source) if source.suffix == ".gguf" else None
        if config is None:
            from brisk.model.config import ModelConfig

            config = ModelConfig.from_hf_dict(json.loads((source / "config.json").read_text(encoding="utf-8")))
        techniques = [t for t in [*WEIGHT_TECHNIQUES, *KV_TECHNIQUES] if (t != "gguf" or quantized_gguf)
                      and applies(t, config.hidden_size, config.intermediate_size)]
    names = techniques
    unknown = [t for t in names if t not in WEIGHT_TECHNIQUES and t not in KV_TECHNIQUES]
    if unknown:
        raise ValueError(f"unknown technique(s) {', '.join(unknown)}; known: "
                         f"{', '.join([*WEIGHT_TECHNIQUES, *KV_TECHNIQUES])}")
    if "float32" not in names:
        names = ["float32", *names]
    text = evaluation_text_path().read_text(encoding="utf-8")
    ppl: dict[str, float] = {}
    seconds: dict[str, float] = {}
    ids: list[int] | None = None  # every technique keeps the model's tokenizer: the text is encoded once
    with tempfile.TemporaryDirectory(dir=workdir, prefix="brisk-quality-") as tmp:
        for name in names:
            start = time.perf_counter()
            log(f"quality: {name} ...")
            loaded, kv = _load_for(name, source, Path(tmp))
            if ids is None:
                ids = loaded.tokenizer.encode(text, add_special_tokens=False)
            ppl[name] = perplexity(loaded, text, window=window, max_windows=max_windows, progress=False,
                                   kv_cache_dtype=kv, token_ids=ids).ppl
            seconds[name] = round(time.perf_counter() - start, 1)
            log(f"quality: {name}: ppl {ppl[name]:.4f} ({seconds[name]:.0f} s)")
            del loaded
    return {"model": source.name, "protocol": {"text": evaluation_text_path().name, "window": window,
                                               "max_windows": max_windows},
            "ppl": ppl, "seconds": seconds}


def _gguf_is_quantized(path: Path) -> bool:
    from brisk.model.gguf import read_gguf

    f = read_gguf(path)
    try:
        return any(t.qtype.name not in ("F32", "F16", "BF16") for t in f.tensors.values())
    finally:
        f.buffer.close()


def _load_for(name: str, source: Path, tmp: Path) -> tuple[Any, str]:
    import torch

    from brisk.model.loader import load_model
    from brisk.quant.layers import set_quant_activations

    if name in KV_TECHNIQUES:
        return load_model(source, show_progress=False), KV_TECHNIQUES[name]
    spec = WEIGHT_TECHNIQUES[name]
    path: Path = source
    if "quantize" in spec or "prune" in spec:
        path = tmp / name.replace(":", "-")
        if "quantize" in spec:
            from brisk.quant.cli import quantize as command
            args = spec["quantize"]
        else:
            from brisk.prune.cli import prune as command
            args = spec["prune"]
        command.main([str(source), str(path), *args], standalone_mode=False)
    dtype = torch.bfloat16 if spec.get("dtype") == "bfloat16" else torch.float32
    loaded = load_model(path, dtype=dtype, keep_quantized=bool(spec.get("keep_quantized")), show_progress=False)
    set_quant_activations(loaded.model, "auto")  # what the engine runs (int8 activations on 4-bit layers)
    return loaded, "auto"
