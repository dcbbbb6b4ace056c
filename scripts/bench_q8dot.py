"""Dense quantized GEMV, float-activation kernel vs int8-activation kernel, on the blocked layout (quant_linear_small,
quant_linear_q8) and, where built (AVX-512 VNNI), the tiled one (quant_linear_t, quant_linear_q8t).

    python scripts/bench_q8dot.py MODEL_DIR [--threads 1,2] [--rows 1,8] [--repeats 30]

For each distinct (N, K) of the quantized model's linear layers (real packed codes), the kernels alternate call by
call in one process, so all see the same background load. Printed: best wall-clock and best CPU time
(time.thread_time of the calling thread; at 2 threads that misses the worker thread, so read the wall figure
there) in microseconds, and the ratio float / int8 of the blocked kernels (> 1: the int8-activation kernel is
faster); then the tiled kernels' wall times.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from functools import partial

import torch

from brisk.ops import kernels
from brisk.ops.layers import QuantLinear
from brisk.ops.qlinear import can_tile, set_tiled
from brisk.ops.qlinear_q8 import covers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--inner", type=int, default=20, help="calls per timed sample")
    args = ap.parse_args()
    from brisk.model.loader import load_model

    model = load_model(args.model).model
    ops = kernels.get_ops()
    small, q8 = ops.quant_linear_small.default, ops.quant_linear_q8.default
    layers: dict[tuple, tuple[str, QuantLinear]] = {}
    for name, mod in model.named_modules():
        if type(mod) is QuantLinear and covers(mod.packed):
            pw = mod.packed
            layers.setdefault((pw.out_features, pw.in_features, pw.bits, pw.group_size), (name, mod))
    print(f"{'layer':34s} {'N':>6s} {'K':>5s} bits  G    thr  M | float us (wall/cpu) | int8 us (wall/cpu) | "
          "float/int8 wall cpu | tiled float / int8 wall")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for m in [int(r) for r in args.rows.split(",")]:
            for (n, k, bits, g), (name, mod) in layers.items():
                pw = mod.packed
                set_tiled(pw, False)  # load_model tiled it: the blocked kernels read the blocked layout
                x = torch.randn(m, k)
                calls = {
                    "float": partial(small, x, pw.data, pw.scales, pw.zeros, None, pw.bits, pw.group_size, None),
                    "int8": partial(q8, x, pw.data, pw.scales, pw.zeros, pw.bits, pw.group_size, None),
                }
                if can_tile(pw):  # a tiled copy
                    tw = dataclasses.replace(pw, data=pw.data.clone(), scales=pw.scales.clone(),
                                             zeros=None if pw.zeros is None else pw.zeros.clone())
                    set_tiled(tw, True)
                    calls["tiled float"] = partial(ops.quant_linear_t.default, x, tw.data, tw.scales, tw.zeros, None,
                                                   tw.bits, tw.group_size, None)
                    calls["tiled int8"] = partial(ops.quant_linear_q8t.default, x, tw.data, tw.scales, tw.zeros,
                                                  tw.bits, tw.group_size, None)
                best = {key: [float("inf"), float("inf")] for key in calls}
                for _ in range(args.repeats):
                    for key, fn in calls.items():  # alternated
                        w0, c0 = time.perf_counter(), time.thread_time()
                        for _ in range(args.inner):
                            fn()
                        w1, c1 = time.perf_counter(), time.thread_time()
                        best[key][0] = min(best[key][0], (w1 - w0) / args.inner * 1e6)
                        best[key][1] = min(best[key][1], (c1 - c0) / args.inner * 1e6)
                f, q = best["float"], best["int8"]
                tiled = (f" | {best['tiled float'][0]:8.1f} {best['tiled int8'][0]:8.1f}" if "tiled int8" in best
                         else "")
                print(f"{name:34s} {n:6d} {k:5d} {bits:4d} {g:4d} {threads:4d} {m:2d} | {f[0]:8.1f} {f[1]:8.1f} | "
                      f"{q[0]:8.1f} {q[1]:8.1f} | {f[0] / q[0]:5.2f} {f[1] / q[1]:5.2f}{tiled}", flush=True)


if __name__ == "__main__":
    main()
