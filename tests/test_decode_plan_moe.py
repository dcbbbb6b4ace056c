"""Mixture-of-experts layers (model/moe.py) in the decode fast path: the plan's Python loop and its C++ layer loop
route, run each chosen expert once over its rows and sum as the module path does, so tokens and logprobs are equal
(not merely close), for float32, bfloat16, int4 RTN and GGUF-repacked experts; and every path records the same
expert loads."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_decode_plan import _run_both
from test_moe import ARCHS, make_tiny_moe, write_moe_gguf

from brisk import LLM, SamplingParams
from brisk.engine.decode_plan import DecodePlan
from brisk.model.moe import ExpertLoads, record_expert_loads

# three requests of different lengths: each decode step routes 3 rows, mostly to different experts
PROMPTS = [[11, 5, 9, 33, 7], [12, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22], [3]]


@pytest.fixture(scope="module", params=ARCHS)
def moe_folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"plan_{request.param}")
    make_tiny_moe(path, request.param, seed=2)
    return request.param, path


def _recording(make_llm, stack: contextlib.ExitStack, loads: list[ExpertLoads]):
    """make_llm(**kw) whose engines record their expert loads (record_expert_loads) until the stack closes."""
    def make(**kw) -> LLM:
        llm = make_llm(**kw)
        plan = llm.engine.runner.executor.plan
        if plan is not None:  # every layer of these models routes: the plan holds each one's experts
            assert len(plan.moe_layers) == len(plan.layers) == llm.engine.loaded.config.num_hidden_layers
        loads.append(stack.enter_context(record_expert_loads(llm.engine.loaded.model)))
        return llm
    return make


def _check_loads(loads: list[ExpertLoads], top_k: int = 2) -> None:
    """cpp, plan and modules routed every step's rows to the same experts, each expert with rows called once; and
    some decode step of the three rows used more than top_k experts (rows of one step on different experts)."""
    cpp, plan, modules = loads
    assert cpp.counts == plan.counts == modules.counts and cpp.calls == plan.calls == modules.calls
    assert all(c == int(n > 0) for (_, counts), calls in zip(cpp.counts, cpp.calls, strict=True)
               for n, c in zip(counts, calls, strict=True))
    decode = [counts for _, counts in cpp.counts if sum(counts) == 3 * top_k]
    assert decode and any(sum(n > 0 for n in counts) > top_k for counts in decode)


def _prefill_then_decodes(monkeypatch, path, dtype: str = "float32") -> None:
    """The prompts' prefill (17 rows: the Python loop, an expert with more rows than its small kernel takes on its
    large-row path, as in the module path) and batched decode steps of 3 rows (the C++ loop)."""
    loads: list[ExpertLoads] = []
    with contextlib.ExitStack() as stack:
        make = _recording(lambda **kw: LLM(str(path), dtype=dtype, kv_cache_memory="8MiB", **kw), stack, loads)
        steps = _run_both(monkeypatch, make, PROMPTS)
    assert steps[0] == (17, False)
    assert all(s == (3, True) for s in steps[1:])
    _check_loads(loads)


def test_plan_equals_module_path_moe(ops, moe_folder, monkeypatch):
    _prefill_then_decodes(monkeypatch, moe_folder[1])


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_plan_equals_module_path_moe_bfloat16(ops, tmp_path, monkeypatch, arch):
    """bfloat16 under both rules for the top-k weights: mixtral's float32 weighted sum, qwen's in the model dtype."""
    make_tiny_moe(tmp_path, arch, seed=2)
    _prefill_then_decodes(monkeypatch, tmp_path, "bfloat16")


def test_plan_runs_moe_prefill_chunks_in_cpp(ops, moe_folder, monkeypatch):
    """4-token prefill chunks mixed with decodes: steps of up to 8 rows with query_start, all in the C++ loop."""
    _, path = moe_folder
    loads: list[ExpertLoads] = []
    with contextlib.ExitStack() as stack:
        make = _recording(lambda **kw: LLM(str(path), kv_cache_memory="8MiB", max_model_len=64,
                                           max_num_batched_tokens=4, enable_chunked_prefill=True, **kw), stack, loads)
        steps = _run_both(monkeypatch, make, PROMPTS)
    assert all(rows <= 4 for rows, _ in steps)  # every step in C++
    assert any(not decode for _, decode in steps[3:])  # chunks of the long prompt beside decodes
    _check_loads(loads)


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_plan_equals_module_path_moe_int4(ops, moe_folder, tmp_path, monkeypatch, activations):
    """`brisk quantize --method rtn` int4 (group 32) experts: QuantLinear kernel descriptors in both loops (float
    activations, or rounded to int8 as quant_activations auto gives 4-bit layers); the router and the shared
    expert's gate stay float."""
    from brisk.bench.quant import build_checkpoint
    from brisk.ops.layers import LinearKind, QuantLinear
    from brisk.quant.config import LayerQuant

    arch, _ = moe_folder
    path = tmp_path / "hf"  # every linear's K a multiple of 32 (the kernels' blocked layout): a 64-wide shared expert
    make_tiny_moe(path, arch, seed=2, **({"shared_expert_intermediate_size": 64} if arch == "qwen2_moe" else {}))
    out = tmp_path / "int4"
    build_checkpoint(LayerQuant(bits=4, group_size=32, sym=False), out, str(path))

    def make_llm(**kw) -> LLM:
        llm = LLM(str(out), kv_cache_memory="8MiB", quant_activations=activations, **kw)
        expert = llm.engine.loaded.model.model.layers[1].mlp.experts[5]
        assert isinstance(expert.gate_up_proj, QuantLinear) and isinstance(expert.down_proj, QuantLinear)
        plan = llm.engine.runner.executor.plan
        if plan is not None:
            int8 = {LinearKind.QUANT_Q8, LinearKind.QUANT_Q8_TILED}
            kinds = {k.kind for layer in plan.layers for k in layer.mlp_linears}
            assert kinds and (kinds <= int8 if activations == "int8" else not kinds & int8)
        return llm

    _run_both(monkeypatch, make_llm, PROMPTS)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_plan_equals_module_path_moe_gguf(ops, tmp_path, monkeypatch, qtype):
    """A GGUF file's stacked experts, repacked one expert at a time into QuantLinear codes (tiled where built)."""
    from gguf import GGMLQuantizationType

    from brisk.ops.layers import LinearKind, QuantLinear

    make_tiny_moe(tmp_path / "hf", "qwen2_moe", seed=2, shared_expert_intermediate_size=64)  # K: whole blocks
    gguf = write_moe_gguf(tmp_path / f"{qtype}.gguf", tmp_path / "hf", GGMLQuantizationType[qtype])

    def make_llm(**kw) -> LLM:
        llm = LLM(str(gguf), kv_cache_memory="8MiB", **kw)
        mlp = llm.engine.loaded.model.model.layers[0].mlp
        assert all(isinstance(m, QuantLinear) for m in [e.down_proj for e in mlp.experts]
                   + [mlp.shared_expert.gate_up_proj, mlp.shared_expert.down_proj])
        plan = llm.engine.runner.executor.plan
        if plan is not None:
            kinds = {k.kind for layer in plan.layers for k in layer.mlp_linears}
            assert kinds <= {LinearKind.QUANT, LinearKind.QUANT_TILED, LinearKind.QUANT_Q8,
                             LinearKind.QUANT_Q8_TILED}
        return llm

    _run_both(monkeypatch, make_llm, PROMPTS)


def test_plan_equals_module_path_moe_pruned(ops, tmp_path, monkeypatch):
    """Magnitude-pruned experts (50% per row: ops.sparse.SparseLinear, kind SPARSE) in both loops."""
    from test_sparse_linear import write_pruned

    from brisk.ops.layers import LinearKind, SparseLinear

    make_tiny_moe(tmp_path / "hf", "qwen3_moe", seed=2)
    folder = write_pruned(tmp_path / "hf", tmp_path / "pruned", 0.5)

    def make_llm(**kw) -> LLM:
        llm = LLM(str(folder), kv_cache_memory="8MiB", **kw)
        assert isinstance(llm.engine.loaded.model.model.layers[0].mlp.experts[2].down_proj, SparseLinear)
        plan = llm.engine.runner.executor.plan
        if plan is not None:
            assert {k.kind for layer in plan.layers for k in layer.mlp_linears} == {LinearKind.SPARSE}
        return llm

    _run_both(monkeypatch, make_llm, PROMPTS)


def test_plan_covers_mixed_dense_and_moe_layers(ops, tmp_path, monkeypatch):
    """Layer 0 keeps a dense MLP (mlp_only_layers): the C++ layout holds a dense layer beside routed ones."""
    make_tiny_moe(tmp_path, "qwen3_moe", seed=2, num_hidden_layers=3, mlp_only_layers=[0])

    def make_llm(**kw) -> LLM:
        llm = LLM(str(tmp_path), kv_cache_memory="8MiB", **kw)
        plan = llm.engine.runner.executor.plan
        if plan is not None:
            assert [layer.moe is None for layer in plan.layers] == [True, False, False]
            # per layer: window, RoPE table, activation (the step's, the one table, SiLU), then the MoE ints
            assert plan.layer_spec == [-1, -1, 0] + [0] * 5 + ([-1, -1, 0] + [8, 2, 1, 0, 0]) * 2
        return llm

    _run_both(monkeypatch, make_llm, PROMPTS)


def test_moe_plan_left_out_where_it_does_not_apply(ops, tmp_path):
    """A hook on the router or on an expert's linear means no plan; the C++ layout refuses inconsistent MLP ints."""
    make_tiny_moe(tmp_path, "mixtral", seed=2)
    llm = LLM(str(tmp_path), kv_cache_memory="8MiB")
    model = llm.engine.loaded.model
    plan = llm.engine.runner.executor.plan
    assert isinstance(plan, DecodePlan) and llm.engine.runner.executor.path == "cpp"
    for module in (model.model.layers[1].mlp.gate, model.model.layers[0].mlp.experts[3].down_proj):
        handle = module.register_forward_hook(lambda m, a, out: None)
        assert DecodePlan.build(model) is None
        handle.remove()
    assert DecodePlan.build(model) is not None
    def weights(layer_spec: list[int]) -> None:
        torch.classes.brisk.DecodeWeights(plan.params, plan.spec, layer_spec, plan.eps, plan.scales, plan.final_norm,
                                          plan.final_eps)

    bad = list(plan.layer_spec)
    bad[4] = 9  # top-9 of 8 experts
    with pytest.raises(RuntimeError, match="layer 0: top_k 9 of 8 experts"):
        weights(bad)
    dense = [n if j % 8 < 3 else 0 for j, n in enumerate(plan.layer_spec)]  # read as dense: the experts do not fit
    with pytest.raises(RuntimeError, match="decode_layers: 2 layers need 60 parameter slots"):
        weights(dense)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
