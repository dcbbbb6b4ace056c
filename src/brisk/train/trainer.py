"""One trainer for everything brisk trains: a model, a loss, a data source; AdamW, warm-up + cosine, checkpoints.

    for step in range(start, max_steps):            # an optimizer step
        lr = lr_at(step)                            # linear warm-up, then cosine decay to min_lr_ratio * lr
        for micro in range(grad_accum):             # micro-batches of batch_size windows
            loss_fn(model, data.batch(sample_index, batch_size)).backward()  # / grad_accum
        clip_grad_norm_; AdamW.step
        log; evaluate every eval_every; save out/last/ every checkpoint_every

Determinism: there is no randomness in a step (no dropout) and the batch of a step is a pure function of
(seed, step) (data.py), so the same seed gives the same weights, and a run resumed from out/last/ (weights,
AdamW moments, step, history) gives bit for bit the weights of the uninterrupted run.

Ctrl-C: the first one finishes the current optimizer step, saves out/last/ and the model folder, and returns
(`TrainResult.interrupted`); a second one stops at once, leaving the last saved checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from brisk.eval.ppl import perplexity
from brisk.model.hugepages import bound_heap_retention
from brisk.model.llama import LlamaForCausalLM
from brisk.model.loader import LoadedModel
from brisk.train.checkpoint import STATE_DIR, check_same_run, load_state, save_state, save_trained
from brisk.train.data import TextWindows
from brisk.train.forward import check_trainable

# loss_fn(model, input_ids [B, T]) -> (scalar loss to minimise, float metrics to log)
LossFn = Callable[[LlamaForCausalLM, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]

# settings that do not change the weights a run produces: they may differ between a run and its resumption
_CADENCE = ("eval_every", "checkpoint_every", "eval_windows", "eval_window", "progress")


@dataclass
class TrainConfig:
    max_steps: int
    batch_size: int = 4  # windows per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 0
    weight_decay: float = 0.0  # AdamW decoupled decay, on matrices only (not norms or biases)
    beta1: float = 0.9
    beta2: float = 0.95
    max_grad_norm: float | None = 1.0  # None: no clipping (the norm is still logged)
    activation_checkpointing: bool = False
    keep_sparsity: bool = False  # weights of the decoder's linear layers that are zero at the start stay zero
    bf16_autocast: bool = False  # matmuls in bfloat16 (pays on CPUs with AVX512-BF16 / AMX), master weights float32
    eval_every: int = 0  # optimizer steps between held-out evaluations; 0: before and after training only
    eval_windows: int = 4  # held-out windows per evaluation
    eval_window: int = 512  # tokens per held-out window
    checkpoint_every: int = 50  # optimizer steps between saves of out/last/ (it is also saved at the end)
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum", "eval_windows", "eval_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be 0 or more, got {self.weight_decay}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive (or None for no clipping), got {self.max_grad_norm}")

    def run_settings(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in _CADENCE}


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up over warmup_steps, then a cosine from lr
    down to lr * min_lr_ratio at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = config.max_steps - config.warmup_steps
    progress = (step - config.warmup_steps) / max(decay_steps - 1, 1)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


@dataclass
class TrainResult:
    out: Path
    steps: int  # optimizer steps done, over all resumptions
    interrupted: bool
    record: dict[str, Any]  # what was written under config.json["training"]
    history: list[dict[str, Any]] = field(default_factory=list)


def sparsity_masks(model: LlamaForCausalLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, nonzero mask) of each trainable decoder linear weight with zeros in it (a pruned checkpoint):
    the trainer multiplies the weight by its mask after every optimizer step, so the pruned weights stay pruned
    (their gradients are not zero, and AdamW would fill them in) and the result keeps its sparsity pattern."""
    out = []
    for name, p in model.model.layers.named_parameters():
        if p.requires_grad and p.dim() == 2 and not name.endswith("norm.weight"):
            mask = p.detach() != 0
            if not bool(mask.all()):
                out.append((p, mask))
    return out


def zero_fraction(model: LlamaForCausalLM) -> float:
    """The share of exact zeros among the decoder's linear weights (a pruned model's sparsity)."""
    zeros = total = 0
    for name, p in model.model.layers.named_parameters():
        if p.dim() == 2 and not name.endswith("norm.weight"):
            zeros += int((p == 0).sum())
            total += p.numel()
    return zeros / max(total, 1)


def make_optimizer(model: LlamaForCausalLM, config: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]  # parameters() lists a tied weight once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: the per-tensor loop, whose float arithmetic does not depend on how tensors are grouped
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), foreach=False)


class _Interrupt:
    """The first SIGINT sets a flag (the step finishes and is saved); the second raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Interrupt]:
        try:
            previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: Ctrl-C stays the plain KeyboardInterrupt
            yield self
            return
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def evaluate(loaded: LoadedModel, text: str | None, config: TrainConfig) -> float | None:
    """Held-out perplexity under `brisk eval ppl`'s protocol (eval/ppl.py), or None without an eval text."""
    if text is None:
        return None
    return perplexity(loaded, text, window=config.eval_window, max_windows=config.eval_windows, progress=False).ppl


def train(loaded: LoadedModel, loss_fn: LossFn, data: TextWindows, config: TrainConfig, out: str | Path, *,
          method: dict[str, Any], eval_text: str | None = None, eval_source: str | None = None,
          resume: bool = False, frozen: tuple[str, ...] = (),
          save_model: Callable[[Path, LoadedModel, dict[str, Any]], Path] | None = None,
          state_tensors: Callable[[LlamaForCausalLM], dict[str, torch.Tensor]] | None = None) -> TrainResult:
    """Train `loaded.model` in place on `data` under `loss_fn`; write the model folder and the logs to `out`.

    `method` describes what is trained (e.g. {"method": "distill", "teacher": ..., "alpha": ...}); it goes into
    the training record and must match on resume, as must every setting of `config` that changes the weights.
    `frozen` names parameters (as in named_parameters()) that keep their values.
    `save_model` writes the finished run instead of save_trained (LoRA: the adapter folder), and `state_tensors`
    picks what out/last/ keeps of the model (LoRA: the adapters only).
    """
    from brisk.train.progress import TrainProgress, write_loss_curve

    out = Path(out)
    model = loaded.model
    check_trainable(model)
    bound_heap_retention()  # freed activations go back to the kernel, not into the heap's high-water mark
    if data.seq_len > model.config.max_position_embeddings:
        raise ValueError(f"seq_len {data.seq_len} is longer than the model's max_position_embeddings "
                         f"({model.config.max_position_embeddings})")
    model.requires_grad_(True)
    names = dict(model.named_parameters())
    unknown = [n for n in frozen if n not in names]
    assert not unknown, f"frozen names no parameter of the model: {unknown[:3]}"
    for n in frozen:
        names[n].requires_grad_(False)
    optimizer = make_optimizer(model, config)
    masks = sparsity_masks(model) if config.keep_sparsity else []
    settings = {**config.run_settings(), **method, "text": data.source, "seq_len": data.seq_len,
                "num_windows": data.num_windows}
    start_step, history, seconds = 0, [], 0.0
    if resume:
        state = load_state(out, model, state_tensors)
        check_same_run(state["settings"], settings, out / STATE_DIR)
        optimizer.load_state_dict(state["optimizer"])
        start_step, history, seconds = state["step"], state["history"], state["seconds"]
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train_log.jsonl"
    if not resume:
        log_path.write_text("")
        ppl = evaluate(loaded, eval_text, config)  # also fails early on an eval text shorter than one window
        if ppl is not None:
            history.append({"step": 0, "eval_ppl": ppl})
            _log(log_path, history[-1])
    tokens_per_step = config.batch_size * config.grad_accum * data.seq_len
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if config.bf16_autocast
                else contextlib.nullcontext())
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def save() -> None:
        save_state(out, model, {"step": step, "optimizer": optimizer.state_dict(), "history": history,
                                "seconds": seconds, "settings": settings}, state_tensors)

    step = start_step
    interrupted = False
    with _Interrupt().installed() as interrupt, TrainProgress(config.max_steps, start_step, config.progress) as bar:
        while step < config.max_steps:
            t0 = time.perf_counter()
            lr = lr_at(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad(set_to_none=True)
            total, metrics = 0.0, {}
            for micro in range(config.grad_accum):
                ids = data.batch((step * config.grad_accum + micro) * config.batch_size, config.batch_size)
                with autocast:
                    loss, parts = loss_fn(model, ids)
                (loss / config.grad_accum).backward()
                total += float(loss.detach()) / config.grad_accum
                for k, v in parts.items():
                    metrics[k] = metrics.get(k, 0.0) + v / config.grad_accum
            max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
            optimizer.step()
            with torch.no_grad():
                for weight, mask in masks:
                    weight.mul_(mask)
            step += 1
            dt = time.perf_counter() - t0
            seconds += dt
            history.append({"step": step, "loss": total, **metrics, "lr": lr, "grad_norm": grad_norm,
                            "tokens": step * tokens_per_step, "seconds": seconds})
            _log(log_path, history[-1])
            if config.eval_every and step % config.eval_every == 0 and step < config.max_steps:
                history.append({"step": step, "eval_ppl": evaluate(loaded, eval_text, config)})
                _log(log_path, history[-1])
            bar.update(step, total, tokens_per_step / dt)
            if interrupt.requested:
                interrupted = True
                break
            if config.checkpoint_every and step % config.checkpoint_every == 0 and step < config.max_steps:
                save()
    save()
    if not interrupted:
        ppl = evaluate(loaded, eval_text, config)
        if ppl is not None:
            history.append({"step": step, "eval_ppl": ppl})
            _log(log_path, history[-1])
    model.requires_grad_(False)
    losses = [h["loss"] for h in history if "loss" in h]
    evals = [h["eval_ppl"] for h in history if h.get("eval_ppl") is not None]
    record = {**method, "source_model": loaded.name, "text": data.source, "seq_len": data.seq_len,
              "eval_text": eval_source, "eval_window": config.eval_window, "eval_windows": config.eval_windows,
              "steps": step, "max_steps": config.max_steps, "tokens": step * tokens_per_step,
              "seconds": round(seconds, 3), "interrupted": interrupted,
              "kept_zeros": sum(int((~m).sum()) for _, m in masks) if config.keep_sparsity else None,
              "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
              "eval_ppl_before": evals[0] if evals else None, "eval_ppl_after": evals[-1] if len(evals) > 1 else None,
              "config": config.run_settings()}
    (save_model or save_trained)(out, loaded, record)
    record["loss_curve"] = write_loss_curve(out / "loss.png", history)
    return TrainResult(out=out, steps=step, interrupted=interrupted, record=record, history=history)


def _log(path: Path, entry: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(entry) + "\n")
