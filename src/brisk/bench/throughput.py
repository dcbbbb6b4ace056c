"""Offline throughput: all prompts submitted at once, continuous batching decides the rest.

The engine is stepped here rather than through `LLM.generate` so that the KV cache can be sampled after
every step: how full the allocated blocks are (slots holding KV / slots in allocated blocks; the rest is
the tail of each request's last block, the internal fragmentation paging bounds to < 1 block per
request) and how much of the pool is in use at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from brisk.bench.report import mean
from brisk.console import Advance
from brisk.engine.sampling_params import SamplingParams


@dataclass
class ThroughputResult:
    num_prompts: int
    output_len: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    num_steps: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    kv_slot_util: list[float] = field(default_factory=list, repr=False)  # per step: used / allocated slots
    kv_usage: list[float] = field(default_factory=list, repr=False)  # per step: fraction of the pool's blocks
    num_running: list[int] = field(default_factory=list, repr=False)  # per step: requests running after it

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    @property
    def requests_s(self) -> float:
        return self.num_prompts / self.elapsed_s

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "num_prompts": self.num_prompts,
            "output_len": self.output_len,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "elapsed_s": self.elapsed_s,
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
            "requests_s": self.requests_s,
        }
        if self.num_steps:  # engine-only figures (an HF baseline has none)
            out.update({
                "num_steps": self.num_steps,
                "num_preemptions": self.num_preemptions,
                "num_cached_tokens": self.num_cached_tokens,
                "kv_slot_util_mean": mean(self.kv_slot_util),
                "kv_usage_mean": mean(self.kv_usage),
                "kv_usage_peak": max(self.kv_usage, default=0.0),
                "num_running_mean": mean(self.num_running),
                "num_running_peak": max(self.num_running, default=0),
            })
        return out


def warm_up(llm) -> None:  # noqa: ANN001
    """One tiny untimed request: thread pools, allocator and first-call paths start outside the clock.

    Its prompt is shorter than a block, so it leaves nothing in the prefix cache for the timed prompts.
    """
    block_size = llm.engine.config.cache.block_size
    prompt = [llm.get_tokenizer().eos_token_id or 0] * max(1, block_size - 1)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))


def run_throughput(llm, prompts: list[list[int]], output_len: int,  # noqa: ANN001
                   advance: Advance | None = None) -> ThroughputResult:
    """Generate exactly `output_len` greedy tokens for every prompt, all submitted at once; time it all."""
    if output_len < 1:
        raise ValueError(f"output_len must be at least 1, got {output_len}")
    engine = llm.engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine has requests in flight; throughput must be measured on an idle engine")
    longest = max(len(p) for p in prompts) + output_len
    if longest > engine.max_model_len:
        raise ValueError(f"the longest prompt plus output is {longest} tokens, over max_model_len="
                         f"{engine.max_model_len}; raise --max-model-len or lower --input-len-max or "
                         "--output-len")
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    result = ThroughputResult(num_prompts=len(prompts), output_len=output_len,
                              prompt_tokens=sum(len(p) for p in prompts), output_tokens=0, elapsed_s=0.0)
    preemptions_before = engine.stats().num_preemptions
    steps_before = engine.num_steps

    start = time.perf_counter()
    ids = {engine.add_request(None, p, params) for p in prompts}
    while engine.has_unfinished_requests():
        outs = engine.step()
        stats = engine.stats()
        if stats.kv_slots_allocated:
            result.kv_slot_util.append(stats.kv_slots_used / stats.kv_slots_allocated)
        result.kv_usage.append(stats.kv_usage)
        result.num_running.append(stats.num_running)
        for out in outs:
            if out.finished and out.request_id in ids:
                result.output_tokens += len(out.outputs[0].token_ids)
                result.num_cached_tokens += out.metrics.num_cached_tokens if out.metrics else 0
                if advance:
                    advance(1)
    result.elapsed_s = time.perf_counter() - start

    result.num_steps = engine.num_steps - steps_before
    result.num_preemptions = engine.stats().num_preemptions - preemptions_before
    return result
