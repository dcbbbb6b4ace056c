"""`brisk bench sparse`: batch-1 decode of a pruned model through the sparse path, against the dense model, in one
process. Every row prunes the same float model in memory (per output row, the smallest |w| set to zero: the
magnitude baseline; the speed of the sparse path does not depend on which weights a method keeps, only on how
many), then measures decode tok/s (best of `runs`), the weight bytes one token reads, and what that makes in GB/s.

Rows come in groups, each with its own baseline (speedup column): float32 | float32 pruned through the dense path
(same bytes as dense: zeros cost as much as any weight) | float32 50%, 2:4 and 4:8 through the sparse path; and per
quantization: dense codes | codes of the 50%-pruned model through the sparse path (int8 also through the
integer-dot kernel of ops.sparse_q8). `kernel_sweep` (--kernels) is
the microbenchmark behind ops.sparse.MIN_SPARSITY: one kernel call per layer shape, over enough layers that the
weights come from memory, at several sparsities.
"""

from __future__ import annotations

import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from brisk.quant.config import LayerQuant

QUANT = {"int8": LayerQuant(bits=8, group_size=-1, sym=True), "int4": LayerQuant(bits=4, group_size=64, sym=True)}
# quantized layers are not converted at load by default (ops.sparse.MIN_SPARSITY); the bench forces them
FORCE_ALL = {32: 0.0, 8: 0.0, 4: 0.0}
MAX_MODEL_LEN = 1024  # per engine; with 64 MiB of KV each, a dozen engines fit next to their models


def prune_rows(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Per output row, the round(sparsity * K) smallest |w| set to zero."""
    drop = int(round(sparsity * w.shape[1]))
    if drop == 0:
        return w
    idx = w.abs().argsort(dim=1)[:, :drop]  # [N, drop]
    return w.scatter(1, idx, 0.0)


def prune_nm(w: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the n largest |w| of every m consecutive weights of a row (K % m == 0)."""
    rows, k = w.shape
    groups = w.view(rows, k // m, m)  # [N, K/m, m]
    drop = groups.abs().argsort(dim=-1)[..., : m - n]  # [N, K/m, m-n]
    return groups.scatter(-1, drop, 0.0).view(rows, k)


def prune_decoder_(model: nn.Module, pattern: str) -> None:
    """Prune every linear layer of the decoder layers in place: pattern "0.5" (unstructured) or "2:4" (N:M).
    Rows are pruned independently, so a fused q/k/v or gate/up layer prunes exactly as its parts would."""
    for module in model.model.layers.modules():
        if isinstance(module, nn.Linear):
            w = module.weight.data
            if ":" in pattern:
                n, m = (int(v) for v in pattern.split(":"))
                w.copy_(prune_nm(w, n, m))
            else:
                w.copy_(prune_rows(w, float(pattern)))


@dataclass
class SparseRow:
    name: str
    baseline: str
    sparse_layers: int
    weight_bytes: int  # bytes one decode step reads for weights
    tok_s: float
    speedup: float = 1.0
    same_greedy: bool | None = None  # as the same weights through the dense path (where that row exists)

    @property
    def gbps(self) -> float:
        return self.weight_bytes * self.tok_s / 1e9

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "weight_gbps": self.gbps}


def _engine(loaded, quant_activations: str = "auto", kv_cache_memory: str = "64MiB"):  # noqa: ANN001, ANN202
    from brisk.engine.config import CacheConfig, EngineConfig
    from brisk.engine.llm_engine import LLMEngine

    # a small cache per engine: the report holds about a dozen engines at once
    config = EngineConfig(model=str(loaded.path), max_model_len=MAX_MODEL_LEN, quant_activations=quant_activations,
                          cache=CacheConfig(kv_cache_memory=kv_cache_memory, enable_prefix_caching=False))
    return SimpleNamespace(engine=LLMEngine(config, loaded))


def _quantized(model: str | None, pattern: str | None, spec: LayerQuant, folder: Path):  # noqa: ANN202
    """RTN-quantize the (pruned) float model into `folder` and load it (fused, quantized layers dense)."""
    from brisk.model.loader import load_model
    from brisk.quant.checkpoint import save_quantized
    from brisk.quant.rtn import plan_layers, rtn_quantize

    loaded = load_model(model, fuse=False)
    if pattern is not None:
        prune_decoder_(loaded.model, pattern)
    plan = plan_layers(loaded.model, loaded.config.tie_word_embeddings, spec)
    tensors, qconfig = rtn_quantize(loaded, plan, spec, progress=False)
    save_quantized(folder, loaded.config, loaded.tokenizer, qconfig, tensors)
    del loaded, tensors
    gc.collect()
    return load_model(folder)


def run_sparse_report(model: str | None, quants: list[str], input_len: int, output_len: int, runs: int,
                      log: Callable[[str], Any] = print) -> list[SparseRow]:
    """Build every setting first, then measure them round-robin, `runs` rounds, keeping each row's best: on a
    shared machine the load drifts over minutes, and interleaving spreads it evenly over the rows (a row measured
    in a quiet minute only would look faster than it is)."""
    from brisk.model.loader import load_model
    from brisk.ops.sparse import sparsify_model

    unknown = [q for q in quants if q not in QUANT]
    if unknown:
        raise ValueError(f"unknown quantization(s) {', '.join(unknown)}; choose from {', '.join(QUANT)}")
    if input_len + output_len > MAX_MODEL_LEN:
        raise ValueError(f"--input-len + --output-len must be at most {MAX_MODEL_LEN}, got {input_len + output_len}")
    # (name, baseline, loaded, same_as): same_as names the row with the same weights through the dense path
    settings: list[tuple[str, str, Any, str | None]] = [("float32", "float32", load_model(model, sparse=False), None)]
    for pattern, label in (("0.5", "50%"), ("2:4", "2:4"), ("4:8", "4:8")):
        log(f"float32 {label}: pruning ...")
        for sparse in (False, True):
            loaded = load_model(model, sparse=False)
            prune_decoder_(loaded.model, pattern)
            if sparse:
                sparsify_model(loaded.model)
            name = f"float32 {label} {'sparse' if sparse else 'dense path'}"
            settings.append((name, "float32", loaded, f"float32 {label} dense path" if sparse else None))
    with tempfile.TemporaryDirectory() as tmp:  # kept until the end: loaded safetensors may be memory-mapped
        for q in quants:
            spec = QUANT[q]
            log(f"{q}: quantizing the dense and the pruned model ...")
            base = f"{q} ({spec.label})"
            settings.append((base, base, _quantized(model, None, spec, Path(tmp) / f"{q}-dense"), None))
            folder = Path(tmp) / f"{q}-50"
            settings.append((f"{q} 50% dense path", base, _quantized(model, "0.5", spec, folder), None))
            loaded = load_model(folder)
            sparsify_model(loaded.model, FORCE_ALL)
            settings.append((f"{q} 50% sparse", base, loaded, f"{q} 50% dense path"))
            if spec.bits == 8:  # the integer-dot kernel (ops.sparse_q8): x rounded to int8, so no greedy check
                # its baseline: the dense model with int8 activations too (quant_q8's integer dot products)
                settings.append((f"{q} int8-act", f"{q} int8-act", load_model(Path(tmp) / f"{q}-dense"), None))
                loaded = load_model(folder)
                sparsify_model(loaded.model, FORCE_ALL, int8_dot=True)
                settings.append((f"{q} 50% sparse int8-dot", f"{q} int8-act", loaded, None))
        return _measure(settings, input_len, output_len, runs, log)


def _measure(settings: list[tuple[str, str, Any, str | None]], input_len: int, output_len: int, runs: int,
             log: Callable[[str], Any]) -> list[SparseRow]:
    from brisk.bench.prompts import make_prompt, text_token_ids
    from brisk.bench.quant import decode_rate
    from brisk.bench.roofline import weight_bytes_per_token
    from brisk.ops.layers import SparseLinear

    # the int8-dot row and its baseline: every quantized layer with int8 activations (the lm_head too)
    engines = {name: _engine(loaded, "int8" if name.endswith(("int8-act", "int8-dot")) else "auto")
               for name, _, loaded, _ in settings}
    tok = settings[0][2].tokenizer
    prompt = make_prompt(tok, text_token_ids(tok), 0, input_len)
    for name, engine in engines.items():
        log(f"{name}: warm-up ...")
        decode_rate(engine, prompt, 1, 8)  # kernels built, caches touched
    best: dict[str, float] = {}
    greedy: dict[str, list[int]] = {}
    for r in range(runs):
        log(f"round {r + 1} of {runs} ...")
        for name, engine in engines.items():
            tok_s, tokens = decode_rate(engine, prompt, 1, output_len)
            best[name] = max(best.get(name, 0.0), tok_s)
            greedy[name] = tokens
    rows: list[SparseRow] = []
    for name, baseline, loaded, same_as in settings:
        rows.append(SparseRow(
            name=name, baseline=baseline,
            sparse_layers=sum(isinstance(m, SparseLinear) for m in loaded.model.modules()),
            weight_bytes=weight_bytes_per_token(loaded.model), tok_s=best[name],
            speedup=best[name] / best[baseline],
            same_greedy=None if same_as is None else greedy[name] == greedy[same_as]))
    return rows


# ---------------------------------------------------------------------------- kernel microbenchmark
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # the default model's fused qkv, o, gate_up, down


def _best(groups: list[list[Callable[[], Any]]], reps: int) -> list[float]:
    """Best time of each group of calls, the groups measured in turn within every repetition (A/B/A/B...)."""
    for fns in groups:
        for f in fns:
            f()
    best = [float("inf")] * len(groups)
    for _ in range(reps):
        for i, fns in enumerate(groups):
            start = time.perf_counter()
            for f in fns:
                f()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def kernel_sweep(sparsities: list[str], layers: int = 16, reps: int = 10, seed: int = 0) -> list[dict[str, Any]]:
    """M = 1 time of the sparse kernel against the dense one, per value kind and sparsity, over `layers` copies of
    the default model's four decoder shapes (float32: 16 layers = 170 MB, far beyond the 32 MB L3). int8 values
    are also timed through the integer-dot kernel (ops.sparse_q8), `int8dot_ms`."""
    from brisk.ops.linear import linear
    from brisk.ops.qlinear import prepack, quant_linear
    from brisk.ops.sparse import compress, compress_packed, sparse_linear
    from brisk.quant.rtn import quantize_layer

    g = torch.Generator().manual_seed(seed)
    out: list[dict[str, Any]] = []
    for kind, spec in (("float32", None), ("int8", QUANT["int8"]), ("int4", QUANT["int4"])):
        for pattern in sparsities:
            dense_fns, sparse_fns, dot_fns = [], [], []
            dense_bytes = sparse_bytes = 0
            for _ in range(layers):
                for n, k in SHAPES:
                    w = torch.randn(n, k, generator=g)
                    w = prune_nm(w, *map(int, pattern.split(":"))) if ":" in pattern else prune_rows(w, float(pattern))
                    x = torch.randn(1, k, generator=g)
                    if spec is None:
                        sw = compress(w)
                        dense_fns.append(lambda x=x, w=w: linear(x, w))
                        dense_bytes += w.numel() * 4
                    else:
                        t = quantize_layer(w, spec)
                        group = k if spec.group_size == -1 else spec.group_size
                        pw = prepack(t["qweight"], t["scales"], t.get("qzeros"), spec.bits, group, k)
                        sw = compress_packed(pw)
                        assert sw is not None, "symmetric codes always have a sparse format"
                        dense_fns.append(lambda x=x, pw=pw: quant_linear(x, pw))
                        dense_bytes += pw.nbytes()
                    sparse_fns.append(lambda x=x, sw=sw: sparse_linear(x, sw))
                    if sw.kind == 8:
                        dot_fns.append(lambda x=x, sw=sw: sparse_linear(x, sw, int8_dot=True))
                    sparse_bytes += sw.nbytes()
            td, ts, *tq = _best([dense_fns, sparse_fns] + ([dot_fns] if dot_fns else []), reps)
            out.append({"kind": kind, "sparsity": pattern, "dense_ms": td * 1e3, "sparse_ms": ts * 1e3,
                        "dense_gbps": dense_bytes / td / 1e9, "sparse_gbps": sparse_bytes / ts / 1e9,
                        "bytes_ratio": sparse_bytes / dense_bytes, "speedup": td / ts,
                        "int8dot_ms": tq[0] * 1e3 if tq else None, "int8dot_speedup": td / tq[0] if tq else None})
            del dense_fns, sparse_fns, dot_fns
            gc.collect()
    return out
