"""`--compile`: the decoder's dense parts through torch.compile (inductor), attention on brisk's paged kernels.

A step's layer loop becomes a chain of compiled graphs with paged attention between them:

    first:  h = rms_norm(x); qkv = h @ Wqkv; q, k = rope(q, k)                 -> q, k, v, residual
    (eager) k, v into the paged cache; o = paged attention(q)
    mid:    residual += o @ Wo; h = rms_norm(residual); x = down(silu(gate) * up)
            residual += x; h = rms_norm(residual); qkv = h @ Wqkv'; rope       -> q, k, v, residual
    ...
    last:   residual += o @ Wo; ...; x = down(...); final rms_norm(residual + x) -> hidden

Inductor fuses each graph's norms, residual adds, RoPE and SwiGLU product into generated C++ loops; the weights
are graph inputs, so every layer reuses one compiled graph per shape. Linears within the float kernel's row limit call
brisk's small-M GEMV kernel (an opaque op in the graph: inductor's own M=1 matmul reads weights ~1.5x slower
here); larger ones are inductor's (MKL / oneDNN extern calls).

Shapes are bucketed so that nothing recompiles per batch size: steps of up to 8 rows are padded to 1, 2, 4 or 8
rows (one static graph each), larger steps (prefill chunks, big batches) run one graph with a dynamic row count.
`compile_model` compiles every bucket the engine can reach before the first request and returns the seconds it
took (reported at start-up and by `brisk bench latency --compile`). The decode plan's C++ layer loop is not used
while compiled: --compile replaces it for the steps it covers (plain caches of the model dtype, no eviction,
no H2O scores; the rest take the module path; engine/executor.py decides). Whether it pays is measured, not
assumed: BENCHMARKS.md. It lives in engine/ beside the executor that runs it: compilation is applied to the
plain model from outside, by the engine's settings.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from brisk.engine.decode_plan import straight_line_step
from brisk.model.llama import SILU
from brisk.model.rope import apply_rope
from brisk.ops import kernels
from brisk.ops.attention import PREFILL_Q_TILE, AttentionMetadata, write_kv
from brisk.ops.layers import MAX_ROWS, FastLinear, LinearKind
from brisk.ops.linear import linear

if TYPE_CHECKING:
    from brisk.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

STATIC_BUCKETS = (1, 2, 4, 8)  # rows; a step of t <= 8 rows is padded to the next one
_SMALL_ROWS = MAX_ROWS[LinearKind.FLOAT]  # the float linears' small-row kernel limit (ops/layers.py)
_fakes_registered = False


class CompileError(ValueError):
    """--compile cannot run this model or on this machine; the message says what to do instead."""


def _register_fakes() -> None:
    """Shape functions for the brisk ops the graphs call, so dynamo can trace them as opaque calls; and the
    large-row linear as a Python custom op (one call per GEMM: its ~10 us are nothing against the GEMM)."""
    global _fakes_registered
    if _fakes_registered:
        return

    @torch.library.register_fake("brisk::linear_small_m")
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.custom_op("brisk_compiled::linear", mutates_args=())
    def _large_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, weight, bias)

    @_large_linear.register_fake
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    _fakes_registered = True


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """ops.fused.rms_norm_reference: statistics in float32, the weight applied in the model dtype (as HF)."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """ops.linear.linear's choices, as graph nodes: brisk's GEMV kernel up to 8 rows, else ops.linear's GEMM
    (oneDNN; bf16 widened to float32 where the CPU has no bf16 arithmetic) as one opaque call: inductor's own
    bf16 GEMM runs ~5x slower here and its oneDNN lowering does not take a dynamic row count."""
    if x.shape[0] <= _SMALL_ROWS:  # static at trace time: the small buckets only
        return torch.ops.brisk.linear_small_m(x, w, b)
    return torch.ops.brisk_compiled.linear(x, w, b)


def _qkv(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
         nh: int, nkv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = h.shape[0]
    qkv = _linear(h, w, b).view(t, nh + 2 * nkv, -1)
    qk = apply_rope(qkv[:, :nh + nkv], cos, sin)  # one rotation for q and k together
    return qk[:, :nh].contiguous(), qk[:, nh:].contiguous(), qkv[:, nh + nkv:].contiguous()


def _mlp_block(o: torch.Tensor, residual: torch.Tensor, wo: torch.Tensor, ln2: torch.Tensor, wgu: torch.Tensor,
               wd: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """o (attention output, [T, h d]) -> (MLP output, residual stream including the attention output)."""
    residual = residual + _linear(o, wo, None)
    gate_up = _linear(_rms(residual, ln2, eps), wgu, None)
    gate, up = gate_up.chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, wd, None), residual


def _first(x: torch.Tensor, ln1: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None, cos: torch.Tensor,
           sin: torch.Tensor, eps: float, nh: int, nkv: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = _qkv(_rms(x, ln1, eps), wqkv, bqkv, cos, sin, nh, nkv)
    return q, k, v, x


def _mid(o: torch.Tensor, residual: torch.Tensor, wo: torch.Tensor, ln2: torch.Tensor, wgu: torch.Tensor,
         wd: torch.Tensor, ln1: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None, cos: torch.Tensor,
         sin: torch.Tensor, eps: float, nh: int, nkv: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, residual = _mlp_block(o, residual, wo, ln2, wgu, wd, eps)
    residual = residual + x
    q, k, v = _qkv(_rms(residual, ln1, eps), wqkv, bqkv, cos, sin, nh, nkv)
    return q, k, v, residual


def _last(o: torch.Tensor, residual: torch.Tensor, wo: torch.Tensor, ln2: torch.Tensor, wgu: torch.Tensor,
          wd: torch.Tensor, norm: torch.Tensor, eps: float, norm_eps: float) -> torch.Tensor:
    x, residual = _mlp_block(o, residual, wo, ln2, wgu, wd, eps)
    return _rms(residual + x, norm, norm_eps)


def bucket_rows(t: int) -> int:
    """Rows a step of t tokens runs at: the next static bucket up to 8, else t itself (the dynamic graph)."""
    for b in STATIC_BUCKETS:
        if t <= b:
            return b
    return t


def _check_covered(arch: str, i: int, layer: Any, norms: Any) -> None:
    """The parts of a decoder layer (model/llama.py DecoderLayer) the graphs do not compute, refused by what the
    layer holds: routed experts, norms after attention or the MLP or of the (1 + w) kind, per-head q/k norms, a
    GeGLU MLP, a window or RoPE table of the layer's own."""
    attn, mlp = layer.self_attn, layer.mlp
    if not hasattr(mlp, "gate_up_proj"):
        raise CompileError(f"--compile does not cover mixture-of-experts layers (layer {i} routes tokens to "
                           "experts); run it without --compile (execution auto runs the experts grouped)")
    missing = [what for what, has in (
        ("norms after attention and MLP (sandwich)", norms.attn_out is not None or norms.mlp_out is not None),
        ("(1 + w) RMSNorms", any(n.round_once for n in norms.present())),
        ("per-head q/k norms", attn.q_norm is not None),
        ("GeGLU", getattr(mlp, "act", SILU) != SILU),
        ("per-layer windows and RoPE tables", attn.own_window or attn.rope_index is not None)) if has]
    if missing:
        raise CompileError(f"--compile does not cover {arch}'s {', '.join(missing)} (layer {i}); run it without "
                           "--compile (execution auto runs the decode plan)")


class CompiledModel:
    """The compiled graphs of one model and the per-layer weights they take (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        cfg = model.config
        dtype = model.model.norm.weight.dtype
        self.layers = []
        for i, layer in enumerate(model.model.layers):
            attn, mlp, norms = layer.self_attn, layer.mlp, layer.norms()
            _check_covered(cfg.architecture, i, layer, norms)
            parts = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(type(p) is not FastLinear for p in parts):
                raise CompileError(
                    f"--compile covers float32 / bfloat16 models with fused projections; layer {i} has "
                    f"{', '.join(sorted({type(p).__name__ for p in parts if type(p) is not FastLinear}))} "
                    "(a quantized, sparse or unfused layer): run it without --compile (brisk's own kernels)")
            if any(m._forward_hooks or m._forward_pre_hooks for m in (layer, attn, mlp, *parts)):
                raise CompileError(f"--compile cannot trace forward hooks (layer {i} has one); remove them first")
            eps = norms.input.eps
            if norms.mlp.eps != eps:
                raise CompileError("--compile expects one RMSNorm eps per layer")
            self.layers.append((norms.input.weight, attn.qkv_proj.weight, attn.qkv_proj.bias,
                                attn.o_proj.weight, norms.mlp.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight,
                                eps))
        if not self.layers:
            raise CompileError("--compile needs a model with at least one layer")
        if any(w.dtype != dtype for w in (self.layers[0][0], self.layers[0][1])):
            raise CompileError("--compile needs the norms and weights in one dtype (float32 or bfloat16)")
        a = model.model.layers[0].self_attn
        self.h, self.kvh, self.d, self.scale = a.num_heads, a.num_kv_heads, a.head_dim, a.scale
        self.hidden = cfg.hidden_size
        self.norm, self.norm_eps = model.model.norm.weight, model.model.norm.eps
        self.dtype = dtype
        ops = kernels.get_ops()
        self.decode_attention = ops.paged_decode_attention.default
        self.prefill_attention = ops.paged_prefill_attention.default
        self.first = torch.compile(_first, dynamic=False, fullgraph=True)
        self.mid = torch.compile(_mid, dynamic=False, fullgraph=True)
        self.last = torch.compile(_last, dynamic=False, fullgraph=True)
        self.compile_seconds = 0.0

    def applies(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[Any]) -> bool:
        return straight_line_step(x, meta, kv_caches, self.dtype)  # the decode plan's conditions

    def _pad(self, t: int, *tensors: torch.Tensor) -> list[torch.Tensor]:
        rows = bucket_rows(t)
        if rows == t:
            return list(tensors)
        return [torch.cat((x, x.new_zeros((rows - t, *x.shape[1:])))) for x in tensors]

    def _mark(self, t: int, *tensors: torch.Tensor) -> None:
        if t > STATIC_BUCKETS[-1]:  # one graph for every larger row count
            for x in tensors:
                torch._dynamo.mark_dynamic(x, 0, min=STATIC_BUCKETS[-1] + 1, max=1 << 20)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """x: [T, hidden] embeddings -> [T, hidden] final-normed hidden states."""
        t, h, kvh, d = x.shape[0], self.h, self.kvh, self.d
        window = meta.sliding_window or 0
        slots, tables, lens = meta.slot_mapping, meta.block_tables, meta.context_lens
        qsl = None if meta.num_decodes == tables.shape[0] == t else meta.query_start_loc
        x, cos, sin = self._pad(t, x, cos.contiguous(), sin.contiguous())
        self._mark(t, x, cos, sin)
        ln1, wqkv, bqkv, *_, eps = self.layers[0]
        q, k, v, residual = self.first(x, ln1, wqkv, bqkv, cos, sin, eps, h, kvh)
        rows = x.shape[0]
        for i, kv in enumerate(kv_caches):
            write_kv(kv, k[:t], v[:t], slots)
            o = torch.zeros((rows, h, d), dtype=x.dtype) if rows > t else torch.empty((t, h, d), dtype=x.dtype)
            if qsl is None:
                self.decode_attention(o[:t], q[:t], kv, tables, lens, self.scale, window)
            else:
                self.prefill_attention(o[:t], q[:t], kv, qsl, tables, lens, self.scale, window, PREFILL_Q_TILE)
            o = o.view(rows, h * d)
            self._mark(t, o, residual)
            _, _, _, wo, ln2, wgu, wd, eps = self.layers[i]
            if i + 1 < len(self.layers):
                ln1, wqkv, bqkv, *_, eps1 = self.layers[i + 1]
                q, k, v, residual = self.mid(o, residual, wo, ln2, wgu, wd, ln1, wqkv, bqkv, cos, sin, eps, h, kvh)
            else:
                return self.last(o, residual, wo, ln2, wgu, wd, self.norm, eps, self.norm_eps)[:t]
        raise AssertionError("unreachable")

    @torch.inference_mode()  # as the runner steps: dynamo guards on grad mode, another mode would recompile
    def warm_up(self, max_tokens: int) -> float:
        """Compile every bucket a step of up to max_tokens rows can reach (the static ones, and the dynamic one
        when max_tokens exceeds 8) on dummy inputs; returns the seconds it took."""
        start = time.perf_counter()
        half = self.d // 2
        sizes = [b for b in STATIC_BUCKETS if b <= bucket_rows(max_tokens)]
        if max_tokens > STATIC_BUCKETS[-1]:
            sizes.append(STATIC_BUCKETS[-1] + 8)
        ln1, wqkv, bqkv, wo, ln2, wgu, wd, eps = self.layers[0]
        for rows in sizes:
            x = torch.zeros((rows, self.hidden), dtype=self.dtype)
            cos, sin = torch.ones((rows, half)), torch.zeros((rows, half))
            o = torch.zeros((rows, self.h * self.d), dtype=self.dtype)
            self._mark(rows, x, cos, sin, o)
            _, _, _, residual = self.first(x, ln1, wqkv, bqkv, cos, sin, eps, self.h, self.kvh)
            self._mark(rows, residual)
            self.mid(o, residual, wo, ln2, wgu, wd, ln1, wqkv, bqkv, cos, sin, eps, self.h, self.kvh)
            self.last(o, residual, wo, ln2, wgu, wd, self.norm, eps, self.norm_eps)
        self.compile_seconds += time.perf_counter() - start
        return time.perf_counter() - start


def check_can_compile() -> None:
    """Raise CompileError where --compile cannot run on this machine (no kernels, no C++ compiler); otherwise get
    dynamo ready for the graphs (the brisk ops' shape functions, room in its cache)."""
    if kernels.get_ops() is None or not hasattr(kernels.get_ops(), "linear_small_m"):
        raise CompileError("--compile needs brisk's C++ kernels, which did not build here (see the warning "
                           "above); run without --compile")
    if shutil.which("g++") is None and shutil.which("c++") is None:
        raise CompileError("--compile needs a C++ compiler (inductor generates C++); install g++ or run "
                           "without --compile")
    _register_fakes()
    # 5 buckets x 3 graphs per model shape and dtype; a process may hold several (tests, a draft model)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)


def compile_model(model: LlamaForCausalLM, max_tokens: int) -> CompiledModel:
    """The compiled graphs of `model`, with every shape bucket a step of up to `max_tokens` rows (the
    scheduler's token budget) can reach compiled (`compile_seconds` says how long that took).

    Raises CompileError for what cannot be compiled (quantized / sparse layers, no C++ compiler, no kernels)."""
    check_can_compile()
    compiled = CompiledModel(model)
    seconds = compiled.warm_up(max_tokens)
    logger.info("--compile: the decoder's graphs compiled in %.1f s", seconds)
    return compiled
