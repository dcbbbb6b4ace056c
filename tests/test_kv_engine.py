"""KV policies and cache dtypes as engine settings: continuous batching, prefix caching, no leaked blocks."""

from __future__ import annotations

import pytest
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
    return LLM(model_dir, max_model_len=128, kv_cache_memory="2MiB", block_size=4, max_num_batched_tokens=16, **kw)


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
