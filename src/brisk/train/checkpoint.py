"""What a training run writes: the resumable state (OUT/last/) and the finished model (OUT itself).

    OUT/
      config.json, model.safetensors, tokenizer files, generation_config.json   an ordinary brisk checkpoint:
                                                        `brisk generate --model OUT` loads it with no flags
      config.json["training"]                           the training record (method, data, steps, tokens,
                                                        time, losses); also written alone as training.json
      train_log.jsonl                                   one JSON object per optimizer step and per evaluation
      loss.png                                          the loss curve (when matplotlib is installed)
      last/model.safetensors, last/trainer.pt           the resumable state: weights, AdamW moments, step,
                                                        history and the settings they were made under

`last/` is replaced atomically (written to last.tmp, then renamed), so an interrupted save leaves the previous
state whole.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from brisk.model.llama import LlamaForCausalLM
from brisk.model.loader import LoadedModel
from brisk.model.save import model_tensors

TRAINING_KEY = "training"
STATE_DIR = "last"
_STATE_FILE = "trainer.pt"
_WEIGHTS_FILE = "model.safetensors"
_FORMAT = 1


class TrainCheckpointError(ValueError):
    """A resume checkpoint is missing, corrupt, or was made by a run with other settings."""


def save_state(out: Path, model: LlamaForCausalLM, state: dict[str, Any],
               tensors_of: Callable[[LlamaForCausalLM], dict[str, torch.Tensor]] | None = None) -> Path:
    """Write the resumable state (weights + `state`: step, optimizer, history, settings) to out/last/."""
    final = out / STATE_DIR
    tmp = out / (STATE_DIR + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    own = model_tensors(model, model.config) if tensors_of is None else tensors_of(model)
    save_file(own, str(tmp / _WEIGHTS_FILE), metadata={"format": "pt"})
    torch.save({"format": _FORMAT, **state}, tmp / _STATE_FILE)
    old = out / (STATE_DIR + ".old")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)
    return final


def load_state(out: Path, model: LlamaForCausalLM,
               tensors_of: Callable[[LlamaForCausalLM], dict[str, torch.Tensor]] | None = None) -> dict[str, Any]:
    """Read out/last/ into `model`'s parameters (in place) and return the saved state dict."""
    folder = out / STATE_DIR
    if not (folder / _STATE_FILE).is_file() or not (folder / _WEIGHTS_FILE).is_file():
        raise TrainCheckpointError(f"no training checkpoint to resume from in {folder} (it needs {_WEIGHTS_FILE} "
                                   f"and {_STATE_FILE}); run without --resume to start from the beginning")
    try:
        state = torch.load(folder / _STATE_FILE, weights_only=True)
        tensors = load_file(str(folder / _WEIGHTS_FILE))
    except (SafetensorError, RuntimeError, EOFError, OSError, ValueError) as e:
        raise TrainCheckpointError(f"the training checkpoint in {folder} is corrupt ({e}); delete {folder} and "
                                   "run without --resume to start over") from e
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise TrainCheckpointError(f"{folder / _STATE_FILE} is not a brisk training state (format {_FORMAT})")
    own = model_tensors(model, model.config) if tensors_of is None else tensors_of(model)
    if set(own) != set(tensors) or any(tuple(own[k].shape) != tuple(tensors[k].shape) for k in own):
        raise TrainCheckpointError(f"the weights in {folder} do not fit this model (another architecture or size); "
                                   "resume with the model the run started from")
    params = dict(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value)
    return state


def check_same_run(saved: Mapping[str, Any], current: Mapping[str, Any], folder: Path) -> None:
    """A resumed run must have the settings of the run that wrote the checkpoint, or it is another run."""
    diffs = [f"{k}: {saved.get(k)!r} then, {current.get(k)!r} now" for k in sorted(set(saved) | set(current))
             if saved.get(k) != current.get(k)]
    if diffs:
        raise TrainCheckpointError(f"the checkpoint in {folder} was made with other settings ({'; '.join(diffs)}); "
                                   "resume with the same settings, or start a new run in another folder")


def save_trained(out: Path, loaded: LoadedModel, record: dict[str, Any]) -> Path:
    """Write the trained model as an ordinary checkpoint folder, with `record` under config.json["training"]."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(model_tensors(loaded.model, loaded.config), str(out / _WEIGHTS_FILE),
              metadata={"format": "pt", "training": "brisk"})
    loaded.tokenizer.save(out, loaded.generation_config)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    config_dict = loaded.config.to_hf_dict()
    config_dict[TRAINING_KEY] = record
    # config.json last: a folder with a config.json is a finished checkpoint
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    return out
