"""Predicted decode and prefill speed of a candidate: a roofline of this machine, calibrated by a probe.

A decode step of B sequences at context L reads every weight once and each sequence's KV cache, and does
2 x (linear weights) x B multiply-adds' worth of work, so its time is

    t(B) = max(weight bytes / (bandwidth x e_fmt), B / prefill rate_fmt) + B x KV bytes(L) / (bandwidth x e_kv)
           + (B - 1) x s

with the machine's read bandwidth measured (`brisk bench membw`'s method), e_fmt the fraction of it the format's
kernels reach at batch 1, the prefill rate (tokens/s, compute bound) as the compute ceiling, e_kv the fraction the
attention kernel reaches on the float cache (measured with the KV factors) and s what each further sequence adds
to a step besides (scheduling, sampling, small-batch kernels). The probe (a few seconds on the real model: batch-1
decode, one prefill, and a short decode of PROBE_BATCH sequences for s) fixes e, s and the prefill rate of the
probed format;
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
PROBE_BATCH = 16


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
    batch_tok_s: float = 0.0  # probe: PROBE_BATCH sequences decoding together at a short context
    per_seq_s: float = 0.0  # s: the step time each sequence beyond the first adds besides the roofline

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
            context: int, concurrency: int, spec_speedup: float = 1.0, sparse_speedup: float = 1.0,
            kv_cache_dtype: str = "auto", num_layers: int = 0, stream_budget: int | None = None) -> Prediction:
    """The roofline at batch 1 and at `concurrency`; KV read at the mean context of a sequence (context / 2; under
    StreamingLLM with `stream_budget` tokens kept, the mean of min(t, budget) over t < context).

    A quantized KV cache is priced by the path it runs (factors["kv_paths"], `measure_kv_factors`): its attention
    reads fewer bytes but widens every code it reads, so its bytes go at `read` times the float cache's rate, and
    its steps (quantize on write) take `step_us` more per layer and step. StreamingLLM's steps take the decode
    plan's Python layer loop and a sink pass: kv_paths["streaming"]'s `step_us` more, added to the dtype's."""
    rows = factors["formats"]
    key = factor_key(precision_name)
    ref = rows.get(factor_key(cal.probed), rows["float32"])
    row = rows.get(key, rows["float32"])
    bw = cal.read_gbps * 1e9
    eff = cal.efficiency * row["bandwidth"] / ref["bandwidth"]
    prefill = cal.prefill_tok_s * row["prefill"] / ref["prefill"]
    paths = factors.get("kv_paths", {})
    path = {"read": 1.0, "step_us": 0.0, **paths.get(kv_cache_dtype, {})}
    # the float cache's attention kernel against the probe's weight streaming rate, then the dtype's path
    kv_eff = cal.efficiency * paths.get("auto", {}).get("vs_weights", 1.0) * path["read"]
    overhead = num_layers * path["step_us"] * 1e-6
    mean_ctx = context / 2
    if stream_budget is not None and stream_budget < context:
        mean_ctx = stream_budget - stream_budget**2 / (2 * context)
        overhead += num_layers * paths.get("streaming", {}).get("step_us", 0.0) * 1e-6

    def step(batch: int) -> tuple[float, str]:
        mem = weight_bytes / (bw * eff)
        compute = batch / prefill
        kv = batch * kv_bytes_token * mean_ctx / (bw * kv_eff)
        extra = (batch - 1) * cal.per_seq_s * row.get("per_seq", 1.0) / ref.get("per_seq", 1.0)
        return max(mem, compute) + kv + overhead + extra, "memory" if mem >= compute else "compute"

    t1, _ = step(1)
    tb, bound = step(concurrency)
    b1 = sparse_speedup * spec_speedup / t1
    batch = concurrency / tb * (spec_speedup if concurrency <= SPEC_DISABLE_ABOVE else 1.0)
    return Prediction(b1, batch if concurrency > 1 else b1, prefill, bound)


def calibrate(llm: Any, probed: str, read_gbps: float | None = None, prompt_len: int = 128, output_len: int = 24,
              batch: int = 1, log: Callable[[str], None] = lambda m: None) -> Calibration:
    """A few seconds on the loaded model: a batch-1 decode of `output_len` tokens after a prompt of `prompt_len`
    (best of 2), and the prefill rate of that prompt; plus a quick read-bandwidth measurement; with `batch` > 1,
    `batch` sequences of 64 tokens decoding together (best of 2), for the per-sequence step cost."""
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
    cal = Calibration(read_gbps, probed, decode, prefill, weights, kv, 0.0)
    cal.efficiency = (weights + kv) * decode / (read_gbps * 1e9)
    if batch > 1:
        from brisk.bench.quant import decode_rate, output_len_together

        short = make_prompt(tok, text_token_ids(tok), 0, 64)
        output = output_len_together(llm, batch, 64, output_len)
        cal.batch_tok_s = max(decode_rate(llm, short, batch, output)[0] for _ in range(2))
        # what the roofline gives at this batch without s (the short context's KV reads are in the probe's e)
        roof = max(weights / (read_gbps * 1e9 * cal.efficiency), batch / prefill)
        cal.per_seq_s = max(0.0, (batch / cal.batch_tok_s - roof) / (batch - 1))
    cal.seconds = time.perf_counter() - start
    log(f"probe ({probed}): decode {decode:.1f} tok/s at batch 1 ({cal.efficiency:.0%} of {read_gbps:.1f} GB/s), "
        f"{cal.batch_tok_s:.0f} tok/s at batch {batch} ({1e3 * cal.per_seq_s:.2f} ms a sequence besides the roofline), "
        f"prefill {prefill:.0f} tok/s, {cal.seconds:.1f} s")
    return cal


FACTOR_FORMATS = ("float32", "bfloat16", "gguf", "int8", "int4-g32", "int4-g64", "int4-g128")


def measure_factors(model: str | None, formats: tuple[str, ...] = FACTOR_FORMATS, rounds: int = 2,
                    log: Callable[[str], None] = print) -> dict[str, Any]:
    """Batch-1 bandwidth fraction, prefill rate and per-sequence step cost (the PROBE_BATCH probe) of each format
    relative to float32, from one probe per format per round (formats alternate within a round; the best round
    counts). int4 formats are RTN checkpoints written to a temporary folder; gguf is a quantized GGUF model in its
    own codes (skipped for other models); the probe's read bandwidth is measured once and shared."""
    import tempfile
    from pathlib import Path

    from brisk.bench.membw import QUICK_BUFFER_BYTES, measure_membw
    from brisk.bench.quant import build_checkpoint
    from brisk.engine.llm import LLM
    from brisk.model.loader import resolve_model
    from brisk.quant.config import LayerQuant, QuantConfigError

    read = measure_membw(QUICK_BUFFER_BYTES, runs=3).read_gbps
    best: dict[str, Calibration] = {}
    with tempfile.TemporaryDirectory(prefix="brisk-factors-") as tmp:
        engines = {}
        if not str(resolve_model(model)).endswith(".gguf"):
            formats = tuple(f for f in formats if f != "gguf")
        for name in formats:
            kw: dict[str, Any] = {"dtype": {"bfloat16": "bfloat16", "gguf": "auto"}.get(name, "float32")}
            path = model
            if name.startswith("int"):
                group = -1 if name == "int8" else int(name.rsplit("-g", 1)[1])
                setting = LayerQuant(bits=8 if name == "int8" else 4, group_size=group, sym=name == "int8")
                path = str(Path(tmp) / name)
                log(f"factors: quantizing {name} ...")
                try:
                    build_checkpoint(setting, Path(path), model)
                except QuantConfigError as e:  # a group size that does not divide this model's layers
                    log(f"factors: {name} skipped: {e}")
                    continue
            engines[name] = LLM(path, kv_cache_memory="128MiB", enable_prefix_caching=False, max_model_len=512,
                                max_num_seqs=PROBE_BATCH, **kw)
        for _r in range(rounds):
            for name, llm in engines.items():
                cal = calibrate(llm, name, read, batch=PROBE_BATCH, log=log)
                if name not in best or cal.decode_tok_s > best[name].decode_tok_s:
                    best[name] = cal
    ref = best["float32"]
    return {"read_gbps": read,
            "formats": {n: {"bandwidth": round(c.efficiency / ref.efficiency, 3),
                            "prefill": round(c.prefill_tok_s / ref.prefill_tok_s, 3),
                            "per_seq": round(c.per_seq_s / ref.per_seq_s, 3) if ref.per_seq_s else 1.0,
                            "decode_tok_s": round(c.decode_tok_s, 1), "prefill_tok_s": round(c.prefill_tok_s, 1)}
                        for n, c in best.items()}}


KV_FACTOR_DTYPES = ("int8", "int4")


def measure_kv_factors(model: str | None, rounds: int = 5, batch: int = 64, context: int = 400,
                       log: Callable[[str], None] = print) -> dict[str, Any]:
    """What a quantized KV cache's path costs against the float cache's, for factors["kv_paths"]:

    - read: the attention kernel's bytes per second relative to the float32 cache's, one layer of the model's
      attention shape, `batch` sequences x `context` tokens on shuffled blocks (memory-bound: the pool is far
      larger than the caches), median of `rounds` x 20 calls;
    - step_us: the extra time of a batch-1 decode step per layer at a short context (64 tokens, so KV reads do
      not count): the Python loop and the quantize-on-write; 32 tokens per run, the dtypes alternated, the best
      of `rounds` runs each.

    The "auto" row is the float cache's: `vs_weights`, the attention kernel's cache bytes per second against the bytes
    per second the float32 model's batch-1 decode streams its weights at (so a probe's achieved rate, bandwidth x
    e, prices the KV reads of every format, whatever the bandwidth measurement gave). The "streaming" row is
    StreamingLLM on the float cache (budget 32 of the 64-token prompt, so every step evicts): its `step_us` is
    measured the same way; its window is read by the float cache's kernel (read 1.0).
    """
    import statistics

    import torch

    from brisk.advise.memory import kv_block_size
    from brisk.bench.latency import run_latency
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.bench.roofline import weight_bytes_per_token
    from brisk.engine.llm import LLM
    from brisk.kvcache.quant import kv_bytes_per_token, make_kv_caches
    from brisk.ops.attention import paged_attention, write_kv
    from brisk.ops.metadata import AttentionMetadata

    engines = {kv: LLM(model, kv_cache_dtype=kv, kv_cache_memory="64MiB", enable_prefix_caching=False,
                       max_model_len=512, dtype="float32") for kv in ("auto", *KV_FACTOR_DTYPES)}
    engines["streaming"] = LLM(model, kv_policy="streaming", kv_budget=32, sink_tokens=4, kv_cache_memory="64MiB",
                               max_num_batched_tokens=512, enable_prefix_caching=False, max_model_len=512,
                               dtype="float32")
    read: dict[str, float] = {"streaming": 1.0}
    config = engines["auto"].engine.loaded.config
    h, kvh, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layers = config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    for kv in ("auto", *KV_FACTOR_DTYPES):
        bs = kv_block_size(kv)
        per_seq = (context + bs - 1) // bs
        num_blocks = batch * per_seq
        cache = make_kv_caches(kv, 1, num_blocks, bs, kvh, d, torch.float32)[0]
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        blocks = [pool[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
        for b in range(batch):
            slots = torch.tensor([blocks[b][p // bs] * bs + p % bs for p in range(context)])
            k, v = torch.randn(2, context, kvh, d, generator=gen)
            write_kv(cache, k, v, slots)
        meta = AttentionMetadata.for_sequences([1] * batch, [context] * batch, blocks, bs)
        q = torch.randn(batch, h, d, generator=gen)
        new = q[:, :kvh]
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(20):
                paged_attention(q, new, new, cache, meta, d**-0.5)
            times.append((time.perf_counter() - start) / 20)
        item = 4 if kv == "auto" else 0
        per_token = kv_bytes_per_token(kv, 1, kvh, d, bs, item)
        read[kv] = batch * context * per_token / statistics.median(times)
        log(f"kv factors: {kv} attention {statistics.median(times) * 1e3:.2f} ms a layer "
            f"({read[kv] / 1e9:.1f} GB/s of cache bytes)")
    best = dict.fromkeys(engines, 0.0)
    for _ in range(rounds):  # the dtypes alternate within a round; each keeps its best
        for kv, llm in engines.items():
            tok = llm.get_tokenizer()
            prompt = make_prompt(tok, text_token_ids(tok), 0, 64)
            best[kv] = max(best[kv], run_latency(llm, prompt, 32, runs=1, warmup=1).decode_tok_s)
    step = {kv: 1.0 / rate for kv, rate in best.items()}
    log("kv factors: batch-1 decode " + ", ".join(f"{kv} {rate:.1f} tok/s" for kv, rate in best.items()))
    streamed = weight_bytes_per_token(engines["auto"].engine.loaded.model) * best["auto"]
    out: dict[str, Any] = {"auto": {"read": 1.0, "step_us": 0.0, "vs_weights": round(read["auto"] / streamed, 3)}}
    out.update({kv: {"read": round(read[kv] / (1.0 if kv == "streaming" else read["auto"]), 3),
                     "step_us": round(max(0.0, (step[kv] - step["auto"]) / layers * 1e6), 1)}
                for kv in (*KV_FACTOR_DTYPES, "streaming")})
    return out



if __name__ == "__main__":  # python -m brisk.advise.speed [formats]: rows of data/speed_factors.json
    import sys

    if sys.argv[1:] == ["formats"]:
        print(json.dumps(measure_factors(None), indent=1))
    else:
        print(json.dumps({"kv_paths": measure_kv_factors(None)}, indent=1))
