"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch

from brisk import SamplingParams
from brisk.ops.attention import AttentionMetadata

pytestmark = pytest.mark.slow

PROMPT = ("Elinor, this eldest daughter, whose advice was so effectual, possessed a strength of understanding, "
          "and coolness of judgment, which qualified her, though only nineteen, to be the counsellor of her mother")


def test_logits_match_transformers(default_llm, hf_default_model):
    loaded = default_llm.engine.loaded
    ids = loaded.tokenizer.encode(PROMPT)
    n = len(ids)
    c = loaded.config
    kv = [torch.zeros(2, (n + 15) // 16, 16, c.num_key_value_heads, c.head_dim) for _ in range(c.num_hidden_layers)]
    meta = AttentionMetadata.for_sequences([n], [n], [list(range((n + 15) // 16))], 16)
    with torch.inference_mode():
        got = loaded.model(torch.tensor(ids), torch.arange(n), meta, kv)
        want = hf_default_model(torch.tensor([ids])).logits[0]
    # same float32 weights, same math; differences are summation order only (logits are O(10))
    torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("chat", [False, True])
def test_greedy_64_tokens_match_transformers(default_llm, hf_default_model, chat):
    tok = default_llm.get_tokenizer()
    if chat:
        ids = tok.encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])
    else:
        ids = tok.encode(PROMPT)
    out = default_llm.generate([ids], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                        pad_token_id=tok.eos_token_ids[0])[0, len(ids):].tolist()
    assert out.outputs[0].token_ids == ref


def test_chat_answer_is_sensible(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ended on <|im_end|>, not the length cap
