"""The sparse decode kernels as ops, M = 1, weights far beyond the caches (session 11's kernel table).

    python scripts/bench_sparse_ops.py [--threads 2] [--layers 30] [--repeats 15]

float32: `sparse_linear` on 50%-pruned float32 weights against the dense GEMV (`linear_small_m`) on the same
shapes; int8: `sparse_q8_linear` (int8 activations) on 50%-pruned int8 values with random and with magnitude
masks. Shapes: `--layers` copies of (1536 x 576, 576 x 1536), the default model's MLP shapes. Each set of calls
runs `--repeats` times; the best time and the bytes it read per second are printed. Run it with
BRISK_KERNEL_ISA=avx2 for the AVX2 build's figures.
"""

from __future__ import annotations

import argparse
import time

import torch

from brisk.ops import sparse as S
from brisk.ops.kernels import get_op, kernel_isa


def _best(fns: list, repeats: int) -> float:
    for f in fns:
        f()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for f in fns:
            f()
        best = min(best, time.perf_counter() - t)
    return best


def _int8_weight(n: int, k: int, masks: str) -> S.SparseWeight:
    if masks == "random":
        keep = torch.rand(n, k) < 0.5
    else:  # magnitude: the larger half of each row of a random weight
        w = torch.randn(n, k)
        keep = w.abs() > w.abs().median(dim=1, keepdim=True).values
    q = (torch.randint(-100, 100, (n, k), dtype=torch.int32) + 128).to(torch.uint8)  # symmetric codes, zero 128
    return S.compress_codes(q, keep, torch.ones(n, 1), -128 * torch.ones(n, 1), 8, k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = [(1536, 576), (576, 1536)] * args.layers
    sparse_op, dense_op, q8_op = get_op("sparse_linear"), get_op("linear_small_m"), get_op("sparse_q8_linear")
    if sparse_op is None or dense_op is None or q8_op is None:
        raise SystemExit("the C++ kernels are not built (see brisk.ops.kernels)")
    print(f"{kernel_isa()} build, {args.threads} threads, {args.layers} x (1536 x 576, 576 x 1536), M = 1")

    dense = [torch.randn(n, k) for n, k in shapes]
    pruned = [S.compress(w * (torch.rand_like(w) >= 0.5)) for w in dense]
    xs = [torch.randn(1, k) for _, k in shapes]
    t_sparse = _best([lambda x=x, sw=sw: sparse_op(x, sw.mask, sw.row_ptr, sw.values, None, None, 32, 0, None)
                      for x, sw in zip(xs, pruned, strict=True)], args.repeats)
    t_dense = _best([lambda x=x, w=w: dense_op(x, w, None) for x, w in zip(xs, dense, strict=True)], args.repeats)
    sparse_bytes = sum(sw.nbytes() for sw in pruned)
    dense_bytes = sum(w.numel() * 4 for w in dense)
    print(f"float32 50%: sparse {t_sparse * 1e3:.2f} ms ({sparse_bytes / t_sparse / 1e9:.1f} GB/s), "
          f"dense {t_dense * 1e3:.2f} ms ({dense_bytes / t_dense / 1e9:.1f} GB/s), {t_dense / t_sparse:.2f}x")
    for masks in ("random", "magnitude"):
        sws = [_int8_weight(n, k, masks) for n, k in shapes]
        t = _best([lambda x=x, sw=sw: q8_op(x, sw.mask, sw.row_ptr, sw.values, sw.scales, sw.group_size, None)
                   for x, sw in zip(xs, sws, strict=True)], args.repeats)
        nbytes = sum(sw.nbytes() for sw in sws)
        print(f"int8 50% x int8 activations, {masks} masks: {t * 1e3:.2f} ms ({nbytes / t / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
