"""The decode fast path (engine/decode_plan.py) against the module path: the same kernels with the same inputs,
so logits are bit-identical, for float32, bfloat16 and quantized models; and the cases it must leave alone."""

from __future__ import annotations

import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.engine.decode_plan import DecodePlan


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    # head_dim 16 (the kernels need a multiple of 8), GQA 4:2, untied head; K = 96 for down_proj
    path = tmp_path_factory.mktemp("plan")
    make_tiny_hf_model(path, "llama", num_kv_heads=2, intermediate_size=96)
    return path


def _greedy_and_logprobs(llm: LLM, prompts: list[list[int]], n: int = 12) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _run_both(monkeypatch, make_llm, prompts, plan_steps: bool = True, params: SamplingParams | None = None,
              cpp: bool = True):
    """execution cpp (the plan with its C++ layer loop), plan (its Python loop) and modules: the same numbers.
    make_llm(execution=...) builds the engine; cpp False: a model the C++ loop does not cover, so execution cpp
    runs the plan's Python loop. Returns the rows of each step the plan ran, and whether it was decode-only."""
    calls = []
    real_run, real_cpp = DecodePlan.run, DecodePlan.run_cpp

    def record(self, x, meta, loop):
        if self is targets[-1]:  # the engine's model (a speculative draft model has a plan of its own)
            calls.append((x.shape[0], meta.num_decodes == meta.block_tables.shape[0] == x.shape[0], loop))

    def run(self, x, cos, sin, meta, kv):
        record(self, x, meta, "python")
        return real_run(self, x, cos, sin, meta, kv)

    def run_cpp(self, x, cos, sin, meta, kv):
        record(self, x, meta, "cpp")
        return real_cpp(self, x, cos, sin, meta, kv)

    def make(execution: str) -> LLM:
        llm = make_llm(execution=execution)
        assert llm.engine.runner.executor.execution == execution
        targets.append(llm.engine.runner.executor.plan)
        return llm

    def outputs(llm: LLM) -> list:
        return _greedy_and_logprobs(llm, prompts) if params is None else _outputs(llm, prompts, params)

    targets: list = []
    monkeypatch.setattr(DecodePlan, "run", run)
    monkeypatch.setattr(DecodePlan, "run_cpp", run_cpp)
    fast_llm = make("cpp")
    plan = targets[-1]
    assert plan is not None, "the plan should cover this model"
    assert (plan.decode_layers is not None) == cpp, "ops/csrc/decode_layers.cpp should be built (and cover it)"
    assert fast_llm.engine.runner.executor.path == ("cpp" if cpp else "plan")
    fast = outputs(fast_llm)
    assert (len(calls) > 0) == plan_steps  # steps ran through the plan (or, here, must not)
    # steps of <= 8 rows ran the C++ loop, larger ones the Python loop
    assert all((rows <= 8 and cpp) == (loop == "cpp") for rows, _, loop in calls)
    steps = [(rows, decode) for rows, decode, _ in calls]
    calls.clear()
    again = outputs(make("plan"))
    assert again == fast  # the plan's Python loop
    assert [(rows, decode) for rows, decode, _ in calls] == steps and all(loop == "python" for *_, loop in calls)
    calls.clear()
    slow_llm = make("modules")
    assert slow_llm.engine.runner.executor.plan is None
    slow = outputs(slow_llm)
    assert not calls
    assert fast == slow  # token ids and top-3 logprobs, exactly
    return steps


def _outputs(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


PROMPTS = [[1, 5, 9, 33, 7], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22], [3]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_equals_module_path(ops, tiny_folder, monkeypatch, dtype):
    steps = _run_both(monkeypatch, lambda **kw: LLM(str(tiny_folder), dtype=dtype, kv_cache_memory="8MiB", **kw),
                      PROMPTS)
    assert steps[0] == (17, False)  # the three prompts' prefill: 17 rows, the Python loop with prefill attention
    assert all(s == (3, True) for s in steps[1:])  # then decode steps of the three


@pytest.mark.parametrize("chunk", [None, 4])
def test_plan_runs_short_prefills_and_mixed_steps_in_cpp(ops, tiny_folder, monkeypatch, chunk):
    """A 5-token and a 1-token prompt: a 6-row prefill step (C++ loop with query_start); with 4-token prefill
    chunks, steps that mix a decode with a prefill chunk."""
    kw = {"max_num_batched_tokens": chunk, "enable_chunked_prefill": True} if chunk else {}
    steps = _run_both(monkeypatch, lambda **ex: LLM(str(tiny_folder), kv_cache_memory="8MiB", max_model_len=64, **kw,
                                                    **ex), [[1, 5, 9, 33, 7], [3]])
    assert steps[0] == ((6, False) if chunk is None else (4, False))
    assert any(rows <= 8 and not decode for rows, decode in steps)


@pytest.mark.parametrize("method", ["draft", "self:int8"])
def test_plan_runs_speculative_verification(ops, tmp_path, monkeypatch, method):
    """Verification steps (γ + 1 rows per sequence) through the plan: the module path's tokens and logprobs.
    (The draft is the model itself, or its int8 copy: drafts every step, mostly accepted.)"""
    make_tiny_hf_model(tmp_path, "llama", num_kv_heads=2)  # intermediate 128: the int8 self-draft's groups fit
    spec = {"method": method.partition(":")[0], "num_speculative_tokens": 3, "adaptive": False,
            "model": str(tmp_path) if method == "draft" else "int8", "disable_by_batch_size": None}
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10, 11, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    steps = _run_both(monkeypatch, lambda **kw: LLM(str(tmp_path), kv_cache_memory="8MiB", max_model_len=64,
                                                    speculative_config=spec, **kw), prompts, params=params)
    verify = [rows for rows, decode in steps if not decode and rows <= 8]
    assert len(verify) > 1  # verification steps ran (in C++): each sequence 1 + its drafts rows


# q/k/v biases; a sliding window; per-head q/k norms (qwen3, in both loops; bfloat16 too); fused phi3 tensors;
# smollm3's layers without RoPE (the identity table, in both loops)
@pytest.mark.parametrize("arch,window,dtype", [("qwen2", None, "float32"), ("mistral", 6, "float32"),
                                               ("qwen3", None, "float32"), ("qwen3", None, "bfloat16"),
                                               ("phi3", None, "float32"), ("smollm3", None, "float32")])
def test_plan_equals_module_path_other_architectures(ops, tmp_path, monkeypatch, arch, window, dtype):
    make_tiny_hf_model(tmp_path, arch, num_kv_heads=2, sliding_window=window)
    _run_both(monkeypatch, lambda **kw: LLM(str(tmp_path), kv_cache_memory="8MiB", dtype=dtype, **kw), PROMPTS)


@pytest.mark.parametrize("bits,group,sym", [(8, -1, True), (4, 32, False), (4, 32, True)])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_plan_equals_module_path_quantized(ops, tiny_folder, tmp_path, monkeypatch, bits, group, sym, activations):
    from brisk.bench.quant import build_checkpoint
    from brisk.ops.layers import QuantLinear
    from brisk.quant.config import LayerQuant

    out = tmp_path / f"q{bits}"
    build_checkpoint(LayerQuant(bits=bits, group_size=group, sym=sym), out, str(tiny_folder))

    def make_llm(**kw) -> LLM:
        llm = LLM(str(out), kv_cache_memory="8MiB", quant_activations=activations, **kw)
        assert (llm.engine.num_int8_activation_layers > 0) == (activations == "int8")
        modules = llm.engine.loaded.model.named_modules()
        layers = [m for name, m in modules if type(m) is QuantLinear and "layers." in name]
        assert layers and all(m.packed.symmetric == sym for m in layers)  # symmetric: no zero points
        return llm

    _run_both(monkeypatch, make_llm, PROMPTS)


@pytest.mark.parametrize("values", ["float32", "int8", "int8-dot", "int4"])
def test_plan_equals_module_path_pruned(ops, tiny_folder, tmp_path, monkeypatch, values):
    """Pruned layers (ops.sparse.SparseLinear) in the plan and its C++ loop: float32 values, int8 and int4 codes
    through sparse_linear, int8 with int8 activations through sparse_q8_linear; the same numbers as the module
    path, which calls the same kernels."""
    from test_sparse_linear import write_pruned

    from brisk.bench.quant import build_checkpoint
    from brisk.ops.layers import SparseLinear
    from brisk.ops.sparse import sparsify_model
    from brisk.quant.config import LayerQuant

    folder = write_pruned(tiny_folder, tmp_path / "pruned", 0.5)
    if values != "float32":
        bits = 4 if values == "int4" else 8
        out = tmp_path / values
        build_checkpoint(LayerQuant(bits=bits, group_size=32, sym=True), out, str(folder))
        folder = out

    def make_llm(**kw) -> LLM:
        llm = LLM(str(folder), kv_cache_memory="8MiB", **kw)
        model = llm.engine.loaded.model
        if values != "float32":  # quantized layers are converted only when asked (ops.sparse.MIN_SPARSITY)
            assert sparsify_model(model, {32: None, 8: 0.3, 4: 0.3}, int8_dot=values == "int8-dot") == 8
            llm.engine.runner.executor.rebuild()  # the layers were replaced under it
        sparse = [m for m in model.modules() if isinstance(m, SparseLinear)]
        assert len(sparse) == 8 and all(m.int8_dot == (values == "int8-dot") for m in sparse)
        return llm

    _run_both(monkeypatch, make_llm, PROMPTS)


def test_plan_left_out_where_it_does_not_apply(kernel_settings, ops, tiny_folder):
    llm = LLM(str(tiny_folder), kv_cache_memory="8MiB")
    model = llm.engine.loaded.model
    executor = llm.engine.runner.executor
    plan = executor.plan
    assert isinstance(plan, DecodePlan) and len(plan.layers) == len(model.model.layers)
    # a hook on any linear (calibration observers use them) means no plan: the hook must see its inputs
    handle = model.model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda m, a: None)
    assert DecodePlan.build(model) is None
    handle.remove()
    # kernels off: no plan, and the module path still answers
    kernel_settings(enabled=False)
    assert DecodePlan.build(model) is None
    executor.rebuild()
    assert executor.plan is None and executor.path == "modules"
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
@pytest.mark.parametrize("chunk", [None, 4])
def test_plan_runs_quantized_kv_caches(ops, tiny_folder, monkeypatch, kv_cache_dtype, chunk):
    """int8 / int4 KV caches through both plan loops (the C++ one rotating with rope_qk and writing with the caches'
    own write kernels), short prefill chunks mixed with decodes included: the module path's numbers exactly, and
    the caches end in the same state (codes, scales, the int4 residual window)."""
    states = []

    def make(**kw) -> LLM:
        llm = LLM(str(tiny_folder), kv_cache_memory="8MiB", kv_cache_dtype=kv_cache_dtype,
                  max_num_batched_tokens=chunk or 2048, **kw)
        states.append(llm.engine.runner.kv_caches)
        return llm

    steps = _run_both(monkeypatch, make, PROMPTS)
    assert any(rows <= 8 for rows, _ in steps)  # some steps took the C++ loop
    cpp, plan, modules = states
    for layers in (plan, modules):
        for a, b in zip(cpp, layers, strict=True):
            got, want = (c.kernel_tensors() if c.bits == 8 else c.write_state() for c in (a, b))
            assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))


def test_prepacked_weights_give_the_same_batched_tokens(ops, tiny_folder):
    """12 requests at once (batched decode past the small-M kernel, through oneDNN's packed GEMM) give the
    tokens of the unpacked engine; logprobs agree to float32 rounding."""
    prompts = [[1 + i, 5, 9 + i, 33, 7] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    on = LLM(str(tiny_folder), kv_cache_memory="8MiB", prepack_weights="on")
    off = LLM(str(tiny_folder), kv_cache_memory="8MiB", prepack_weights="off")
    assert on.engine.num_prepacked > 0 and off.engine.num_prepacked == 0
    a, b = on.generate(prompts, params), off.generate(prompts, params)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            for tok, lp in lx.items():
                assert lp == pytest.approx(ly[tok], abs=1e-4)
    with pytest.raises(ValueError, match="prepack_weights must be 'auto', 'on' or 'off'"):
        LLM(str(tiny_folder), kv_cache_memory="8MiB", prepack_weights="yes")
    # auto: only when batches can outgrow the small-M kernel
    assert LLM(str(tiny_folder), kv_cache_memory="8MiB", max_num_seqs=8).engine.num_prepacked == 0
    assert LLM(str(tiny_folder), kv_cache_memory="8MiB").engine.num_prepacked > 0
    # ... and when the copies fit auto's bound (a 1B model's float32 copies would be 4.9 GB): here one byte under
    from brisk.engine import memory
    from brisk.ops.linear import float32_linear_bytes

    plain = LLM(str(tiny_folder), kv_cache_memory="8MiB", prepack_weights="off")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory, "PREPACK_AUTO_MAX_BYTES", float32_linear_bytes(plain.engine.loaded.model) - 1)
        assert LLM(str(tiny_folder), kv_cache_memory="8MiB").engine.num_prepacked == 0
    # bfloat16: a float32 packed copy only when asked for ("on"), not under "auto"
    assert LLM(str(tiny_folder), kv_cache_memory="8MiB", dtype="bfloat16").engine.num_prepacked == 0
    bf_on = LLM(str(tiny_folder), kv_cache_memory="8MiB", dtype="bfloat16", prepack_weights="on")
    bf_off = LLM(str(tiny_folder), kv_cache_memory="8MiB", dtype="bfloat16", prepack_weights="off")
    assert bf_on.engine.num_prepacked > 0
    c, d = bf_on.generate(prompts, params), bf_off.generate(prompts, params)
    for x, y in zip(c, d, strict=True):  # the same float32 products; the sums' order may move a bf16 rounding
        assert x.outputs[0].token_ids[0] == y.outputs[0].token_ids[0]
        lx, ly = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
        assert all(abs(lp - ly[tok]) < 0.05 for tok, lp in lx.items() if tok in ly)


def test_cpp_layer_loop_rejects_inconsistent_arguments(ops, tiny_folder):
    import torch

    llm = LLM(str(tiny_folder), kv_cache_memory="8MiB")
    plan = llm.engine.runner.executor.plan
    x = torch.zeros(1, llm.engine.loaded.config.hidden_size)
    none = torch.zeros(1, dtype=torch.int32)
    kv = llm.engine.runner.kv_caches
    with pytest.raises(RuntimeError, match="decode_layers: 2 layers need 60 parameter slots"):
        torch.classes.brisk.DecodeWeights(plan.params[:-1], plan.spec, plan.layer_spec, plan.eps, plan.scales,
                                          plan.final_norm, plan.final_eps)
    with pytest.raises(RuntimeError, match="RoPE table must be -1, 0 or 1 and activation 0 or 1"):
        torch.classes.brisk.DecodeWeights(plan.params, plan.spec, [-1, -1, 2, 0, 0, 0, 0, 0] * 2, plan.eps,
                                          plan.scales, plan.final_norm, plan.final_eps)
    with pytest.raises(RuntimeError, match="the weights are for 2 layers, the step passes 1 KV caches"):
        plan.decode_layers(x, x, x, none, none.view(1, 1), none, kv[:1], plan.weights, 0, plan.h, plan.kvh, plan.d,
                           None, 16)
    with pytest.raises(RuntimeError, match=r"x must be \[T <= 8, hidden\]"):
        plan.decode_layers(torch.zeros(9, x.shape[1]), x, x, none, none.view(1, 1), none, kv, plan.weights, 0,
                           plan.h, plan.kvh, plan.d, None, 16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_plan_equals_module_path_squeezellm(ops, tiny_folder, tmp_path, monkeypatch, dtype, activations):
    """SqueezeLLM's table layers (ops.layers.LutLinear: kind 9, or 10 with int8 activations) in the plan and its C++
    loop: lut_linear / lut_linear_q8 there as in the module path, so the same numbers."""
    from brisk.data import calibration_text_path
    from brisk.model.loader import load_model
    from brisk.ops.layers import LinearKind, LutLinear
    from brisk.quant.calib import CalibConfig
    from brisk.quant.checkpoint import save_quantized
    from brisk.quant.config import LayerQuant
    from brisk.quant.rtn import plan_layers
    from brisk.quant.squeezellm import SqueezeLLMConfig, squeezellm_quantize

    loaded = load_model(tiny_folder, fuse=False)
    spec = LayerQuant(bits=3, group_size=-1, sym=True, scheme="lut")
    plan = plan_layers(loaded.model, loaded.config.tie_word_embeddings, spec)
    calib = CalibConfig(str(calibration_text_path()), num_samples=2, seq_len=32)
    tensors, qconfig = squeezellm_quantize(loaded, plan, spec, calib, SqueezeLLMConfig(outliers=0.01), progress=False)
    out = save_quantized(tmp_path / "sq", loaded.config, loaded.tokenizer, qconfig, tensors)

    def make_llm(**kw) -> LLM:
        llm = LLM(str(out), kv_cache_memory="8MiB", dtype=dtype, quant_activations=activations, **kw)
        luts = [m for m in llm.engine.loaded.model.modules() if isinstance(m, LutLinear)]
        assert len(luts) == 4 * 2  # fused, 2 layers
        kind = LinearKind.LUT_Q8 if activations == "int8" else LinearKind.LUT
        assert all(m.kernel().kind is kind for m in luts)
        return llm

    # every kernel build holds the integer table kernel (AVX-512 VBMI on the avx512 tier, 256-bit vpshufb tables on
    # the others), so int8 activations join the plan and its C++ loop as float ones do
    assert hasattr(ops, "lut_linear_q8"), "lut_linear.cpp registers lut_linear_q8 wherever it builds"
    _run_both(monkeypatch, make_llm, PROMPTS)


# ----------------------------------------------------------------------------------------- gemma3

@pytest.fixture(scope="module")
def gemma_folders(tmp_path_factory):
    # 4 layers, local (window 8, shorter than the prompts plus their 12 tokens) and global, own RoPE tables, q/k
    # norms, sandwich norms, GeGLU, head_dim 32, a final soft-cap (outside the layers); 4 query heads on 2 KV heads
    # (GQA) and on 1 (MQA, as Gemma-3-270M: its k heads are a strided view for the per-head norm)
    from test_gemma import make_tiny_gemma3

    paths = {}
    for kvh in (2, 1):
        paths[kvh] = tmp_path_factory.mktemp(f"plan-gemma3-kv{kvh}")
        make_tiny_gemma3(paths[kvh], num_kv_heads=kvh)
    return paths


@pytest.fixture(scope="module")
def gemma_folder(gemma_folders):
    return gemma_folders[2]


@pytest.mark.parametrize("kvh,chunk,dtype,kv_dtype", [(2, None, "float32", "auto"), (1, None, "float32", "auto"),
                                                      (1, 4, "float32", "auto"), (1, None, "bfloat16", "auto"),
                                                      (1, 4, "float32", "int8")])
def test_plan_equals_module_path_gemma3(ops, gemma_folders, monkeypatch, kvh, chunk, dtype, kv_dtype):
    """gemma3's layers in both loops: each layer's window, RoPE table and scale, the (1 + w) sandwich norms and
    gelu_tanh_mul, the module path's kernels with its inputs, so the same tokens and logprobs exactly; with 4-token
    prefill chunks, steps of <= 8 rows mixing a decode and a chunk run the C++ loop. bfloat16: the norms' float32
    1 + w on bfloat16 rows, through the same kernels in all three paths; an int8 KV cache: each layer's window and
    table in the quantized cache's rotation, write and attention."""
    from brisk.engine.decode_plan import GELU_TANH

    kw = {"max_num_batched_tokens": chunk, "enable_chunked_prefill": True} if chunk else {}

    def make_llm(**ex) -> LLM:
        llm = LLM(str(gemma_folders[kvh]), kv_cache_memory="8MiB", max_model_len=64, dtype=dtype,
                  kv_cache_dtype=kv_dtype, **kw, **ex)
        plan = llm.engine.runner.executor.plan
        if plan is not None:  # local and global layers, each with its own table
            assert [(layer.window, layer.rope) for layer in plan.layers] == [(8, 1), (8, 1), (0, 0), (8, 1)]
            assert all(layer.act == GELU_TANH and layer.mlp_norm is not None for layer in plan.layers)
            assert plan.scales == [24 ** -0.5] * 4  # query_pre_attn_scalar, not head_dim
        return llm

    steps = _run_both(monkeypatch, make_llm, PROMPTS)
    if chunk is None:
        assert steps[0] == (17, False)  # the three prompts' prefill: 17 rows, the Python loop
        assert all(s == (3, True) for s in steps[1:])  # then decode batches of three, in C++
    else:
        assert steps[0] == (4, False) and any(rows <= 8 and not decode for rows, decode in steps[1:])


@pytest.mark.parametrize("bits", [4, 8])
def test_plan_equals_module_path_gemma3_quantized(ops, gemma_folder, tmp_path, monkeypatch, bits):
    """An RTN copy of the gemma3 model (4-bit groups of 32, asymmetric; 8-bit per channel): its QuantLinear kernels
    in both loops, the module path's numbers."""
    from brisk.bench.quant import build_checkpoint
    from brisk.ops.layers import QuantLinear
    from brisk.quant.config import LayerQuant

    out = tmp_path / f"q{bits}"
    spec = LayerQuant(bits=4, group_size=32, sym=False) if bits == 4 else LayerQuant(bits=8, group_size=-1, sym=True)
    build_checkpoint(spec, out, str(gemma_folder))

    def make_llm(**kw) -> LLM:
        llm = LLM(str(out), kv_cache_memory="8MiB", max_model_len=64, **kw)
        model = llm.engine.loaded.model
        assert sum(type(m) is QuantLinear for m in model.model.layers.modules()) == 4 * 4  # fused, 4 layers
        return llm

    _run_both(monkeypatch, make_llm, PROMPTS)
