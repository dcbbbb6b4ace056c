"""Read a Hugging Face model folder: config.json, safetensors weights, tokenizer, generation_config.json.

Only safetensors are read. `pytorch_model.bin` and other pickle checkpoints can execute arbitrary code when
loaded, so brisk refuses them and says how to convert. Tensor names are kept exactly as in the file
(`model.layers.0.self_attn.q_proj.weight`, ...): brisk's model code uses transformers' module names, so no
renaming table sits between the two.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from brisk.model import mapped
from brisk.model.config import ModelConfig
from brisk.model.fuse import FusedBuffers, FusedTensorError, split_fused_tensors
from brisk.model.moe import MoETensorError, rename_hf_moe_tensors
from brisk.model.tokenizer import Tokenizer
from brisk.quant.community import convert_community_checkpoint, read_community_config
from brisk.quant.config import QuantizationConfig, read_quantization_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Buffers some older checkpoints saved next to the weights; brisk recomputes them from the config.
_NON_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# "org/name" the way the hub spells repository ids (no leading dot or slash, exactly one slash).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class HFCheckpointError(ValueError):
    """A Hugging Face model folder is missing, incomplete or malformed; the message names the file."""


@dataclass
class HFCheckpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    generation_config: dict[str, Any] = field(default_factory=dict)
    quantization: QuantizationConfig | None = None  # set for a folder of `brisk quantize` (or GPTQ / AWQ / c-t)
    mapped: list[torch.Tensor] = field(default_factory=list)  # the files' memory maps the weights view (mapped.py)


def load_hf_folder(path: str | Path, dtype: torch.dtype = torch.float32, fuse: bool = False,
                   progress: Callable[[int], None] | None = None) -> HFCheckpoint:
    """Load config, weights (floating tensors converted to `dtype`) and tokenizer from a local HF folder.

    Tensors stored as they run (in `dtype`, or integer / scale tensors) are views of the memory-mapped files
    (model/mapped.py); the rest are converted one at a time. `fuse`: q/k/v and gate/up parts are written into one
    buffer per layer as they are converted (fuse.FusedBuffers), for fuse_projections to take without a copy.
    `progress(nbytes)` is called after each tensor with its stored bytes (model/load_progress.py)."""
    folder = _check_folder(path)
    config_dict = _read_json(folder / "config.json", required=True)
    try:
        config = ModelConfig.from_hf_dict(config_dict)
    except (TypeError, KeyError, AttributeError) as e:  # a field of the wrong type; UnsupportedModelError passes
        raise HFCheckpointError(f"{folder / 'config.json'} has a malformed field: {e}") from e
    community = read_community_config(config_dict, str(folder / "config.json"))  # GPTQ, AWQ, compressed-tensors
    quantization = None if community else read_quantization_config(config_dict, str(folder / "config.json"))
    generation_config = _read_json(folder / "generation_config.json", required=False) or {}
    maps: list[torch.Tensor] = []
    tensors = load_safetensors_folder(folder, dtype, FusedBuffers(config, dtype) if fuse else None, maps, progress)
    try:
        split_fused_tensors(tensors, config)  # phi3's qkv_proj / gate_up_proj -> HF's q/k/v and gate/up names
        rename_hf_moe_tensors(tensors, config)  # hub Mixtral's block_sparse_moe.* -> mlp.* (model/moe.py)
    except (FusedTensorError, MoETensorError) as e:
        raise HFCheckpointError(f"{folder}: {e}") from None
    if community is not None:  # their packed tensors become brisk's, once (quant/community.py)
        quantization = convert_community_checkpoint(tensors, config, community)
    tokenizer = _load_tokenizer(folder, config, config_dict, generation_config)
    return HFCheckpoint(config=config, tensors=tensors, tokenizer=tokenizer, generation_config=generation_config,
                        quantization=quantization, mapped=maps)


def load_safetensors_folder(folder: Path, dtype: torch.dtype = torch.float32, fused: FusedBuffers | None = None,
                            maps: list[torch.Tensor] | None = None,
                            progress: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards listed in `model.safetensors.index.json`. With `maps`,
    tensors stored as they run are views of the files' memory maps (appended to `maps`); else all are copies."""
    index_file, single_file = folder / INDEX_FILE, folder / SINGLE_FILE
    if index_file.is_file():
        index = _read_json(index_file, required=True)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFCheckpointError(f"{index_file} has no 'weight_map' (tensor name -> shard file)")
        shard_names = sorted(set(weight_map.values()))
        for name in shard_names:
            if not (folder / name).is_file():
                raise HFCheckpointError(
                    f"{index_file} names shard {name!r}, which is missing from {folder}; "
                    "the download is incomplete: fetch every model-*.safetensors file"
                )
        tensors: dict[str, torch.Tensor] = {}
        for name in shard_names:
            tensors.update(_read_safetensors(folder / name, dtype, fused, maps, progress))
        missing = [k for k in weight_map if k not in tensors and not k.endswith(_NON_WEIGHT_SUFFIXES)]
        if missing:
            raise HFCheckpointError(
                f"{index_file} lists {len(missing)} tensors that no shard holds (first: {missing[0]!r}); "
                "the shards do not belong to this index"
            )
        return tensors
    if single_file.is_file():
        return _read_safetensors(single_file, dtype, fused, maps, progress)

    pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(_PICKLE_SUFFIXES))
    if pickles:
        raise HFCheckpointError(
            f"{folder} has no {SINGLE_FILE} (only {', '.join(pickles)}). brisk does not load pickle checkpoints "
            "(.bin/.pt): unpickling can run arbitrary code. Convert once, where you trust the file: "
            "transformers.AutoModelForCausalLM.from_pretrained(folder).save_pretrained(folder, "
            "safe_serialization=True)"
        )
    raise HFCheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}: no model weights found")


def _read_safetensors(file: Path, dtype: torch.dtype, fused: FusedBuffers | None,
                      maps: list[torch.Tensor] | None,
                      progress: Callable[[int], None] | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    advance = progress or (lambda n: None)
    try:
        with safe_open(str(file), framework="pt") as f, open(file, "rb") as raw:  # (safe_open checks the header)
            layout = mapped.safetensors_layout(file)
            base = mapped.map_file(file) if maps is not None else None
            used, pending = False, 0
            for name in f.keys():
                if name.endswith(_NON_WEIGHT_SUFFIXES):
                    continue
                stored = layout.get(name)  # (dtype, shape, offset) in the file
                if stored is None:  # a dtype torch has no name for here: safetensors' own reader
                    t = f.get_tensor(name)
                    out[name] = t.to(dtype) if t.is_floating_point() else t
                    continue
                stored_dtype, shape, offset = stored
                if pending:
                    advance(pending)  # the previous tensor is done
                pending = math.prod(shape) * stored_dtype.itemsize
                # Integer tensors (packed quantized weights, index buffers) and quantization scales keep their
                # dtype (a float16 scale rounded to bfloat16 would move every weight of its group); other floating
                # tensors are converted once, here, one at a time, so the model never holds two copies.
                convert = stored_dtype.is_floating_point and not name.endswith((".scales", ".weight_scale"))
                runtime = dtype if convert else stored_dtype
                slot = fused.slot(name, shape) if fused is not None and convert else None
                if slot is None and base is not None and stored_dtype == runtime:
                    t = mapped.view(base, offset, shape, stored_dtype)
                    if t is not None:  # stored as it runs: a view of the file
                        out[name], used = t, True
                        continue
                if slot is not None and stored_dtype == runtime:
                    out[name] = mapped.read_tensor(raw, offset, shape, stored_dtype, out=slot)  # straight in
                    continue
                t = mapped.read_tensor(raw, offset, shape, stored_dtype)
                out[name] = slot.copy_(t) if slot is not None else t.to(runtime)
            if pending:
                advance(pending)
            if used and maps is not None:
                maps.append(base)
    except SafetensorError as e:
        raise HFCheckpointError(
            f"{file} is not a readable safetensors file ({e}); it is probably truncated or corrupt: "
            "download it again"
        ) from e
    return out


def _check_folder(path: str | Path) -> Path:
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if folder.exists():
        raise HFCheckpointError(f"{folder} is a file; expected a Hugging Face model folder (config.json, "
                                "model.safetensors, tokenizer.json, ...)")
    if _HUB_ID.match(str(path)):
        raise HFCheckpointError(
            f"{path!r} is not a local folder. It looks like a Hugging Face hub id, but brisk does not download "
            f"models at run time: download it first (e.g. `huggingface-cli download {path} --local-dir DIR`) "
            "and pass the local folder"
        )
    raise HFCheckpointError(f"model folder {folder} does not exist")


def _read_json(file: Path, required: bool) -> dict[str, Any] | None:
    if not file.is_file():
        if required:
            raise HFCheckpointError(f"{file} not found; a Hugging Face model folder needs it")
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFCheckpointError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise HFCheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _load_tokenizer(
    folder: Path, config: ModelConfig, config_dict: dict[str, Any], generation_config: dict[str, Any]
) -> Tokenizer:
    """Tokenizer with EOS ids = tokenizer's, then generation_config.json's, then config.json's (first wins
    ties): chat models often stop on an end-of-turn token that only generation_config lists."""
    eos: list[int] = []
    for source in (generation_config.get("eos_token_id"), config_dict.get("eos_token_id")):
        eos += [source] if isinstance(source, int) else [i for i in (source or []) if isinstance(i, int)]
    try:
        tokenizer = Tokenizer.from_hf_folder(folder, generation_config={"eos_token_id": eos})
    except FileNotFoundError as e:
        raise HFCheckpointError(f"{e}; brisk needs the tokenizer to generate text") from e
    except ValueError as e:
        raise HFCheckpointError(str(e)) from e
    if not tokenizer.eos_token_ids:
        raise HFCheckpointError(
            f"no end-of-sequence token in {folder} (tokenizer_config.json eos_token, generation_config.json "
            "or config.json eos_token_id): generation would never stop"
        )
    if tokenizer.vocab_size > config.vocab_size:
        raise HFCheckpointError(
            f"tokenizer.json has {tokenizer.vocab_size} tokens but config.json vocab_size is {config.vocab_size}: "
            "the tokenizer does not belong to this model"
        )
    return tokenizer
