"""`brisk finetune MODEL OUT --data FILE`: LoRA / QLoRA adapters on a frozen base, written in PEFT's format."""

from __future__ import annotations

import time
from pathlib import Path

import click

from brisk.train.options import activation_checkpointing_option, optimizer_options, run_options


@click.command("finetune")
@click.argument("model")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--data", required=True, type=click.Path(dir_okay=False),
              help="Training data: chat JSONL ({\"messages\": [...]}, loss on the assistant turns) or plain text.")
@click.option("--eval-data", type=click.Path(dir_okay=False), default=None,
              help="Held-out data in the same format: its loss is measured before and after training.")
@click.option("--lora-rank", type=int, default=8, show_default=True, help="Adapter rank r.")
@click.option("--lora-alpha", type=float, default=16.0, show_default=True, help="Scaling alpha (update * alpha / r).")
@click.option("--lora-dropout", type=float, default=0.0, show_default=True, help="Dropout on the adapters' input.")
@click.option("--use-rslora", is_flag=True, help="Scale by alpha / sqrt(r) (rsLoRA) instead of alpha / r.")
@click.option("--target-modules", default="q,k,v,o,gate,up,down", show_default=True,
              help="Projections to adapt: q,k,v,o,gate,up,down (or PEFT's names, or all-linear).")
@click.option("--qlora", is_flag=True, help="QLoRA: the base in NF4 (groups of 64) with double-quantized scales.")
@click.option("--base", "base", type=click.Choice(["nf4", "int4", "int8", "float"]), default=None,
              help="The frozen base's format (default float; nf4 with --qlora). A quantized MODEL keeps its codes.")
@optimizer_options(steps=100, lr=2e-4, batch_help="Examples per micro-batch.",
                   seq_len_help="Tokens per example / window.")
@activation_checkpointing_option
@run_options
def finetune(model: str, out: Path, data: str, eval_data: str | None, lora_rank: int, lora_alpha: float,
             lora_dropout: float, use_rslora: bool, target_modules: str, qlora: bool, base: str | None, steps: int,
             batch_size: int, grad_accum: int, seq_len: int, lr: float, warmup_steps: int, weight_decay: float,
             max_grad_norm: float, activation_checkpointing: bool, checkpoint_every: int, seed: int, resume: bool,
             force: bool) -> None:
    """Train LoRA adapters for MODEL on --data; write the adapter folder OUT (PEFT's format).

    Serve it with: brisk serve --enable-lora --lora-modules NAME=OUT
    """
    from brisk.lora.adapter import AdapterError
    from brisk.lora.finetune import finetune_lora
    from brisk.train.checkpoint import TrainCheckpointError
    from brisk.train.data import TrainDataError
    from brisk.train.trainer import TrainConfig

    if qlora and base not in (None, "nf4"):
        raise click.ClickException(f"--qlora is the NF4 base; it contradicts --base {base}")
    if not resume and not force and ((out / "adapter_config.json").exists() or (out / "last").exists()):
        raise click.ClickException(f"{out} already holds a run; pass --resume to continue it, --force to start over")
    for path, what in ((data, "--data"), (eval_data, "--eval-data")):
        if path is not None and not Path(path).is_file():
            raise click.ClickException(f"{what} {path} does not exist")
    start = time.perf_counter()
    try:
        config = TrainConfig(max_steps=steps, batch_size=batch_size, grad_accum=grad_accum, lr=lr,
                             warmup_steps=warmup_steps, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                             activation_checkpointing=activation_checkpointing, checkpoint_every=checkpoint_every,
                             seed=seed)
        r = finetune_lora(model, out, data, config, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout,
                          use_rslora=use_rslora, target_modules=target_modules,
                          base="nf4" if qlora else (base or "float"), seq_len=seq_len, eval_data=eval_data,
                          resume=resume)
    except (AdapterError, TrainDataError, TrainCheckpointError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {out}: {r['steps']} steps, {r['tokens']:,} tokens in {r['seconds']:.1f} s (total "
               f"{time.perf_counter() - start:.1f} s); base {r['base']}; loss {r['first_loss']:.4f} -> "
               f"{r['last_loss']:.4f}; held-out loss {r.get('eval_loss_before')} -> {r.get('eval_loss_after')}; "
               f"peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB")
