"""The model against HF transformers on tiny random checkpoints of every supported architecture."""

from __future__ import annotations

import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.model.loader import load_model
from brisk.ops.attention import AttentionMetadata

CASES = [
    # arch, kv heads (4 query heads: 4 = MHA, 2 = GQA, 1 = MQA), tied embeddings
    ("llama", 4, False),
    ("llama", 2, True),
    ("llama", 1, False),
    ("mistral", 2, False),
    ("qwen2", 2, True),
    ("qwen2", 4, False),
    ("qwen3", 2, False),
    ("qwen3", 1, True),
    ("phi3", 2, False),
    ("smollm3", 2, True),  # layers without RoPE (NoPE) among rotating ones
]


def prefill_logits(loaded, ids: torch.Tensor) -> torch.Tensor:
    """All-position logits of one sequence through the paged path (one prefill, no prior context)."""
    c = loaded.config
    n = ids.shape[0]
    num_blocks = (n + 15) // 16
    kv = [torch.zeros(2, num_blocks, 16, c.num_key_value_heads, c.head_dim, dtype=loaded.dtype)
          for _ in range(c.num_hidden_layers)]
    meta = AttentionMetadata.for_sequences([n], [n], [list(range(num_blocks))], 16, sliding_window=c.sliding_window)
    with torch.inference_mode():
        return loaded.model(ids, torch.arange(n), meta, kv).float()


@pytest.mark.parametrize("arch,kv_heads,tied", CASES)
def test_logits_and_greedy_match_transformers(tmp_path, arch, kv_heads, tied):
    ref = make_tiny_hf_model(tmp_path, arch, num_kv_heads=kv_heads, tie_word_embeddings=tied, seed=1)
    loaded = load_model(tmp_path)
    ids = torch.randint(3, loaded.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got = prefill_logits(loaded, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    llm = LLM(str(tmp_path), max_model_len=256, kv_cache_memory="4MiB")
    prompt = ids[:12].tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    with torch.no_grad():
        hf_ids = ref.generate(ids[None, :12], max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, 12:]
    assert out.outputs[0].token_ids == hf_ids.tolist()


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
])
def test_rope_scaling_matches_transformers(tmp_path, scaling):
    # max_position 64 so a 96-token sequence exercises the dynamic NTK branch
    ref = make_tiny_hf_model(tmp_path, "llama", rope_scaling=scaling, max_position_embeddings=64, seed=2)
    loaded = load_model(tmp_path, max_model_len=128)
    ids = torch.randint(3, loaded.config.vocab_size, (96,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    if scaling["rope_type"] == "dynamic":
        # HF rescales by the whole sequence's length; so does brisk (per sequence, via context_lens)
        c = loaded.config
        kv = [torch.zeros(2, 6, 16, c.num_key_value_heads, c.head_dim) for _ in range(c.num_hidden_layers)]
        meta = AttentionMetadata.for_sequences([96], [96], [list(range(6))], 16)
        with torch.inference_mode():
            got = loaded.model(ids, torch.arange(96), meta, kv, context_lens=torch.full((96,), 96))
    else:
        got = prefill_logits(loaded, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sliding_window_matches_transformers(tmp_path):
    ref = make_tiny_hf_model(tmp_path, "mistral", sliding_window=8, seed=3)
    ref.config._attn_implementation = "eager"
    loaded = load_model(tmp_path)
    assert loaded.config.sliding_window == 8
    ids = torch.randint(3, loaded.config.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(loaded, ids), want, atol=1e-4, rtol=1e-4)
    # decode steps through the paged cache must apply the same window
    llm = LLM(str(tmp_path), max_model_len=128, kv_cache_memory="2MiB")
    out = llm.generate([ids[:6].tolist()], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    with torch.no_grad():
        hf_ids = ref.generate(ids[None, :6], max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, 6:]
    assert out.outputs[0].token_ids == hf_ids.tolist()


def test_bfloat16_close_to_float32_reference(tmp_path):
    ref = make_tiny_hf_model(tmp_path, "llama", seed=4)
    loaded = load_model(tmp_path, dtype=torch.bfloat16)
    assert loaded.model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(3, loaded.config.vocab_size, (32,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    got = prefill_logits(loaded, ids)
    # bf16 keeps 8 mantissa bits (relative step 2^-8 ~ 0.4%); errors accumulate over 2 layers and the
    # 64-wide dot products, so compare at a few percent of the logit scale, and the argmax almost everywhere
    scale = want.abs().max()
    assert (got - want).abs().max() < 0.05 * scale
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 0.9


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the fused q/k/v carries the biases too
def test_fused_projections_equal_plain_ones(tmp_path, arch):
    make_tiny_hf_model(tmp_path, arch, seed=5)
    plain = load_model(tmp_path, fuse=False)
    fused = load_model(tmp_path)
    assert plain.model.model.layers[0].self_attn.qkv_proj is None
    assert fused.model.model.layers[0].self_attn.q_proj is None
    assert fused.model.model.layers[0].mlp.gate_up_proj is not None
    ids = torch.randint(3, plain.config.vocab_size, (24,), generator=torch.Generator().manual_seed(4))
    # one wide matmul sums in a different order than three narrow ones: float32 rounding only
    torch.testing.assert_close(prefill_logits(fused, ids), prefill_logits(plain, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [40, 56])  # within and beyond phi3's original context of 48
def test_phi3_longrope_matches_transformers(tmp_path, num_tokens):
    """LongRoPE: short factors within the original context, long ones beyond it, cos / sin scaled by the
    attention factor (prefills on both sides of the original context), and 32-token greedy runs within it and
    across it: at the step a sequence first passes the original context, transformers drops its cache and
    recomputes every token with the long factors, and brisk recomputes the cached prefix the same way."""
    g = torch.Generator().manual_seed(3)
    half = 64 // 4 // 2  # head_dim / 2 of the tiny model
    scaling = {"rope_type": "longrope", "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
               "long_factor": (1 + 4 * torch.rand(half, generator=g)).tolist()}
    ref = make_tiny_hf_model(tmp_path, "phi3", rope_scaling=scaling, max_position_embeddings=256,
                             original_max_position_embeddings=48, seed=4)
    loaded = load_model(tmp_path, max_model_len=128)
    assert loaded.model.rope.attention_factor > 1.0
    ids = torch.randint(3, loaded.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    c = loaded.config
    kv = [torch.zeros(2, 4, 16, c.num_key_value_heads, c.head_dim) for _ in range(c.num_hidden_layers)]
    meta = AttentionMetadata.for_sequences([num_tokens], [num_tokens], [[0, 1, 2, 3]], 16)
    with torch.inference_mode():
        got = loaded.model(ids, torch.arange(num_tokens), meta, kv, context_lens=torch.full((num_tokens,),
                                                                                          num_tokens))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    llm = LLM(str(tmp_path), max_model_len=128, kv_cache_memory="4MiB")
    # 12 + 32 stays within the original 48; 40 + 32 crosses it at the 9th new token; 20-token chunks of a 56-token
    # prompt cross it within the prefill
    for prompt_len in (12, 40):
        out = llm.generate([ids[:prompt_len].tolist()], SamplingParams(temperature=0, max_tokens=32,
                                                                     ignore_eos=True))[0]
        with torch.no_grad():
            hf_ids = ref.generate(ids[None, :prompt_len], max_new_tokens=32, min_new_tokens=32,
                                  do_sample=False)[0, prompt_len:]
        assert out.outputs[0].token_ids == hf_ids.tolist(), prompt_len
    chunked = LLM(str(tmp_path), max_model_len=128, kv_cache_memory="4MiB", max_num_batched_tokens=20)
    out = chunked.generate([ids.tolist()], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    with torch.no_grad():
        hf_ids = ref.generate(ids[None], max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, num_tokens:]
    assert out.outputs[0].token_ids == hf_ids.tolist()
