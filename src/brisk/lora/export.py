"""`brisk export merged`: a LoRA adapter folded into its base model's weights, written as an ordinary HF folder.

The merged folder needs no adapter machinery at run time (no per-row adapter groups, any execution path, any
quantization method afterwards): W' = W + scaling * B A for every adapted projection, computed in float32 and
stored in the chosen dtype. The folder's config.json records the adapter that was merged (`merged_lora`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from brisk.lora.adapter import check_fits, load_adapter, merge_adapter
from brisk.model.loader import load_model
from brisk.model.save import model_tensors

MERGED_KEY = "merged_lora"


@dataclass(frozen=True)
class MergeReport:
    path: Path
    modules: int
    rank: int
    bytes: int


def projection_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Module path -> (out_features, in_features) of every 2-D float weight of an unfused model."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and name.startswith("model.layers."):
            shapes[name] = (int(weight.shape[0]), int(weight.shape[1]))
    return shapes


def _submodule(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def export_merged(model: str | None, adapter: str | Path, out: str | Path,
                  dtype: torch.dtype = torch.float32) -> MergeReport:
    """Load `model` in float32, unfused (a quantized GGUF is dequantized; a packed brisk or community quantized
    folder is refused: merge into the float model the adapter was trained on), add the adapter, save to `out`."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new folder for the merged model")
    lora = load_adapter(adapter)
    loaded = load_model(model, dtype=torch.float32, fuse=False, sparse=False, show_progress=False)
    for mod in lora.modules:
        module = _submodule(loaded.model, mod)
        weight = getattr(module, "weight", None)
        if module is not None and not (isinstance(weight, torch.Tensor) and weight.is_floating_point()):
            raise ValueError(f"{model or 'default'} holds {mod} quantized or compressed: merge the adapter into the "
                             "float model it was trained on, then quantize the merged folder (brisk quantize ...)")
    check_fits(lora, projection_shapes(loaded.model), f"adapter {str(adapter)!r}")
    merged = merge_adapter(loaded.model, lora)
    tensors = {k: v.to(dtype) if v.is_floating_point() else v
               for k, v in model_tensors(loaded.model, loaded.config).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "merged_lora": "brisk"})
    loaded.tokenizer.save(out, loaded.generation_config)
    config = loaded.config.to_hf_dict()
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    config[MERGED_KEY] = {"adapter": str(adapter), "sha256": lora.digest, "r": lora.r, "lora_alpha": lora.lora_alpha,
                          "use_rslora": lora.use_rslora, "modules": merged,
                          "base_model": lora.base_model_name_or_path or (model or "default")}
    # config.json last: a folder with a config.json is a finished checkpoint
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return MergeReport(out, merged, lora.r, sum(t.numel() * t.element_size() for t in tensors.values()))
