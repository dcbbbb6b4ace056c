"""The memory estimate against the measured peak resident set, configuration by configuration.

Each configuration is priced by advise/memory.py (as `brisk advise` prices it), then run by the memory probe in a
fresh process (advise/memprobe.py: load, then every sequence prefilled and decoded for a few tokens together) and
its peak RSS (VmHWM) read. Quantized configurations are RTN checkpoints written to a temporary folder first.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from brisk.advise import memory as mem

# (name, precision, KV cache dtype, context, concurrency)
TARGETS: list[tuple[str, mem.Precision, str, int, int]] = [
    ("float32", mem.Precision("float32", torch.float32), "auto", 2048, 1),
    ("bfloat16", mem.Precision("bfloat16", torch.bfloat16), "auto", 2048, 1),
    ("int8", mem.Precision("int8", torch.float32, 8, -1), "auto", 2048, 1),
    ("int4", mem.Precision("int4-rtn-g64", torch.float32, 4, 64), "auto", 2048, 1),
    ("int4 + int8 KV", mem.Precision("int4-rtn-g64", torch.float32, 4, 64), "int8", 2048, 1),
    ("int4 + 64 x 2048 tokens", mem.Precision("int4-rtn-g64", torch.float32, 4, 64), "auto", 2048, 64),
]


@dataclass
class MemoryCheck:
    name: str
    estimate_bytes: int
    estimate: dict[str, int]
    peak_rss_bytes: int
    after_import_bytes: int
    after_load_bytes: int
    settings: dict[str, Any]

    @property
    def error(self) -> float:
        """Estimate over measurement, less one (+0.05 = the estimate is 5% high)."""
        return self.estimate_bytes / self.peak_rss_bytes - 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "error": self.error}


def check_estimates(model: str | None = None, targets: list[tuple[str, mem.Precision, str, int, int]] | None = None,
                    prompt_len: int = 64, log: Callable[[str], None] = print) -> list[MemoryCheck]:
    from brisk.advise.advisor import build_model
    from brisk.advise.memprobe import measure_peak_rss

    shape = mem.model_shape(model)
    out = []
    with tempfile.TemporaryDirectory(prefix="brisk-memcheck-") as tmp:
        built: dict[str, str | None] = {}
        for name, p, kv, context, concurrency in targets or TARGETS:
            if p.name not in built:
                built[p.name] = build_model(model, p, Path(tmp) / p.name.replace(":", "-"))
            est, settings = mem.estimate(shape, p, kv, context, concurrency)
            path = built[p.name]
            run = {**settings, "model": path, "enable_prefix_caching": False}
            if p.bits is not None:
                run["dtype"] = "auto"  # a quantized folder runs in float32 activations either way
            log(f"memory: {name}: estimate {est.describe()}; measuring ...")
            # one sequence: a prompt of the whole context, so that the step's activations (priced at the full token
            # budget) really are allocated; many: short prompts, whose prefill fills the token budget together
            length = min(context - 8, 2040) if concurrency == 1 else min(prompt_len, context - 8)
            rss = measure_peak_rss(run, num_prompts=concurrency, prompt_len=length)
            check = MemoryCheck(name, est.total, {"weights": est.weights, "packed": est.packed,
                                                  "kv_pool": est.kv_pool, "activations": est.activations,
                                                  "runtime": est.runtime},
                                rss["peak"], rss["after_import"], rss["after_load"], run)
            log(f"memory: {name}: peak RSS {mem.gib(check.peak_rss_bytes)} (after imports "
                f"{mem.gib(check.after_import_bytes)}, after load {mem.gib(check.after_load_bytes)}); estimate "
                f"{100 * check.error:+.1f}%")
            out.append(check)
    return out


def main(argv: list[str] | None = None) -> None:
    """`python -m brisk.advise.memcheck [MODEL] [--runs N] [--json PATH]`: every target of TARGETS measured N times
    (default 1), then one markdown row each: the estimate, the peaks, the error against their median."""
    import argparse
    import json
    import statistics

    parser = argparse.ArgumentParser(prog="python -m brisk.advise.memcheck", description=main.__doc__)
    parser.add_argument("model", nargs="?", default=None, help="model path (default: the default model)")
    parser.add_argument("--runs", type=int, default=1, help="measurements of each configuration")
    parser.add_argument("--json", dest="json_path", default=None, help="write every check to this file")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    runs = [check_estimates(args.model) for _ in range(args.runs)]
    print("| configuration | estimate | peak RSS | error (median; range) |")
    print("|---|---|---|---|")
    for checks in zip(*runs, strict=True):
        first = checks[0]
        peaks = [c.peak_rss_bytes for c in checks]
        errors = sorted(100 * c.error for c in checks)
        e = first.estimate
        terms = " + ".join(mem.gib(e[k]) for k in ("weights", "kv_pool", "activations", "runtime"))
        spread = f"; {errors[0]:+.1f}% .. {errors[-1]:+.1f}%" if len(checks) > 1 else ""
        print(f"| {first.name} | {mem.gib(first.estimate_bytes)} ({terms}) | "
              f"{', '.join(mem.gib(p) for p in peaks)} | "
              f"{100 * (first.estimate_bytes / statistics.median(peaks) - 1):+.1f}%{spread} |")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump([[c.to_dict() for c in checks] for checks in runs], f, indent=2)


if __name__ == "__main__":
    main()
