"""The model runners of a parallel engine: the driver's (rank 0) and the workers', on each rank's shard.

As in vLLM's executor, the driver schedules and every rank executes the same plain-data SchedulerOutput:

    driver (rank 0)                                      worker (rank r)
    scheduler.schedule() -> sched
    send sched to every rank  ------------------------>  recv sched
    execute(sched): prepare, forward on shard 0    <-->  prepare, forward on shard r   (tensor parallel: the
      (all-reduces inside the forward)                    all-reduces; pipeline: hidden states stage to stage)
    logits [N, vocab] on rank 0 -> sample
    scheduler.update(sched, result)

Each rank is an ordinary ModelRunner over its shard (its own paged KV cache holds its KV heads, or its stage's
layers); `prepare` runs on every rank from the same message, so all ranks agree on the slot mapping and block
tables without sending tensors. Sampling happens on the driver only.

Which code runs a rank's forward: the module path (engine/executor.py "modules"). The decode plan and the C++
layer loop run a whole model's layers with no point between them where an all-reduce or a stage boundary could
go, so a sharded model never gets a plan (its row-parallel layers are not runtime linears); inside the module path
every linear still runs its own small-row kernel (ops/layers.py), float or quantized.

Failure: any error of a collective or message (a dead worker closes its connections; a hung one misses the
group's timeout) makes the driver stop every rank it can, free the process group and raise ParallelError; the
engine is unusable afterwards (every later step raises the same error).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from brisk.engine.memory import weight_bytes
from brisk.engine.model_runner import ModelRunner
from brisk.engine.request import Request
from brisk.engine.scheduler import RunnerOutput, SchedulerOutput
from brisk.model.llama import LlamaForCausalLM
from brisk.ops.attention import AttentionMetadata
from brisk.parallel import launch
from brisk.parallel.comm import ParallelError
from brisk.parallel.pipeline import stage_layers, take_stage
from brisk.parallel.shard import shard_model

logger = logging.getLogger(__name__)


class _ShardRunner(ModelRunner):
    """A ModelRunner over one rank's shard, that knows its parallel state."""

    state: launch.ParallelState
    weight_bytes: int = 0  # this rank's parameters and buffers after sharding

    def forward_only(self, sched: SchedulerOutput) -> None:
        """What every rank does with a step (ModelRunner.execute before sampling), on this rank's shard."""
        self.kv_policy.on_free(sched.freed_req_ids)
        self.move_kv(sched.kv_moves)
        self.copy_blocks(sched.block_copies)
        ids, positions, meta, context_lens = self.prepare(sched)
        self.run_forward(ids, positions, meta, context_lens)

    def run_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    context_lens: torch.Tensor | None) -> torch.Tensor | None:
        return self.executor(ids.to(self.device), positions.to(self.device), meta, self.kv_caches, context_lens)

    def serve(self) -> None:
        """A worker's loop: execute the driver's steps until it sends None."""
        while True:
            sched = self.state.group.recv_object(0)
            if sched is None:
                return
            with torch.inference_mode():
                self.forward_only(sched)


class DriverRunner(_ShardRunner):
    """Rank 0: sends each step to the workers, runs its own shard, samples; any failure shuts everything down."""

    failed: ParallelError | None = None
    rank_weight_bytes: list[int] = []  # every rank's weight bytes, in rank order (start-up; see the log line)
    full_weight_bytes: int = 0  # the whole model's, before it was cut

    def _broadcast(self, obj: Any) -> None:
        for rank in range(1, self.state.group.size):
            self.state.group.send_object(obj, rank)

    def execute(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> RunnerOutput:
        self._check_alive()
        try:
            self._broadcast(sched)
            return super().execute(sched, requests)
        except RuntimeError as e:  # torch.distributed's errors (DistBackendError, timeouts) are RuntimeErrors
            raise self._fail(e) from e

    def _check_alive(self) -> None:
        if self.failed is not None:
            raise ParallelError(f"the parallel engine was shut down after a failure: {self.failed}")

    def _fail(self, cause: BaseException) -> ParallelError:
        """Stop every rank this process started, leave the process group, remember why."""
        detail = launch.worker_errors(self.state)
        self.failed = ParallelError(
            f"a parallel worker failed or did not answer within the {self.timeout:.0f} s timeout "
            f"({detail or cause}); the engine has been shut down, start a new one")
        logger.error("%s", self.failed)
        launch.shutdown(self.state)
        return self.failed

    timeout: float = 60.0

    def shutdown(self) -> None:
        """Stop the workers (they leave their loop) and free the process group; idempotent."""
        if self.failed is not None or not dist.is_initialized():
            launch.shutdown(self.state)
            return
        try:
            self._broadcast(None)
        except RuntimeError:
            pass
        launch.shutdown(self.state)
        self.failed = ParallelError("the parallel engine was shut down")


# ---------------------------------------------------------------------------- pipeline stages
@dataclass
class _InFlight:
    """A micro-batch whose first stage ran on the driver; its logits come back from the last stage."""

    sched: SchedulerOutput
    prepared: tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor | None]
    logits: torch.Tensor  # [N, vocab], filled by the recv
    submitted: float


class _StageMixin:
    """Runs one contiguous stage of layers: receive (x, residual) from the previous stage (or embed, on stage 0),
    run the stage's layers, send them on (or, on the last stage, the final norm and the logits to rank 0).

    With tensor parallelism inside the stages (global rank g = stage * tp + tensor rank), every rank of a stage
    runs the stage on its shard (the all-reduces within the stage's group) and ends with the whole hidden state,
    so tensor rank r sends to tensor rank r of the next stage, g + tp; on the last stage the vocabulary-parallel
    head gathers the logits on its tensor rank 0, which sends them to the driver."""

    model: LlamaForCausalLM
    state: launch.ParallelState
    hidden_size: int

    @property
    def first(self) -> bool:
        return self.state.pp_rank == 0

    @property
    def last(self) -> bool:
        return self.state.pp_rank == self.state.pipeline_parallel_size - 1

    def run_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    context_lens: torch.Tensor | None) -> torch.Tensor | None:
        model, group, rank = self.model, self.state.group, self.state.group.rank
        step = self.state.tensor_parallel_size  # global ranks from one stage to the next
        t = ids.shape[0]
        if self.first:
            x, cos, sin = model.prologue(ids, positions, meta, context_lens)  # [T, hidden], [T, d/2] x 2
            residual = None
        else:
            cos, sin = model.cos_sin(positions, context_lens)  # [T, d/2]
            both = group.recv(torch.empty((2, t, self.hidden_size), dtype=self.dtype), rank - step)  # [2, T, hidden]
            x, residual = both[0], both[1].clone()
        for layer, kv in zip(model.model.layers, self.kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, meta, kv)
        if not self.last:
            group.send(torch.stack([x, residual]), rank + step)  # [2, T, hidden]
            return None
        hidden, _ = model.model.norm(x, residual)
        logits = model.compute_logits(hidden, meta)  # [N, vocab] (tensor rank 0; the others their slice)
        if not self.first and self.state.tp_rank == 0:
            group.send(logits.contiguous(), 0)
        return logits


class StageWorkerRunner(_StageMixin, _ShardRunner):
    """A pipeline stage other than the first."""


class PipelineDriverRunner(_StageMixin, DriverRunner):
    """Stage 0 and the sampler: `submit` runs a micro-batch's first stage and returns at once; `collect` waits for
    its logits from the last stage and samples, as ModelRunner.execute would. Up to pipeline_parallel_size
    micro-batches are in flight (parallel/pipeline.py decides which requests each may hold)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight: deque[_InFlight] = deque()
        self.max_in_flight = 0  # the most micro-batches that were in flight at once
        self._collecting: _InFlight | None = None

    def submit(self, sched: SchedulerOutput) -> None:
        self._check_alive()
        try:
            self._broadcast(sched)
            with torch.inference_mode():
                self.kv_policy.on_free(sched.freed_req_ids)
                self.move_kv(sched.kv_moves)
                self.copy_blocks(sched.block_copies)
                prepared = ModelRunner.prepare(self, sched)
                ids, positions, meta, context_lens = prepared
                # the rows compute_logits keeps: logits_indices, or every row (None: a batch of decodes)
                n = ids.shape[0] if meta.logits_indices is None else int(meta.logits_indices.numel())
                logits = torch.empty((n, self.vocab_size), dtype=self.dtype)
                _StageMixin.run_forward(self, ids, positions, meta, context_lens)
        except RuntimeError as e:
            raise self._fail(e) from e
        self.in_flight.append(_InFlight(sched, prepared, logits, time.perf_counter()))
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    def collect(self, requests: Mapping[str, Request]) -> tuple[SchedulerOutput, RunnerOutput]:
        """The oldest micro-batch's RunnerOutput (its logits received from the last stage, then sampled)."""
        item = self.in_flight.popleft()
        try:
            if item.logits.shape[0]:  # from the last stage's tensor rank 0
                last = (self.state.pipeline_parallel_size - 1) * self.state.tensor_parallel_size
                self.state.group.recv(item.logits, last)
            self._collecting = item
            return item.sched, ModelRunner.execute(self, item.sched, requests)  # the sampling half (below)
        except RuntimeError as e:
            raise self._fail(e) from e
        finally:
            self._collecting = None

    # While collecting, ModelRunner.execute's steps before sampling were done by submit: its cache edits are
    # skipped, `prepare` returns what submit prepared and the forward returns the received logits.
    def move_kv(self, moves: tuple[list[int], list[int]]) -> None:
        if self._collecting is None:
            super().move_kv(moves)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if self._collecting is None:
            super().copy_blocks(copies)

    def prepare(self, sched: SchedulerOutput) -> Any:
        return self._collecting.prepared if self._collecting is not None else super().prepare(sched)

    def execute(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> RunnerOutput:
        """One micro-batch through the whole pipeline (nothing else in flight): submit, then collect."""
        self.submit(sched)
        return self.collect(requests)[1]


class _Logits:
    """The executor ModelRunner.execute calls while collecting: the logits the last stage sent."""

    def __init__(self, runner: PipelineDriverRunner, inner: Any) -> None:
        self.runner, self.inner = runner, inner

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        item = self.runner._collecting
        if item is None:
            return self.inner(*args, **kwargs)
        return item.logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# ---------------------------------------------------------------------------- building them
def make_parallel_runner(config: Any, model: LlamaForCausalLM, num_blocks: int, dtype: torch.dtype, policy: Any
                         ) -> ModelRunner:
    """This rank's runner for `config`'s parallel engine (called by LLMEngine in place of ModelRunner): joins or
    starts the ranks (parallel/launch.py), cuts the model to this rank's shard, builds the runner. An inherited
    worker process (torchrun, another node's command) serves here and leaves the process when stopped."""
    state = launch.start(config)
    group = state.group
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    hidden_size = model.config.hidden_size
    full_bytes = weight_bytes(model)
    if pp > 1:  # this rank's stage first (its layers; the embedding / head where the stage holds them)
        take_stage(model, stage_layers(model.config.num_hidden_layers, pp)[state.pp_rank], state.pp_rank, pp)
    if tp > 1:  # then its tensor-parallel share of the stage
        assert state.tp_group is not None
        shard_model(model, state.tp_group)
    cls: type[_ShardRunner]
    if pp > 1:
        cls = PipelineDriverRunner if state.is_driver else StageWorkerRunner
    else:
        cls = DriverRunner if state.is_driver else _ShardRunner
    cache = config.cache
    runner = cls(model, num_blocks, cache.block_size, dtype,
                 config.device, cache.kv_cache_dtype, cache.num_residual_blocks, policy, execution="modules")
    runner.state = state
    runner.hidden_size = hidden_size  # type: ignore[attr-defined]
    runner.weight_bytes = weight_bytes(model)
    if isinstance(runner, PipelineDriverRunner):
        runner.executor = _Logits(runner, runner.executor)  # type: ignore[assignment]
    if isinstance(runner, DriverRunner):
        runner.timeout = float(config.distributed_timeout)
        try:
            launch.wait_ready(state, float(config.distributed_timeout))
            runner.rank_weight_bytes = launch.gather_weight_bytes(state, runner.weight_bytes) or []
        except (ParallelError, RuntimeError):
            launch.shutdown(state)
            raise
        runner.full_weight_bytes = full_bytes
        # a warning, as the kernel builds' start-up line: printed with no logging set up
        per_rank = runner.rank_weight_bytes
        logger.warning("brisk: parallel engine (tensor %d x pipeline %d): weights per rank %s MiB, %s of the "
                       "whole model's %.1f MiB", tp, pp, ", ".join(f"{b / 2**20:.1f}" for b in per_rank),
                       ", ".join(f"{b / full_bytes:.2f}" for b in per_rank), full_bytes / 2**20)
        return runner
    if not state.spawned:  # an inherited worker process: serve here, then leave
        dist.monitored_barrier(group=group.cpu_group, timeout=timedelta(seconds=config.distributed_timeout))
        launch.gather_weight_bytes(state, runner.weight_bytes)
        try:
            runner.serve()
        finally:
            launch.shutdown(state)
        raise SystemExit(0)
    return runner
