"""`brisk bench ab` and `brisk bench ab-kernels`: same-process A/Bs, alternated run by run (or pass by pass) so
that both sides see the same bandwidth phase of a shared machine.

`ab`: one quantized model's engine with its layers in the tiled layout (quant_q8t.cpp, the load default on
x86 builds) against the blocked one (quant_linear.cpp / quant_q8.cpp), or, with `--kv DTYPE`, two tiled
engines that differ in the KV cache (the model dtype vs DTYPE). Decode tok/s excludes prefill
(`brisk.bench.quant.decode_rate`); greedy tokens of both sides are compared; `--ttft N` adds the time to first
token of one N-token prompt.

`ab-kernels`: two or more versions of a quantized-linear C++ file (or of linear_small.cpp, `--op linear_small_m`,
over a float model's linears or a random-weight `--shape`) (e.g. `git show HEAD:...quant_q8.cpp` against
the working tree's), each compiled with its op library renamed (brisk_v0, brisk_v1, ...) and brisk's own ISA
flags, run over every decoder linear of a quantized model in decode order. Outputs are checked against the
first variant's before timing. Python calls each op, so absolute figures include that call overhead;
differences between variants do not.
"""

from __future__ import annotations

import hashlib
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import torch

KERNEL_OPS = ("quant_linear_q8", "quant_linear_q8t", "quant_linear_t", "linear_small_m")  # the last: float linears


@dataclass
class EngineSide:
    """One side of an engine A/B: its name, engine (has `.engine`), loaded model and tiled-layer count."""

    name: str
    llm: Any
    loaded: Any
    num_tiled: int
    rates: dict[int, list[float]] = field(default_factory=dict)


def make_side(name: str, model: str | None, tiled: bool, activations: str, kv_cache_dtype: str) -> EngineSide:
    """Load `model` and build its engine; `tiled=False` keeps every quantized layer in the blocked layout."""
    import brisk.ops.qlinear as qlinear
    from brisk.engine.config import CacheConfig, EngineConfig
    from brisk.engine.llm_engine import LLMEngine
    from brisk.model.loader import load_model

    can_tile = qlinear.can_tile
    if not tiled:  # load_model and the engine's activation setting both ask can_tile for every layer
        qlinear.can_tile = lambda pw: False  # noqa: ARG005
    try:
        loaded = load_model(model, dtype=torch.float32)
        config = EngineConfig(model=str(loaded.path), max_model_len=2048, quant_activations=activations,
                              cache=CacheConfig(kv_cache_memory="128MiB", enable_prefix_caching=False,
                                                kv_cache_dtype=kv_cache_dtype))
        llm = SimpleNamespace(engine=LLMEngine(config, loaded))
    finally:
        qlinear.can_tile = can_tile
    num_tiled = sum(getattr(m, "packed", None) is not None and m.packed.tiled for m in loaded.model.modules())
    return EngineSide(name, llm, loaded, num_tiled)


def run_engine_ab(sides: list[EngineSide], batches: list[int], runs: int, input_len: int,
                  output_len: int) -> dict[int, bool]:
    """Fill each side's `rates[batch]` with `runs` decode rates, sides alternated; returns, per batch, whether
    request 0's greedy tokens were equal on every side."""
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.bench.quant import decode_rate

    tok = sides[0].loaded.tokenizer
    prompt = make_prompt(tok, text_token_ids(tok), 0, input_len)
    for side in sides:
        decode_rate(side.llm, prompt, 1, min(16, output_len))  # warm-up: kernels loaded, caches touched
    same = {}
    for batch in batches:
        tokens = {}
        for _ in range(runs):
            for side in sides:
                rate, first = decode_rate(side.llm, prompt, batch, output_len)
                side.rates.setdefault(batch, []).append(rate)
                tokens[side.name] = tuple(first)
        same[batch] = len(set(tokens.values())) == 1
    return same


def time_to_first_token(sides: list[EngineSide], prompt_len: int, runs: int = 6) -> dict[str, float]:
    """Median seconds to the first token of one `prompt_len`-token prompt per side, alternated."""
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.engine.sampling_params import SamplingParams

    tok = sides[0].loaded.tokenizer
    ids = make_prompt(tok, text_token_ids(tok), 0, prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times: dict[str, list[float]] = {side.name: [] for side in sides}
    for i in range(runs):
        for side in sides:
            engine = side.llm.engine
            start = time.perf_counter()
            engine.add_request(None, ids[i:] + ids[:i], params)  # rotated: no prefix-cache hit between runs
            while engine.has_unfinished_requests():
                engine.step()
            times[side.name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def renamed_source(source: str, index: int) -> str:
    """The C++ source with its op library renamed to brisk_v{index}, so several versions load side by side: the
    schema block and every kernel block (a file that registers its kernels with TORCH_LIBRARY_IMPL(brisk, CPU, m)
    would otherwise define brisk_v{index}'s ops and give them to brisk's, twice)."""
    marker = "TORCH_LIBRARY_FRAGMENT(brisk,"
    if marker not in source:
        raise ValueError(f"the kernel source defines no {marker} ...) block to rename")
    source = source.replace("TORCH_LIBRARY_IMPL(brisk,", f"TORCH_LIBRARY_IMPL(brisk_v{index},")
    return source.replace(marker, f"TORCH_LIBRARY_FRAGMENT(brisk_v{index},")


def build_kernel_variant(path: Path, index: int, op: str) -> Any:
    """Compile one version of a kernel file (cached by content) and return its `op`."""
    from torch.utils import cpp_extension

    from brisk.ops import kernels

    src = renamed_source(path.read_text(), index)
    digest = hashlib.sha256(src.encode()).hexdigest()[:12]
    directory = Path(tempfile.gettempdir()) / "brisk_ab" / digest
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / f"q8v{index}_{digest}.cpp"
    source.write_text(src)
    shutil.copy(Path(kernels.__file__).parent / "csrc" / "simd.h", directory / "simd.h")
    _, isa = kernels._isa_flags()
    cpp_extension.load(name=source.stem, sources=[str(source)], extra_cflags=["-O3", "-fopenmp", *isa],
                       extra_ldflags=["-fopenmp"], build_directory=str(directory), is_python_module=False)
    return getattr(getattr(torch.ops, f"brisk_v{index}"), op).default


def kernel_calls(model: str | None, op: str, rows: int, head: bool, dtype: torch.dtype = torch.float32,
                 shape: str | None = None) -> tuple[list[tuple], int]:
    """Arguments of every decoder linear (and the lm_head if `head`) in the layout `op` reads, and the bytes of
    weights they stream: the quantized layers for the quant ops, the float ones at `dtype` for linear_small_m
    (`shape`: random weights of that shape, as `--load-format dummy`)."""
    from brisk.model.loader import load_model
    from brisk.ops.layers import FastLinear, QuantLinear
    from brisk.ops.qlinear import set_tiled

    loaded = (load_model(model, dtype=dtype, load_format="dummy", shape=shape) if shape is not None
              else load_model(model, dtype=dtype))
    calls, nbytes = [], 0
    for name, mod in loaded.model.named_modules():
        if not ("layers." in name or head):
            continue
        if op == "linear_small_m" and isinstance(mod, FastLinear):
            w = mod.weight.detach().contiguous()
            calls.append((torch.randn(rows, w.shape[1]).to(dtype), w))  # x: [rows, in_features]
            nbytes += w.numel() * w.element_size()
        elif op != "linear_small_m" and type(mod) is QuantLinear:
            pw = mod.packed
            set_tiled(pw, op != "quant_linear_q8")
            codebook = (pw.codebook,) if op == "quant_linear_t" else ()  # that op's extra argument
            # x: [rows, in_features]
            calls.append((torch.randn(rows, pw.in_features), pw.data, pw.scales, pw.zeros, *codebook, pw.bits,
                          pw.group_size))
            nbytes += pw.nbytes()
    if not calls:
        kind = "float" if op == "linear_small_m" else "quantized"
        raise ValueError(f"{shape or model or 'the default model'}: no {kind} linear layers for {op} (quantized ops "
                         "need a brisk quantize folder; linear_small_m a float model, or --shape)")
    return calls, nbytes


@click.command("ab")
@click.option("--model", "-m", default=None, help="Quantized model folder (brisk quantize output) or any model.")
@click.option("--activations", default="auto", show_default=True, type=click.Choice(["auto", "float", "int8"]),
              help="Activations of the quantized layers (as --quant-activations).")
@click.option("--kv", "kv_cache_dtype", default=None, type=click.Choice(["bfloat16", "int8", "int4"]),
              help="Compare the model-dtype KV cache with this one (both tiled) instead of blocked vs tiled.")
@click.option("--batches", default="1,8", show_default=True, help="Comma-separated decode batch sizes.")
@click.option("--runs", type=int, default=5, show_default=True, help="Alternated runs per side and batch.")
@click.option("--input-len", type=int, default=128, show_default=True, help="Prompt tokens.")
@click.option("--output-len", type=int, default=64, show_default=True, help="Generated tokens per run.")
@click.option("--ttft", type=int, default=0, show_default=True, help="Prompt tokens of a time-to-first-token A/B.")
def ab(model: str | None, activations: str, kv_cache_dtype: str | None, batches: str, runs: int, input_len: int,
       output_len: int, ttft: int) -> None:
    """Same-process engine A/B: tiled vs blocked quantized layers, or two KV-cache dtypes."""
    if runs < 1:
        raise ValueError(f"--runs must be at least 1, got {runs}")
    variants = ([("blocked", False, "auto"), ("tiled", True, "auto")] if kv_cache_dtype is None
                else [("kv auto", True, "auto"), (f"kv {kv_cache_dtype}", True, kv_cache_dtype)])
    sides = [make_side(name, model, tiled, activations, kv) for name, tiled, kv in variants]
    for side in sides:
        click.echo(f"{side.name}: {side.num_tiled} tiled layers")
    same = run_engine_ab(sides, [int(b) for b in batches.split(",")], runs, input_len, output_len)
    for batch, equal in same.items():
        click.echo(f"batch {batch}: " + ", ".join(
            f"{s.name} best {max(s.rates[batch]):.1f} median {statistics.median(s.rates[batch]):.1f} tok/s"
            for s in sides) + f"; greedy tokens equal: {equal}")
    if ttft:
        medians = time_to_first_token(sides, ttft)
        click.echo(f"time to first token, {ttft} tokens: "
                   + ", ".join(f"{n} median {t * 1e3:.0f} ms" for n, t in medians.items()))


@click.command("ab-kernels")
@click.argument("variants", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", "-m", default=None, help="Quantized model folder (brisk quantize output).")
@click.option("--op", default="quant_linear_q8", show_default=True, type=click.Choice(KERNEL_OPS),
              help="The op the variant files define (the layers are put in the layout it reads).")
@click.option("--rows", type=int, default=1, show_default=True, help="Activation rows (the decode batch).")
@click.option("--passes", type=int, default=60, show_default=True, help="Timed passes per variant.")
@click.option("--head", is_flag=True, help="Include the lm_head.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Weights and activations of linear_small_m's float linears.")
@click.option("--shape", default=None, metavar="NAME|CONFIG",
              help="Random weights of a shape (llama-3.2-1b, ...) instead of --model, for linear_small_m.")
def ab_kernels(variants: tuple[Path, ...], model: str | None, op: str, rows: int, passes: int, head: bool,
               dtype: str, shape: str | None) -> None:
    """Same-process A/B of versions of a linear C++ file (quantized or linear_small_m) over a model's linears."""
    if len(variants) < 2:
        raise ValueError("give at least two kernel files to compare")
    ops = [build_kernel_variant(p, i, op) for i, p in enumerate(variants)]
    calls, nbytes = kernel_calls(model, op, rows, head, getattr(torch, dtype), shape)
    reference = [ops[0](*c, None) for c in calls]
    for fn in ops[1:]:
        for c, ref in zip(calls, reference, strict=True):
            torch.testing.assert_close(fn(*c, None), ref, rtol=1e-4, atol=1e-3 * ref.abs().max().item())
    times: list[list[float]] = [[] for _ in ops]
    for _ in range(passes + 3):
        for i, fn in enumerate(ops):
            start = time.perf_counter()
            for c in calls:
                fn(*c, None)
            times[i].append(time.perf_counter() - start)
    click.echo(f"{len(calls)} linears, {nbytes / 1e6:.1f} MB, M = {rows}, {torch.get_num_threads()} threads")
    for path, t in zip(variants, times, strict=True):
        t = t[3:]  # the first passes warm the caches and the page tables
        click.echo(f"{path.name:24s} median {statistics.median(t) * 1e3:7.3f} ms   best {min(t) * 1e3:7.3f} ms "
                   f"({nbytes / min(t) / 1e9:5.1f} GB/s)")
