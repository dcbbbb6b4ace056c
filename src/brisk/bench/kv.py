"""`brisk bench kv`: what each KV cache dtype and policy buys: tokens per MiB, concurrent sequences, decode speed.

For every setting (cache dtype x policy):
  * tokens per MiB: token slots the block pool gets from the KV budget (the engine's own sizing: int4's float16
    key window buffers come out of the same budget), divided by the budget in MiB;
  * max concurrent sequences: how many requests of `seq_len` tokens the engine's KVCacheManager admits at
    once from that pool, measured by allocating them through the real manager and policy in chunks of
    `chunk` tokens (as chunked prefill / decoding would) until one no longer fits. No model runs: capacity
    depends only on block accounting;
  * decode speed (optional, `decode_tokens > 0`): output tokens per second of `batch` greedy requests through
    the engine with the setting (prompt `prompt_len` tokens). Quantized caches are read in place by the C++
    attention kernel, which widens their codes (slower per byte than a float cache), so they gain where KV reads
    are a large share of a step: long contexts, many sequences (docs/kv-cache.md).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from brisk.engine.request import Request
from brisk.kvcache.manager import KVCacheManager
from brisk.kvcache.policy import H2OPolicy, make_policy
from brisk.kvcache.quant import Int4KVCache, kv_bytes_per_token
from brisk.model.config import ModelConfig


@dataclass
class KVSetting:
    kv_cache_dtype: str  # auto | int8 | int4
    policy: str  # full | streaming | h2o (recent = budget // 2)
    budget: int | None = None
    sink_tokens: int = 4
    block_size: int = 16

    @property
    def label(self) -> str:
        name = "float" if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        pol = self.policy if self.budget is None else f"{self.policy}({self.budget})"
        return f"{name}/{pol}/bs{self.block_size}"


@dataclass
class KVBenchResult:
    setting: str
    kv_cache_dtype: str
    policy: str
    budget: int | None
    block_size: int
    bytes_per_token: float  # pool bytes per token slot, all layers
    num_blocks: int
    tokens_per_mib: float
    max_concurrent_seqs: int
    decode_tokens_per_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pool_blocks(config: ModelConfig, setting: KVSetting, kv_bytes: int, float_bytes: int,
                num_residual_blocks: int = 16) -> tuple[int, float]:
    """(num_blocks, bytes per token) exactly as LLMEngine sizes the pool."""
    per_token = kv_bytes_per_token(setting.kv_cache_dtype, config.num_hidden_layers, config.num_key_value_heads,
                                   config.head_dim, setting.block_size, float_bytes)
    pool = kv_bytes
    if setting.kv_cache_dtype == "int4":
        pool -= num_residual_blocks * config.num_hidden_layers * Int4KVCache.residual_bytes_per_block(
            config.num_key_value_heads, config.head_dim, setting.block_size)
    return max(0, pool) // int(per_token * setting.block_size), per_token


def max_concurrent(num_blocks: int, setting: KVSetting, seq_len: int, chunk: int = 256,
                   limit: int = 100_000) -> int:
    """Requests of `seq_len` tokens admitted together by the real manager + policy (see module docstring)."""
    policy = make_policy(setting.policy, setting.budget, setting.sink_tokens)
    manager = KVCacheManager(num_blocks, setting.block_size, enable_caching=False, policy=policy)
    admitted = 0
    while admitted < limit:
        req = Request(f"r{admitted}", list(range(seq_len)), sampling_params=None)
        while req.num_computed_tokens < seq_len:
            num_new = min(chunk, seq_len - req.num_computed_tokens)
            if manager.allocate_slots(req, num_new) is None:
                return admitted
            req.num_computed_tokens += num_new
            num_entries = manager.get_num_cache_entries(req)
            if isinstance(policy, H2OPolicy) and num_entries > policy.keep:
                # the runner would pick heavy hitters; for block accounting any kept set of that size will do
                manager.schedule_compaction(req, list(range(num_entries - policy.keep, num_entries)))
        admitted += 1
    return admitted


def decode_speed(model: str | None, setting: KVSetting, kv_cache_memory: str, batch: int, prompt_len: int,
                 decode_tokens: int, loaded: Any = None) -> float:
    """Output tokens per second of `batch` greedy requests (after one warm-up request)."""
    from brisk.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from brisk.engine.llm_engine import LLMEngine
    from brisk.engine.sampling_params import SamplingParams

    max_len = prompt_len + decode_tokens + 1
    cache = CacheConfig(block_size=setting.block_size, kv_cache_memory=kv_cache_memory,
                        kv_cache_dtype=setting.kv_cache_dtype, kv_policy=setting.policy, kv_budget=setting.budget,
                        sink_tokens=setting.sink_tokens)
    sched = SchedulerConfig(max_num_batched_tokens=max(512, prompt_len), max_model_len=max(max_len, 64))
    engine = LLMEngine(EngineConfig(model=model, max_model_len=sched.max_model_len, cache=cache, scheduler=sched),
                       loaded)
    params = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)
    prompts = [[(17 + 7 * i + j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
    engine.add_request(None, prompts[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    for p in prompts:
        engine.add_request(None, p, params)
    # prefill first (not timed), then time the decode steps
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running + list(
            engine.scheduler.waiting)):
        engine.step()
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(o.outputs[0].num_new_tokens for o in engine.step())
    return produced / (time.perf_counter() - start)


def run_kv_bench(config: ModelConfig, settings: list[KVSetting], kv_bytes: int, seq_len: int, float_bytes: int,
                 decode: dict[str, Any] | None = None) -> list[KVBenchResult]:
    results = []
    for s in settings:
        num_blocks, per_token = pool_blocks(config, s, kv_bytes, float_bytes)
        res = KVBenchResult(
            setting=s.label, kv_cache_dtype=s.kv_cache_dtype, policy=s.policy, budget=s.budget,
            block_size=s.block_size, bytes_per_token=per_token, num_blocks=num_blocks,
            tokens_per_mib=num_blocks * s.block_size / (kv_bytes / 2**20),
            max_concurrent_seqs=max_concurrent(num_blocks, s, seq_len))
        if decode:
            res.decode_tokens_per_s = decode_speed(setting=s, **decode)
        results.append(res)
    return results
