"""`brisk bench quant`: the quantization report. Each setting quantized from the same float model in one
invocation, then: checkpoint size, perplexity on held-out text, decode tok/s at batch 1 and batch B, and the
speedup over the float32 row measured in the same run.
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from brisk.engine.sampling_params import SamplingParams
from brisk.quant.config import LayerQuant

# name -> setting of the decoder's linear layers (embedding / head at 8 bits per channel, as `brisk quantize`)
SETTINGS: dict[str, LayerQuant | None] = {
    "float32": None,
    "int8": LayerQuant(bits=8, group_size=-1, sym=True),
    "int4-g64": LayerQuant(bits=4, group_size=64, sym=False),
    "int4-g64-sym": LayerQuant(bits=4, group_size=64, sym=True),
    "nf4-g64": LayerQuant(bits=4, group_size=64, sym=True, scheme="nf4"),
    "int3-g64": LayerQuant(bits=3, group_size=64, sym=False),
    "int2-g64": LayerQuant(bits=2, group_size=64, sym=False),
    "int4-g32": LayerQuant(bits=4, group_size=32, sym=False),
    "int4-ch": LayerQuant(bits=4, group_size=-1, sym=False),
}
# A setting name + this suffix: the same checkpoint run with int8 activations (`quant_activations="int8"`: x rounded
# to int8 per 32 columns and integer dot products, in the perplexity windows and the decode runs alike).
A8 = "-a8"


def parse_setting(name: str) -> tuple[LayerQuant | None, bool]:
    """'int4-g64-a8' -> (the int4-g64 setting, True). Raises ValueError for an unknown name."""
    base, a8 = (name[: -len(A8)], True) if name.endswith(A8) else (name, False)
    if base not in SETTINGS or (a8 and SETTINGS[base] is None):
        known = ", ".join([*SETTINGS, *(n + A8 for n, v in SETTINGS.items() if v is not None)])
        raise ValueError(f"unknown setting {name!r}; choose from {known}")
    return SETTINGS[base], a8


@dataclass
class QuantRow:
    name: str
    label: str
    size_bytes: int  # weight files on disk (the float row: its float32 tensors, counted as stored in memory)
    ppl: float | None
    decode_tok_s_b1: float
    decode_tok_s_batch: float
    batch: int
    quantize_s: float = 0.0
    same_greedy_as_float: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def output_len_together(llm, batch: int, prompt_len: int, output_len: int) -> int:  # noqa: ANN001
    """`output_len` plus the steps the batch's prompts take to prefill (chunked, while the first ones decode), so
    that every request of `decode_rate` has its first token before any finishes."""
    step = llm.engine.config.scheduler.max_num_batched_tokens or 2048
    return output_len + -(-batch * prompt_len // step)


def decode_rate(llm, prompt_ids: list[int], batch: int, output_len: int) -> tuple[float, list[int]]:  # noqa: ANN001
    """Decode tokens/s of `batch` identical-length requests running together, prefill excluded: the clock starts
    when every request has its first token. Returns (tok/s, greedy tokens of request 0)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # distinct prompts (a shifted window each) so prefix caching cannot share them
    ids = [engine.add_request(None, prompt_ids[i:] + prompt_ids[:i], params) for i in range(batch)]
    started: set[str] = set()
    first_tokens: dict[str, int] = {}
    start = None
    tokens_after = 0
    first_out: list[int] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            n = len(out.outputs[0].token_ids)
            if out.request_id not in started and n:
                started.add(out.request_id)
                first_tokens[out.request_id] = n
            if out.request_id == ids[0]:
                first_out = list(out.outputs[0].token_ids)
            if out.finished:
                if start is None:  # a request done before the last one started: they never ran together
                    raise RuntimeError(f"decode_rate: the engine did not run {batch} requests of "
                                       f"{len(prompt_ids)} + {output_len} tokens at once (KV pool or max_num_seqs "
                                       "too small); raise kv_cache_memory or lower the batch")
                tokens_after += n - first_tokens[out.request_id]
        if start is None and len(started) == batch:
            start = now
    elapsed = time.perf_counter() - start if start is not None else float("nan")
    return tokens_after / elapsed, first_out


def build_checkpoint(setting: LayerQuant, out: Path, model: str | None) -> float:
    """Quantize `model` with RTN at `setting` into `out`; returns seconds spent."""
    from brisk.model.loader import load_model
    from brisk.quant.checkpoint import save_quantized
    from brisk.quant.rtn import plan_layers, rtn_quantize

    start = time.perf_counter()
    loaded = load_model(model, fuse=False)
    plan = plan_layers(loaded.model, loaded.config.tie_word_embeddings, setting)
    tensors, qconfig = rtn_quantize(loaded, plan, setting, progress=False)
    save_quantized(out, loaded.config, loaded.tokenizer, qconfig, tensors)
    return time.perf_counter() - start


def run_quant_report(names: list[str], model: str | None, text: str | None, window: int, max_windows: int | None,
                     batch: int, input_len: int, output_len: int, runs: int = 3, workdir: Path | None = None,
                     log: Any = print) -> list[QuantRow]:
    """One row per setting name (see SETTINGS). The float32 row is measured first and always."""
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.engine.llm import LLM
    from brisk.eval.ppl import perplexity
    from brisk.eval.size import model_size
    from brisk.model.loader import resolve_model

    for n in names:
        parse_setting(n)
    if "float32" not in names:
        names = ["float32", *names]
    source = str(resolve_model(model))
    rows: list[QuantRow] = []
    built: dict[str, tuple[str, float]] = {}  # checkpoint label -> (folder, seconds); an -a8 row reuses it
    engines: list[tuple[str, Any, list[int]]] = []  # (name, LLM, prompt) of every row, kept for the decode rounds
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for name in names:
            setting, a8 = parse_setting(name)
            seconds = 0.0
            path = source
            if setting is not None:
                if setting.label not in built:
                    log(f"{name}: quantizing ...")
                    folder = Path(tmp) / f"q{len(built)}"
                    built[setting.label] = (str(folder), build_checkpoint(setting, folder, model))
                path, seconds = built[setting.label]
            llm = LLM(path, kv_cache_memory="256MiB", enable_prefix_caching=False,
                      quant_activations="int8" if a8 else "float")
            loaded = llm.engine.loaded
            size = (model_size(loaded) if setting is None else model_size(Path(path))).total.bytes
            ppl = None
            if text is not None:
                log(f"{name}: perplexity ...")
                ppl = perplexity(loaded, text, window=window, max_windows=max_windows, progress=True).ppl
            tok = llm.get_tokenizer()
            prompt = make_prompt(tok, text_token_ids(tok), 0, input_len)
            decode_rate(llm, prompt, 1, 8)  # warm-up: kernels built, caches touched
            label = (setting.label + (", int8 act" if a8 else "")) if setting else "float32"
            rows.append(QuantRow(name=name, label=label, size_bytes=size, ppl=ppl, decode_tok_s_b1=0.0,
                                 decode_tok_s_batch=0.0, batch=batch, quantize_s=seconds))
            engines.append((name, llm, prompt))
        # Decode runs in rounds, every setting once per round: this VM's speed drifts by tens of percent over
        # minutes, so settings measured one after the other would compare different machines. Best of `runs`:
        # a stray process costs a run, never helps it.
        b1: dict[str, list[tuple[float, list[int]]]] = {name: [] for name in names}
        bb: dict[str, list[float]] = {name: [] for name in names}
        for r in range(runs):
            log(f"decode round {r + 1}/{runs}: batch 1 and {batch}, every setting ...")
            for name, llm, prompt in engines:
                b1[name].append(decode_rate(llm, prompt, 1, output_len))
                bb[name].append(decode_rate(llm, prompt, batch, output_len)[0])
        reference_tokens = max(b1[names[0]])[1]
        for row in rows:
            rate, tokens = max(b1[row.name])
            row.decode_tok_s_b1, row.decode_tok_s_batch = rate, max(bb[row.name])
            row.same_greedy_as_float = tokens == reference_tokens
        engines.clear()
        gc.collect()
    return rows
