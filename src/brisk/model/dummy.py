"""Random-weight models of real shapes, for benchmarking without downloading weights (vLLM's `--load-format dummy`).

A shape is one of the named configs below (the published `config.json` of each model, trimmed to the fields brisk
reads) or any HF `config.json` (a file, or a folder holding one). The weights are drawn one tensor at a time
straight into their final buffer in the runtime dtype, from a seeded generator: the same shape, dtype and seed
give the same weights, and the load never holds more than the model itself.

    load_dummy("llama-3.2-1b", dtype=torch.bfloat16)    # 1.24B parameters, random
    brisk generate --load-format dummy --shape llama-3.2-1b --dtype bfloat16 -p "Hello"

The tokenizer is the default model's (or the one of `--model`, when given): its ids are a subset of any of these
vocabularies, and ids beyond it decode to nothing. Random weights make random text; the figures that matter are
load time, memory and speed, which depend on the shape only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from brisk.model.config import ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
_LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
           "torch_dtype": "bfloat16"}

_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
          "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
          "head_dim": 128, "attention_bias": False, "tie_word_embeddings": True, "bos_token_id": 151643,
          "eos_token_id": 151645, "torch_dtype": "bfloat16"}

# name -> HF config.json fields (from the models' published configs)
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {**_LLAMA3, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                     "tie_word_embeddings": True, "rope_scaling": _LLAMA3_ROPE},
    "llama-3.2-3b": {**_LLAMA3, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                     "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
                     "tie_word_embeddings": True, "rope_scaling": _LLAMA3_ROPE},
    "llama-3.1-8b": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                     "tie_word_embeddings": False, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}},
    "llama-3.1-70b": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                      "tie_word_embeddings": False, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}},
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8},
    # mixture of experts: 60 routed experts (top 4) and a shared expert per layer; 14.3B parameters, 2.7B active
    "qwen1.5-moe-a2.7b": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 151936,
                          "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
                          "shared_expert_intermediate_size": 5632, "num_experts": 60, "num_experts_per_tok": 4,
                          "norm_topk_prob": False, "decoder_sparse_step": 1, "num_hidden_layers": 24,
                          "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 8192,
                          "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
                          "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151643,
                          "torch_dtype": "bfloat16"},
}


class ShapeError(ValueError):
    """A dummy shape that is neither a known name nor a readable config.json."""


def shape_config(shape: str | Path) -> ModelConfig:
    """A named shape (SHAPES), a config.json file, or a folder holding one -> the model config."""
    name = str(shape).lower()
    if name in SHAPES:
        return ModelConfig.from_hf_dict(SHAPES[name])
    path = Path(shape).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ShapeError(f"unknown shape {str(shape)!r}: name one of {', '.join(SHAPES)} or give an HF config.json "
                         "(a file, or a model folder holding one)")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShapeError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ShapeError(f"{file} must hold a JSON object (an HF config.json), got {type(data).__name__}")
    try:
        return ModelConfig.from_hf_dict(data)
    except (TypeError, KeyError, AttributeError) as e:  # a field of the wrong type; UnsupportedModelError passes
        raise ShapeError(f"{file} has a malformed field: {e}") from e


def shape_name(shape: str | Path) -> str:
    """What a shape is called in file names and reports: the named shape, or the config's folder / file stem."""
    if str(shape).lower() in SHAPES:
        return str(shape).lower()
    path = Path(shape).expanduser()
    return path.name if path.is_dir() else (path.parent.name if path.name == "config.json" else path.stem)


def random_tensors(config: ModelConfig, dtype: torch.dtype, seed: int = 0,
                   device: torch.device | str = "cpu",
                   progress: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of `config`'s model (transformers names), random, in `dtype`.

    Matrices are uniform with the standard deviation of a 1/sqrt(fan_in) init (so activations keep their scale
    through the layers and logits stay finite in bfloat16); norm weights are 1, biases 0. Each tensor is filled
    in place in its final dtype: no float32 staging copy. `progress(nbytes)`: after each tensor, its bytes.
    """
    from brisk.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        meta = LlamaForCausalLM(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, p in meta.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if p.ndim == 1:
            t.fill_(0.0 if name.endswith(".bias") else 1.0)
        else:
            bound = math.sqrt(3.0 / p.shape[-1])  # uniform(-b, b) has std b / sqrt(3) = 1 / sqrt(fan_in)
            t.uniform_(-bound, bound, generator=gen)
        out[name] = t
        if progress is not None:
            progress(t.numel() * t.element_size())
    return out
