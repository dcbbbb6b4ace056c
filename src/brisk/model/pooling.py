"""What a model's files say about turning its hidden states into one embedding: the pooling and Matryoshka sizes.

    an HF folder   sentence-transformers' modules.json naming a Pooling module, whose folder's config.json sets
                   one of pooling_mode_lasttoken / pooling_mode_mean_tokens / pooling_mode_cls_token; a Normalize
                   module after it; config.json's matryoshka_dimensions (or is_matryoshka: any size)
    a GGUF file    {arch}.pooling_type: 1 mean, 2 cls, 3 last (llama.cpp's enum; 0 none and 4 rank say nothing)

Where they say nothing the caller picks (engine/pooling.py: last, as vLLM and llama.cpp pool causal models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_TYPES = ("last", "mean", "cls")

# sentence-transformers' Pooling config keys, in the order they are looked at
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


@dataclass(frozen=True)
class ModelPooling:
    pooling: str | None = None  # last | mean | cls; None: the files do not say
    normalize: bool | None = None  # a sentence-transformers Normalize module (None: not said)
    # Matryoshka: the sizes an embedding may be truncated to (None: none; an empty tuple: any size)
    matryoshka_dimensions: tuple[int, ...] | None = None

    def allows_dimensions(self, dimensions: int) -> bool:
        dims = self.matryoshka_dimensions
        return dims is not None and (not dims or dimensions in dims)


def read_model_pooling(path: str | Path) -> ModelPooling:
    """The pooling a model's files state (see the module docstring); ModelPooling() where they state none."""
    path = Path(path)
    if path.is_dir():
        return _from_folder(path)
    if path.is_file():
        from brisk.model.loader import is_gguf

        if is_gguf(path):
            return _from_gguf(path)
    return ModelPooling()


def _from_folder(path: Path) -> ModelPooling:
    pooling, normalize = None, None
    modules = _read_json(path / "modules.json")
    if isinstance(modules, list):
        for module in modules:
            if not isinstance(module, dict):
                continue
            kind = str(module.get("type", ""))
            if kind.endswith(".Pooling"):
                cfg = _read_json(path / str(module.get("path", "")) / "config.json") or {}
                pooling = next((mode for key, mode in _ST_MODES.items() if cfg.get(key)), None)
            elif kind.endswith(".Normalize"):
                normalize = True
        if normalize is None and any(isinstance(m, dict) for m in modules):
            normalize = False
    config = _read_json(path / "config.json") or {}
    dims: tuple[int, ...] | None = None
    if isinstance(config.get("matryoshka_dimensions"), list):
        dims = tuple(int(d) for d in config["matryoshka_dimensions"])
    elif config.get("is_matryoshka"):
        dims = ()
    return ModelPooling(pooling, normalize, dims)


def _from_gguf(path: Path) -> ModelPooling:
    from brisk.model.gguf import read_gguf

    md = read_gguf(path).metadata
    value = md.get(f"{md.get('general.architecture')}.pooling_type")
    return ModelPooling(_GGUF_POOLING.get(int(value)) if isinstance(value, int) else None)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
