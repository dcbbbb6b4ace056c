"""Random-weight models of real shapes (--load-format dummy): the named shapes, the loader, the settings, and the
memory the load takes (peak RSS growth in a subprocess, a ceiling, not a timing)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from brisk.engine.config import EngineConfig
from brisk.model.dummy import SHAPES, ShapeError, shape_config
from brisk.model.loader import load_model

# the parameter counts the models' publishers give (exact)
PUBLISHED_PARAMS = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
                    "llama-3.1-70b": 70_553_706_496}
# the Qwen model cards give rounded figures: (total, without the embeddings, active per token), in billions
PUBLISHED_ROUNDED = {"qwen3-0.6b": (0.6, 0.44, 0.6), "qwen3-4b": (4.0, 3.6, 4.0),
                     "qwen1.5-moe-a2.7b": (14.3, None, 2.7)}


def tiny_config(name: str, folder: Path) -> Path:
    """The named shape with every width divided by 16 and two layers (heads, GQA ratio, tying, RoPE kept); the
    vocabulary is the default model's tokenizer's, so it fits."""
    d = dict(SHAPES[name])
    d.update(hidden_size=d["hidden_size"] // 16, intermediate_size=d["intermediate_size"] // 16,
             num_hidden_layers=2, num_attention_heads=d["num_attention_heads"] // 4,
             num_key_value_heads=d["num_key_value_heads"] // 4, vocab_size=49152)
    d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if key in d:
            d[key] //= 16
    if "num_experts" in d:
        d["num_experts"] = 8
    path = folder / f"{name}.json"
    path.write_text(json.dumps(d))
    return path


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_named_shapes_have_the_published_sizes(name: str) -> None:
    c = shape_config(name)
    if name in PUBLISHED_PARAMS:
        assert c.num_params == PUBLISHED_PARAMS[name]
        return
    total, body, active = PUBLISHED_ROUNDED[name]
    digits = 2 if total < 1 else 1
    assert round(c.num_params / 1e9, digits) == total
    assert round(c.num_active_params / 1e9, digits) == active
    if body is not None:
        embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
        assert round((c.num_params - embeddings) / 1e9, len(str(body)) - 2) == body


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_dummy_loader_builds_tiny_versions_of_the_named_shapes(name: str, tmp_path: Path) -> None:
    path = tiny_config(name, tmp_path)
    config = shape_config(path)
    a = load_model(None, load_format="dummy", shape=str(path), fuse=False, seed=3)
    assert a.dummy_shape == name and a.config == config
    state = a.model.state_dict()
    assert state["model.layers.1.self_attn.k_proj.weight"].shape == (
        config.num_key_value_heads * config.head_dim, config.hidden_size)
    down, width = (("mlp.experts.7.down_proj", config.moe_intermediate_size) if config.is_moe
                   else ("mlp.down_proj", config.intermediate_size))
    assert state[f"model.layers.0.{down}.weight"].shape == (config.hidden_size, width)
    assert (a.model.lm_head.weight is a.model.model.embed_tokens.weight) == config.tie_word_embeddings
    assert torch.equal(state["model.norm.weight"], torch.ones(config.hidden_size))
    w = state["model.layers.0.self_attn.q_proj.weight"]
    assert 0 < w.abs().max() <= (3 / config.hidden_size) ** 0.5  # uniform within the 1/sqrt(fan_in)-std bound
    # the same seed gives the same weights, another seed others; the runtime dtype is used directly
    b = load_model(None, load_format="dummy", shape=str(path), fuse=False, seed=3, dtype=torch.bfloat16)
    c = load_model(None, load_format="dummy", shape=str(path), fuse=False, seed=4)
    assert b.model.model.embed_tokens.weight.dtype == torch.bfloat16
    b2 = load_model(None, load_format="dummy", shape=str(path), fuse=False, seed=3, dtype=torch.bfloat16)
    assert torch.equal(b.model.model.embed_tokens.weight, b2.model.model.embed_tokens.weight)
    bound = (3 / config.hidden_size) ** 0.5
    assert 0 < b.model.model.embed_tokens.weight.float().abs().max() <= bound * (1 + 2 ** -7)
    assert not torch.equal(c.model.model.embed_tokens.weight, a.model.model.embed_tokens.weight)


def test_dummy_shape_from_the_model_argument(default_gguf_path: Path) -> None:
    # vLLM's form: --model names the shape (here the default model's GGUF header: no weight is read)
    from brisk.model.gguf import read_gguf_config

    loaded = load_model(str(default_gguf_path), load_format="dummy")
    assert loaded.config == read_gguf_config(default_gguf_path)
    assert loaded.config.hidden_size == 576 and loaded.config.num_hidden_layers == 30
    assert loaded.name.endswith("(random weights)")


def test_engine_generates_with_a_dummy_shape(tmp_path: Path) -> None:
    from brisk.engine.llm import LLM
    from brisk.engine.sampling_params import SamplingParams

    path = tiny_config("llama-3.2-1b", tmp_path)
    llm = LLM(load_format="dummy", shape=str(path), max_model_len=64, kv_cache_memory="4MiB")
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    assert all(0 <= t < 49152 for t in out[0].outputs[0].token_ids)


def test_dummy_settings_are_validated_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="add --load-format dummy"):
        EngineConfig(shape="llama-3.2-1b")
    with pytest.raises(ShapeError, match="llama-3.2-1b, llama-3.2-3b, llama-3.1-8b"):
        EngineConfig(load_format="dummy", shape="llama-9b")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ShapeError, match="not valid JSON"):
        EngineConfig(load_format="dummy", shape=str(bad))
    with pytest.raises(ValueError, match="load_format must be"):
        EngineConfig(load_format="random")
    with pytest.raises(ValueError, match="self:"):
        EngineConfig(load_format="dummy", speculative="self:int4")


def test_dummy_tokenizer_must_fit_the_shape(tmp_path: Path) -> None:
    d = json.loads(tiny_config("llama-3.2-1b", tmp_path).read_text())
    d["vocab_size"] = 1000
    small = tmp_path / "small.json"
    small.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="49152 tokens, more than the 1000"):
        load_model(None, load_format="dummy", shape=str(small))


# A model of a few hundred MB whose largest tensor (the embedding) is a third of it: the worst case for the one
# tensor the huge-page move holds twice at a time.
_MEMORY_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    import psutil, torch
    from brisk.model.loader import load_model
    base = max(psutil.Process().memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    loaded = load_model(None, load_format="dummy", shape=sys.argv[1])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tensors = {t.data_ptr(): t.nbytes for t in loaded.model.state_dict().values()}
    print(json.dumps({"growth": peak - base, "weights": sum(tensors.values()), "largest": max(tensors.values())}))
""")


def test_dummy_load_peak_rss_is_the_weights_plus_one_tensor(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 1024,
              "intermediate_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 16,
              "num_key_value_heads": 4, "max_position_embeddings": 512}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    src = str(Path(__file__).resolve().parents[1] / "src")
    out = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, str(path)], capture_output=True, text=True,
                         env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin"}, timeout=600, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["weights"] > 500 * 2**20
    # the weights once, the largest tensor a second time while it moves onto huge pages, fusion's one layer and
    # the tokenizer within the 192 MiB; a full-model intermediate copy (2x the weights) cannot pass
    assert m["growth"] <= m["weights"] + m["largest"] + 192 * 2**20, m


def test_shape_gguf_holds_the_dummy_weights_and_is_cached(tmp_path: Path) -> None:
    from brisk.bench.shape_gguf import cached_shape_gguf
    from brisk.model.dummy import random_tensors
    from brisk.model.gguf import load_gguf

    d = dict(SHAPES["llama-3.2-1b"])
    d.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    (tmp_path / "tiny").mkdir()
    config_path = tmp_path / "tiny" / "config.json"
    config_path.write_text(json.dumps(d))
    logs: list[str] = []
    path = cached_shape_gguf(str(config_path), seed=1, folder=tmp_path / "cache", log=logs.append)
    assert path.name == "tiny.seed1.f16.gguf" and "writing" in logs[-1]
    ckpt = load_gguf(path)
    assert ckpt.config.vocab_size == 128256 and ckpt.tokenizer.vocab_size == 128256  # padded token list
    assert ckpt.tokenizer.decode(ckpt.tokenizer.encode("Hello world")) == "Hello world"
    ref = random_tensors(shape_config(config_path), torch.float16, seed=1)
    for name, t in ref.items():  # F16 stored exactly; llama.cpp's Q/K row order undone by brisk's reader
        assert torch.equal(ckpt.tensors[name], t.float()), name
    mtime = path.stat().st_mtime_ns
    assert cached_shape_gguf(str(config_path), seed=1, folder=tmp_path / "cache", log=logs.append) == path
    assert "cached" in logs[-1] and path.stat().st_mtime_ns == mtime
