"""`brisk distill TEACHER STUDENT_INIT OUT`: a student learns the teacher's distribution on a text."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import click

from brisk.data import calibration_text_path, evaluation_text_path
from brisk.train.options import activation_checkpointing_option, optimizer_options, run_options


@click.command("distill")
@click.argument("teacher")
@click.argument("student_init")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--text", type=click.Path(dir_okay=False), default=str(calibration_text_path()),
              show_default="the bundled calibration text, Emma", help="UTF-8 training text.")
@click.option("--eval-text", type=click.Path(dir_okay=False), default=str(evaluation_text_path()),
              show_default="the bundled held-out text, Sense and Sensibility",
              help="Held-out text for perplexity before, during and after (never the training text).")
@optimizer_options(steps=200, lr=5e-5, batch_help="Windows per micro-batch.",
                   seq_len_help="Tokens per training window.")
@click.option("--alpha", type=float, default=0.5, show_default=True, help="Weight of the KL term (1 - alpha: CE).")
@click.option("--temperature", type=float, default=2.0, show_default=True)
@click.option("--hidden-weight", type=float, default=0.0, show_default=True,
              help="Weight of hidden-state matching on mapped layers (0: off; needs equal hidden sizes).")
@click.option("--generations", type=int, default=0, show_default=True,
              help="Also train on the teacher's greedy answers to this many chat prompts cut from --text "
                   "(self-distillation: what a draft model will be asked to predict). Kept in OUT for reuse.")
@click.option("--generation-tokens", type=int, default=128, show_default=True,
              help="Longest teacher answer of --generations, in tokens.")
@click.option("--draft-vocab", type=int, default=0, show_default=True,
              help="Write OUT/draft_vocab.safetensors: the N most frequent tokens of the training data (the "
                   "teacher's answers weigh as much as the text). As a draft (--speculative draft:OUT) the model "
                   "then computes logits for those tokens only. 0: none.")
@activation_checkpointing_option
@click.option("--bf16", "bf16_autocast", is_flag=True, help="bfloat16 autocast (pays on AVX512-BF16 / AMX CPUs).")
@click.option("--keep-sparsity/--no-keep-sparsity", default=None,
              help="Keep the student's zero weights zero (a pruned student keeps its pattern). Default: on when "
                   "at least 1% of the student's decoder linear weights are zero.")
@click.option("--eval-every", type=int, default=0, show_default=True, help="Steps between evaluations (0: ends).")
@click.option("--eval-windows", type=int, default=4, show_default=True, help="Held-out windows per evaluation.")
@click.option("--eval-window", type=int, default=512, show_default=True, help="Tokens per held-out window.")
@run_options
def distill(teacher: str, student_init: str, out: Path, text: str, eval_text: str, steps: int, batch_size: int,
            grad_accum: int, seq_len: int, lr: float, warmup_steps: int, weight_decay: float, max_grad_norm: float,
            alpha: float, temperature: float, hidden_weight: float, generations: int, generation_tokens: int,
            draft_vocab: int, activation_checkpointing: bool,
            bf16_autocast: bool, keep_sparsity: bool | None, eval_every: int, eval_windows: int, eval_window: int,
            checkpoint_every: int, seed: int, resume: bool, force: bool) -> None:
    """Distill TEACHER into a student initialised from STUDENT_INIT; write the student folder OUT.

    STUDENT_INIT: a float checkpoint sharing the teacher's tokenizer (e.g. a structured-pruned teacher), or
    'every:K' / 'layers:I,J,...' for a shallower copy of the teacher made of those teacher layers (a draft).
    OUT loads with no flags: brisk generate --model OUT.
    """
    from brisk.model.loader import load_model
    from brisk.spec.vocab import save_vocab
    from brisk.train.checkpoint import TrainCheckpointError
    from brisk.train.data import TextWindows, TrainDataError
    from brisk.train.distill import (
        DistillError,
        cached_generations,
        check_hidden_sizes,
        check_same_tokenizer,
        default_layer_map,
        draft_vocabulary,
        make_distill_loss,
        parse_layers,
        teacher_layers_student,
    )
    from brisk.train.trainer import TrainConfig, train, zero_fraction

    if not resume and not force and ((out / "config.json").exists() or (out / "last").exists()):
        raise click.ClickException(f"{out} already holds a run; pass --resume to continue it, --force to start over")
    for path, what in ((text, "--text"), (eval_text, "--eval-text")):
        if not Path(path).is_file():
            raise click.ClickException(f"{what} {path} does not exist")
    try:
        config = TrainConfig(max_steps=steps, batch_size=batch_size, grad_accum=grad_accum, lr=lr,
                             warmup_steps=warmup_steps, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                             activation_checkpointing=activation_checkpointing, bf16_autocast=bf16_autocast,
                             eval_every=eval_every, eval_windows=eval_windows, eval_window=eval_window,
                             checkpoint_every=checkpoint_every, seed=seed)
        start = time.perf_counter()
        t = load_model(teacher, fuse=False)
        layers = None
        if student_init.startswith(("every:", "layers:")):
            layers = parse_layers(student_init, t.config.num_hidden_layers)
            s = teacher_layers_student(t, layers)
        else:
            s = load_model(student_init, fuse=False)
        check_same_tokenizer(t, s)
        zeros = zero_fraction(s.model)
        if keep_sparsity is None:
            keep_sparsity = zeros >= 0.01
        if keep_sparsity:
            click.echo(f"keeping the student's zeros ({zeros:.1%} of its decoder linear weights) zero", err=True)
        config = dataclasses.replace(config, keep_sparsity=keep_sparsity)
        layer_map = None
        if hidden_weight:
            check_hidden_sizes(t, s)
            layer_map = default_layer_map(s.config.num_hidden_layers, t.config.num_hidden_layers, layers)
        loss_fn = make_distill_loss(t.model, alpha, temperature, hidden_weight, layer_map, activation_checkpointing)
        data = TextWindows.from_file(text, s.tokenizer, seq_len, seed)
        answers = cached_generations(out, t, text, generations, generation_tokens) if generations else []
        if draft_vocab:
            save_vocab(out, draft_vocabulary([data.windows], answers, t.config.vocab_size, draft_vocab,
                                             t.tokenizer.eos_token_ids))
        if answers:
            data = data.joined(TextWindows.from_ids([i for a in answers for i in a], seq_len, seed,
                                                    f"{len(answers)} teacher answers"))
        method = {"method": "distill", "teacher": t.name, "student_init": student_init if layers else s.name,
                  "student_layers": layers, "alpha": alpha, "temperature": temperature,
                  "hidden_weight": hidden_weight, "generations": generations,
                  "generation_tokens": generation_tokens if generations else None, "draft_vocab": draft_vocab or None}
        result = train(s, loss_fn, data, config, out, method=method,
                       eval_text=Path(eval_text).read_text(encoding="utf-8"), eval_source=Path(eval_text).name,
                       resume=resume)
    except (DistillError, TrainDataError, TrainCheckpointError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    r = result.record
    state = "interrupted; continue with --resume" if result.interrupted else "done"
    click.echo(f"wrote {out} ({state}): {r['steps']} steps, {r['tokens']:,} tokens in {r['seconds']:.1f} s "
               f"(total {time.perf_counter() - start:.1f} s); loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}; "
               f"held-out ppl {r['eval_ppl_before']} -> {r['eval_ppl_after']}")
