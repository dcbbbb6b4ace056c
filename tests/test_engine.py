"""Continuous batching is lossless: every scheduling variant gives each request the tokens it gets alone."""

from __future__ import annotations

import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.engine.llm_engine import PromptTooLongError

VOCAB = 384


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=VOCAB)
    return str(path)


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, VOCAB, (40,), generator=g).tolist()  # a 40-token prefix shared by three prompts
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 17, 33, 64, 100, 1)]
    prompts += [shared + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 9, 30)]
    return prompts


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(model_dir):
    """The oracle: each prompt run by itself in a fresh engine (no batching, no cache sharing)."""
    results = []
    for p in make_prompts():
        llm = LLM(model_dir, max_model_len=256, enable_prefix_caching=False)
        results.append(llm.generate([p], GREEDY)[0].outputs[0].token_ids)
    return results


def assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv_manager.block_pool.get_num_free_blocks() == engine.num_blocks
    assert not engine.scheduler.requests and not engine.groups


@pytest.mark.parametrize("kwargs", [
    dict(),  # chunked prefill + prefix caching (defaults)
    dict(enable_chunked_prefill=False),
    dict(max_num_batched_tokens=16),  # every long prompt is split into chunks that interleave with decodes
    dict(enable_prefix_caching=False, max_num_batched_tokens=48),
    dict(max_num_seqs=2),
    dict(block_size=4),
], ids=["default", "no-chunking", "chunk16", "no-prefix-cache", "max-seqs-2", "block4"])
def test_batched_equals_alone(model_dir, alone, kwargs):
    llm = LLM(model_dir, max_model_len=256, **kwargs)
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert_no_leak(llm)


def test_prefix_cache_hits_are_lossless(model_dir, alone):
    llm = LLM(model_dir, max_model_len=256)
    prompts = make_prompts()
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)  # now every full block of every prompt is cached
    assert [o.outputs[0].token_ids for o in again] == alone == [o.outputs[0].token_ids for o in first]
    hits = [o.metrics.num_cached_tokens for o in again]
    assert hits[4] == 96  # 100-token prompt: 6 full blocks hit
    assert all(h % 16 == 0 and h < len(p) for h, p in zip(hits, prompts, strict=True))
    assert llm.engine.stats().prefix_hits > 0
    assert_no_leak(llm)


def test_preemption_by_recompute_is_lossless(model_dir, alone):
    # 16 blocks x 16 tokens = 256 slots: far less than the batch needs, so requests get preempted
    llm = LLM(model_dir, max_model_len=256, num_kv_blocks=16)
    outs = llm.generate(make_prompts(), GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    assert_no_leak(llm)


def test_preemption_victim_is_lowest_priority(model_dir):
    llm = LLM(model_dir, max_model_len=256, num_kv_blocks=16, scheduling_policy="priority")
    prompts = [make_prompts()[i] for i in (3, 4, 2)]  # 84 + 120 + 53 tokens > 16 blocks x 16 slots
    outs = llm.generate(prompts, GREEDY, priority=[0, 0, 5])
    assert outs[2].metrics.num_preemptions >= 1
    assert all(o.metrics.num_preemptions == 0 for o in outs[:2])


def test_parallel_samples_share_the_prompt(model_dir, alone):
    prompts = make_prompts()
    llm = LLM(model_dir, max_model_len=256)
    greedy_n = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=3)
    outs = llm.generate(prompts, greedy_n)
    for out, want in zip(outs, alone, strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == want for c in out.outputs)
    assert_no_leak(llm)

    # sampled: sample k of a seeded n-request equals a lone request seeded with seed + k. Each sample writes
    # its own tokens into the prompt's shared last block, so this fails if copy-on-write is wrong.
    sampled = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, n=3, seed=123)
    together = llm.generate(prompts[3], sampled)[0]
    for k in range(3):
        solo = LLM(model_dir, max_model_len=256, enable_prefix_caching=False).generate(
            prompts[3], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=123 + k))[0]
        assert together.outputs[k].token_ids == solo.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in together.outputs}) > 1
    assert_no_leak(llm)


def test_seeded_sampling_independent_of_batch(model_dir):
    prompts = make_prompts()
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=5, ignore_eos=True)
    llm = LLM(model_dir, max_model_len=256)
    alone_out = llm.generate([prompts[2]], params)[0].outputs[0].token_ids
    mixed = [SamplingParams(temperature=1.0, max_tokens=16)] * len(prompts)
    mixed[2] = params
    batch_out = llm.generate(prompts, mixed)[2].outputs[0].token_ids
    assert alone_out == batch_out


def test_stop_conditions(model_dir):
    llm = LLM(model_dir, max_model_len=256)
    tok = llm.get_tokenizer()
    prompt = make_prompts()[3]
    full = llm.generate([prompt], GREEDY)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20

    # stop token id: ends at its first occurrence, the token kept in token_ids
    stop_tok = full.token_ids[5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]))[0]
    first = full.token_ids.index(stop_tok)
    assert out.outputs[0].token_ids == full.token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok

    # stop string: text cut before it (or kept with include_stop_str_in_output)
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if stop.strip():
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0].outputs[0]
        assert out.text == text[: text.index(stop)]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop],
                                                    include_stop_str_in_output=True))[0].outputs[0]
        assert out.text == text[: text.index(stop) + len(stop)]

    # EOS (not ignored) stops; ignore_eos runs on
    eos = tok.eos_token_ids[0]
    forced = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert forced.outputs[0].finish_reason == "length"
    assert_no_leak(llm)
    assert eos in tok.eos_token_ids


def test_max_model_len_caps_generation(model_dir):
    llm = LLM(model_dir, max_model_len=64)
    out = llm.generate([make_prompts()[3][:60]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    with pytest.raises(PromptTooLongError, match="max_model_len=64"):
        llm.generate([make_prompts()[4]], GREEDY)
    assert_no_leak(llm)


def test_logprobs(model_dir):
    llm = LLM(model_dir, max_model_len=256)
    out = llm.generate([make_prompts()[1]], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == max(lp.values())  # greedy picks the most likely token
        assert all(v <= 0 for v in lp.values())
    assert out.cumulative_logprob == pytest.approx(sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs,
                                                                              strict=True)))


def test_stream_deltas_and_abort(model_dir):
    llm = LLM(model_dir, max_model_len=256)
    prompt = make_prompts()[2]
    deltas = []
    final = None
    for out in llm.stream(prompt, GREEDY):
        deltas.append(out.outputs[0].text_delta)
        final = out
    assert final.finished and "".join(deltas) == final.outputs[0].text
    # closing a stream early aborts the request and frees its blocks
    stream = llm.stream(prompt, GREEDY)
    next(stream)
    assert llm.engine.kv_manager.block_pool.get_num_free_blocks() < llm.engine.num_blocks
    stream.close()
    assert_no_leak(llm)


def test_bad_inputs(model_dir):
    llm = LLM(model_dir, max_model_len=256)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[1, VOCAB + 5]], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLM(model_dir, max_model_len=256, num_kv_blocks=4)
    assert_no_leak(llm)


def test_multi_turn_chat_hits_the_prefix_cache(model_dir):
    llm = LLM(model_dir, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=12)
    turn1 = [{"role": "system", "content": "You answer in the style of Jane Austen, at some length."},
             {"role": "user", "content": "Emma Woodhouse, handsome, clever, and rich, with a comfortable home"}]
    first = llm.chat(turn1, greedy)[0]
    turn2 = turn1 + [{"role": "assistant", "content": first.outputs[0].text},
                     {"role": "user", "content": "and then?"}]
    second = llm.chat(turn2, greedy)[0]
    # every full block of the first turn's prompt is reused by the second turn
    assert second.metrics.num_cached_tokens >= len(first.prompt_token_ids) // 16 * 16 > 0
    fresh = LLM(model_dir, max_model_len=256, enable_prefix_caching=False).chat(turn2, greedy)[0]
    assert second.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert_no_leak(llm)


def test_stream_never_shows_part_of_a_stop_string(model_dir):
    llm = LLM(model_dir, max_model_len=256)
    prompt = make_prompts()[3]
    text = llm.generate([prompt], GREEDY)[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 6]  # spans several tokens of the byte-level BPE
    assert stop.strip()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    outs = list(llm.stream(prompt, params))
    assert "".join(o.outputs[0].text_delta for o in outs) == outs[-1].outputs[0].text == text[: text.index(stop)]
    assert all(o.outputs[0].text == "".join(p.outputs[0].text_delta for p in outs[: i + 1])
               for i, o in enumerate(outs))
    assert_no_leak(llm)
