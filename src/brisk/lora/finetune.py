"""One LoRA / QLoRA run: load, prepare the base, add adapters, train (train/trainer.py), write PEFT's folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from brisk.console import peak_rss_bytes
from brisk.lora.adapter import parse_target_modules
from brisk.lora.data import load_training_data
from brisk.lora.train import (
    adapter_of,
    adapter_params,
    add_adapters,
    check_lora_trainable,
    make_lora_loss,
    prepare_base,
    save_adapter_output,
)
from brisk.model.loader import LoadedModel
from brisk.train.data import TextWindows
from brisk.train.trainer import TrainConfig, train


@torch.no_grad()
def held_out_loss(loaded: LoadedModel, data: TextWindows, max_rows: int = 64) -> float:
    """Mean labelled-token cross-entropy over (up to max_rows of) a held-out set, in nats."""
    loss_fn = make_lora_loss()
    n = min(max_rows, data.num_windows)
    total, count = 0.0, 0
    for s in range(0, n, 8):
        rows = data.windows[s:min(n, s + 8)]
        loss, parts = loss_fn(loaded.model, rows)
        k = parts["tokens"]
        total += float(loss) * k
        count += k
    return round(total / max(count, 1), 5)


def finetune_lora(model: str, out: str | Path, data_path: str, config: TrainConfig, *, rank: int, alpha: float,
                  dropout: float, use_rslora: bool, target_modules: str, base: str, seq_len: int = 256,
                  eval_data: str | None = None, resume: bool = False) -> dict[str, Any]:
    """Train adapters for `model` on `data_path`; write them to `out`; return the training record."""
    from brisk.model.hugepages import bound_heap_retention
    from brisk.model.loader import is_gguf, load_model, resolve_model

    bound_heap_retention()  # from the load on (the trainer sets it too): the held-out pass's temporaries go back
    out = Path(out)
    targets = parse_target_modules(target_modules)
    # a quantized base from a GGUF file: load it in its own precision and convert one layer at a time (the float
    # decoder, 4x the file, is never held whole); a float base dequantizes at load as before
    streamed = base != "float" and is_gguf(resolve_model(model))
    loaded = load_model(model, fuse=False, sparse=False, keep_quantized=streamed)
    check_lora_trainable(loaded.config)
    base_info = prepare_base(loaded, base, requantize=streamed)
    paths = add_adapters(loaded.model, targets, rank, alpha, dropout, seed=config.seed, use_rslora=use_rslora)
    data = load_training_data(data_path, loaded.tokenizer, seq_len, config.seed)
    eval_set = None if eval_data is None else load_training_data(eval_data, loaded.tokenizer, data.seq_len, 0)
    eval_before = None if eval_set is None or resume else held_out_loss(loaded, eval_set)
    trainable = adapter_params(loaded.model)
    frozen = tuple(n for n, _ in loaded.model.named_parameters() if n not in trainable)
    method = {"method": "lora", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout, "use_rslora": use_rslora,
              "target_modules": targets, "base": base}

    def tensors_of(m: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.detach().contiguous() for n, p in adapter_params(m).items()}

    def save_model(o: Path, ld: LoadedModel, record: dict[str, Any]) -> Path:
        adapter = adapter_of(ld.model, targets, rank, alpha, dropout, use_rslora, ld.name)
        record.update(base_info, num_adapted_modules=len(paths),
                      trainable_parameters=sum(p.numel() for p in trainable.values()))
        if eval_set is not None:
            record["eval_loss_before"] = eval_before
            record["eval_loss_after"] = held_out_loss(ld, eval_set)

        record["peak_rss_bytes"] = peak_rss_bytes()  # the process's high-water mark: load, conversion, training
        return save_adapter_output(o, ld, record, adapter=adapter)

    result = train(loaded, make_lora_loss(config.activation_checkpointing), data, config, out, method=method,
                   resume=resume, frozen=frozen, save_model=save_model, state_tensors=tensors_of)
    return {k: v for k, v in result.record.items()}

