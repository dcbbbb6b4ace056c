"""engine/executor.py: the execution paths the runner can be built with give the same greedy tokens, `auto` picks
the fastest one built, and a step the fast path cannot run takes the module path."""

from __future__ import annotations

import pytest
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.engine.config import EngineConfig
from brisk.engine.executor import Executor
from brisk.ops.layers import LinearKind, QuantLinear

PROMPTS = [[1, 5, 9, 33, 7], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22], [3]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("executor")
    make_tiny_hf_model(path, "llama", num_kv_heads=2, intermediate_size=96)
    return path


@pytest.fixture(scope="module")
def int4_folder(tiny_folder, tmp_path_factory):
    from brisk.bench.quant import build_checkpoint
    from brisk.quant.config import LayerQuant

    out = tmp_path_factory.mktemp("executor_int4")
    build_checkpoint(LayerQuant(bits=4, group_size=32, sym=False), out, str(tiny_folder))
    return out


def _llm(folder, **kw) -> LLM:
    return LLM(str(folder), kv_cache_memory="8MiB", max_model_len=64, **kw)


def _outputs(llm: LLM) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, PARAMS)]


def _paths(llm: LLM, monkeypatch) -> list[str]:
    """Record which path each step of `llm` takes."""
    executor = llm.engine.runner.executor
    taken: list[str] = []
    real = executor.step_path
    monkeypatch.setattr(executor, "step_path", lambda *a: taken.append(real(*a)) or taken[-1])
    return taken


@pytest.mark.parametrize("quantized,quant_activations", [(False, "float"), (True, "float"), (True, "int8")])
def test_every_execution_gives_the_module_path_tokens(ops, tiny_folder, int4_folder, monkeypatch, quantized,
                                                      quant_activations):
    folder = int4_folder if quantized else tiny_folder
    want = _outputs(_llm(folder, execution="modules", quant_activations=quant_activations))
    for execution in ("plan", "cpp"):
        llm = _llm(folder, execution=execution, quant_activations=quant_activations)
        assert llm.engine.runner.executor.path == execution
        taken = _paths(llm, monkeypatch)
        assert _outputs(llm) == want, execution  # the same kernels with the same inputs: tokens and logprobs exact
        # the 17-row prefill on the Python loop, then 3-row decode steps (C++ when asked)
        assert taken[0] == "plan" and set(taken[1:]) == {execution}
    if quantized:
        layers = [m for m in llm.engine.loaded.model.modules() if type(m) is QuantLinear]
        kinds = {m.kernel().kind for m in layers}
        int8 = {LinearKind.QUANT_Q8, LinearKind.QUANT_Q8_TILED}
        assert kinds <= int8 if quant_activations == "int8" else not kinds & int8


def test_compiled_execution_gives_the_same_tokens(ops, tiny_folder, int4_folder):
    from brisk.engine.compiled import CompileError

    want = _outputs(_llm(tiny_folder, execution="modules", max_num_batched_tokens=64))
    llm = _llm(tiny_folder, execution="compiled", max_num_batched_tokens=64)
    assert llm.engine.config.compile and llm.engine.runner.executor.path == "compiled"
    assert llm.engine.compile_seconds > 0
    # inductor reorders float32 sums: the logprobs are close, not equal; the greedy tokens are the same
    assert [ids for ids, _ in _outputs(llm)] == [ids for ids, _ in want]
    with pytest.raises(CompileError, match="QuantLinear"):
        _llm(int4_folder, execution="compiled")


def test_auto_picks_cpp_where_built_and_modules_without_kernels(ops, tiny_folder, kernel_settings):
    llm = _llm(tiny_folder)
    assert llm.engine.config.execution == "auto" and llm.engine.runner.executor.path == "cpp"
    want = _outputs(llm)
    kernel_settings(enabled=False)
    plain = _llm(tiny_folder)
    assert plain.engine.runner.executor.path == "modules" and plain.engine.runner.executor.plan is None
    assert [ids for ids, _ in _outputs(plain)] == [ids for ids, _ in want]  # the reference ops: tokens agree


def test_a_step_the_fast_path_cannot_run_takes_the_modules(ops, tiny_folder, monkeypatch):
    """H2O (attention mass collected, reference path): every step falls back to the modules, with the module path's
    numbers; StreamingLLM takes the plan's Python loop (attention on the kernel with its sinks), an int8 cache the
    plan and its C++ loop, each with the module path's numbers."""
    cases = [({"kv_policy": "h2o", "kv_budget": 12}, {"modules"}),
             ({"kv_policy": "streaming", "kv_budget": 12, "sink_tokens": 2}, {"plan"}),
             ({"kv_cache_dtype": "int8"}, {"plan", "cpp"})]  # (a prefill of more than 8 rows: the Python loop)
    for settings, paths in cases:
        want = _outputs(_llm(tiny_folder, execution="modules", **settings))
        llm = _llm(tiny_folder, execution="cpp", **settings)
        assert llm.engine.runner.executor.path == "cpp"
        taken = _paths(llm, monkeypatch)
        assert _outputs(llm) == want, settings
        assert set(taken) == paths, settings


def test_rebuild_follows_the_quantized_activations(ops, int4_folder):
    """The executor resolves each layer's kernel when built; after set_quant_activations it is rebuilt."""
    from brisk.quant.layers import set_quant_activations

    llm = _llm(int4_folder, quant_activations="float")
    executor = llm.engine.runner.executor
    kinds = lambda: {k for k in executor.plan.spec[0::3]}  # noqa: E731 - the C++ loop's kind per linear
    assert kinds() <= {LinearKind.QUANT, LinearKind.QUANT_TILED}
    want = _outputs(_llm(int4_folder, quant_activations="int8"))
    set_quant_activations(llm.engine.loaded.model, "int8")
    executor.rebuild()
    assert kinds() <= {LinearKind.QUANT_Q8, LinearKind.QUANT_Q8_TILED}
    assert _outputs(llm) == want


def test_execution_setting_is_validated():
    assert EngineConfig(compile=True).execution == "compiled"
    assert EngineConfig(execution="compiled").compile
    assert not EngineConfig(execution="plan").compile
    with pytest.raises(ValueError, match="execution must be 'auto', 'modules', 'plan', 'cpp' or 'compiled'"):
        EngineConfig(execution="fast")
    with pytest.raises(ValueError, match="compile=True is execution 'compiled'"):
        EngineConfig(compile=True, execution="modules")
    with pytest.raises(ValueError, match="execution must be one of"):
        Executor(None, "fast")  # type: ignore[arg-type]
