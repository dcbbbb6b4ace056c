"""MHA -> GQA / MQA conversion: G equal to the original head count is exact; pooling is the group mean."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model

from brisk.cli import main
from brisk.engine.llm import LLM
from brisk.engine.sampling_params import SamplingParams
from brisk.eval.ppl import sequence_logits
from brisk.model.gqa import GQAConversionError, convert_gqa, mean_pool_heads
from brisk.model.loader import load_model


def test_mean_pool_heads_is_the_group_mean():
    w = torch.arange(4 * 2 * 3, dtype=torch.float32).reshape(4 * 2, 3)  # 4 heads of d=2, hidden 3
    pooled = mean_pool_heads(w, num_kv_heads=4, head_dim=2, new_kv_heads=2)
    heads = w.reshape(4, 2, 3)
    assert torch.equal(pooled, torch.cat([(heads[0] + heads[1]) / 2, (heads[2] + heads[3]) / 2]))
    bias = torch.arange(8, dtype=torch.float32)
    assert torch.equal(mean_pool_heads(bias, 4, 2, 1), bias.reshape(4, 2).mean(0))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gqa")
    make_tiny_hf_model(root / "mha", "qwen2", num_kv_heads=4, num_attention_heads=4, seed=7)  # q/k/v biases
    return root


def test_same_head_count_is_exact(tiny):
    out = convert_gqa(str(tiny / "mha"), tiny / "same", 4)
    a, b = load_model(str(tiny / "mha")), load_model(str(out))
    ids = torch.arange(1, 40)
    assert torch.equal(sequence_logits(a, ids), sequence_logits(b, ids))


def test_mqa_has_one_kv_head_and_runs(tiny):
    runner = CliRunner()
    result = runner.invoke(main, ["convert", "gqa", "--kv-heads", "1", str(tiny / "mha"), str(tiny / "mqa")])
    assert result.exit_code == 0, result.output
    loaded = load_model(str(tiny / "mqa"))
    assert loaded.config.num_key_value_heads == 1
    k = loaded.model.model.layers[0].self_attn
    src = load_model(str(tiny / "mha"), fuse=False).model.model.layers[0].self_attn
    # the fused qkv weight holds q rows, then the one pooled k head, then the pooled v head
    d = loaded.config.head_dim
    q_rows = loaded.config.num_attention_heads * d
    pooled_k = k.qkv_proj.weight[q_rows:q_rows + d]
    assert torch.allclose(pooled_k, src.k_proj.weight.reshape(4, d, -1).mean(0), atol=1e-6)
    out = LLM(str(tiny / "mqa"), max_model_len=64, kv_cache_memory="4MiB").generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_kv_heads_must_divide(tiny):
    with pytest.raises(GQAConversionError, match="must divide"):
        convert_gqa(str(tiny / "mha"), tiny / "bad", 3)
