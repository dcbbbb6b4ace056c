"""The start-up memory estimate and check (engine/memory.py): exact figures on tiny configs, and the refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from brisk.engine import memory
from brisk.engine.memory import (
    GiB,
    InsufficientMemoryError,
    MiB,
    check_memory,
    estimate_memory,
    model_footprint,
)
from brisk.engine.settings import build_engine_config
from brisk.model.dummy import shape_config


def test_weights_of_a_named_shape_follow_the_dtype() -> None:
    c = shape_config("llama-3.2-1b")
    f = model_footprint(None, "dummy", "llama-3.2-1b")
    assert f.float_params == c.num_params and f.fixed_bytes == 0
    # tied: every matrix is a linear (the head on the embedding's weight); only the norms are not
    assert f.float_linear_params == c.num_params - (2 * c.num_hidden_layers + 1) * c.hidden_size
    f32 = estimate_memory(build_engine_config(load_format="dummy", shape="llama-3.2-1b"), f)
    bf16 = estimate_memory(build_engine_config(load_format="dummy", shape="llama-3.2-1b", dtype="bfloat16"), f)
    assert f32.weights == 4 * c.num_params and bf16.weights == 2 * c.num_params
    # prepack auto: a 1B model's float32 copies (4.9 GB) are over its 1 GiB bound; bfloat16 ones only with "on"
    assert 4 * f.float_linear_params > memory.PREPACK_AUTO_MAX_BYTES
    assert f32.packed == 0 and bf16.packed == 0
    on = estimate_memory(build_engine_config(load_format="dummy", shape="llama-3.2-1b", dtype="bfloat16",
                                      prepack_weights="on"), f)
    assert on.packed == 4 * f.float_linear_params
    assert f32.kv_pool <= 512 * MiB and f32.kv_pool > 500 * MiB  # the default pool, in whole blocks
    # a step's activations are in the runtime dtype, the sampled rows' logits and probabilities in float32 either
    # way (twice each: the allocator's free blocks)
    logits = 2 * 4 * 2 * 128 * c.vocab_size  # max_num_seqs 128 rows
    assert (bf16.activations - logits) * 2 == f32.activations - logits > 0


def test_kv_pool_follows_the_block_count() -> None:
    f = model_footprint(None, "dummy", "llama-3.2-1b")
    c = shape_config("llama-3.2-1b")
    est = estimate_memory(build_engine_config(load_format="dummy", shape="llama-3.2-1b", num_kv_blocks=10), f)
    # keys and values, every layer, 16 tokens a block, float32
    assert est.kv_pool == 10 * 16 * 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4


def test_safetensors_footprint_reads_headers(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(64, 16, dtype=torch.bfloat16),
               "lm_head.weight": torch.zeros(64, 16, dtype=torch.bfloat16),
               "model.layers.0.mlp.down_proj.qweight": torch.zeros(16, 16, dtype=torch.int32),
               "model.layers.0.mlp.down_proj.scales": torch.zeros(16, 1, dtype=torch.float16),
               "model.norm.weight": torch.zeros(16)}, str(tmp_path / "model.safetensors"))
    f = model_footprint(str(tmp_path))
    assert f.float_params == 64 * 16 * 2 + 16  # follow the runtime dtype
    assert f.fixed_bytes == 16 * 16 * 4 + 16 * 2  # packed codes and scales keep their stored dtype
    assert f.float_linear_params == 64 * 16  # the head; the embedding is not a linear
    assert f.weight_bytes(torch.float32) == 4 * (64 * 16 * 2 + 16) + 16 * 16 * 4 + 16 * 2


def test_check_refuses_with_the_numbers_and_what_would_fit() -> None:
    config = build_engine_config(load_format="dummy", shape="llama-3.2-1b")
    est = estimate_memory(config, model_footprint(None, "dummy", "llama-3.2-1b"))
    available = 4 * GiB  # less than float32 weights alone (4.6 GiB); bfloat16's 2.3 GiB fits
    with pytest.raises(InsufficientMemoryError) as e:
        check_memory(config, available=available)
    msg = str(e.value)
    assert f"needs about {est.total / GiB:.2f} GiB" in msg and "4.00 GiB is available" in msg
    assert f"weights {est.weights / GiB:.2f} GiB" in msg and "KV pool" in msg
    assert "--dtype bfloat16   (about" in msg
    assert "--no-memory-check" in msg
    # every option listed does fit
    for line in msg.splitlines():
        if "(about " in line and line.startswith("  "):
            figure = line.rsplit("(about ", 1)[1].split()[0]
            assert float(figure) * (GiB if "GiB" in line.rsplit("(about ", 1)[1] else MiB) <= available


def test_a_smaller_kv_pool_is_offered_when_it_is_what_fits() -> None:
    config = build_engine_config(load_format="dummy", shape="llama-3.2-1b", dtype="bfloat16", kv_cache_memory="8GiB")
    est = estimate_memory(config, model_footprint(None, "dummy", "llama-3.2-1b"))
    available = est.total - 6 * GiB
    with pytest.raises(InsufficientMemoryError, match=r"--kv-cache-memory \d+MiB"):
        check_memory(config, available=available)


def _small_shape(tmp_path: Path) -> str:
    """A 100M-parameter llama config.json: its float32 copies (~400 MB) are under prepack auto's bound."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 768,
              "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 4, "tie_word_embeddings": True, "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path / "config.json")


def test_fewer_sequences_are_offered_when_they_drop_the_packed_copies(tmp_path: Path) -> None:
    """float32 at 128 sequences packs a float32 copy of every linear (prepack auto, a model small enough); at 8
    the small-M kernel runs every batch and nothing is packed. Both ways out are offered, each with its own
    estimate."""
    shape = _small_shape(tmp_path)
    config = build_engine_config(load_format="dummy", shape=shape)
    f = model_footprint(None, "dummy", shape)
    est = estimate_memory(config, f)
    eight = estimate_memory(config, f, max_num_seqs=8)
    assert eight.packed == 0 and est.total - eight.total > est.packed  # the copies and 120 rows of logits
    available = est.total - est.packed // 2
    with pytest.raises(InsufficientMemoryError) as e:
        check_memory(config, available=available)
    msg = str(e.value)
    assert f"  --max-num-seqs 8   (about {eight.total / GiB:.2f} GiB)" in msg
    assert "  --prepack-weights off   (about" in msg
    assert "--dtype bfloat16 --max-num-seqs" not in msg  # bfloat16 packs nothing: no flag that changes nothing


def test_a_pool_shorter_than_max_model_len_comes_with_the_length_it_holds() -> None:
    config = build_engine_config(load_format="dummy", shape="llama-3.2-3b", dtype="bfloat16", kv_cache_memory="4GiB",
                                 max_model_len=8192, max_num_seqs=8)
    f = model_footprint(None, "dummy", "llama-3.2-3b")
    est = estimate_memory(config, f)
    available = est.total - est.kv_pool + 700 * MiB  # room for ~6k tokens of a 3B's bfloat16 KV (112 KiB each)
    with pytest.raises(InsufficientMemoryError) as e:
        check_memory(config, available=available)
    (line,) = [ln for ln in str(e.value).splitlines() if "--kv-cache-memory" in ln]
    pool_mib = int(line.split("--kv-cache-memory ")[1].split("MiB")[0])
    c = shape_config("llama-3.2-3b")
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2
    assert "--max-model-len 4096" in line and 4096 <= pool_mib * MiB // per_token < 8192


def test_check_passes_and_can_be_switched_off() -> None:
    config = build_engine_config(load_format="dummy", shape="llama-3.2-1b")
    est = check_memory(config, available=10**15)
    assert est is not None and est.total > est.weights
    assert check_memory(build_engine_config(load_format="dummy", shape="llama-3.2-1b", memory_check=False),
                        available=1) is None


def test_llm_stops_before_loading_when_it_cannot_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    from brisk.engine import llm_engine
    from brisk.engine.llm import LLM

    monkeypatch.setattr(memory, "available_memory", lambda: (64 * MiB, "a test's figure"))

    def must_not_load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded despite the failed memory check")

    monkeypatch.setattr(llm_engine, "load_model", must_not_load)
    with pytest.raises(InsufficientMemoryError, match="64 MiB is available \\(a test's figure\\)"):
        LLM(load_format="dummy", shape="llama-3.1-8b")


def test_available_memory_is_positive() -> None:
    avail, source = memory.available_memory()
    assert avail > 0 and source


_PEAK_SCRIPT = """
import sys, torch
from brisk.model.loader import load_model
import brisk.model.hf, brisk.model.fuse, brisk.ops.linear  # imports before the baseline
from brisk.console import peak_rss_bytes, reset_peak_rss
assert reset_peak_rss()
base = peak_rss_bytes()
loaded = load_model(sys.argv[1], dtype=torch.bfloat16)
print(peak_rss_bytes() - base)
"""


def test_safetensors_load_peak_rss_stays_near_the_weights(tmp_path: Path) -> None:
    """A ~300 MB bfloat16 folder loaded in bfloat16: the peak RSS growth of the load stays under 1.2x the weights
    (+ 64 MiB for the allocator and the rope tables). Reading every tensor into a fresh buffer and concatenating
    q/k/v and gate/up afterwards peaks at about twice the weights; here the mapped tensors are not even touched
    and the fused parts are read straight into their buffers."""
    import subprocess
    import sys

    from hf_utils import make_tiny_hf_model

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's resettable peak RSS (/proc/self/clear_refs)")
    make_tiny_hf_model(tmp_path, "llama")  # config and tokenizer files; the weights are replaced below
    config = json.loads((tmp_path / "config.json").read_text())
    h, inter, layers, vocab, kv = 1024, 4096, 6, 32000, 4
    config.update(hidden_size=h, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=16,
                  num_key_value_heads=kv, vocab_size=vocab, head_dim=64, torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.rand(shape, generator=g) - 0.5).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h),
               "model.norm.weight": rand(h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": rand(h), p + "post_attention_layernorm.weight": rand(h),
                    p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv * 64, h),
                    p + "self_attn.v_proj.weight": rand(kv * 64, h), p + "self_attn.o_proj.weight": rand(h, h),
                    p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                    p + "mlp.down_proj.weight": rand(h, inter)}
    weight_bytes = sum(t.nbytes for t in tensors.values())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    del tensors
    assert weight_bytes > 250 * MiB
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    run = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    growth = int(run.stdout.split()[-1])
    assert growth < 1.2 * weight_bytes + 64 * MiB, f"peak RSS grew {growth / MiB:.0f} MiB for " \
                                                   f"{weight_bytes / MiB:.0f} MiB of weights"
