"""One small training loop for the speculation heads (spec/medusa.py, spec/eagle.py): the heads train over cached
self-distillation data, never through the target, so this is the trainer's optimizer and schedule (AdamW, linear
warm-up + cosine, gradient clipping; train/trainer.py) without its checkpoints, evaluation or model plumbing.

    for step in range(steps):
        lr = lr_at(step)                               # the trainer's schedule
        idx = randint(num_rows, batch_size)            # seeded: the batch of a step depends on (seed, step) only
        loss, parts = loss_fn(idx, generator)          # the method's loss over those rows (or windows)
        backward; clip_grad_norm_; AdamW.step
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

# loss_fn(row indices [B], generator) -> (scalar loss, float parts to log)
HeadLossFn = Callable[[torch.Tensor, torch.Generator], tuple[torch.Tensor, dict[str, float]]]


def fit_head(module: nn.Module, loss_fn: HeadLossFn, num_rows: int, steps: int, batch_size: int, lr: float,
             seed: int = 0, rows_per_item: int = 1, log: Callable[[str], None] | None = None,
             progress: bool = False) -> list[float]:
    """Fit `module`'s parameters to `loss_fn` over `num_rows` items for `steps` AdamW steps (warm-up over the first
    5%, then cosine to 0.1 x lr); returns the loss of every step. `rows_per_item` only scales the progress bar's
    rows per second (an EAGLE window is many rows)."""
    from brisk.train.progress import TrainProgress
    from brisk.train.trainer import TrainConfig, lr_at, make_optimizer

    if num_rows < 1:
        raise ValueError("no training rows: generate more self-distillation data (--prompts, --max-tokens)")
    config = TrainConfig(max_steps=steps, lr=lr, warmup_steps=max(1, steps // 20), batch_size=batch_size, seed=seed)
    module.requires_grad_(True)
    opt = make_optimizer(module, config)  # type: ignore[arg-type]  # any module: it only reads parameters()
    g = torch.Generator().manual_seed(seed)
    history: list[float] = []
    log_every = max(1, steps // 10)
    t0 = time.perf_counter()
    with TrainProgress(steps, 0, enabled=progress) as bar:
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, config)
            idx = torch.randint(0, num_rows, (batch_size,), generator=g)
            loss, parts = loss_fn(idx, g)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), config.max_grad_norm)
            opt.step()
            history.append(loss.item())
            rate = (step + 1) * batch_size * rows_per_item / max(1e-9, time.perf_counter() - t0)
            bar.update(step + 1, history[-1], rate)
            if log is not None and (step + 1) % log_every == 0:
                shown = "".join(f", {k} {v:.3f}" for k, v in parts.items())
                log(f"step {step + 1}/{steps}: loss {sum(history[-log_every:]) / log_every:.3f}{shown}")
    module.requires_grad_(False)
    return history


def to_draft_ids(tokens: torch.Tensor, draft_vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Token ids -> their index in the sorted `draft_vocab` (the rows of the restricted lm_head); -2 for a token
    outside it (a sure miss of a drafter that only proposes draft_vocab tokens); negative ids are kept."""
    where = torch.full((vocab_size,), -2, dtype=torch.int64)
    where[draft_vocab] = torch.arange(draft_vocab.numel())
    return torch.where(tokens >= 0, where[tokens.clamp_min(0)], tokens)
