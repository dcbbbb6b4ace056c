"""Batch-1 latency: time to first token, time per output token, decode tokens/s.

One request at a time on an otherwise idle engine. The clock starts before `add_request` and is read after
every `engine.step()` that gave the request a token, so

    | add_request | prefill ... first token | decode | decode | ... | last token |
    start         t[0]                      t[1]     t[2]           t[N-1]

    TTFT = t[0] - start          TPOT = t[i] - t[i-1], i = 1 .. N-1          E2E = t[N-1] - start
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from brisk.bench.report import mean, percentile
from brisk.console import Advance
from brisk.engine.sampling_params import SamplingParams


@dataclass
class LatencyResult:
    input_len: int
    output_len: int
    ttft_s: list[float] = field(default_factory=list)  # one per measured run
    tpot_s: list[float] = field(default_factory=list)  # every decode interval of every measured run
    e2e_s: list[float] = field(default_factory=list)  # one per measured run
    token_ids: list[int] = field(default_factory=list)  # output of the last run (to compare engines)
    step_split_ms: dict[str, float] = field(default_factory=dict)  # brisk only: per decode step, by part

    @property
    def runs(self) -> int:
        return len(self.ttft_s)

    @property
    def ttft_mean_s(self) -> float:
        return mean(self.ttft_s)

    @property
    def tpot_mean_s(self) -> float:
        return mean(self.tpot_s)

    @property
    def decode_tok_s(self) -> float:
        """Steady-state decode rate: 1 / mean time per output token (prefill excluded)."""
        return 1.0 / self.tpot_mean_s if self.tpot_s else float("nan")

    @property
    def prefill_tok_s(self) -> float:
        return self.input_len / self.ttft_mean_s

    def summary(self) -> dict[str, Any]:
        return {
            "input_len": self.input_len,
            "output_len": self.output_len,
            "runs": self.runs,
            "ttft_s_mean": self.ttft_mean_s,
            "ttft_s_min": min(self.ttft_s),
            "ttft_s_all": self.ttft_s,
            "prefill_tok_s": self.prefill_tok_s,
            "tpot_s_mean": self.tpot_mean_s,
            "tpot_s_p50": percentile(self.tpot_s, 50),
            "tpot_s_p90": percentile(self.tpot_s, 90),
            "decode_tok_s": self.decode_tok_s,
            "e2e_s_mean": mean(self.e2e_s),
            **({"decode_step_split_ms": self.step_split_ms} if self.step_split_ms else {}),
        }


def merge_results(parts: list[LatencyResult]) -> LatencyResult:
    """One LatencyResult from several of the same request shape (interleaved rounds): runs concatenated,
    the decode-step split averaged over the parts weighted by their step counts."""
    if not parts:
        raise ValueError("nothing to merge")
    first = parts[0]
    out = LatencyResult(input_len=first.input_len, output_len=first.output_len)
    for p in parts:
        if (p.input_len, p.output_len) != (first.input_len, first.output_len):
            raise ValueError("cannot merge latency results of different request shapes")
        out.ttft_s.extend(p.ttft_s)
        out.tpot_s.extend(p.tpot_s)
        out.e2e_s.extend(p.e2e_s)
        out.token_ids = p.token_ids
    splits = [p.step_split_ms for p in parts if p.step_split_ms.get("steps")]
    if splits:
        steps = sum(s["steps"] for s in splits)
        out.step_split_ms = {k: (steps if k == "steps" else sum(s[k] * s["steps"] for s in splits) / steps)
                             for k in splits[0]}
    return out


def record_run(result: LatencyResult, start: float, token_times: list[float], token_ids: list[int]) -> None:
    """Add one run's timestamps (one per output token, in order) to `result`."""
    if len(token_times) != result.output_len or len(token_ids) != result.output_len:
        raise RuntimeError(f"the run produced {len(token_ids)} tokens in {len(token_times)} steps, expected "
                           f"{result.output_len}; was the request cut short by max_model_len?")
    result.ttft_s.append(token_times[0] - start)
    result.tpot_s.extend(b - a for a, b in zip(token_times, token_times[1:], strict=False))
    result.e2e_s.append(token_times[-1] - start)
    result.token_ids = list(token_ids)


def run_latency(llm, prompt_ids: list[int], output_len: int, runs: int = 3, warmup: int = 1,  # noqa: ANN001
                advance: Advance | None = None) -> LatencyResult:
    """Time `runs` greedy batch-1 generations of exactly `output_len` tokens, after `warmup` untimed ones.

    `llm` is a brisk LLM; its engine must have no other requests. Prefix caching should be off, or every
    run after the first would find its prompt cached and TTFT would measure a cache hit, not a prefill.
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"need runs >= 1 and warmup >= 0, got runs={runs}, warmup={warmup}")
    if output_len < 1:
        raise ValueError(f"output_len must be at least 1, got {output_len}")
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine has requests in flight; latency must be measured on an idle engine")
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    result = LatencyResult(input_len=len(prompt_ids), output_len=output_len)
    for i in range(warmup + runs):
        if i == warmup:
            engine.step_timer.reset()  # the decode-step split covers the measured runs only
        times: list[float] = []
        token_ids: list[int] = []
        start = time.perf_counter()
        rid = engine.add_request(None, prompt_ids, params)
        finished = False
        while not finished:
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.request_id != rid:
                    continue
                new = out.outputs[0].num_new_tokens
                # one token per step at batch 1; a step that gave several would hide their spacing
                assert new <= 1, f"a batch-1 step produced {new} tokens"
                times.extend([now] * new)
                token_ids = out.outputs[0].token_ids
                finished = out.finished
                if advance:
                    advance(new)
        if i >= warmup:
            record_run(result, start, times, token_ids)
    result.step_split_ms = engine.step_timer.mean_ms()
    return result
