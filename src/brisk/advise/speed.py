"""Predicted decode and prefill speed of a candidate: a roofline of this machine, calibrated by a probe.

A decode step of B sequences at context L reads every weight once and each sequence's KV cache, and does
2 x (linear weights) x B multiply-adds' worth of work, so its time is

    t(B) = max(weight bytes / (bandwidth x e_fmt), B / prefill rate_fmt) + B x KV bytes(L) / (bandwidth x e_kv)

with the machine's read bandwidth measured (`brisk bench membw`'s method), e_fmt the fraction of it the format's
kernels reach at batch 1, and the prefill rate (tokens/s, compute bound) as the compute ceiling. The probe (a few
seconds on the real model: batch-1 decode and one prefill) fixes e and the prefill rate of the probed format;
the other formats follow by the stored ratios in data/speed_factors.json (their batch-1 bandwidth fraction and
prefill rate relative to float32, measured by `measure_factors` on this CPU family: see docs/advise.md).
Speculative decoding multiplies the batch-1 rate by its stored speed-up, and does nothing above
`disable_by_batch_size` (8) sequences, where the engine stops drafting.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

FACTORS_FILE = "speed_factors.json"
SPEC_DISABLE_ABOVE = 8  # the engine's default disable_by_batch_size


@dataclass
class Calibration:
    read_gbps: float  # measured read bandwidth
    probed: str  # the format the probe ran
    decode_tok_s: float  # probe: batch-1 decode
    prefill_tok_s: float  # probe: prefill rate
    weight_bytes: int  # what one batch-1 token of the probed model reads
    kv_bytes_read: int  # KV bytes the probe's mean decode step read
    seconds: float
    efficiency: float = 0.0  # achieved fraction of the bandwidth of the probed format

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def stored_factors() -> dict[str, Any]:
    text = resources.files("brisk.advise").joinpath("data", FACTORS_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def factor_key(precision_name: str) -> str:
    """The factors table's row for a precision: int4 formats share one per group size (the method changes the
    codes, not the kernel)."""
    if precision_name.startswith("int4-"):
        return "int4-g" + precision_name.rsplit("-g", 1)[1]
    return precision_name


@dataclass
class Prediction:
    decode_b1_tok_s: float  # one sequence
    decode_batch_tok_s: float  # all `concurrency` sequences together, aggregate
    prefill_tok_s: float
    bound: str  # memory | compute, at the batch

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict(cal: Calibration, factors: dict[str, Any], precision_name: str, weight_bytes: int, kv_bytes_token: int,
            context: int, concurrency: int, spec_speedup: float = 1.0, sparse_speedup: float = 1.0) -> Prediction:
    """The roofline at batch 1 and at `concurrency`; KV read at the mean context of a sequence (context / 2)."""
    rows = factors["formats"]
    key = factor_key(precision_name)
    ref = rows.get(factor_key(cal.probed), rows["float32"])
    row = rows.get(key, rows["float32"])
    bw = cal.read_gbps * 1e9
    eff = cal.efficiency * row["bandwidth"] / ref["bandwidth"]
    prefill = cal.prefill_tok_s * row["prefill"] / ref["prefill"]
    kv_eff = cal.efficiency  # the attention kernels' share does not depend on the weight format
    mean_ctx = context / 2

    def step(batch: int) -> tuple[float, str]:
        mem = weight_bytes / (bw * eff)
        compute = batch / prefill
        kv = batch * kv_bytes_token * mean_ctx / (bw * kv_eff)
        return max(mem, compute) + kv, "memory" if mem >= compute else "compute"

    t1, _ = step(1)
    tb, bound = step(concurrency)
    b1 = sparse_speedup * spec_speedup / t1
    batch = concurrency / tb * (spec_speedup if concurrency <= SPEC_DISABLE_ABOVE else 1.0)
    return Prediction(b1, batch if concurrency > 1 else b1, prefill, bound)


def calibrate(llm: Any, probed: str, read_gbps: float | None = None, prompt_len: int = 128, output_len: int = 24,
              log: Callable[[str], None] = lambda m: None) -> Calibration:
    """A few seconds on the loaded model: a batch-1 decode of `output_len` tokens after a prompt of `prompt_len`
    (best of 2), and the prefill rate of that prompt; plus a quick read-bandwidth measurement."""
    from brisk.bench.latency import run_latency
    from brisk.bench.membw import QUICK_BUFFER_BYTES, measure_membw
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.bench.roofline import kv_bytes_read, mean_decode_context, weight_bytes_per_token

    start = time.perf_counter()
    if read_gbps is None:
        read_gbps = measure_membw(QUICK_BUFFER_BYTES, runs=3).read_gbps
    tok = llm.get_tokenizer()
    prompt = make_prompt(tok, text_token_ids(tok), 0, prompt_len)
    res = run_latency(llm, prompt, output_len, runs=2, warmup=1)
    decode = res.decode_tok_s
    prefill = prompt_len / min(res.ttft_s)
    weights = weight_bytes_per_token(llm.engine.loaded.model)
    config = llm.engine.loaded.config
    kv_item = 2 if str(llm.engine.loaded.dtype) == "torch.bfloat16" else 4
    kv = kv_bytes_read(config, kv_item, int(mean_decode_context(prompt_len, output_len)))
    cal = Calibration(read_gbps, probed, decode, prefill, weights, kv, time.perf_counter() - start)
    cal.efficiency = (weights + kv) * decode / (read_gbps * 1e9)
    log(f"probe ({probed}): decode {decode:.1f} tok/s at batch 1 ({cal.efficiency:.0%} of {read_gbps:.1f} GB/s), "
        f"prefill {prefill:.0f} tok/s, {cal.seconds:.1f} s")
    return cal


FACTOR_FORMATS = ("float32", "bfloat16", "int8", "int4-g32", "int4-g64", "int4-g128")


def measure_factors(model: str | None, formats: tuple[str, ...] = FACTOR_FORMATS, rounds: int = 2,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Batch-1 bandwidth fraction and prefill rate of each format relative to float32, from one probe per format
    per round (formats alternate within a round; the best round counts). int4 formats are RTN checkpoints written
    to a temporary folder; the probe's read bandwidth is measured once and shared."""
    import tempfile
    from pathlib import Path

    from brisk.bench.membw import QUICK_BUFFER_BYTES, measure_membw
    from brisk.bench.quant import build_checkpoint
    from brisk.engine.llm import LLM
    from brisk.quant.config import LayerQuant

    read = measure_membw(QUICK_BUFFER_BYTES, runs=3).read_gbps
    best: dict[str, Calibration] = {}
    with tempfile.TemporaryDirectory(prefix="brisk-factors-") as tmp:
        engines = {}
        for name in formats:
            kw: dict[str, Any] = {"dtype": "bfloat16" if name == "bfloat16" else "float32"}
            path = model
            if name.startswith("int"):
                group = -1 if name == "int8" else int(name.rsplit("-g", 1)[1])
                setting = LayerQuant(bits=8 if name == "int8" else 4, group_size=group, sym=name == "int8")
                path = str(Path(tmp) / name)
                log(f"factors: quantizing {name} ...")
                build_checkpoint(setting, Path(path), model)
            engines[name] = LLM(path, kv_cache_memory="64MiB", enable_prefix_caching=False, max_model_len=512,
                                **kw)
        for _r in range(rounds):
            for name, llm in engines.items():
                cal = calibrate(llm, name, read, log=log)
                if name not in best or cal.decode_tok_s > best[name].decode_tok_s:
                    best[name] = cal
    ref = best["float32"]
    return {"read_gbps": read,
            "formats": {n: {"bandwidth": round(c.efficiency / ref.efficiency, 3),
                            "prefill": round(c.prefill_tok_s / ref.prefill_tok_s, 3),
                            "decode_tok_s": round(c.decode_tok_s, 1), "prefill_tok_s": round(c.prefill_tok_s, 1)}
                        for n, c in best.items()}}
