"""MHA -> GQA / MQA conversion by mean-pooling key and value heads (Ainslie et al., EMNLP 2023, section 2.2).

With H query heads and K key/value heads, query head i reads kv head i // (H / K) (HF's `repeat_kv`: consecutive
query heads share a kv head). Converting to G < K kv heads keeps that rule, so new kv head g serves query heads
[g H/G, (g+1) H/G), which are exactly the ones old kv heads [g K/G, (g+1) K/G) served. The new head's
projection is the mean of theirs:

    W_K^(g) = (1 / (K/G)) * sum_{j in group g} W_K^(j)        (the same for W_V and the biases)

Rows keep their order within a head, so RoPE's rotate-half layout is untouched. G = K changes nothing (exact).
The paper then uptrains ~5% of the pretraining steps to recover quality; that is out of scope here, so expect
a perplexity increase that grows as G shrinks (reported in BENCHMARKS / the KV notes).
The output is an ordinary float HF folder (config.json with the new num_key_value_heads, model.safetensors,
tokenizer files), loadable by `brisk generate --model OUT` and by transformers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from brisk.model.config import ModelConfig


class GQAConversionError(ValueError):
    """The requested number of kv heads does not divide the model's."""


def mean_pool_heads(weight: torch.Tensor, num_kv_heads: int, head_dim: int, new_kv_heads: int) -> torch.Tensor:
    """A k/v projection weight [K d, hidden] (or bias [K d]) -> [G d, hidden] (or [G d]), groups mean-pooled."""
    per_group = num_kv_heads // new_kv_heads
    rest = weight.shape[1:]
    heads = weight.reshape(new_kv_heads, per_group, head_dim, *rest)  # [G, K/G, d, (hidden)]
    return heads.float().mean(dim=1).reshape(new_kv_heads * head_dim, *rest).to(weight.dtype)


def convert_state_dict(tensors: dict[str, torch.Tensor], config: ModelConfig, new_kv_heads: int
                       ) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """Mean-pool every layer's k_proj / v_proj (weights and biases); return the new tensors and config."""
    k = config.num_key_value_heads
    if new_kv_heads < 1 or k % new_kv_heads:
        divisors = [g for g in range(1, k + 1) if k % g == 0]
        raise GQAConversionError(
            f"--kv-heads {new_kv_heads} must divide the model's {k} key/value heads (each new head pools a whole "
            f"group of old ones); choose one of {divisors}")
    out = dict(tensors)
    for i in range(config.num_hidden_layers):
        for proj in ("k_proj", "v_proj"):
            for kind in ("weight", "bias"):
                name = f"model.layers.{i}.self_attn.{proj}.{kind}"
                if name in out:
                    out[name] = mean_pool_heads(out[name], k, config.head_dim, new_kv_heads).contiguous()
    return out, dataclasses.replace(config, num_key_value_heads=new_kv_heads)


def convert_gqa(model: str | None, out: str | Path, new_kv_heads: int) -> Path:
    """Read `model` (GGUF or HF folder; quantized GGUF tensors are dequantized to float32) and write the
    converted float checkpoint folder `out`."""
    from brisk.model.gguf import load_gguf
    from brisk.model.hf import load_hf_folder
    from brisk.model.loader import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        ckpt = load_hf_folder(path, dtype=torch.float32)
    else:
        ckpt = load_gguf(path, dtype=torch.float32)
    if getattr(ckpt, "quantization", None) is not None:
        raise GQAConversionError(f"{path} is a brisk-quantized folder; convert the float model first, then "
                                 "quantize the converted one")
    tensors, config = convert_state_dict(ckpt.tensors, ckpt.config, new_kv_heads)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    ckpt.tokenizer.save(folder, ckpt.generation_config)
    # config.json last: a folder with a config.json is a finished checkpoint
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    return folder
