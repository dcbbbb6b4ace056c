"""Reading Hugging Face model folders: weights equal to transformers' state dict, sharded equal to single-file,
and one clear HFCheckpointError per way a folder can be broken."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hf_utils import make_tiny_hf_model
from safetensors.torch import save_file

from brisk.model.config import UnsupportedModelError
from brisk.model.hf import HFCheckpointError, load_hf_folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("llama")
    model = make_tiny_hf_model(path, "llama", num_kv_heads=2, tie_word_embeddings=False, seed=0)
    return path, model


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_llama_folder_loads_like_transformers(llama_dir: tuple[Path, torch.nn.Module]) -> None:
    path, model = llama_dir
    ckpt = load_hf_folder(path)
    ref = model.state_dict()
    assert set(ckpt.tensors) == set(ref)
    for name, t in ckpt.tensors.items():
        assert t.dtype == torch.float32 and torch.equal(t, ref[name]), name
    c = ckpt.config
    assert (c.architecture, c.num_key_value_heads, c.vocab_size, c.tie_word_embeddings) == ("llama", 2, 384, False)
    assert ckpt.tokenizer is not None and ckpt.tokenizer.eos_token_ids == [2]
    assert ckpt.generation_config["eos_token_id"] == [2]
    assert ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user")


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_sharded_equals_single_file(tmp_path: Path, arch: str) -> None:
    kwargs = dict(num_kv_heads=1, tie_word_embeddings=True, seed=3, rope_scaling={"rope_type": "linear", "factor": 2.0})
    make_tiny_hf_model(tmp_path / "single", arch, shards=1, **kwargs)
    model = make_tiny_hf_model(tmp_path / "sharded", arch, shards=3, **kwargs)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) >= 2 and not (tmp_path / "sharded" / "model.safetensors").exists()

    single, sharded = load_hf_folder(tmp_path / "single"), load_hf_folder(tmp_path / "sharded")
    assert set(single.tensors) == set(sharded.tensors) == set(model.state_dict()) - {"lm_head.weight"}
    for name, t in single.tensors.items():
        assert torch.equal(t, sharded.tensors[name]), name
    assert single.config == sharded.config
    assert sharded.config.architecture == arch and sharded.config.tie_word_embeddings
    assert sharded.config.rope_scaling["rope_type"] == "linear" and sharded.config.rope_scaling["factor"] == 2.0
    if arch == "qwen2":
        assert sharded.config.attention_bias and "model.layers.0.self_attn.q_proj.bias" in sharded.tensors


def test_dtype_conversion_and_dropped_buffers(tmp_path: Path, llama_dir: tuple[Path, torch.nn.Module]) -> None:
    path = _copy(llama_dir[0], tmp_path / "m")
    ref = llama_dir[1].state_dict()
    # Older checkpoints saved the rotary buffer and may hold integer tensors; neither is a float weight.
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8), "model.step": torch.tensor([7])}
    tensors = {k: v.contiguous() for k, v in ref.items()} | extra
    save_file(tensors, str(path / "model.safetensors"))
    ckpt = load_hf_folder(path, dtype=torch.bfloat16)
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" not in ckpt.tensors
    assert ckpt.tensors["model.step"].dtype == torch.int64
    for name, t in ref.items():
        assert ckpt.tensors[name].dtype == torch.bfloat16 and torch.equal(ckpt.tensors[name], t.to(torch.bfloat16))


def test_generation_config_eos_ids_are_merged(tmp_path: Path, llama_dir: tuple[Path, torch.nn.Module]) -> None:
    path = _copy(llama_dir[0], tmp_path / "m")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2, 0]}))
    ckpt = load_hf_folder(path)
    assert ckpt.tokenizer.eos_token_ids == [2, 1, 0]  # tokenizer's own EOS first, then the union


# ---------------------------------------------------------------------------------------------- error table
def _rm(name: str) -> Callable[[Path], None]:
    return lambda p: (p / name).unlink()


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda p: (p / name).write_text(text)


def _edit_json(name: str, **changes: object) -> Callable[[Path], None]:
    def edit(p: Path) -> None:
        data = json.loads((p / name).read_text())
        data.update(changes)
        (p / name).write_text(json.dumps(data))
    return edit


def _truncate(p: Path) -> None:
    f = p / "model.safetensors"
    with open(f, "r+b") as h:
        h.truncate(f.stat().st_size // 2)


def _only_pickle(p: Path) -> None:
    (p / "model.safetensors").unlink()
    (p / "pytorch_model.bin").write_bytes(b"not loaded")


def _index_with_missing_shard(p: Path) -> None:
    (p / "model.safetensors").rename(p / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors",
                                            "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (p / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_with_foreign_tensor(p: Path) -> None:
    (p / "model.safetensors").rename(p / "model-00001-of-00001.safetensors")
    index = {"weight_map": {"model.not_there.weight": "model-00001-of-00001.safetensors"}}
    (p / "model.safetensors.index.json").write_text(json.dumps(index))


def _no_eos_anywhere(p: Path) -> None:
    _edit_json("tokenizer_config.json", eos_token=None)(p)
    _edit_json("generation_config.json", eos_token_id=None)(p)
    _edit_json("config.json", eos_token_id=None)(p)


BROKEN = {
    "no config.json": (_rm("config.json"), "config.json not found"),
    "config.json not json": (_write("config.json", "{'vocab_size': 384"), "config.json is not valid JSON"),
    "config.json a list": (_write("config.json", "[1, 2]"), "must hold a JSON object"),
    "config.json bad field": (_edit_json("config.json", num_hidden_layers="two"), "malformed field"),
    "no weights": (_rm("model.safetensors"), "no model weights"),
    "pickle only": (_only_pickle, "does not load pickle checkpoints.*pytorch_model.bin|pytorch_model.bin.*pickle"),
    "truncated safetensors": (_truncate, "model.safetensors.*truncated or corrupt"),
    "garbage safetensors": (_write("model.safetensors", "garbage"), "truncated or corrupt"),
    "index names missing shard": (_index_with_missing_shard, "model-00002-of-00002.safetensors.*missing"),
    "index without weight_map": (_write("model.safetensors.index.json", "{}"), "no 'weight_map'"),
    "index lists foreign tensor": (_index_with_foreign_tensor, "model.not_there.weight"),
    "no tokenizer.json": (_rm("tokenizer.json"), "tokenizer.json not found"),
    "tokenizer.json corrupt": (_write("tokenizer.json", '{"model": 3}'), "tokenizer.json could not be parsed"),
    "tokenizer_config not json": (_write("tokenizer_config.json", "{"), "tokenizer_config.json is not valid JSON"),
    "generation_config not json": (_write("generation_config.json", "]"), "generation_config.json is not valid"),
    "tokenizer larger than model": (_edit_json("config.json", vocab_size=300), "does not belong to this model"),
    "no eos anywhere": (_no_eos_anywhere, "never stop"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_folder_errors(tmp_path: Path, llama_dir: tuple[Path, torch.nn.Module], case: str) -> None:
    breaker, fragment = BROKEN[case]
    path = _copy(llama_dir[0], tmp_path / "m")
    breaker(path)
    with pytest.raises(HFCheckpointError, match=fragment):
        load_hf_folder(path)


def test_unknown_architecture_is_unsupported(tmp_path: Path, llama_dir: tuple[Path, torch.nn.Module]) -> None:
    path = _copy(llama_dir[0], tmp_path / "m")
    _edit_json("config.json", architectures=["GPT2LMHeadModel"], model_type="gpt2")(path)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_hf_folder(path)


def test_path_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(HFCheckpointError, match="does not exist"):
        load_hf_folder(tmp_path / "nowhere")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(HFCheckpointError, match="is a file"):
        load_hf_folder(tmp_path / "model.gguf")
    monkeypatch.chdir(tmp_path)  # so the relative "org/name" surely does not exist
    assert not os.path.exists("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(HFCheckpointError, match="does not download models at run time.*local folder"):
        load_hf_folder("HuggingFaceTB/SmolLM2-135M-Instruct")
