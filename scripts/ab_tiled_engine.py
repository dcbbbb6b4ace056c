"""Same-process A/B of a quantized model's engine with its layers tiled (quant_q8t.cpp, the load default on AVX-512)
and kept blocked (quant_linear.cpp / quant_q8.cpp), or with two KV-cache dtypes: batch decode tok/s, alternated run
by run so that both engines see the same bandwidth phase, and optionally the time to first token of one prompt.

    python scripts/ab_tiled_engine.py MODEL_DIR [--activations auto|float|int8] [--batches 1,8] [--runs 5]
        [--ttft 512] [--kv bfloat16]

Without --kv the two engines are blocked vs tiled; with --kv DTYPE both are tiled and differ in the KV cache
(the model dtype vs DTYPE). Decode: 128-token prompts, 64 tokens, prefill excluded (brisk.bench.quant.decode_rate);
printed: best and median tok/s, and whether the first request's greedy tokens agree. --ttft N: one N-token prompt,
max_tokens 1, median of 6 alternated runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

import brisk.ops.qlinear as qlinear
from brisk.bench.prompts import make_prompt, text_token_ids
from brisk.bench.quant import decode_rate
from brisk.engine.config import CacheConfig, EngineConfig
from brisk.engine.llm_engine import LLMEngine
from brisk.engine.sampling_params import SamplingParams
from brisk.model.loader import load_model


def make_engine(model: str, tiled: bool, activations: str, kv: str):  # noqa: ANN201
    can_tile = qlinear.can_tile
    if not tiled:  # load_model asks can_tile for every layer
        qlinear.can_tile = lambda pw: False  # noqa: ARG005
    try:
        loaded = load_model(model, dtype=torch.float32)
        config = EngineConfig(model=model, max_model_len=2048, quant_activations=activations,
                              cache=CacheConfig(kv_cache_memory="128MiB", enable_prefix_caching=False,
                                                kv_cache_dtype=kv))
        engine = SimpleNamespace(engine=LLMEngine(config, loaded))  # set_quant_activations tiles via can_tile too
    finally:
        qlinear.can_tile = can_tile
    layers = sum(getattr(m, "packed", None) is not None and m.packed.tiled for m in loaded.model.modules())
    return engine, loaded, layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--activations", default="auto", choices=["auto", "float", "int8"])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ttft", type=int, default=0, help="prompt tokens of a time-to-first-token A/B (0: none)")
    ap.add_argument("--kv", default=None, help="compare the model-dtype KV cache with this dtype (both tiled)")
    args = ap.parse_args()
    variants = ([("blocked", False, "auto"), ("tiled", True, "auto")] if args.kv is None
                else [("kv auto", True, "auto"), (f"kv {args.kv}", True, args.kv)])
    rows = []
    for name, tiled, kv in variants:
        engine, loaded, layers = make_engine(args.model, tiled, args.activations, kv)
        prompt = make_prompt(loaded.tokenizer, text_token_ids(loaded.tokenizer), 0, 128)
        decode_rate(engine, prompt, 1, 16)  # warm-up: kernels built, caches touched
        rows.append((name, engine, loaded))
        print(f"{name}: {layers} tiled layers")
    prompt = make_prompt(rows[0][2].tokenizer, text_token_ids(rows[0][2].tokenizer), 0, 128)
    for batch in [int(b) for b in args.batches.split(",")]:
        rates: dict[str, list[float]] = {name: [] for name, _, _ in rows}
        tokens = {}
        for _ in range(args.runs):
            for name, engine, _ in rows:
                rate, first = decode_rate(engine, prompt, batch, 64)
                rates[name].append(rate)
                tokens[name] = first
        same = len({tuple(t) for t in tokens.values()}) == 1
        print(f"batch {batch}: " + ", ".join(f"{n} best {max(v):.1f} median {statistics.median(v):.1f} tok/s"
                                            for n, v in rates.items()) + f"; greedy tokens equal: {same}")
    if args.ttft:
        ids = make_prompt(rows[0][2].tokenizer, text_token_ids(rows[0][2].tokenizer), 0, args.ttft)
        params = SamplingParams(temperature=0.0, max_tokens=1)
        times: dict[str, list[float]] = {name: [] for name, _, _ in rows}
        for i in range(6):
            for name, engine, _ in rows:
                t0 = time.perf_counter()
                engine.engine.add_request(None, ids[i:] + ids[:i], params)
                while engine.engine.has_unfinished_requests():
                    engine.engine.step()
                times[name].append(time.perf_counter() - t0)
        print(f"time to first token, {args.ttft} tokens: "
              + ", ".join(f"{n} median {statistics.median(v) * 1e3:.0f} ms" for n, v in times.items()))


if __name__ == "__main__":
    main()
