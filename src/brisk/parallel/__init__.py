"""Tensor and pipeline parallelism over torch.distributed, and data-parallel replicas (docs/parallel.md).

    launch.py    starting the ranks (spawned here, torchrun, several nodes) and the process group
    comm.py      the collectives and the driver's messages
    shard.py     tensor-parallel sharding of a loaded model (column / row / vocab parallel)
    pipeline.py  layer stages and the engine step that keeps several micro-batches in flight
    runner.py    the driver's and the workers' model runners
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from brisk.engine.extensions import EXTENSIONS

if TYPE_CHECKING:
    from brisk.engine.llm_engine import LLMEngine
    from brisk.engine.model_runner import ModelRunner
    from brisk.engine.outputs import RequestOutput


def _parallel_runner(*args: Any) -> ModelRunner:
    from brisk.parallel.runner import make_parallel_runner  # start-up: torch.distributed loads for parallel engines

    return make_parallel_runner(*args)


def _pipeline_step(engine: LLMEngine) -> list[RequestOutput]:
    from brisk.parallel.pipeline import pipeline_step  # start-up: loads with the parallel runner only

    return pipeline_step(engine)


def install() -> None:
    """Give the engine its parallel runner and pipeline step (engine/extensions.py)."""
    EXTENSIONS.parallel_runner = _parallel_runner
    EXTENSIONS.pipeline_step = _pipeline_step
