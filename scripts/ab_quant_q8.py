"""Same-process A/B of quant_q8.cpp or quant_q8t.cpp variants: every decoder linear of a quantized model, in decode
order, streamed from memory, alternating the variants pass by pass so that all see the same bandwidth phase.

    python scripts/ab_quant_q8.py MODEL_DIR OLD.cpp NEW.cpp [...] [--rows 1] [--passes 60] [--head]
        [--op quant_linear_q8 | quant_linear_q8t | quant_linear_t]

--op names the op the variants define (default quant_linear_q8, the blocked int8-activation kernel); the layers are
put in the layout it reads (load_model tiles them for quant_q8t.cpp's ops; quant_linear_q8 gets them back blocked).

Each variant is compiled (cached by content under /tmp/brisk_ab) with its op library renamed brisk_v0, brisk_v1, ...
and the same ISA flags as brisk's own build. Outputs are checked against the first variant's before timing.
Printed: median and best milliseconds per pass and the best pass's GB/s over codes and group parameters. Python calls
each op (~2.4 us a call here), so absolute figures include that; differences between variants do not.
Typical use: `git show HEAD:src/brisk/ops/csrc/quant_q8.cpp > /tmp/old.cpp` against the working tree's file.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from brisk.model.loader import load_model
from brisk.ops import kernels
from brisk.ops.layers import QuantLinear
from brisk.ops.qlinear import set_tiled

CSRC = Path(kernels.__file__).parent / "csrc"


def build_variant(path: Path, index: int, op: str):  # noqa: ANN201
    src = path.read_text().replace("TORCH_LIBRARY_FRAGMENT(brisk,", f"TORCH_LIBRARY_FRAGMENT(brisk_v{index},")
    digest = hashlib.sha256(src.encode()).hexdigest()[:12]
    directory = Path("/tmp/brisk_ab") / digest
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / f"q8v{index}_{digest}.cpp"
    source.write_text(src)
    shutil.copy(CSRC / "simd.h", directory / "simd.h")
    _, isa = kernels._isa_flags()
    cpp_extension.load(name=source.stem, sources=[str(source)], extra_cflags=["-O3", "-fopenmp", *isa],
                       extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False)
    return getattr(getattr(torch.ops, f"brisk_v{index}"), op).default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("variants", nargs="+", type=Path)
    ap.add_argument("--rows", type=int, default=1, help="activation rows M (the decode batch)")
    ap.add_argument("--passes", type=int, default=60)
    ap.add_argument("--head", action="store_true", help="include the lm_head")
    ap.add_argument("--op", default="quant_linear_q8",
                    choices=["quant_linear_q8", "quant_linear_q8t", "quant_linear_t"])
    args = ap.parse_args()
    ops = [build_variant(p, i, args.op) for i, p in enumerate(args.variants)]
    model = load_model(args.model).model
    calls, nbytes = [], 0
    for name, mod in model.named_modules():
        if type(mod) is QuantLinear and ("layers." in name or args.head):
            pw = mod.packed
            set_tiled(pw, args.op != "quant_linear_q8")  # the layout the op reads
            codebook = (pw.codebook,) if args.op == "quant_linear_t" else ()  # its extra argument
            calls.append((torch.randn(args.rows, pw.in_features), pw.data, pw.scales, pw.zeros, *codebook, pw.bits,
                          pw.group_size))
            nbytes += pw.nbytes()
    if not calls:
        raise SystemExit(f"{args.model}: no quantized linear layers")
    reference = [ops[0](*c, None) for c in calls]
    for op in ops[1:]:
        for c, ref in zip(calls, reference, strict=True):
            torch.testing.assert_close(op(*c, None), ref, rtol=1e-4, atol=1e-3 * ref.abs().max().item())
    times: list[list[float]] = [[] for _ in ops]
    for _ in range(args.passes + 3):
        for i, op in enumerate(ops):
            t0 = time.perf_counter()
            for c in calls:
                op(*c, None)
            times[i].append(time.perf_counter() - t0)
    print(f"{len(calls)} linears, {nbytes / 1e6:.1f} MB, M = {args.rows}, {torch.get_num_threads()} threads")
    for path, t in zip(args.variants, times, strict=True):
        t = t[3:]  # warm-up passes
        print(f"{path.name:24s} median {statistics.median(t) * 1e3:7.3f} ms   best {min(t) * 1e3:7.3f} ms "
              f"({nbytes / min(t) / 1e9:5.1f} GB/s)")


if __name__ == "__main__":
    main()
