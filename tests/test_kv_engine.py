"""KV policies and cache dtypes as engine settings: continuous batching, prefix caching, no leaked blocks."""

from __future__ import annotations

import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk.engine.llm import LLM
from brisk.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [5, 6, 7, 8, 9, 10, 11, 12, 40, 41, 42], [100, 101, 102]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("kvengine") / "m"
    make_tiny_hf_model(path, "llama", seed=11)
    return str(path)


def _llm(model_dir: str, **kw) -> LLM:
    kw = {"max_model_len": 128, "kv_cache_memory": "2MiB", "block_size": 4, "max_num_batched_tokens": 16, **kw}
    return LLM(model_dir, **kw)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_pool_clean(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv_manager.num_free_blocks == engine.num_blocks, "blocks leaked"


def test_streaming_batched_equals_one_at_a_time_and_frees_everything(model_dir):
    llm = _llm(model_dir, kv_policy="streaming", kv_budget=12, sink_tokens=2)
    batched = _tokens(llm.generate(PROMPTS, GREEDY))  # 3 requests in one continuous batch, shared prefix
    _assert_pool_clean(llm)
    alone = [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]
    _assert_pool_clean(llm)
    assert batched == alone
    assert all(len(t) == 40 for t in batched)  # generation runs far past the 12-token budget
    full = _tokens(_llm(model_dir).generate(PROMPTS, GREEDY))
    assert full != batched  # the policy really evicted
    # with the budget covering the whole sequence nothing is evicted: identical to the full cache
    roomy = _tokens(_llm(model_dir, kv_policy="streaming", kv_budget=128).generate(PROMPTS, GREEDY))
    assert roomy == full


def test_streaming_with_and_without_prefix_caching_agree(model_dir):
    cached = _llm(model_dir, kv_policy="streaming", kv_budget=12, sink_tokens=2)
    first = _tokens(cached.generate(PROMPTS[:1], GREEDY))
    again = _tokens(cached.generate(PROMPTS[:2], GREEDY))  # hits the first prompt's blocks
    _assert_pool_clean(cached)
    plain = _tokens(_llm(model_dir, kv_policy="streaming", kv_budget=12, sink_tokens=2,
                         enable_prefix_caching=False).generate(PROMPTS[:2], GREEDY))
    assert again == plain and first[0] == plain[0]


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_cache_in_the_engine(model_dir, dtype):
    llm = _llm(model_dir, kv_cache_dtype=dtype)
    outs = _tokens(llm.generate(PROMPTS, GREEDY))
    _assert_pool_clean(llm)
    full = _tokens(_llm(model_dir).generate(PROMPTS, GREEDY))
    # quantization noise may flip a greedy choice late; the first tokens of every request agree
    assert all(a[:3] == b[:3] for a, b in zip(outs, full, strict=True))
    assert llm.engine.num_blocks > _llm(model_dir).engine.num_blocks  # more blocks from the same budget


def test_policy_needs_a_budget(model_dir):
    with pytest.raises(ValueError, match="kv-budget"):
        _llm(model_dir, kv_policy="streaming")


# ---- H2O -----------------------------------------------------------------------------------------------------

H2O = {"kv_policy": "h2o", "kv_budget": 12, "h2o_recent": 5}  # keep 11 entries after a step: 5 recent + 6 heavy


def _h2o_reference(llm: LLM, ids: list[int], num_prompt: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from `brisk eval ppl --long --mode h2o`'s stream with chunk 1 over the
    engine's own sequence (teacher-forced): each row from the prompt's last on predicts the next output."""
    from brisk.eval.longppl import h2o_stream_logits
    from brisk.kvcache.policy import H2OPolicy

    tokens, logprobs = [], []
    policy = H2OPolicy(H2O["kv_budget"], H2O["h2o_recent"])
    for start, logits, _ in h2o_stream_logits(llm.engine.loaded, ids, policy, chunk=1, block_size=4):
        if start >= num_prompt - 1:
            lp = torch.log_softmax(logits[0].float(), -1)  # [V]
            tokens.append(int(lp.argmax()))
            logprobs.append(float(lp[ids[start + 1]]) if start + 1 < len(ids) else 0.0)
    return tokens[:-1], logprobs[:-1]


@pytest.mark.parametrize("chunk", [1, 16])
def test_h2o_engine_equals_the_eval_stream(model_dir, chunk):
    # The engine cuts a cache to budget - 1 entries after every step, the eval stream to budget - chunk after every
    # chunk: with chunk 1 they compact at the same moments. max_num_batched_tokens 1 runs the 20-token prompt
    # token by token (it compacts during the prefill); 16 prefills the 8-token prompt in one step, which holds
    # fewer than budget - 1 entries, so nothing is cut before decoding either way.
    prompt = list(range(30, 50)) if chunk == 1 else PROMPTS[0][:8]
    llm = _llm(model_dir, max_num_batched_tokens=chunk, **H2O)
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=0))[0]
    tokens = out.outputs[0].token_ids
    logprobs = [lp[t] for lp, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
    ref_tokens, ref_logprobs = _h2o_reference(llm, prompt + tokens, len(prompt))
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4)
    full = _tokens(_llm(model_dir, max_num_batched_tokens=chunk).generate([prompt], GREEDY))[0]
    assert full[:30] != tokens  # the policy really evicted
    _assert_pool_clean(llm)


def test_h2o_batched_equals_one_at_a_time_and_within_the_bound(model_dir):
    llm = _llm(model_dir, **H2O)
    engine = llm.engine
    for p in PROMPTS:
        engine.add_request(None, p, GREEDY)
    done: dict[str, list[int]] = {}
    keep, step_tokens, bs = H2O["kv_budget"] - 1, 16, 4
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        for req in engine.scheduler.running:  # after a step: at most keep + one step's tokens, in few blocks
            assert engine.kv_manager.get_num_cache_entries(req) <= keep + step_tokens
            assert engine.kv_manager.get_num_blocks(req.request_id) <= -(-(keep + step_tokens) // bs)
    batched = [done[str(i)] for i in range(3)]
    _assert_pool_clean(llm)
    alone = [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]  # these hit the cached prompt blocks
    uncached = _tokens(_llm(model_dir, enable_prefix_caching=False, **H2O).generate(PROMPTS, GREEDY))
    _assert_pool_clean(llm)
    assert batched == alone == uncached  # a prefix hit carries its blocks' attention mass: no output change
    assert all(len(t) == 40 for t in batched)
    full = _tokens(_llm(model_dir).generate(PROMPTS, GREEDY))
    assert full != batched
    roomy = _tokens(_llm(model_dir, kv_policy="h2o", kv_budget=128).generate(PROMPTS, GREEDY))
    assert roomy == full  # a budget above the sequence evicts nothing


def test_h2o_compaction_leaves_a_cached_prefix_intact(model_dir):
    llm = _llm(model_dir, **H2O)
    prompt = PROMPTS[0]  # 10 tokens: blocks 0 and 1 (8 tokens) get cached
    short = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)  # 10 + 1 entries: never cut
    a = _tokens(llm.generate([prompt], short))[0]
    stats = llm.engine.kv_manager.prefix_cache_stats
    b = _tokens(llm.generate([prompt], GREEDY))[0]  # hits blocks 0-1, then compacts into their places
    assert stats.hits == 8
    c = _tokens(llm.generate([prompt], short))[0]
    assert stats.hits == 16  # C read the same cached blocks B had compacted over
    assert c == a
    assert b == _tokens(_llm(model_dir, enable_prefix_caching=False, **H2O).generate([prompt], GREEDY))[0]
    _assert_pool_clean(llm)


def test_h2o_preemption_abort_and_forks_free_everything(model_dir):
    roomy = _llm(model_dir, max_num_batched_tokens=8, enable_prefix_caching=False, **H2O)
    ref = _tokens(roomy.generate(PROMPTS, GREEDY))
    # 8 blocks of 4: three requests of up to 11 + 8 entries cannot all fit, so the latest are preempted. A preempted
    # request recomputes its tokens in prefill chunks, which moves its compactions (H2OPolicy: the engine cuts after
    # each step), so only the never-preempted first request must equal its uninterrupted run.
    tight = _llm(model_dir, num_kv_blocks=8, max_num_batched_tokens=8, **H2O)
    outs = _tokens(tight.generate(PROMPTS, GREEDY))
    assert tight.engine.scheduler.num_preemptions > 0
    assert outs[0] == ref[0] and all(len(t) == 40 for t in outs)
    _assert_pool_clean(tight)
    # n > 1: the samples fork the parent's table and a copy of its scores; the 20-token prompt forks with a
    # compaction pending (16 entries after its second chunk of 8), which the fork inherits
    long = list(range(30, 50))
    ref += _tokens(roomy.generate([long], GREEDY))
    # (one prompt per call and no prefix cache: a prompt longer than budget - 1 is compacted after each prefill
    # chunk, so batch neighbours or a prefix hit would move its chunk boundaries, hence its kept set)
    for prompt, tokens in ((PROMPTS[0], ref[0]), (long, ref[3])):
        forks = roomy.generate([prompt], SamplingParams(n=2, max_tokens=40, temperature=0, ignore_eos=True))
        assert [c.token_ids for c in forks[0].outputs] == [tokens, tokens]
    _assert_pool_clean(roomy)
    engine = tight.engine
    ids = [engine.add_request(None, p, GREEDY) for p in PROMPTS]
    for _ in range(6):
        engine.step()
    engine.abort_request(ids)
    assert not engine.has_unfinished_requests()
    _assert_pool_clean(tight)


def test_h2o_bad_settings(model_dir):
    with pytest.raises(ValueError, match="kv-budget"):
        _llm(model_dir, kv_policy="h2o")
    with pytest.raises(ValueError, match="h2o-recent"):
        _llm(model_dir, kv_policy="h2o", kv_budget=8, h2o_recent=8)
    with pytest.raises(ValueError, match="h2o-recent"):
        _llm(model_dir, kv_policy="h2o", kv_budget=8, h2o_recent=0)
    with pytest.raises(ValueError, match="kv_cache_dtype auto"):
        _llm(model_dir, kv_policy="h2o", kv_budget=8, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="speculative decoding does not support kv_policy h2o"):
        _llm(model_dir, kv_policy="h2o", kv_budget=8, speculative="ngram")


def test_bfloat16_cache_under_a_float32_model(kernel_settings, model_dir, monkeypatch):
    """--kv-cache-dtype bfloat16: twice the blocks for the same memory; K/V rounded on write and read back by
    every path alike (the plan's C++ loop, the module path, the reference path without kernels), so those agree
    with each other; against the float32 cache only by the rounding."""
    from brisk.engine.decode_plan import DecodePlan

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)

    def run(**kw):
        llm = _llm(model_dir, **kw)
        outs = llm.generate(PROMPTS, params)
        _assert_pool_clean(llm)
        return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    plan_steps = []
    real_run = DecodePlan.run
    real_cpp = DecodePlan.run_cpp
    monkeypatch.setattr(DecodePlan, "run", lambda self, x, *a: plan_steps.append(x.shape[0]) or real_run(self, x, *a))
    monkeypatch.setattr(DecodePlan, "run_cpp",
                        lambda self, x, *a: plan_steps.append(x.shape[0]) or real_cpp(self, x, *a))
    f32, want = run()
    bf16, got = run(kv_cache_dtype="bfloat16")
    assert all(c.dtype == torch.bfloat16 for c in bf16.engine.runner.kv_caches)
    assert bf16.engine.num_blocks == 2 * f32.engine.num_blocks  # same kv_cache_memory
    assert len(plan_steps) > 0  # the fast path takes a bf16 cache under a float32 model
    _, modules = run(kv_cache_dtype="bfloat16", execution="modules")
    assert modules == got  # the same kernels with the same inputs: bit for bit
    kernel_settings(enabled=False)
    _, reference = run(kv_cache_dtype="bfloat16")
    for (g_ids, g_lp), (r_ids, r_lp), (w_ids, w_lp) in zip(got, reference, want, strict=True):
        assert g_ids == r_ids
        for g, r in zip(g_lp, r_lp, strict=True):
            # float32 noise between the kernels and the reference ops (~1e-7) can move a K or V value across a
            # bf16 rounding boundary (one bf16 step is 0.4%): up to ~4e-4 here, against ~0.02 for the rounding
            assert g.keys() == r.keys() and all(abs(g[t] - r[t]) < 2e-3 for t in g)
        # the first token's distribution (prefill): bf16 K/V move the logprobs a little, not the argmax
        assert g_ids[0] == w_ids[0]
        assert all(abs(g_lp[0][t] - w_lp[0][t]) < 0.05 for t in g_lp[0].keys() & w_lp[0].keys())
        assert any(abs(g_lp[0][t] - w_lp[0][t]) > 0 for t in g_lp[0].keys() & w_lp[0].keys())  # it did round


def test_bad_kv_cache_dtype_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto, bfloat16, int8 or int4"):
        _llm(model_dir, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="h2o' runs with kv_cache_dtype auto only"):
        _llm(model_dir, kv_cache_dtype="bfloat16", kv_policy="h2o", kv_budget=32)


def test_streaming_with_a_bfloat16_cache(model_dir):
    """StreamingLLM's sink/window path gathers the 16-bit K/V like the kernel does; blocks all come back."""
    kw = {"kv_policy": "streaming", "kv_budget": 12, "sink_tokens": 2}
    llm = _llm(model_dir, kv_cache_dtype="bfloat16", **kw)
    got = _tokens(llm.generate(PROMPTS, GREEDY))
    _assert_pool_clean(llm)
    one = [_tokens(_llm(model_dir, kv_cache_dtype="bfloat16", **kw).generate([p], GREEDY))[0] for p in PROMPTS]
    assert got == one  # batched equals one at a time
    assert all(len(t) == GREEDY.max_tokens for t in got)
