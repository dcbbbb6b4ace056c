"""LLMEngine: requests in, outputs out; one `step()` = schedule, execute, update."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from brisk.engine.config import EngineConfig, SchedulerConfig
from brisk.engine.extensions import extension
from brisk.engine.memory import check_memory, prepack_auto, weight_bytes
from brisk.engine.model_runner import ModelRunner
from brisk.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from brisk.engine.pooling import PoolingParams
from brisk.engine.request import Request, RequestStatus
from brisk.engine.sampling_defaults import resolve_sampling_defaults
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import Scheduler, SchedulerStats
from brisk.kvcache.manager import KVCacheManager
from brisk.kvcache.offload import make_offload
from brisk.kvcache.policy import KVPolicy, make_policy
from brisk.kvcache.sizing import check_kv_pool, check_policy_supports, num_kv_blocks
from brisk.lora.request import LoRARequest
from brisk.model.loader import LoadedModel, load_model
from brisk.model.tokenizer import IncrementalDetokenizer, Tokenizer
from brisk.ops.linear import float32_linear_bytes, prepack_linears
from brisk.quant.layers import set_quant_activations

if TYPE_CHECKING:
    from brisk.lora.manager import LoRAManager
    from brisk.ops.attention import KVCache
    from brisk.structured.backend import GrammarCompiler


def jump_forward_mode(setting: str, params: SamplingParams) -> str:
    """A request's jump-forward mode (structured/runner.py): none with logprobs (forced tokens have none); auto
    only where it keeps the output identical, i.e. not for seeded sampling, whose random stream it would shift."""
    if setting == "off" or params.logprobs is not None:
        return "off"
    if setting == "auto" and params.seed is not None and not params.is_greedy:
        return "off"
    return setting


def load_engine_model(config: EngineConfig) -> LoadedModel:
    """The model `config` names, once the configuration is known to fit in memory (engine/memory.py: a CPU
    configuration that cannot fit stops here, before any weight is read)."""
    if torch.device(config.device).type == "cpu":
        check_memory(config)
    return load_model(config.model, dtype=config.torch_dtype, device=config.device,
                      max_model_len=config.max_model_len, load_format=config.load_format, shape=config.shape,
                      seed=config.seed, keep_quantized=config.dtype == "auto")


class PromptTooLongError(ValueError):
    """The prompt does not leave room for a single generated token within max_model_len."""


@dataclass
class _SampleState:
    """Per-sample output bookkeeping: incremental text, stop-string search."""

    detok: IncrementalDetokenizer
    text: str = ""
    emitted_tokens: int = 0
    emitted_text: int = 0


class _Group:
    """The n samples of one user request."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 samples: list[Request], params: SamplingParams, tokenizer: Tokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.samples = samples
        self.params = params
        self.states = [_SampleState(IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens))
                       for _ in samples]
        self.finished_time: float | None = None
        self.lora_slot = -1  # the adapter slot its samples hold (brisk/lora/manager.py), -1: none


@dataclass
class StepTimer:
    """Where the time of pure decode steps goes (seconds, summed): scheduling, the runner's three parts
    (building the flattened batch and its metadata, the model forward, sampling), and the engine's bookkeeping
    after it (scheduler update, detokenization, outputs). `brisk bench latency` prints the per-step means."""

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    runner_other: float = 0.0
    update_outputs: float = 0.0

    def add(self, schedule: float, runner: tuple[float, float, float], execute: float, after: float) -> None:
        self.steps += 1
        self.schedule += schedule
        self.prepare += runner[0]
        self.forward += runner[1]
        self.sample += runner[2]
        self.runner_other += max(0.0, execute - sum(runner))
        self.update_outputs += after

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def mean_ms(self) -> dict[str, float]:
        """Per-step milliseconds of each part, and their total."""
        n = max(1, self.steps)
        parts = {k: 1e3 * getattr(self, k) / n
                 for k in ("schedule", "prepare", "forward", "sample", "runner_other", "update_outputs")}
        return {**parts, "total": sum(parts.values()), "steps": float(self.steps)}


class LLMEngine:
    """Requests in, outputs out, one `step` at a time. Built in stages, each a method below with its inputs and
    outputs explicit (the order matters only where a stage reads what an earlier one made, and says so):

        the model            load_engine_model (unless `loaded` is given)       -> self.loaded
        limits               _limits: max_model_len, the scheduler's budget       -> sched_cfg
        weights as they run  _prepare_weights: prepacked GEMM weights, int8 activations of quantized linears
        KV pool              _kv_pool: eviction policy, block count, block manager, scheduler
        runner               _runner: one process's ModelRunner, or this rank's parallel runner (its executor
                             resolves the layers' kernels as _prepare_weights left them)
        disk tier            make_offload: evicted prefix blocks to a directory and back (kvcache/offload.py)
        adapters             _lora: LoRA slots wrapped around the executor's layers
        speculation          the speculator config.spec names (brisk.spec, installed at `import brisk`)

    A pipeline-parallel engine steps several micro-batches at once: its step is the strategy brisk.parallel
    installs (engine/extensions.py pipeline_step), chosen here once; nothing on the instance is replaced."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.loaded = loaded or load_engine_model(config)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        # what the sampling fields a request omits default to (engine/sampling_defaults.py)
        self.sampling_defaults = resolve_sampling_defaults(config.generation_config, config.sampling_overrides,
                                                           self.loaded.generation_config, self.loaded.name)
        sched_cfg = self._limits()
        self.num_prepacked, self.num_int8_activation_layers = self._prepare_weights(sched_cfg.max_num_seqs)
        policy = self._kv_pool(sched_cfg)
        self.runner = self._runner(policy)
        # the disk tier under the prefix cache (kvcache/offload.py), on the runner's caches; None: off
        self.kv_offload = make_offload(config, self.loaded, self.runner, self.kv_manager)
        self._step_strategy = extension("pipeline_step") if config.pipeline_parallel_size > 1 else None
        self.groups: dict[str, _Group] = {}
        self._next_id = 0
        self.num_steps = 0
        self.step_timer = StepTimer()
        # --compile: time spent compiling at start-up (0 for the other executions)
        self.compile_seconds = self.runner.executor.warm_up(sched_cfg.max_num_batched_tokens)
        self.lora_manager = self._lora()  # brisk/lora/manager.py: adapter slots on the wrapped layers
        self._grammar_compiler: GrammarCompiler | None = None
        # the server checks constraints on its event loop while the engine thread adds requests: one compiler
        self._grammar_compiler_lock = threading.Lock()
        self.speculator = None if config.spec is None else extension("speculator")(config.spec, self)

    def _limits(self) -> SchedulerConfig:
        """The scheduler's settings resolved against the model: max_model_len (the model's context, at most 2048
        unless asked) and the token budget of a step."""
        assert self.config.scheduler is not None  # EngineConfig fills in the defaults
        mc = self.model_config
        sched_cfg = self.config.scheduler.resolve(self.config.max_model_len or min(mc.max_position_embeddings, 2048))
        assert sched_cfg.max_num_batched_tokens is not None and sched_cfg.max_model_len is not None
        self.max_model_len = sched_cfg.max_model_len
        return sched_cfg

    def _prepare_weights(self, max_num_seqs: int) -> tuple[int, int]:
        """The weights as the engine runs them: (linear layers given a oneDNN-packed weight for batched GEMMs,
        quantized linears that round decode activations to int8 (0 unless quant_activations asks for them))."""
        config, model = self.config, self.loaded.model
        prepacked = 0
        if config.prepack_weights == "on" or (config.prepack_weights == "auto" and prepack_auto(
                max_num_seqs, float32_linear_bytes(model))):
            # a bfloat16 model's float32 packed copy only when asked for: four times its weights' bytes
            prepacked = prepack_linears(model, bfloat16=config.prepack_weights == "on")
        return prepacked, set_quant_activations(model, config.quant_activations)

    def _kv_pool(self, sched_cfg: SchedulerConfig) -> KVPolicy:
        """The KV cache's eviction policy, its block count (checked against the memory asked for and the longest
        request), the block manager and the scheduler over it. Returns the policy (the runner's too)."""
        cache, mc, dtype = self.config.cache, self.model_config, self.loaded.dtype
        policy = make_policy(cache.kv_policy, cache.kv_budget, cache.sink_tokens, cache.h2o_recent)
        rope = self.loaded.model.rope
        check_policy_supports(policy, cache.kv_policy, mc.sliding_window,
                              dynamic_rope=rope is not None and rope.length_dependent)
        self.num_blocks = num_blocks = num_kv_blocks(cache, mc, dtype)
        check_kv_pool(num_blocks, cache, mc, dtype, policy, sched_cfg.max_num_batched_tokens, self.max_model_len)
        # LongRoPE past its original context rotates a cached block by the length of the sequence that holds it
        # (model_runner.recompute_for_long_rope): a block is then no longer a function of its tokens alone
        crosses = rope is not None and rope.long_orig_max is not None and self.max_model_len > rope.long_orig_max
        self.kv_manager = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching and not crosses,
                                         policy)
        self.scheduler = Scheduler(sched_cfg, self.kv_manager)
        return policy

    def _runner(self, policy: KVPolicy) -> ModelRunner:
        """What runs the forward: this process's ModelRunner, or under tensor / pipeline parallelism this rank's
        shard of it (brisk/parallel, installed at `import brisk`). Built after _prepare_weights: its executor
        resolves the layers' kernels as they are then."""
        config, cache = self.config, self.config.cache
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            return extension("parallel_runner")(config, self.loaded.model, self.num_blocks, self.loaded.dtype,
                                                policy)
        return ModelRunner(self.loaded.model, self.num_blocks, cache.block_size, self.loaded.dtype, config.device,
                           cache.kv_cache_dtype, cache.num_residual_blocks, policy, execution=config.execution)

    def _lora(self) -> LoRAManager | None:
        """Adapter slots wrapped around the layers (enable_lora), attached after the executor was built on the
        base layers."""
        if not self.config.enable_lora:
            return None
        from brisk.lora.manager import LoRAManager

        manager = LoRAManager(self.loaded.model, self.config.max_loras, self.config.max_lora_rank)
        manager.attach(self.runner)
        return manager

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    *, priority: int = 0, arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    pooling: PoolingParams | None = None) -> str:
        """Queue a prompt. With `pooling` it is a prefill-only request (engine/pooling.py): its output's `pooled`
        is the embedding (or yes/no score) once the prompt was computed; nothing is sampled."""
        params = params or self.sampling_defaults.sampling_params()
        if pooling is not None:
            self._check_pooling(params, lora_request)
        request_id = self.new_request_id() if request_id is None else request_id
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.model_config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {self.model_config.vocab_size}): {bad[:5]}")
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        if pooling is not None and len(ids) > self.max_model_len:
            raise PromptTooLongError(f"the input has {len(ids)} tokens, more than this model's context of "
                                     f"{self.max_model_len} tokens (max_model_len); shorten it")
        if pooling is None and len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens, which leaves no room to generate within max_model_len="
                f"{self.max_model_len}; shorten the prompt or raise --max-model-len")
        eos = self.tokenizer.eos_token_ids
        samples = []
        for k in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device="cpu").manual_seed((params.seed + k) % 2**64)
            rid = request_id if k == 0 else f"{request_id}#{k}"
            samples.append(Request(rid, ids, params, eos_token_ids=eos, arrival_time=arrival_time,
                                   priority=priority, generator=gen, parent_id=None if k == 0 else request_id,
                                   sample_index=k))
        group = _Group(request_id, text, ids, samples, params, self.tokenizer)
        if params.structured_outputs is not None:  # compiled (or found in the cache) before anything is queued or
            # an adapter slot is taken
            compiler = self.grammar_compiler()
            for req in samples:
                req.structured = compiler.new_state(params.structured_outputs)
                req.structured.jump_forward = jump_forward_mode(self.config.jump_forward, params)
        if lora_request is not None:
            if self.lora_manager is None:
                raise ValueError(f"request {request_id!r} asks for LoRA adapter {lora_request.lora_name!r}, but the "
                                 "engine was started without adapters; pass enable_lora=True (--enable-lora)")
            group.lora_slot, key = self.lora_manager.acquire(lora_request)
            for req in samples:
                req.lora_slot, req.lora_key = group.lora_slot, key
        if pooling is not None:
            samples[0].pooling = pooling
        self.groups[request_id] = group
        self.scheduler.add_request(samples[0], samples[1:])
        return request_id

    def _check_pooling(self, params: SamplingParams, lora_request: LoRARequest | None) -> None:
        """What a prefill-only request cannot be combined with (ValueError)."""
        if not isinstance(self.runner, ModelRunner):
            raise ValueError("embeddings and scores run on a single-process engine only, not under tensor or "
                             "pipeline parallelism")
        if self.speculator is not None:
            raise ValueError("embeddings and scores are not served by an engine with speculative decoding")
        if params.n != 1 or params.structured_outputs is not None or lora_request is not None:
            raise ValueError("an embedding or score request takes one sample, no constraint and no adapter")

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-outputs compiler of this model's vocabulary (built on first use: ~0.2 s), whose cache
        holds every constraint compiled so far."""
        compiler = self._grammar_compiler
        if compiler is not None:
            return compiler
        with self._grammar_compiler_lock:  # two threads asking first must not build (and cache in) two compilers
            if self._grammar_compiler is None:
                from brisk.structured.backend import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer.hf_tokenizer.to_str(),
                                                         self.model_config.vocab_size, self.tokenizer.eos_token_ids)
            return self._grammar_compiler

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests wherever they are; their KV blocks are freed at once."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            self._release_lora(group)
            for req in group.samples:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)
            self.scheduler.remove_finished([r.request_id for r in group.samples])

    def _release_lora(self, group: _Group) -> None:
        if group.lora_slot >= 0 and self.lora_manager is not None:
            self.lora_manager.release(group.lora_slot)
            group.lora_slot = -1

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Schedule, run and update one batch; the outputs of the requests it touched."""
        if self._step_strategy is not None:  # a pipeline-parallel engine: several micro-batches in flight
            return self._step_strategy(self)
        if self.speculator is not None:
            self.speculator.propose(self.scheduler)  # drafts ride along in this step's batch
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished():
                raise RuntimeError("scheduler made no progress with requests waiting; the KV pool is too small")
            return []
        t1 = time.perf_counter()
        result = self.runner.execute(sched, self.scheduler.requests)
        t2 = time.perf_counter()
        touched = self.scheduler.update(sched, result)
        if self.speculator is not None:
            self.speculator.observe(sched, result, self.scheduler)
        self.num_steps += 1
        outputs = self.make_outputs(touched)
        if all(len(s.token_ids) == 1 for s in sched.scheduled):  # a pure decode step: the split worth reading
            self.step_timer.add(t1 - t0, self.runner.last_timing, t2 - t1, time.perf_counter() - t2)
        return outputs

    def make_outputs(self, touched: list[Request]) -> list[RequestOutput]:
        """The outputs of the requests a step touched (their groups'), finished ones released."""
        now = time.monotonic()
        group_ids: dict[str, None] = {}
        for req in touched:
            gid = req.parent_id or req.request_id
            group = self.groups.get(gid)
            if group is None:
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            self._detokenize(group, req)
            group_ids[gid] = None
        outputs = []
        for gid in group_ids:
            group = self.groups[gid]
            out = self._group_output(group)
            if out.finished:
                group.finished_time = now
                out.metrics.finished_time = now
                del self.groups[gid]
                self._release_lora(group)
                self.scheduler.remove_finished([r.request_id for r in group.samples])
            outputs.append(out)
        return outputs

    def _detokenize(self, group: _Group, req: Request) -> None:
        state = group.states[req.sample_index]
        new = req.output_token_ids[state.emitted_tokens:]
        delta = state.detok.add(new)
        if req.is_finished:
            delta += state.detok.flush()
        prev_len = len(state.text)
        state.text += delta
        stops = group.params.stop
        if stops:
            # search only where a new match can start: the new text plus the longest stop string's overlap
            begin = max(0, prev_len - max(len(s) for s in stops) + 1)
            best = None
            for stop in stops:
                at = state.text.find(stop, begin)
                if at != -1 and (best is None or at < best[0]):
                    best = (at, stop)
            if best is not None:
                at, stop = best
                state.text = state.text[: at + (len(stop) if group.params.include_stop_str_in_output else 0)]
                if not req.is_finished:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = stop

    def _group_output(self, group: _Group) -> RequestOutput:
        completions = []
        hold = max((len(stop) for stop in group.params.stop), default=1) - 1 if group.params.stop else 0
        for req, state in zip(group.samples, group.states, strict=True):
            # while running, hold back the last len(longest stop) - 1 characters: they may be the start of a
            # stop string that the next token completes, and must then never have been streamed
            visible = len(state.text) if req.is_finished else max(state.emitted_text, len(state.text) - hold)
            text_delta = state.text[state.emitted_text:visible]
            num_new = req.num_output_tokens - state.emitted_tokens
            state.emitted_text = visible
            state.emitted_tokens = req.num_output_tokens
            lps = None
            cum = None
            if group.params.logprobs is not None:
                lps = list(req.logprobs)
                cum = sum(d[t] for d, t in zip(lps, req.output_token_ids, strict=False))
            completions.append(CompletionOutput(
                index=req.sample_index, text=state.text[:visible], token_ids=list(req.output_token_ids),
                finish_reason=req.status.finish_reason, stop_reason=req.stop_reason, logprobs=lps,
                cumulative_logprob=cum, text_delta=text_delta, num_new_tokens=num_new))
        first = group.samples[0]
        metrics = RequestMetrics(arrival_time=first.arrival_time, first_token_time=first.first_token_time,
                                 num_cached_tokens=first.num_cached_tokens,
                                 num_preemptions=sum(r.num_preemptions for r in group.samples))
        finished = all(r.is_finished for r in group.samples)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished, metrics,
                             first.pooled)

    # ------------------------------------------------------------------ what proposers take (spec/)
    def keep_hidden_states(self) -> None:
        """From now on each step's final hidden states are kept on the requests that produced them (the rows a
        Medusa or EAGLE proposer drafts from); costs one [rows, hidden] copy a step."""
        self.runner.executor.keep_hidden = True

    def target_kv(self) -> tuple[list[KVCache], KVCacheManager]:
        """The target's per-layer KV caches and their block manager, read-only for a proposer that copies
        positions the target computed (a self-draft adopting the target's keys and values)."""
        return self.runner.kv_caches, self.kv_manager

    # ------------------------------------------------------------------ introspection
    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.kv_offload is not None:
            stats.kv_offload = self.kv_offload.stats.as_dict()
        return stats

    def rank_weight_bytes(self) -> list[int]:
        """Bytes of parameters and buffers each rank holds, in rank order (one entry in a single process)."""
        per_rank = getattr(self.runner, "rank_weight_bytes", None)
        if per_rank:
            return list(per_rank)
        return [weight_bytes(self.loaded.model)]

    def shutdown(self) -> None:
        """Free what outlives the engine object: a parallel engine's worker processes and process group."""
        if self.kv_offload is not None:  # the blocks still queued for the disk tier are written first
            self.kv_offload.close()
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()
