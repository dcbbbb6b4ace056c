"""Does `brisk advise` pick well? Three deployment scenarios, each advised on predictions alone, then a spread of
its candidates measured on this machine: the advised configuration's measured speed against the best measured.

    chat        batch-1 chat in 200 MiB of engine memory (weights, KV pool, activations), 2,048-token context
    throughput  64 sequences of 2,048 tokens in 8 GiB
    long        one 32,768-token context in 8 GiB: past the default model's 8,192 positions, StreamingLLM only

Measured per scenario: the advised first, the next ranked ones, and the best-ranked candidate of each weight format
and KV policy not among them (so a format the roofline under-rates is measured too), `--candidates` in all; each
decodes after a prompt of half the context (advisor.measure_all) for `--seconds`. Then the advised configuration's
peak resident memory in a fresh process (memprobe: its sequences' prompts of the whole context less 8 tokens, 4
generated each) against its estimate (`--no-memory` skips it).

    python -m brisk.advise.scenarios [--scenarios chat,throughput,long] [--seconds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from brisk.advise.advisor import Advice, Candidate, advise, build_model, measure_all
from brisk.advise.memory import MiB, gib


@dataclass(frozen=True)
class Scenario:
    name: str
    goal: str
    memory: int
    context: int
    concurrency: int
    max_ppl: float = 0.02
    scope: str = "process"

    def describe(self) -> str:
        scope = " of engine memory" if self.scope == "engine" else ""
        return (f"{self.goal}, {self.concurrency} x {self.context} tokens in {gib(self.memory)}{scope}, "
                f"ppl within +{100 * self.max_ppl:.0f}%")


SCENARIOS = {
    "chat": Scenario("chat", "latency", 200 * MiB, 2048, 1, scope="engine"),
    "throughput": Scenario("throughput", "throughput", 8192 * MiB, 2048, 64),
    "long": Scenario("long", "latency", 8192 * MiB, 32768, 1),
}


def spread(advice: Advice, n: int) -> list[Candidate]:
    """The first ranked candidates, then the best-ranked of each (weight format, KV policy) not yet in, up to n."""
    picked: list[Candidate] = advice.ranked[:max(1, n // 2)]
    seen = {(c.precision.name, c.stream_budget is None) for c in picked}
    for cand in advice.ranked:
        if len(picked) >= n:
            break
        key = (cand.precision.name, cand.stream_budget is None)
        if key not in seen:
            seen.add(key)
            picked.append(cand)
    for cand in advice.ranked:  # fewer families than n: fill in ranked order
        if len(picked) >= n:
            break
        if cand not in picked:
            picked.append(cand)
    return picked


def run_scenario(sc: Scenario, seconds: float, candidates: int, memory: bool = True, log: Any = print
                 ) -> dict[str, Any]:
    advice = advise(None, sc.memory, sc.goal, sc.max_ppl, sc.context, sc.concurrency, memory_scope=sc.scope,
                    log=log)
    advised = advice.ranked[0]
    measured = spread(advice, candidates)
    measure_all(measured, advice, None, seconds, log)
    best = max(measured, key=lambda c: c.measured["tok_s"] if c.measured else 0.0)
    assert advised.measured is not None and best.measured is not None
    rows = [{"rank": advice.ranked.index(c) + 1, "name": c.name, "memory_bytes": c.charged(sc.scope),
             "ppl_increase": c.quality, "predicted_tok_s": c.figure_predicted(sc.goal),
             "measured_tok_s": c.measured["tok_s"] if c.measured else None} for c in measured]
    rss = None
    if memory:
        from brisk.advise.memprobe import measure_peak_rss

        log(f"memory: {advised.name}, {sc.concurrency} x {sc.context - 8} prompt tokens in a fresh process ...")
        with tempfile.TemporaryDirectory(prefix="brisk-scenario-") as tmp:
            path = build_model(None, advised.precision, Path(tmp) / "advised")
            rss = measure_peak_rss({**advised.settings, "model": path, "enable_prefix_caching": False},
                                   sc.concurrency, sc.context - 8)
        rss["estimate"] = advised.memory.total
        rss["estimate_engine"] = advised.charged("engine")
    return {"scenario": sc.name, "describe": sc.describe(), "advised": advised.name, "best": best.name, "rss": rss,
            "advised_tok_s": advised.measured["tok_s"], "best_tok_s": best.measured["tok_s"],
            "ratio": advised.measured["tok_s"] / best.measured["tok_s"], "ranked": len(advice.ranked),
            "commands": advice.commands, "rows": rows, "calibration": advice.calibration.to_dict()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m brisk.advise.scenarios", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--seconds", type=float, default=20.0, help="measuring time per candidate")
    ap.add_argument("--candidates", type=int, default=6, help="candidates measured per scenario")
    ap.add_argument("--no-memory", action="store_true", help="skip the advised configuration's peak-RSS check")
    ap.add_argument("--json", dest="json_path", default=None)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        ap.error(f"unknown scenario(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(SCENARIOS)}")
    if args.seconds <= 0 or args.candidates < 1:
        ap.error("--seconds must be positive and --candidates at least 1")
    results = []
    for name in names:
        sc = SCENARIOS[name]
        print(f"== {name}: {sc.describe()}", file=sys.stderr)
        res = run_scenario(sc, args.seconds, args.candidates, not args.no_memory,
                           log=lambda m: print(m, file=sys.stderr))
        results.append(res)
        print(f"\n{name} ({res['describe']}): advised {res['advised']} {res['advised_tok_s']:.1f} tok/s; best "
              f"measured {res['best']} {res['best_tok_s']:.1f} tok/s; advised / best = {res['ratio']:.3f}")
        print("| rank | candidate | memory | ppl | predicted tok/s | measured tok/s |\n|---|---|---|---|---|---|")
        for r in res["rows"]:
            ppl = "?" if r["ppl_increase"] is None else f"+{100 * r['ppl_increase']:.2f}%"
            print(f"| {r['rank']} | {r['name']} | {gib(r['memory_bytes'])} | {ppl} | {r['predicted_tok_s']:.1f} | "
                  f"{r['measured_tok_s']:.1f} |")
        print(f"advised: {res['commands'][-1]}")
        if res["rss"]:
            r = res["rss"]
            print(f"advised memory: estimate {gib(r['estimate'])}, peak RSS {gib(r['peak'])} "
                  f"({100 * (r['estimate'] / r['peak'] - 1):+.1f}%); engine part: estimate "
                  f"{gib(r['estimate_engine'])}, peak less the RSS after imports {gib(r['peak'] - r['after_import'])}")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
