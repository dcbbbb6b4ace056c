"""The decode fast path: the decoder layers of a decode-only step as straight-line calls to the C++ kernels.

At batch-1 decode a layer's arithmetic is a few GEMVs; what else a step costs is Python: ~270 module calls
(`nn.Module.__call__`), the wrappers' checks for which kernel applies, and ~10 us of dispatch per op. A plan
resolves all of that once per model: for each layer the kernels and the tensors they take (norm weights, the
fused q/k/v and gate/up weights, packed codes of quantized layers), so a step is ~10 direct kernel calls per
layer and nothing else:

    h = add_rms_norm(x, residual)           (rms_norm for layer 0)
    qkv = linear(h); rope_cache(qkv)        (RoPE in place, k and v into the paged cache)
    o = paged_decode_attention(q)           (reads the paged cache in place)
    h = add_rms_norm(linear(o), residual)
    x = linear(silu_mul(linear(h)))
    h = add_rms_norm(x, residual)           (the model's final norm, after the last layer)

For steps of up to 8 rows the loop itself runs in C++ (ops/csrc/decode_layers.cpp: one call a step, the same
kernels through the dispatcher), which removes the ~5-6 us of Python per kernel call (~2 ms a step here; measured
1.1x float32 and 1.1-1.25x int4 batch-1 decode). It calls the very kernels the modules call, with the same inputs,
so its logits equal the module path's bit for bit (tests/test_decode_plan.py).

Steps with several rows per sequence (speculative verification of γ + 1 positions, prefill chunks, mixed
batches) run the same loop with paged_prefill_attention over query_start_loc instead of paged_decode_attention, as
the module path does; verification steps of up to 8 rows thus also run in C++.

A model gets no plan, and keeps the module path, when any layer has a part the plan does not cover (unfused
projections, custom linears, pruned layers of a bfloat16 model, hooks); a step takes the module path when its
caches are quantized or evicting, or attention scores are being collected (H2O).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from brisk.ops import kernels
from brisk.ops.attention import PREFILL_Q_TILE, AttentionMetadata
from brisk.ops.linear import MAX_SMALL_M, FastLinear, linear

if TYPE_CHECKING:
    from brisk.model.llama import LlamaForCausalLM

_DTYPES = (torch.float32, torch.bfloat16)
Linear = Callable[[torch.Tensor], torch.Tensor]
# A linear as ops/csrc/decode_layers.cpp takes it for batches of up to MAX_SMALL_M rows: (kind, six tensor slots,
# bits, group size); kind 0 = float weight (linear_small_m), 1 = int8 activations (quant_linear_q8), 2 = packed codes
# with float activations (quant_linear_small), 3 = pruned weight (sparse_linear; "bits" = its value kind 32/8/4),
# 4 = pruned int8 weight with int8 activations (sparse_q8_linear), 5 / 6 = tiled 8/4-bit codes with int8 / float
# activations (quant_linear_q8t / quant_linear_t).
CppLinear = tuple[int, list[torch.Tensor | None], int, int]


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps: float
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    cpp: list[CppLinear] | None = None  # the four linears for decode_layers, None if one has no C++ form


def _fast_linear(module: FastLinear, ops: Any) -> Linear | None:
    w, b = module.weight, module.bias
    if w.dtype not in _DTYPES or not w.is_contiguous() or (b is not None and b.dtype != w.dtype):
        return None
    small = ops.linear_small_m.default

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= MAX_SMALL_M:  # ops.linear.linear's choice
            return small(x, w, b)
        return linear(x, w, b, module.packed_weight)

    run.cpp = (0, [w, b, None, None, None, None], 0, 0)  # type: ignore[attr-defined]
    return run


def _quant_linear(module: nn.Module, ops: Any) -> Linear | None:
    from brisk.ops.qlinear import quant_linear
    from brisk.ops.qlinear_q8 import MAX_Q8_ROWS, covers

    pw, b = module.packed, module.bias
    if not pw.blocked:
        return None
    small = ops.quant_linear_small.default
    int8 = module.quant_activations == "int8"
    if pw.tiled:  # quant_q8t.cpp's layout and kernels (ops.qlinear.quant_linear's choices)
        op = getattr(ops, "quant_linear_q8t" if int8 else "quant_linear_t", None)
        if op is None:
            return None
        tiled = op.default

        def run_tiled(x: torch.Tensor) -> torch.Tensor:
            if int8:  # int8 activations: the kernel at every row count
                return tiled(x, pw.data, pw.scales, pw.zeros, pw.bits, pw.group_size, b)
            if x.shape[0] <= MAX_SMALL_M:
                return tiled(x, pw.data, pw.scales, pw.zeros, pw.codebook, pw.bits, pw.group_size, b)
            return quant_linear(x, pw, b)

        run_tiled.cpp = ((5, [pw.data, pw.scales, pw.zeros, b, None, None], pw.bits, pw.group_size) if int8  # type: ignore
                         else (6, [pw.data, pw.scales, pw.zeros, pw.codebook, b, None], pw.bits, pw.group_size))
        return run_tiled
    q8 = ops.quant_linear_q8.default if int8 and covers(pw) and hasattr(ops, "quant_linear_q8") else None

    def run(x: torch.Tensor) -> torch.Tensor:
        # ops.qlinear.quant_linear's choices
        if q8 is not None:
            if x.shape[0] <= MAX_Q8_ROWS:
                return q8(x, pw.data, pw.scales, pw.zeros, pw.bits, pw.group_size, b)
            return quant_linear(x, pw, b, int8_activations=True)
        if x.shape[0] <= MAX_SMALL_M:
            return small(x, pw.data, pw.scales, pw.zeros, pw.codebook, pw.bits, pw.group_size, b)
        return quant_linear(x, pw, b, int8_activations=int8)

    run.cpp = ((1, [pw.data, pw.scales, pw.zeros, b, None, None], pw.bits, pw.group_size) if q8 is not None  # type: ignore
               else (2, [pw.data, pw.scales, pw.zeros, pw.codebook, b, None], pw.bits, pw.group_size))
    return run


def _sparse_linear(module: nn.Module, ops: Any, dtype: torch.dtype) -> Linear | None:
    """A pruned layer (ops.sparse.SparseLinear): its kernel for up to MAX_SMALL_M rows, as ops.sparse.sparse_linear
    chooses. The kernels take float32 activations, so only float32 models get it."""
    from brisk.ops.sparse import MAX_SMALL_M as SPARSE_SMALL_M
    from brisk.ops.sparse import sparse_linear

    sw, b, int8_dot = module.sparse, module.bias, module.int8_dot
    op = getattr(ops, "sparse_q8_linear" if int8_dot else "sparse_linear", None)
    if dtype != torch.float32 or op is None or SPARSE_SMALL_M != MAX_SMALL_M:
        return None
    small = op.default
    bf = None if b is None else b.float()

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > MAX_SMALL_M:
            return sparse_linear(x, sw, b, int8_dot=int8_dot)
        if int8_dot:
            return small(x, sw.mask, sw.row_ptr, sw.values, sw.scales, sw.group_size, bf)
        return small(x, sw.mask, sw.row_ptr, sw.values, sw.scales, sw.mins, sw.kind, sw.group_size, bf)

    run.cpp = ((4, [sw.mask, sw.row_ptr, sw.values, sw.scales, bf, None], 8, sw.group_size) if int8_dot  # type: ignore
               else (3, [sw.mask, sw.row_ptr, sw.values, sw.scales, sw.mins, bf], sw.kind, sw.group_size))
    return run


def _resolve_linear(module: nn.Module | None, ops: Any, dtype: torch.dtype) -> Linear | None:
    from brisk.ops.sparse import SparseLinear
    from brisk.quant.layers import QuantLinear

    if module is None or module._forward_hooks or module._forward_pre_hooks:
        return None
    if type(module) is FastLinear:
        return _fast_linear(module, ops)
    if type(module) is QuantLinear:
        return _quant_linear(module, ops)
    if type(module) is SparseLinear:
        return _sparse_linear(module, ops, dtype)
    return None


class DecodePlan:
    """Straight-line decode over a model's layers; build with `DecodePlan.build(model)` (None if not covered)."""

    def __init__(self, layers: list[_Layer], num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype, ops: Any, final_norm: torch.Tensor, final_eps: float) -> None:
        self.layers = layers
        self.final_norm, self.final_eps = final_norm, final_eps
        self.h, self.kvh, self.d = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.dtype = dtype
        self.rms_norm = ops.rms_norm.default
        self.add_rms_norm = ops.add_rms_norm.default
        self.silu_mul = ops.silu_mul.default
        self.rope_cache = ops.rope_cache.default
        self.attention = ops.paged_decode_attention.default
        self.prefill_attention = ops.paged_prefill_attention.default
        # the whole layer loop in one C++ call (ops/csrc/decode_layers.cpp) for batches of up to MAX_SMALL_M rows
        self.decode_layers = getattr(ops, "decode_layers", None)
        if self.decode_layers is not None:
            # the overload's C++ entry point: torch's Python wrapper of an op with a torchbind argument (the
            # DecodeWeights below) walks every argument looking for fake script objects, ~15 us a step
            self.decode_layers = getattr(self.decode_layers.default, "_op", self.decode_layers.default)
        self.params: list[torch.Tensor | None] = []
        self.spec: list[int] = []
        for layer in layers:
            self.params += [layer.ln1, layer.ln2]
            for kind, slots, bits, group in layer.cpp or []:
                self.params += slots
                self.spec += [kind, bits, group]
        self.eps = [layer.eps for layer in layers]
        # the C++ loop's copy of params / spec / eps, converted once (not at every step)
        self.weights = None if self.decode_layers is None else torch.classes.brisk.DecodeWeights(
            self.params, self.spec, self.eps, final_norm, final_eps)

    @staticmethod
    def build(model: LlamaForCausalLM) -> DecodePlan | None:
        ops = kernels.get_ops()
        needed = ("linear_small_m", "rms_norm", "add_rms_norm", "silu_mul", "rope_cache", "paged_decode_attention",
                  "paged_prefill_attention", "quant_linear_small")
        if ops is None or not all(hasattr(ops, n) for n in needed):
            return None
        config = model.config
        dtype = model.model.norm.weight.dtype  # the model dtype (a quantized embedding has no float weight)
        if dtype not in _DTYPES or config.head_dim % 8:
            return None
        layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if any(m._forward_hooks or m._forward_pre_hooks for m in (layer, attn, mlp)):
                return None
            parts = [_resolve_linear(m, ops, dtype)
                     for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if any(p is None for p in parts) or any(n.weight.dtype != dtype for n in norms):
                return None
            if norms[0].eps != norms[1].eps:
                return None
            layers.append(_Layer(norms[0].weight, norms[1].weight, norms[0].eps, *parts,
                                 cpp=[p.cpp for p in parts]))
        a = model.model.layers[0].self_attn if len(model.model.layers) else None
        if a is None:
            return None
        final = model.model.norm
        if final._forward_hooks or final._forward_pre_hooks or final.weight.dtype != dtype:
            return None
        return DecodePlan(layers, a.num_heads, a.num_kv_heads, a.head_dim, a.scale, dtype, ops, final.weight,
                          final.eps)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[Any]) -> bool:
        return straight_line_step(x, meta, kv_caches, self.dtype)

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, hidden] embeddings -> (the final norm's output, the residual stream), as the layers and then
        the model's final norm (a fused residual add + RMSNorm) give them."""
        t, h, kvh, d = x.shape[0], self.h, self.kvh, self.d
        window = meta.sliding_window or 0
        slots, tables, lens = meta.slot_mapping, meta.block_tables, meta.context_lens
        # decode-only: one query row per sequence; else rows of sequence b = [qsl[b], qsl[b + 1]) (ops.attention's
        # paged_attention makes the same choice of kernel)
        qsl = None if meta.num_decodes == tables.shape[0] == t else meta.query_start_loc
        if self.decode_layers is not None and t <= MAX_SMALL_M and not _cpp_loop_disabled():
            return self.decode_layers(x, cos, sin, slots, tables, lens, kv_caches, self.weights, self.scale, window, h,
                                      kvh, d, qsl, PREFILL_Q_TILE)
        residual = x
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hid = self.rms_norm(x, layer.ln1, layer.eps) if i == 0 else self.add_rms_norm(x, residual, layer.ln1,
                                                                                            layer.eps)
            qkv = layer.qkv(hid)  # [B, (h + 2 kvh) d]
            self.rope_cache(qkv, cos, sin, kv, slots, h, kvh)
            q = qkv.view(t, h + 2 * kvh, d)[:, :h]
            o = torch.empty((t, h, d), dtype=x.dtype)
            if qsl is None:
                self.attention(o, q, kv, tables, lens, self.scale, window)
            else:
                self.prefill_attention(o, q, kv, qsl, tables, lens, self.scale, window, PREFILL_Q_TILE)
            hid = self.add_rms_norm(layer.o(o.view(t, h * d)), residual, layer.ln2, layer.eps)
            x = layer.down(self.silu_mul(layer.gate_up(hid)))
        return self.add_rms_norm(x, residual, self.final_norm, self.final_eps), residual


def straight_line_step(x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[Any], dtype: torch.dtype) -> bool:
    """Whether a step can skip the module path (the decode plan, --compile's graphs): plain caches of the model
    dtype (or bfloat16), no eviction or score collection, and either decode-only or laid out by query_start_loc
    (speculative verification, prefill chunks, mixed steps)."""
    bt = meta.block_tables
    if bt is None or meta.evicting or meta.stats is not None:
        return False
    decode_only = meta.num_decodes == bt.shape[0] == x.shape[0]
    return ((decode_only or meta.query_start_loc is not None)
            and x.dtype == dtype and x.is_cpu and type(kv_caches[0]) is torch.Tensor
            and kv_caches[0].dtype in (dtype, torch.bfloat16) and kv_caches[0].is_contiguous())


def _cpp_loop_disabled() -> bool:
    """BRISK_DISABLE_CPP_LAYER_LOOP=1: run the plan's layer loop in Python (for comparisons and tests)."""
    return os.environ.get("BRISK_DISABLE_CPP_LAYER_LOOP", "") not in ("", "0")


def decode_plan_or_none(model: LlamaForCausalLM) -> DecodePlan | None:
    """The model's plan, built on first use and rebuilt when its layers or the kernels' availability change.
    BRISK_DISABLE_DECODE_PLAN=1 turns it off (the module path then runs every step, for comparisons)."""
    if os.environ.get("BRISK_DISABLE_DECODE_PLAN", "") not in ("", "0"):
        return None
    key = (id(model.model.layers), len(model.model.layers), kernels.get_ops() is not None,
           getattr(model, "_quant_activations", "float"))
    cached = getattr(model, "_decode_plan", None)
    if cached is None or cached[0] != key:
        cached = (key, DecodePlan.build(model))
        model._decode_plan = cached
    return cached[1]

