"""Speculative decoding in the engine: greedy output identical to plain greedy for every proposer, alone and
batched, under preemption and with prefix caching; no KV block leaked after rejections and aborts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.engine.config import SpecConfig
from brisk.spec.adaptive import AdaptiveGamma, StepCostModel, best_gamma, expected_tokens, max_speedup
from brisk.spec.ngram import find_continuation

VOCAB = 384
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-spec")
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=VOCAB, num_hidden_layers=3)
    return str(path)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory):
    """A different random model with the same (tiny) tokenizer: a draft that is often wrong."""
    path = tmp_path_factory.mktemp("tiny-llama-draft")
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=8, vocab_size=VOCAB, num_hidden_layers=1)
    return str(path)


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    prompts = []
    for n in (4, 9, 23, 2, 40):  # repeated segments, so prompt lookup finds matches
        base = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        prompts.append(base * 3 + base[: n // 2])
    shared = torch.randint(3, VOCAB, (40,), generator=g).tolist()  # a prefix shared by two prompts
    prompts += [shared + [5, 6, 7], shared + [9]]
    return prompts


@pytest.fixture(scope="module")
def plain(model_dir):
    llm = LLM(model_dir, max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(make_prompts(), GREEDY)]


def assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv_manager.block_pool.get_num_free_blocks() == engine.num_blocks
    assert not engine.scheduler.requests and not engine.groups
    proposer = engine.speculator.proposer
    assert engine.step() == []  # an idle step: the proposer drops state of requests that left (aborts)
    assert not proposer.live_ids() and not engine.speculator.gamma.live_ids()
    if hasattr(proposer, "kv"):
        assert proposer.kv.block_pool.get_num_free_blocks() == proposer.kv.block_pool.num_blocks


def spec_llm(model_dir: str, method: str, **kwargs) -> LLM:
    name, _, arg = method.partition(":")
    # disable_by_batch_size None: these tests verify drafts in batches of any size
    config = {"num_speculative_tokens": 4, "adaptive": False, "method": name, "model": arg or None,
              "disable_by_batch_size": None}
    config.update(kwargs.pop("spec", {}))
    return LLM(model_dir, max_model_len=256, speculative_config=config, **kwargs)


METHODS = ["ngram", "lookahead", "self:int8", "self:int4", "layerskip", "draft:same", "draft:other"]


def resolve(method: str, model_dir: str, other_draft_dir: str) -> tuple[str, dict]:
    if method == "draft:same":  # the target drafting for itself: every draft is accepted
        return f"draft:{model_dir}", {}
    if method == "draft:other":
        return f"draft:{other_draft_dir}", {}
    if method == "layerskip":
        return "layerskip", {"spec": {"skip_layers": [1]}}
    return method, {}


@pytest.mark.parametrize("method", METHODS)
def test_greedy_batched_equals_plain(model_dir, other_draft_dir, plain, method):
    name, kwargs = resolve(method, model_dir, other_draft_dir)
    llm = spec_llm(model_dir, name, **kwargs)
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    if method == "draft:same":
        assert stats.acceptance_rate == 1.0
    elif method in ("ngram", "lookahead", "draft:other", "self:int4"):
        assert stats.acceptance_rate < 1.0  # rejections happened, and were rolled back
    if method.startswith("self:"):  # the self draft's 8/4-bit linears take int8 activations; the output did not move
        from brisk.ops.layers import QuantLinear

        draft = llm.engine.speculator.proposer.runner.model
        modes = {m.quant_activations for m in draft.modules() if type(m) is QuantLinear}
        assert modes == {"int8"}, modes
    assert_no_leak(llm)


@pytest.mark.parametrize("method", ["ngram", "lookahead", "draft:other"])
def test_greedy_alone_and_under_preemption(model_dir, other_draft_dir, plain, method):
    name, kwargs = resolve(method, model_dir, other_draft_dir)
    prompts = make_prompts()
    llm = spec_llm(model_dir, name, **kwargs)
    for p, want in zip(prompts[:3], plain[:3], strict=True):
        assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == want
    # 12 blocks of 16 tokens cannot hold all requests (each needs up to 5): preemption by recompute
    tight = spec_llm(model_dir, name, num_kv_blocks=18, max_num_batched_tokens=64, **kwargs)
    outs = tight.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert tight.engine.scheduler.num_preemptions > 0
    assert_no_leak(tight)


def test_abort_mid_speculation_frees_everything(model_dir):
    llm = spec_llm(model_dir, f"draft:{model_dir}")
    ids = [llm.engine.add_request(None, p, GREEDY) for p in make_prompts()]
    for _ in range(6):
        llm.engine.step()
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    llm.engine.abort_request(ids)
    assert_no_leak(llm)


def test_eos_among_accepted_drafts_stops_there(model_dir, plain):
    """A stop token inside an accepted run of drafts ends the request at that token, as plain decoding does."""
    prompts = make_prompts()
    stop = plain[0][5]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop])
    llm = spec_llm(model_dir, f"draft:{model_dir}")
    out = llm.generate([prompts[0]], params)[0].outputs[0]
    assert out.token_ids == plain[0][: plain[0].index(stop) + 1]
    assert out.finish_reason == "stop"
    capped = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))[0]
    assert capped.outputs[0].token_ids == plain[0][:7]


def test_streaming_emits_several_tokens_per_step(model_dir, plain):
    llm = spec_llm(model_dir, f"draft:{model_dir}")
    deltas = [o.outputs[0].num_new_tokens for o in llm.stream(make_prompts()[0], GREEDY)]
    assert sum(deltas) == 24 and max(deltas) == 5  # 4 accepted drafts + the bonus in one step


@pytest.mark.parametrize("method", ["draft:other", "lookahead"])
def test_sampled_requests_run_seeded_and_repeatable(model_dir, other_draft_dir, method):
    """Sampling with a draft that keeps q (or point-mass drafts): runs, respects max_tokens and logprobs, and a
    seed repeats."""
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2, max_tokens=16,
                            seed=3, logprobs=2, ignore_eos=True)
    runs = []
    for _ in range(2):
        name, kwargs = resolve(method, model_dir, other_draft_dir)
        llm = spec_llm(model_dir, name, **kwargs)
        out = llm.generate([make_prompts()[1]], params)[0].outputs[0]
        assert len(out.token_ids) == 16 and len(out.logprobs) == 16
        assert all(t in lp for t, lp in zip(out.token_ids, out.logprobs, strict=True))
        runs.append(out.token_ids)
        assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert runs[0] == runs[1]


def test_find_continuation():
    t = np.array([1, 2, 3, 9, 8, 1, 2, 3, 7, 5, 1, 2, 3])
    assert find_continuation(t, 3, 1, 2) == [7, 5]  # latest earlier match of "1 2 3"
    assert find_continuation(np.array([4, 5, 6]), 3, 1, 2) == []
    assert find_continuation(np.array([4, 5, 4]), 3, 1, 3) == [5, 4]  # n = 1 fallback
    assert find_continuation(np.array([4, 5, 4, 5]), 3, 2, 3) == [4, 5]


def test_adaptive_gamma():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert abs(expected_tokens(0.8, 4) - 3.3616) < 1e-4  # (1 - 0.8^5) / 0.2
    assert best_gamma(0.05, 0.3, 8) == 0  # hopeless drafts: plain decoding
    assert best_gamma(0.95, 0.0, 8) == 8  # free and nearly always right: draft the most
    assert max_speedup(0.0, 4) == 5.0 and max_speedup(1.0, 4) == 1.0 and max_speedup(2.0, 4) == 1.0
    ctl = AdaptiveGamma(max_gamma=6, cost_per_draft=0.3, probe_every=3, max_probe_every=12)
    for _ in range(10):
        ctl.update("r", 4, 0)
    # off, probing after 3 steps, then 6, then 12, 12 (each probe that fails doubles the wait, up to the cap)
    got = [ctl.gamma("r") for _ in range(3 + 6 + 12 + 12)]
    assert [i for i, g in enumerate(got) if g] == [2, 8, 20, 32]
    for _ in range(10):
        ctl.update("r", 4, 4)
    assert ctl.gamma("r") >= 4  # drafting pays again ...
    for _ in range(10):
        ctl.update("r", 4, 0)
    assert [ctl.gamma("r") for _ in range(3)] == [0, 0, 1]  # ... so the next stretch at zero probes early again
    # a draft costing a whole step cannot pay even when always accepted: probes at the longest interval only
    got = [ctl.gamma("r", cost_per_draft=1.0) for _ in range(36)]
    assert [i for i, g in enumerate(got) if g] == [11, 23, 35]


def test_layerskip_search_stores_a_set_that_loads(model_dir, tmp_path):
    from brisk.model.loader import load_model
    from brisk.spec.draft_model import layer_skip_model
    from brisk.spec.layerskip import layerskip_path, load_skip_layers, save_search, search_skip_layers

    loaded = load_model(model_dir)
    ids = make_prompts()[4][:48]
    result = search_skip_layers(loaded.model, ids, loaded.dtype, max_skip=1, calibration="test")
    assert list(result.single_layer_agreement) == [1]  # 3 layers: only the middle one is a candidate
    assert 0.0 <= result.agreement <= 1.0 and result.prefix_agreement
    path = tmp_path / "model.gguf"
    save_search(result, layerskip_path(path))
    assert load_skip_layers(path) == result.skip_layers
    with pytest.raises(FileNotFoundError, match="layerskip-search"):
        load_skip_layers(tmp_path / "other.gguf")
    with pytest.raises(ValueError, match="every layer"):
        layer_skip_model(loaded.model, [0, 1, 2])


def test_step_cost_model_is_batch_aware():
    """Steps of t = 0.4 s + 0.01 s/token: one more draft costs 0.01/0.41 of a step at batch 1, but at batch 32
    (compute-bound) 0.32/0.72 — adaptive γ must draft less there."""
    model = StepCostModel()
    for x in [1, 5, 300, 8, 40, 1, 2, 64, 16, 3] * 20:
        model.observe_step(x, 0.4 + 0.01 * x)
    a, b = model.line()
    assert abs(a - 0.4) < 1e-3 and abs(b - 0.01) < 1e-5
    assert abs(model.cost_per_draft(1) - 0.01 / 0.41) < 1e-3
    assert abs(model.cost_per_draft(32) - 0.32 / 0.72) < 1e-3
    model.observe_draft(5.0)  # the first draft forward (one-time costs) is not taken as its price
    assert model.draft_seconds == 0.0
    model.observe_draft(0.1)
    assert abs(model.cost_per_draft(1) - 0.11 / 0.41) < 1e-3
    model.observe_draft(0.2)  # slower: followed slowly
    assert abs(model.draft_seconds - 0.12) < 1e-9
    model.observe_draft(0.04)  # faster: followed quickly
    assert abs(model.draft_seconds - 0.08) < 1e-9


def test_step_cost_model_with_two_regimes():
    """Up to 8 tokens a step is memory-bound (40 ms + 1 ms/token), past them compute-bound (20 ms + 3.3 ms/token):
    at 8 requests the first draft each doubles the rows into the second regime and costs step(16) - step(8)
    = 72.8 - 48 ms, about half a plain step; each regime is read off its own line."""
    model = StepCostModel(split=8)
    assert not model.knows(8)
    for x in [1, 2, 3, 5, 8, 4, 6, 8, 1, 2] * 30:
        model.observe_step(x, 0.040 + 0.001 * x)
    assert model.knows(8) and not model.knows(16)
    assert abs(model.step_seconds(16) - (0.040 + 0.016)) < 1e-3  # no large steps yet: the small line
    for x in [16, 24, 32, 40, 20] * 60:
        model.observe_step(x, 0.020 + 0.0033 * x)
    assert model.knows(16) and abs(model.step_seconds(8) - 0.048) < 1e-3  # the small line, undisturbed
    assert abs(model.step_seconds(16) - 0.0728) < 1e-3
    assert abs(model.cost_per_draft(8) - (0.0728 - 0.048) / 0.048) < 2e-2
    assert abs(model.cost_per_draft(1) - 0.001 / 0.041) < 1e-3  # batch 1 stays in the first regime


def test_spec_config_parsing():
    assert SpecConfig.parse("self:int4", 3).num_speculative_tokens == 3
    assert SpecConfig.parse({"model": "/x/draft"}).method == "draft"
    assert SpecConfig.parse({"method": "ngram", "prompt_lookup_max": 3}).prompt_lookup_max == 3
    assert SpecConfig.parse("lookahead").method == "lookahead"
    with pytest.raises(ValueError, match="lookahead_ngram_size >= 2"):
        SpecConfig.parse({"method": "lookahead", "lookahead_ngram_size": 1})
    with pytest.raises(ValueError, match="int8, int4, int2"):
        SpecConfig.parse("self:int3")
    with pytest.raises(ValueError, match="unknown speculative method"):
        SpecConfig.parse("hydra")


@pytest.mark.parametrize("method", ["ngram", "self:int8"])
@pytest.mark.parametrize("kv", [{"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "bfloat16"},
                                {"kv_policy": "streaming", "kv_budget": 48, "sink_tokens": 4}])
def test_speculation_composes_with_kv_compression(model_dir, kv, method):
    """Drafts verified over a quantized or evicting cache: greedy output equals plain greedy decoding with the
    same cache settings (a rejected draft's slots are rewritten, an int4 block re-quantized, an evicted block
    never read), and every block comes back."""
    prompts = make_prompts()
    plain_llm = LLM(model_dir, max_model_len=256, **kv)
    want = [o.outputs[0].token_ids for o in plain_llm.generate(prompts, GREEDY)]
    llm = spec_llm(model_dir, method, **kv)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want
    assert_no_leak(llm)
    if method == "self:int8":  # an int8 cache has another layout: the draft computes its own prompt KV; a
        # bfloat16 one is matched by the draft's, which adopts the target's K/V as they are
        assert (llm.engine.speculator.proposer._target is None) == (kv.get("kv_cache_dtype") == "int8")


def test_self_draft_adopts_the_targets_prompt_kv(model_dir, plain):
    """The self-draft copies the prompt's K/V from the target's cache (exactly), so its first draft forward is
    one row, not a second prefill; the output is still plain greedy decoding's."""
    llm = spec_llm(model_dir, "self:int8")
    engine, proposer = llm.engine, llm.engine.speculator.proposer
    rows = []
    real_prepare = proposer.runner.prepare
    proposer.runner.prepare = lambda sched: rows.append(sum(len(s.token_ids) for s in sched.scheduled)) or \
        real_prepare(sched)
    prompt = make_prompts()[4]  # the 40-token segment, repeated
    rid = engine.add_request(None, prompt, GREEDY)
    engine.step()  # the target's prefill
    engine.step()  # drafts (step 0 over the copied prompt) and their verification
    assert rows and rows[0] == 1 and max(rows) == 1
    shadow = proposer._shadows[rid]
    assert shadow.num_computed_tokens >= len(prompt)
    bs = engine.kv_manager.block_size
    theirs, ours = engine.kv_manager.get_block_ids(rid), proposer.kv.get_block_ids(rid)
    pos = torch.arange(len(prompt))
    src = torch.tensor(theirs)[pos // bs] * bs + pos % bs
    dst = torch.tensor(ours)[pos // bs] * bs + pos % bs
    for t, d in zip(engine.runner.kv_caches, proposer.runner.kv_caches, strict=True):
        assert torch.equal(t.view(2, -1, *t.shape[3:])[:, src], d.view(2, -1, *d.shape[3:])[:, dst])
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(llm)
    want = plain[4]
    assert engine.speculator.stats.num_verify_steps > 0
    out = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert out == want


def test_speculation_refuses_int4_kv_cache(model_dir):
    with pytest.raises(ValueError, match="does not support kv_cache_dtype int4"):
        spec_llm(model_dir, "ngram", kv_cache_dtype="int4")


def test_disable_by_batch_size_drafts_only_for_a_lone_request(model_dir, plain):
    """disable_by_batch_size = 1: no drafts while several requests are in flight, drafts again once one is left;
    output equals plain greedy either way. (The default is 8.)"""
    assert SpecConfig.parse("ngram").disable_by_batch_size == 8
    prompts = make_prompts()
    # the target drafting for itself: every step would draft if allowed
    llm = LLM(model_dir, max_model_len=256, speculative_config={"method": "draft", "model": model_dir,
                                                                "adaptive": False, "disable_by_batch_size": 1})
    assert llm.engine.speculator.disable_by_batch_size == 1
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert llm.engine.speculator.stats.num_draft_tokens == 0  # all in flight together for their 4 tokens
    assert [o.outputs[0].token_ids for o in outs] == [p[:4] for p in plain]
    alone = llm.generate([prompts[0]], GREEDY)
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert alone[0].outputs[0].token_ids == plain[0]
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpecConfig.parse({"method": "ngram", "disable_by_batch_size": 0})
    assert_no_leak(llm)


class _Req:
    def __init__(self, tokens: list[int]) -> None:
        self.request_id = "r"
        self.all_token_ids = list(tokens)


def test_lookahead_jacobi_iteration_and_pool():
    """The proposer's two sources, by hand: the pool's n-gram for the last token first, then the previous step's
    predictions past the accepted prefix (the Jacobi update) for the positions after it."""
    from brisk.spec.lookahead import LookaheadProposer

    prop = LookaheadProposer(ngram_size=3, pool_size=2)
    req = _Req([1, 2, 3, 9, 8])
    (d,) = prop.propose([req], [4])
    # the prompt seeded the pool: 3-grams (1,2,3) (2,3,9) (3,9,8); nothing starts with 8, so no candidate, and no
    # guesses yet: the chain is filled from the context (seeded choice), so only its length is fixed
    assert len(d.token_ids) == 4
    # the target predicted: after 8 -> 5, after 8,d1 -> 6, ...: d1 rejected (unless it was 5), so 5 is emitted
    draft = [7, 7, 7, 7]
    prop.states["r"].last_chain = [8, *draft]
    req.all_token_ids.append(5)
    prop.observe(req, draft, [5, 6, 4, 2, 1], [5])
    state = prop.states["r"]
    assert state.guess == [6, 4, 2, 1] and state.guess_at == 6  # the next iterate of the positions after 5
    assert (7, 6) in state.pool[8]  # (8, 7) then the prediction after it
    # chain (7, 7) followed by its predictions 4, 2, 1: two kept per key, the newest
    assert list(state.pool[7]) == [(7, 2), (7, 1)]
    assert (8, 5) in state.pool[9]  # the emitted token with its context: (9, 8, 5)
    (d,) = prop.propose([req], [4])
    # nothing in the pool starts with 5: the guesses fill the chain
    assert d.token_ids == [6, 4, 2, 1]
    # accept two (6, 4), then the target says 3 instead of 2: guesses continue from the predictions after that
    req.all_token_ids += [6, 4, 3]
    prop.observe(req, [6, 4, 2, 1], [6, 4, 3, 0, 11], [6, 4, 3])
    assert state.guess == [0, 11]
    assert (4, 3) in state.pool[6]  # (6, 4, 3): emitted
    (d,) = prop.propose([req], [3])
    # the prompt's (3, 9, 8) is the candidate for 3 and takes positions 1-2, where the guesses [0, 11] were
    assert d.token_ids[:2] == [9, 8]
    # a step the proposer did not see (e.g. preemption, or γ = 0) invalidates the guesses
    req.all_token_ids.append(12)
    (d,) = prop.propose([req], [2])
    assert len(d.token_ids) == 2
    prop.free(["r"])
    assert not prop.live_ids()


def test_lookahead_pool_keeps_the_newest_n_grams():
    from brisk.spec.lookahead import LookaheadProposer

    prop = LookaheadProposer(ngram_size=2, pool_size=2)
    req = _Req([1, 2, 1, 3, 1, 4, 1])
    (d,) = prop.propose([req], [1])
    assert d.token_ids == [4]  # the newest continuation of 1 in the prompt
    assert list(prop.states["r"].pool[1]) == [(3,), (4,)]  # (2,) dropped: two per key
