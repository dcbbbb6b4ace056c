"""Pruned checkpoints: an ordinary dense HF folder plus a `sparsity_config` entry in config.json.

Unstructured and N:M pruning keep every tensor's shape and store the removed weights as exact zeros, so the
folder loads like any float checkpoint (`brisk generate --model OUT`, `LLM(model=OUT)`, transformers) and can be
quantized further (`brisk quantize OUT OUT-int4`). Tensors keep the source architecture's HF names: phi3's q/k/v
and gate/up (split at load) are written fused again as qkv_proj / gate_up_proj, MoE experts as mlp.experts.{j}.
Structured pruning writes a smaller model whose config.json
(hidden sizes, head counts, number of layers) describes it. `sparsity_config` records how the folder was made:

    "sparsity_config": {
      "format": "brisk", "method": "wanda",          # magnitude | wanda | sparsegpt | structured
      "sparsity": 0.5, "pattern": "2:4",              # "unstructured" or "N:M" (unstructured methods)
      "scope": "per_row",                             # mask comparison group: per_row | per_layer | per_block
      "modules": ["model.layers.0.self_attn.q_proj", ...],   # the pruned linears (HF names)
      "measured_sparsity": 0.5,                       # zeros / weights over those modules
      "calibration": {"calib_text": "emma.txt", "num_samples": 32, "seq_len": 512, "seed": 0} | null,
      ...                                              # method extras (structured: what was removed, params)
    }
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from brisk.model.config import ModelConfig
from brisk.model.save import hf_checkpoint_tensors
from brisk.model.tokenizer import Tokenizer

SPARSITY_KEY = "sparsity_config"


def save_pruned(folder: str | Path, config: ModelConfig, tokenizer: Tokenizer, tensors: dict[str, torch.Tensor],
                sparsity_config: dict[str, Any], generation_config: Mapping[str, Any] | None = None) -> Path:
    """Write model.safetensors, the tokenizer files, generation_config.json (the source model's
    `generation_config` carried on) and config.json (with `sparsity_config`) to `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = hf_checkpoint_tensors(tensors, config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt", "pruning": "brisk"})
    tokenizer.save(folder, generation_config)
    config_dict = config.to_hf_dict()
    config_dict[SPARSITY_KEY] = {"format": "brisk", **sparsity_config}
    # config.json last: a folder with a config.json is a finished checkpoint
    (folder / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    return folder


def add_sparsity_config(folder: str | Path, sparsity_config: dict[str, Any]) -> None:
    """Record `sparsity_config` in an already written checkpoint's config.json (e.g. a quantized folder)."""
    path = Path(folder) / "config.json"
    config_dict = json.loads(path.read_text())
    config_dict[SPARSITY_KEY] = {"format": "brisk", **sparsity_config}
    path.write_text(json.dumps(config_dict, indent=2) + "\n")


def read_sparsity_config(folder: str | Path) -> dict[str, Any] | None:
    """The folder's `sparsity_config`, or None (a GGUF file, or a folder that was not pruned by brisk)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get(SPARSITY_KEY)
    return value if isinstance(value, dict) else None
