"""`brisk bench quant`: the quantization report. Each setting quantized from the same float model in one
invocation, then: checkpoint size, perplexity on held-out text, prefill tok/s of one prompt, decode tok/s at batch
1 and batch B, and the speedup over the float32 row measured in the same run.
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
# int8 weights with int8 activations, calibrated on the bundled calibration text with `brisk quantize`'s defaults
# (SmoothQuant: alpha searched, per-token scales; LLM.int8(): the threshold searched)
W8A8_METHODS = ("smoothquant", "smoothquant-static", "llm-int8")
SETTINGS.update(dict.fromkeys(W8A8_METHODS, LayerQuant(bits=8, group_size=-1, sym=True)))
# A setting name + this suffix: the same checkpoint run with int8 activations (`quant_activations="int8"`: x rounded
# to int8 per 32 columns and integer dot products, in the perplexity windows and the decode runs alike).
A8 = "-a8"


def base_name(name: str) -> str:
    return name[: -len(A8)] if name.endswith(A8) else name


def parse_setting(name: str) -> tuple[LayerQuant | None, bool]:
    """'int4-g64-a8' -> (the int4-g64 setting, True). Raises ValueError for an unknown name."""
    base, a8 = base_name(name), name.endswith(A8)
    if base not in SETTINGS or (a8 and (SETTINGS[base] is None or base in W8A8_METHODS)):
        known = ", ".join([*SETTINGS, *(n + A8 for n, v in SETTINGS.items() if v is not None and n not in
                                        W8A8_METHODS)])
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
    prefill_tok_s: float = 0.0
    prefill_len: int = 0
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


def pool_for(batch: int, prompt_len: int, output_len: int, kv_token_bytes: int, floor_mib: int = 64) -> str:
    """A KV pool that holds `batch` requests of prompt_len + output_len tokens whole (+25%, and a floor), so that
    `decode_rate` finds them running together."""
    need = 1.25 * batch * (prompt_len + 2 * output_len + 64) * kv_token_bytes
    return f"{max(floor_mib, int(need / 2**20))}MiB"


def prefill_rate(llm, prompt_ids: list[int]) -> float:  # noqa: ANN001
    """Prompt tokens/s of one request's prefill (time to its first token, the prompt in one step)."""
    engine = llm.engine
    step = engine.config.scheduler.max_num_batched_tokens or 2048
    if len(prompt_ids) > step:
        raise ValueError(f"a {len(prompt_ids)}-token prefill takes more than one engine step ({step} tokens)")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(None, prompt_ids, params)
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompt_ids) / (time.perf_counter() - start)


def build_checkpoint(setting: LayerQuant, out: Path, model: str | None, method: str = "rtn") -> float:
    """Quantize `model` with RTN at `setting` (or a W8A8 method, see W8A8_METHODS) into `out`; returns seconds
    spent."""
    from brisk.model.loader import load_model
    from brisk.quant.checkpoint import save_quantized
    from brisk.quant.rtn import plan_layers, rtn_quantize

    start = time.perf_counter()
    loaded = load_model(model, fuse=False)
    plan = plan_layers(loaded.model, loaded.config.tie_word_embeddings, setting)
    if method in W8A8_METHODS:
        from brisk.data import calibration_text_path
        from brisk.quant.calib import CalibConfig
        from brisk.quant.cli import calibrated_quantize

        name, activations = (method.removesuffix("-static"), "tensor") if method.endswith("-static") else \
            (method, "token")
        tensors, qconfig = calibrated_quantize(loaded, plan, setting, name, CalibConfig(str(calibration_text_path())),
                                               progress=False, activations=activations)
    else:
        tensors, qconfig = rtn_quantize(loaded, plan, setting, progress=False)
    save_quantized(out, loaded.config, loaded.tokenizer, qconfig, tensors)
    return time.perf_counter() - start


def run_quant_report(names: list[str], model: str | None, text: str | None, window: int, max_windows: int | None,
                     batch: int, input_len: int, output_len: int, runs: int = 3, workdir: Path | None = None,
                     log: Any = print, prefill_len: int = 512) -> list[QuantRow]:
    """One row per setting name (see SETTINGS). The float32 row is measured first and always."""
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.engine.llm import LLM
    from brisk.eval.ppl import perplexity
    from brisk.eval.size import model_size
    from brisk.model.loader import model_shape, resolve_model

    for n in names:
        parse_setting(n)
    if "float32" not in names:
        names = ["float32", *names]
    source = str(resolve_model(model))
    kv_token_bytes = model_shape(source, None)[0].kv_bytes_per_token(4)
    rows: list[QuantRow] = []
    built: dict[str, tuple[str, float]] = {}  # checkpoint label -> (folder, seconds); an -a8 row reuses it
    engines: list[tuple[str, Any, list[int]]] = []  # (name, LLM, prompt) of every row, kept for the decode rounds
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for name in names:
            setting, a8 = parse_setting(name)
            seconds = 0.0
            path = source
            if setting is not None:
                key = base_name(name) if base_name(name) in W8A8_METHODS else setting.label
                if key not in built:
                    log(f"{name}: quantizing ...")
                    folder = Path(tmp) / f"q{len(built)}"
                    built[key] = (str(folder), build_checkpoint(setting, folder, model, base_name(name)))
                path, seconds = built[key]
            # RTN rows: float activations unless -a8; W8A8 rows run as they load (their 8-bit head on int8 ones too);
            # the float row in float32, not a GGUF source's own codes
            llm = LLM(path, kv_cache_memory=pool_for(batch, input_len, output_len, kv_token_bytes, 256),
                      enable_prefix_caching=False,
                      dtype="float32" if setting is None else "auto",
                      quant_activations="int8" if a8 else "auto" if base_name(name) in W8A8_METHODS else "float")
            loaded = llm.engine.loaded
            size = (model_size(loaded) if setting is None else model_size(Path(path))).total.bytes
            ppl = None
            if text is not None:
                log(f"{name}: perplexity ...")
                ppl = perplexity(loaded, text, window=window, max_windows=max_windows, progress=True).ppl
            tok = llm.get_tokenizer()
            prompt = make_prompt(tok, text_token_ids(tok), 0, input_len)
            decode_rate(llm, prompt, 1, 8)  # warm-up: kernels built, caches touched
            label = (setting.label + (", int8 act" if a8 or base_name(name) in W8A8_METHODS else "")) if setting \
                else "float32"
            rows.append(QuantRow(name=name, label=label, size_bytes=size, ppl=ppl, decode_tok_s_b1=0.0,
                                 decode_tok_s_batch=0.0, batch=batch, quantize_s=seconds, prefill_len=prefill_len))
            engines.append((name, llm, prompt))
        long_prompt = make_prompt(tok, text_token_ids(tok), 1, prefill_len) if prefill_len else []
        # Decode runs in rounds, every setting once per round: this VM's speed drifts by tens of percent over
        # minutes, so settings measured one after the other would compare different machines. Best of `runs`:
        # a stray process costs a run, never helps it.
        b1: dict[str, list[tuple[float, list[int]]]] = {name: [] for name in names}
        bb: dict[str, list[float]] = {name: [] for name in names}
        pf: dict[str, list[float]] = {name: [0.0] for name in names}
        for r in range(runs):
            log(f"round {r + 1}/{runs}: prefill {prefill_len}, decode batch 1 and {batch}, every setting ...")
            for name, llm, prompt in engines:
                if long_prompt:
                    prefill_rate(llm, long_prompt[:16])  # warm-up of the prefill path's shapes
                    pf[name].append(prefill_rate(llm, long_prompt))
                b1[name].append(decode_rate(llm, prompt, 1, output_len))
                bb[name].append(decode_rate(llm, prompt, batch, output_len)[0])
        reference_tokens = max(b1[names[0]])[1]
        for row in rows:
            rate, tokens = max(b1[row.name])
            row.decode_tok_s_b1, row.decode_tok_s_batch = rate, max(bb[row.name])
            row.prefill_tok_s = max(pf[row.name])
            row.same_greedy_as_float = tokens == reference_tokens
        engines.clear()
        gc.collect()
    return rows
