"""What an engine runs that is built on top of it: a parallel engine's runner and step (brisk/parallel) and a
speculative engine's speculator (brisk/spec). Those packages build on the engine's runner, scheduler and config,
so the engine does not import them: they install their builders here, and `import brisk`, which runs before any
engine module does, installs both (brisk/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from brisk.engine.config import EngineConfig, SpecConfig
    from brisk.engine.llm_engine import LLMEngine
    from brisk.engine.model_runner import ModelRunner
    from brisk.engine.outputs import RequestOutput
    from brisk.model.llama import LlamaForCausalLM


@dataclass
class Extensions:
    # (config, model, num_blocks, dtype, KV policy) -> this rank's runner when tensor * pipeline parallel > 1
    parallel_runner: Callable[[EngineConfig, LlamaForCausalLM, int, torch.dtype, Any], ModelRunner] | None = None
    # LLMEngine.step of a pipeline-parallel engine: several micro-batches in flight
    pipeline_step: Callable[[LLMEngine], list[RequestOutput]] | None = None
    # the speculator that config.spec names, wrapped around its proposer
    speculator: Callable[[SpecConfig, LLMEngine], Any] | None = None


EXTENSIONS = Extensions()


def extension(name: str) -> Callable[..., Any]:
    """The installed builder `name` (a field of Extensions); a clear error where none is."""
    found = getattr(EXTENSIONS, name)
    if found is None:
        raise RuntimeError(f"the engine has no {name} installed (`import brisk` installs brisk.parallel's and "
                           "brisk.spec's)")
    return found
