"""Paged attention, C++ kernel vs the pure-PyTorch reference path: per layer and per decode step.

    python scripts/bench_paged_attention.py [--threads 2] [--batches 1,8,64] [--repeats 7] [--skip-model]

1. Attention of one layer (default-model shapes: 9 query heads, 3 kv heads, head_dim 64, block 16) for B decode
   sequences of ~370 cached tokens in shuffled blocks, float32 and bfloat16 caches. Reference = the runner's
   gather indices built once (as for layers 2..30), then index_select of K and V plus one batched SDPA.
2. Whole decode steps (`LLMEngine.step`) of the default model with B running requests (prompts of 32..512
   tokens, as /tmp/t/prof_batch.py), alternating kernel-on and kernel-off steps in one process so both see the
   same contexts and the same background load.

Every figure is the best of `repeats` (the median is printed next to it: their gap says how noisy the machine
was). The reference runs switch the kernels off in-process (kernels.configure(enabled=False)).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from brisk.ops import kernels
from brisk.ops.attention import AttentionMetadata, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def timed(fn, repeats: int) -> tuple[float, float]:
    """(best, median) wall time of fn() in ms."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return min(times), statistics.median(times)


def decode_problem(batch: int, context: int, dtype: torch.dtype) -> tuple:
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = (context + BLOCK - 1) // BLOCK
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    kv_new = torch.randn(batch, KV_HEADS, HEAD_DIM).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.zeros(batch, dtype=torch.int64), num_decodes=batch,
                             query_start_loc=torch.arange(batch + 1), block_tables=tables, context_lens=lens)
    return q, kv_new, kv_cache, meta


def bench_layer(batches: list[int], repeats: int) -> None:
    print("attention of one layer, decode, ~370 cached tokens per sequence (ms: best / median)")
    for dtype in (torch.float32, torch.bfloat16):
        for batch in batches:
            q, kv_new, kv_cache, meta = decode_problem(batch, 370, dtype)
            kv_bytes = 2 * batch * 370 * KV_HEADS * HEAD_DIM * kv_cache.element_size()

            def layer(use_kernels: bool, q=q, kv_new=kv_new, kv_cache=kv_cache, meta=meta) -> torch.Tensor:
                return paged_attention(q, kv_new, kv_new, kv_cache, meta, 0.125, use_kernels=use_kernels)

            fast = timed(lambda: layer(True), repeats)
            layer(False)  # the reference path builds its gather indices once per step, on the first layer
            slow = timed(lambda: layer(False), repeats)
            print(f"  {str(dtype)[6:]:8s} B={batch:3d}: kernel {fast[0]:7.3f} / {fast[1]:7.3f}   "
                  f"reference {slow[0]:7.3f} / {slow[1]:7.3f}   speedup {slow[0] / fast[0]:5.1f}x   "
                  f"kernel reads KV at {kv_bytes / fast[0] / 1e6:5.1f} GB/s")


def bench_model(batches: list[int], repeats: int) -> None:
    from brisk import LLM, SamplingParams
    from brisk.bench.prompts import sample_prompts

    print("decode step of the default model, float32 (ms: best / median)")
    for batch in batches:
        llm = LLM(max_model_len=1024, kv_cache_memory="2GiB")
        engine = llm.engine
        prompts = sample_prompts(llm.get_tokenizer(), batch, 32, 512, 0)
        # enough tokens that no request finishes while measured (early prefills decode during later ones)
        params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
        for p in prompts:
            engine.add_request(None, p, params)
        while engine.scheduler.waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
            engine.step()
        engine.step()  # warm both paths
        kernels.configure(enabled=False)
        engine.step()
        on, off = [], []
        for _ in range(repeats):  # alternate, so both see the same contexts and load
            kernels.configure(enabled=True)
            on.append(timed(engine.step, 1)[0])
            kernels.configure(enabled=False)
            off.append(timed(engine.step, 1)[0])
        kernels.configure(enabled=True)
        running = list(engine.scheduler.requests.values())
        assert len(running) == batch, f"only {len(running)} of {batch} requests still running"
        mean_ctx = statistics.mean(r.num_computed_tokens for r in running)
        print(f"  B={batch:3d} (mean context {mean_ctx:4.0f}): kernel {min(on):7.1f} / {statistics.median(on):7.1f}"
              f"   reference {min(off):7.1f} / {statistics.median(off):7.1f}   speedup {min(off) / min(on):4.2f}x"
              f"   -> {batch / min(on) * 1e3:6.1f} tok/s")
        del llm, engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    assert kernels.get_ops() is not None, "the C++ kernels did not build (see the warning above)"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}; kernels ready in {time.perf_counter() - t0:.1f} s")
    with torch.inference_mode():
        bench_layer(batches, args.repeats * 3)
    if not args.skip_model:
        bench_model(batches, args.repeats)


if __name__ == "__main__":
    main()
