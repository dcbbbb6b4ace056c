"""The tensors of a loaded model to save as a checkpoint: its state dict under brisk's names (`model_tensors`) and
under the names the architecture's HF checkpoints use (`hf_checkpoint_tensors`). Pruned, trained, distilled and
LoRA-merged checkpoints are written from these."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from brisk.model.config import ModelConfig
    from brisk.model.llama import LlamaForCausalLM


def model_tensors(model: LlamaForCausalLM, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The state dict to save under HF names (model must be unfused); a tied head goes with the embedding."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    fused = [k for k in state if ".qkv_proj." in k or ".gate_up_proj." in k]
    assert not fused, f"save an unfused model (load_model(..., fuse=False)); found {fused[:2]}"
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def hf_checkpoint_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors under the names the architecture's HF checkpoints use: phi3 fuses q/k/v into qkv_proj
    ([q heads | k heads | v heads] rows) and gate/up into gate_up_proj ([gate | up] rows), the inverse of
    model.fuse.split_fused_tensors; every other architecture's names are brisk's already."""
    if config.architecture != "phi3":
        return tensors
    out = dict(tensors)
    fusions = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    for i in range(config.num_hidden_layers):
        for fused, parts in fusions.items():
            for kind in ("weight", "bias"):
                names = [f"model.layers.{i}.{p}.{kind}" for p in parts]
                if all(n in out for n in names):
                    out[f"model.layers.{i}.{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])  # [rows, K]
    return out
