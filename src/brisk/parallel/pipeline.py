"""Pipeline parallelism: contiguous layer stages, several micro-batches in flight.

    rank 0:  embed, layers [0, L/P)           -> (x, residual) ->  rank 1: layers [L/P, 2L/P) -> ... -> rank P-1:
             ... final norm, lm_head -> logits [N, vocab] -> rank 0, which samples

The engine keeps up to P micro-batches (disjoint sets of requests) in flight, so that while stage 1 runs micro-batch
A, stage 0 already runs B (GPipe's / vLLM's pipelining across requests, not within one):

    step:  fill:    while fewer than P in flight: schedule the requests that are not busy, submit (stage 0 runs)
           collect: wait for the oldest micro-batch's logits, sample, scheduler.update, outputs

A request is busy from the step that schedules it until that step's tokens come back, so the scheduler never sees
it then (`schedule_around`); each micro-batch takes at most ceil(running / P) running requests, so a steady decode
load splits into P groups that take turns. Every stage executes micro-batches in the order the driver submits
them, so K/V a micro-batch writes into a stage's cache is there before any later micro-batch of the same stage
reads it: a prefix-cache hit on blocks that an in-flight micro-batch is still filling is safe, as in one process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from brisk.engine.scheduler import Scheduler, SchedulerOutput
from brisk.parallel.shard import ShardingError, split_evenly

if TYPE_CHECKING:
    from brisk.engine.llm_engine import LLMEngine
    from brisk.engine.outputs import RequestOutput
    from brisk.model.llama import LlamaForCausalLM


def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges, one per stage, sizes differing by at most one."""
    if num_layers < num_stages:
        raise ShardingError(f"{num_layers} layers cannot be split into {num_stages} pipeline stages; use a "
                            f"pipeline-parallel size of at most {num_layers}")
    return split_evenly(num_layers, num_stages)


def take_stage(model: LlamaForCausalLM, layers: tuple[int, int], stage: int, num_stages: int) -> None:
    """Cut `model` in place to one stage: its layers; the embedding on the first stage, the head on the last. Its
    config then counts the stage's layers (which sizes the stage's KV cache)."""
    import dataclasses

    start, end = layers
    model.model.layers = nn.ModuleList(list(model.model.layers)[start:end])
    if stage != 0:
        model.model.embed_tokens = None
    if stage != num_stages - 1:
        model.lm_head = None
    model.config = dataclasses.replace(model.config, num_hidden_layers=end - start)


def schedule_around(scheduler: Scheduler, busy: set[str], num_stages: int) -> SchedulerOutput:
    """scheduler.schedule() over the running requests that are not busy, at most ceil(running / P) of them (see
    the module docstring); the others keep their place in `scheduler.running`."""
    running = scheduler.running
    free = [r for r in running if r.request_id not in busy]
    cap = max(1, -(-len(running) // num_stages))
    visible = free[:cap]
    hidden = len(running) - len(visible)
    limit = scheduler.config.max_num_seqs
    scheduler.running = visible
    scheduler.config.max_num_seqs = max(1, limit - hidden)  # admissions count the hidden ones too
    try:
        return scheduler.schedule()
    finally:
        after = scheduler.running
        still = {id(r) for r in after}
        shown = {id(r) for r in visible}
        before = {id(r) for r in running}
        scheduler.running = ([r for r in running if id(r) not in shown or id(r) in still]
                             + [r for r in after if id(r) not in before])
        scheduler.config.max_num_seqs = limit


def pipeline_step(engine: LLMEngine) -> list[RequestOutput]:
    """LLMEngine.step for a pipeline-parallel engine: fill the pipeline, then finish its oldest micro-batch."""
    runner = engine.runner
    scheduler = engine.scheduler
    num_stages = runner.state.pipeline_parallel_size  # type: ignore[attr-defined]
    while len(runner.in_flight) < num_stages:  # type: ignore[attr-defined]
        busy = {s.req_id for item in runner.in_flight for s in item.sched.scheduled}  # type: ignore[attr-defined]
        sched = schedule_around(scheduler, busy, num_stages)
        if sched.is_empty:
            break
        runner.submit(sched)  # type: ignore[attr-defined]
    if not runner.in_flight:  # type: ignore[attr-defined]
        if scheduler.has_unfinished():
            raise RuntimeError("scheduler made no progress with requests waiting; the KV pool is too small")
        return []
    sched, result = runner.collect(scheduler.requests)  # type: ignore[attr-defined]
    touched = scheduler.update(sched, result)
    engine.num_steps += 1
    return engine.make_outputs(touched)
