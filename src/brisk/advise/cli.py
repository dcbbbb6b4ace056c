"""`brisk advise MODEL`: the configuration to run MODEL in, for a memory budget, a goal and a quality budget."""

from __future__ import annotations

from pathlib import Path

import click

from brisk.advise.advisor import GOALS, MEMORY_SCOPES
from brisk.console import stderr_console, write_json


@click.command("advise")
@click.argument("model", default="default")
@click.option("--memory", "memory_text", default=None,
              help="Memory budget, e.g. 8GiB, 512MiB, or a share of the memory available now, 0.5 or 50% (as "
                   "--kv-cache-memory reads one; default: all of it).")
@click.option("--memory-scope", type=click.Choice(MEMORY_SCOPES), default="process", show_default=True,
              help="What --memory bounds: the whole process's peak RSS (Python, torch and brisk included), or the "
                   "engine's own memory (weights, KV pool, one step's activations).")
@click.option("--goal", type=click.Choice(GOALS), default="latency", show_default=True,
              help="latency: fastest batch-1 decode; throughput: most tokens/s over --concurrency sequences.")
@click.option("--max-ppl-increase", "max_ppl", default="2%", show_default=True,
              help="Largest perplexity increase over float32 accepted, on held-apart text (2% or 0.02).")
@click.option("--context", type=int, default=4096, show_default=True,
              help="Tokens per sequence (prompt + output). Past the model's trained positions only StreamingLLM "
                   "candidates (--kv-policy streaming) are ranked.")
@click.option("--concurrency", type=int, default=None,
              help="Sequences running together (default: 1 for latency, 32 for throughput).")
@click.option("--measure-quality", is_flag=True,
              help="Measure every technique's perplexity on this model now (minutes) instead of the stored table "
                   "(the default model only).")
@click.option("--validate", is_flag=True,
              help="Build and run the top three for --validate-seconds each and re-rank on measurement.")
@click.option("--validate-seconds", type=float, default=60.0, show_default=True)
@click.option("--validate-top", "validate_top_n", type=int, default=3, show_default=True,
              help="How many of the ranked candidates --validate runs.")
@click.option("--membw", "membw_gbps", type=float, default=None,
              help="Read bandwidth in GB/s for the roofline (default: measure a quick one).")
@click.option("--top", type=int, default=12, show_default=True, help="Rows of the ranked table.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every candidate, the calibration and the commands to this file.")
def advise_command(model: str, memory_text: str | None, memory_scope: str, goal: str, max_ppl: str, context: int,
                   concurrency: int | None, measure_quality: bool, validate: bool, validate_seconds: float,
                   validate_top_n: int, membw_gbps: float | None, top: int, json_path: str | None) -> None:
    """Choose a configuration for MODEL ('default' = SmolLM2-135M-Instruct): weight format, KV cache dtype and
    policy (full or StreamingLLM), speculative decoding, sparsity, step budget; ranked by predicted speed among
    those that fit --memory and --max-ppl-increase, with the commands that run the first."""
    from rich.console import Console
    from rich.table import Table

    from brisk.advise.advisor import advise, fmt_pct, parse_percent
    from brisk.advise.memory import gib
    from brisk.engine.config import memory_budget
    from brisk.engine.memory import available_memory

    budget_ppl = parse_percent(max_ppl)
    if memory_text is None:
        budget, _ = available_memory()
    else:
        try:
            budget = memory_budget(memory_text)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--memory must be a size like 8GiB or 512MiB or a share like 50%, got "
                             f"{memory_text!r}") from e
    if validate_seconds <= 0:
        raise ValueError(f"--validate-seconds must be positive, got {validate_seconds}")
    console = stderr_console()
    result = advise(None if model == "default" else model, budget, goal, budget_ppl, context, concurrency,
                    measure_quality=measure_quality, validate=validate, validate_seconds=validate_seconds,
                    read_gbps=membw_gbps, memory_scope=memory_scope, validate_top_n=validate_top_n,
                    log=lambda m: console.print(f"[dim]{m}"))
    figure = "tok/s b=1" if goal == "latency" else f"tok/s x{result.concurrency}"
    cal = result.calibration
    scope = "" if memory_scope == "process" else " for the engine"
    table = Table(title=f"brisk advise {result.model}: goal {goal}, {gib(budget)}{scope}, ppl within "
                        f"+{100 * budget_ppl:.2f}%, {result.concurrency} x {result.context} tokens",
                  title_justify="left")
    cols = ["#", "weights", "KV", "speculative", "memory", "ppl", f"predicted {figure}", "prefill tok/s"]
    if result.validated:
        cols.append(f"measured {figure}")
    for col in cols:
        table.add_column(col, justify="left" if col in ("weights", "KV", "speculative") else "right")
    for i, c in enumerate(result.ranked[:top], 1):
        pred = c.figure_predicted(goal)
        kv = c.kv_cache_dtype if c.stream_budget is None else f"{c.kv_cache_dtype}, streaming {c.stream_budget}"
        row = [str(i), c.precision.label, kv, c.speculative or "-", gib(c.charged(memory_scope)),
               fmt_pct(c.quality), f"{pred:.0f}", f"{c.prediction.prefill_tok_s:.0f}"]
        if result.validated:
            row.append("-" if c.measured is None else f"{c.measured['tok_s']:.0f}")
        table.add_row(*row)
    Console(width=max(Console().width, 130)).print(table)
    click.echo(f"quality costs: {result.quality_source}")
    click.echo(f"speed: roofline at {cal.read_gbps:.1f} GB/s, calibrated by a {cal.seconds:.1f} s probe of the "
               f"model ({cal.probed}: {cal.decode_tok_s:.1f} tok/s batch 1, {cal.prefill_tok_s:.0f} tok/s prefill)"
               + ("; top three re-ranked on measurement" if result.validated else ""))
    click.echo(f"{len(result.rejected)} other candidate(s) did not fit the budgets.")
    best = result.ranked[0]
    click.echo(f"\nrecommended: {best.name} ({best.memory.describe()})")
    for line in result.commands:
        click.echo(f"  {line}")
    if json_path:
        write_json(json_path, "advise", click.get_current_context().params, result.to_dict())
        click.echo(f"wrote {Path(json_path)}", err=True)
