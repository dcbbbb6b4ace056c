"""The decode fast path: the decoder layers of a decode-only step as straight-line calls to the C++ kernels.

At batch-1 decode a layer's arithmetic is a few GEMVs; what else a step costs is Python: ~270 module calls
(`nn.Module.__call__`), the wrappers' checks for which kernel applies, and ~10 us of dispatch per op. A plan
resolves all of that once per model: for each layer the kernels and the tensors they take (norm weights, the
fused q/k/v and gate/up weights, packed codes of quantized layers) and its settings, so a step is ~10 direct kernel
calls per layer and nothing else:

    h = add_rms_norm(x, residual)           (rms_norm for layer 0)
    qkv = linear(h); rope_cache(qkv)        (RoPE in place, k and v into the paged cache; qwen3 and gemma3 first
                                             normalize each q and k head in place, as ops.fused.rms_norm_qk_heads_)
    o = paged_decode_attention(q)           (reads the paged cache in place)
    a = linear(o)                           (gemma3: a = rms_norm(a), its post-attention norm)
    h = add_rms_norm(a, residual)
    x = linear(act_mul(linear(h)))          (silu_mul; gemma3 gelu_tanh_mul, then x = rms_norm(x); a MoE layer:
                                             the routed block below)
    h = add_rms_norm(x, residual)           (the model's final norm, after the last layer)

What differs between the architectures' layers is data in each layer's description (_Layer), read from the one
decoder layer of model/llama.py (its norms by role, DecoderLayer.norms(); the attention's and the MLP's fields),
never from an architecture's name: the optional norms (qwen3's and gemma3's q/k head norms, gemma3's sandwich
norms around attention and MLP, each weight the multiplier RMSNorm.scale_weight gives: gemma3's 1 + w), the
activation, the attention scale, a per-layer window (gemma3's local layers; 0 on global ones) and RoPE table
(the prologue stacks a model's tables as [tables, T, d/2]: gemma3's global and local ones, smollm3's global one and
the identity its layers without RoPE rotate by), and the MLP: a dense one's two linears or routed experts (_Moe,
below). A new architecture whose layers are made of these parts runs both loops with no change here. gemma3's
bfloat16 norms multiply by the float32 1 + w and round once, which the norm kernels do for a float32 weight on
bfloat16 rows (ops.fused round_once), in the module path as here.

For steps of up to 8 rows (CPP_MAX_ROWS) the loop itself runs in C++ (ops/csrc/decode_layers.cpp: one call a
step, the same kernels through the dispatcher), which removes the ~5-6 us of Python per kernel call (~2 ms a step
here; measured 1.1x float32 and 1.1-1.25x int4 batch-1 decode). It calls the very kernels the modules call, with
the same inputs, so its logits equal the module path's bit for bit (tests/test_decode_plan.py).

Steps with several rows per sequence (speculative verification of γ + 1 positions, prefill chunks, mixed
batches) run the same loop with paged_prefill_attention over query_start_loc instead of paged_decode_attention, as
the module path does; verification steps of up to 8 rows thus also run in C++.

Mixture-of-experts layers (mixtral, qwen2_moe, qwen3_moe: model/moe.py) run in both loops with the dense MLP line
replaced by the routed block (_Moe), the module path's own sequence of ops (moe_forward):

    p = softmax(F.linear(h, router)); (w, e) = top-k(p)      (float32; w renormalized where the architecture does)
    picks sorted by expert; per expert with rows: y = down(act_mul(gate_up(h[rows])))   (its kernel descriptors)
    x = index_add(w * y) [+ sigmoid(F.linear(h, shared_gate)) * shared(h)]              (qwen2_moe's shared expert)

The Python loop calls moe_forward with each expert's descriptors; the C++ loop (steps of up to 8 rows, so every
expert's rows fit its small-row kernel) runs the same ATen ops around the same kernels in the same order. Each
chosen expert runs once a step on all its rows, as on the module path, and all three paths give the same numbers
(tests/test_decode_plan_moe.py); record_expert_loads sees the routing of every path (the C++ loop writes each
layer's rows per expert into DecodeWeights' counts while it is on).

The per-head q/k norms (qwen3, gemma3) run in both loops between the qkv linear and rope_cache: the Python loop
calls the module path's own function (ops.fused.rms_norm_qk_heads_), the C++ loop the same rms_norm kernel on the
same rows of d, so all three paths give the same numbers.

A model gets no plan, and keeps the module path, when any layer has a part the plan does not cover (unfused
projections, custom linears, pruned layers of a bfloat16 model, hooks); a step takes the module path when its
caches are evicted by H2O (attention scores collected), or by StreamingLLM in a model whose layers have windows of
their own (gemma3); StreamingLLM's other steps take the Python loop, attention on the kernel with its sinks.
Quantized (int8 / int4) caches run both loops: the Python one as the module path (apply_rope, the cache's write,
attention over the codes), the C++ one with the same kernels (rope_qk, bit-identical to apply_rope; kv_write_int8 /
kv_write_int4, which the caches' writes call; paged_attention_general). Which of these runs a step is decided in
one place, engine/executor.py; the plan lives beside it in engine/ because it is a way of running a model, chosen
by the engine's settings, and the model itself (model/llama.py) must not know it exists. Each linear enters the
plan as its kernel descriptor (ops/layers.py LinearKernel), which both loops call or pass on as is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from brisk.kvcache.quant import QuantizedKVCache
from brisk.model.llama import GELU_TANH as _GELU_TANH
from brisk.model.llama import SILU as _SILU
from brisk.model.llama import DecoderLayer
from brisk.model.moe import ExpertLoads, SparseMoeBlock, moe_forward
from brisk.model.rope import apply_rope
from brisk.ops import kernels
from brisk.ops.attention import PREFILL_Q_TILE, AttentionMetadata, paged_attention, write_kv
from brisk.ops.fused import rms_norm_qk_heads_
from brisk.ops.layers import RUNTIME_LINEARS, LinearKernel
from brisk.ops.metadata import with_sliding_window
from brisk.ops.w8a8 import Int8Linear

if TYPE_CHECKING:
    from torch import nn

    from brisk.model.llama import LlamaForCausalLM

_DTYPES = (torch.float32, torch.bfloat16)
CPP_MAX_ROWS = 8  # ops/csrc/decode_layers.cpp takes steps of at most 8 rows (every linear on its small-row kernel)


SILU, GELU_TANH = 0, 1  # a layer's activation kind: silu_mul (SwiGLU), gelu_tanh_mul (GeGLU, gemma3)
_ACT_OPS = {SILU: "silu_mul", GELU_TANH: "gelu_tanh_mul"}  # each kind's kernel (ops)
_DENSE_MLP_INTS = [0, 0, 0, 0, 0]  # a dense layer's MoE ints in the C++ loop's layer_spec (_Moe.ints)


@dataclass
class _Moe:
    """A layer's routed experts (model/moe.py SparseMoeBlock) as both loops run them: the router and the shared
    expert's gate as float [out, hidden] weights, each expert's fused gate/up and down as kernel descriptors."""

    block: SparseMoeBlock  # read for its `loads` only (record_expert_loads)
    router: torch.Tensor  # [E, hidden], model dtype
    experts: list[tuple[LinearKernel, LinearKernel]]  # per expert: gate_up, down
    top_k: int
    normalize: bool  # renormalize the top-k weights (mixtral; qwen where norm_topk_prob)
    float32_weights: bool  # mixtral sums in float32; qwen casts the weights to the model dtype
    shared: tuple[LinearKernel, LinearKernel] | None  # qwen2_moe's always-on expert
    shared_gate: torch.Tensor | None  # [1, hidden], its sigmoid gate
    act_mul: Any  # the kernel between each expert's gate_up and down (the layer's act)

    def __post_init__(self) -> None:
        # what moe_forward takes in place of the modules: x -> logits, x -> an expert's output
        router, gate = self.router, self.shared_gate
        self.route_logits = lambda x: F.linear(x, router)  # [T, E]
        self.gate_logits = None if gate is None else (lambda x: F.linear(x, gate))  # [T, 1]
        self.calls = [_expert_call(gu, down, self.act_mul) for gu, down in self.experts]
        self.shared_call = None if self.shared is None else _expert_call(*self.shared, self.act_mul)

    @property
    def linears(self) -> list[LinearKernel]:
        """In the C++ loop's order: every expert's gate_up, down; then the shared expert's."""
        pairs = [*self.experts, *([self.shared] if self.shared is not None else [])]
        return [k for pair in pairs for k in pair]

    @property
    def ints(self) -> list[int]:
        """The C++ loop's MoE ints of the layer (ops/csrc/decode_layers.cpp): E, top-k and the three flags."""
        return [len(self.experts), self.top_k, int(self.normalize), int(self.float32_weights),
                int(self.shared is not None)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> the block's output [T, hidden], as SparseMoeBlock.forward gives it."""
        return moe_forward(x, self.route_logits, self.top_k, self.normalize, self.float32_weights, self.calls,
                           self.shared_call, self.gate_logits, self.block.loads, self.block.layer_idx)


def _expert_call(gate_up: LinearKernel, down: LinearKernel, act_mul: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: down(act_mul(gate_up(x)))  # [n, hidden] -> [n, 2I] -> [n, I] -> [n, hidden]


@dataclass
class _Layer:
    """One decoder layer as both loops run it: its kernels' tensors and its settings, plain data. The norm weights
    are what multiplies the normalized rows (RMSNorm.scale_weight: gemma3's 1 + w)."""

    ln1: torch.Tensor  # [hidden] the input norm (its residual add fused in)
    ln2: torch.Tensor  # [hidden] the norm before the MLP (residual add fused in): llama's post-attention norm,
    #                    gemma3's pre-feed-forward norm
    eps: float  # every norm of the layer
    qkv: LinearKernel
    o: LinearKernel
    gate_up: LinearKernel | None  # the dense MLP's; None in a MoE layer
    down: LinearKernel | None
    scale: float  # attention's score scale (head_dim ** -0.5; gemma3: query_pre_attn_scalar ** -0.5)
    act: int = SILU  # the MLP's activation (a MoE layer: its experts')
    q_norm: torch.Tensor | None = None  # [d] per-head RMSNorm weights of q and k (qwen3, gemma3), or None
    k_norm: torch.Tensor | None = None
    attn_norm: torch.Tensor | None = None  # [hidden] a norm of the attention output before its residual add
    mlp_norm: torch.Tensor | None = None  # [hidden] a norm of the MLP output (gemma3's sandwich norms), or None
    window: int | None = None  # the layer's own attention window (0: full), or None: the step's (meta)
    rope: int | None = None  # which of the prologue's stacked cos / sin tables (gemma3), or None: the only one
    moe: _Moe | None = None  # routed experts in place of the dense MLP

    @property
    def mlp_linears(self) -> list[LinearKernel]:
        if self.moe is not None:
            return self.moe.linears
        assert self.gate_up is not None and self.down is not None, "a dense layer has its MLP's linears"
        return [self.gate_up, self.down]

    @property
    def linears(self) -> list[LinearKernel]:
        """Every linear of the layer in the C++ loop's order: qkv, o, then the MLP's (mlp_linears)."""
        return [self.qkv, self.o, *self.mlp_linears]


PLAN_LINEARS = (*RUNTIME_LINEARS, Int8Linear)  # Int8Linear: its kernel says which of its kinds the loop takes


def _kernel_of(module: nn.Module | None, dtype: torch.dtype) -> LinearKernel | None:
    """The layer's kernel descriptor (ops/layers.py) where the plan can call it as is: a runtime linear with no
    hooks (a hook must see its inputs) whose small-row kernel takes this model dtype."""
    if module is None or type(module) not in PLAN_LINEARS or module._forward_hooks or module._forward_pre_hooks:
        return None
    kernel = module.kernel()
    return kernel if dtype in kernel.loop_dtypes else None


class DecodePlan:
    """Straight-line decode over a model's layers; build with `DecodePlan.build(model)` (None if not covered)."""

    def __init__(self, layers: list[_Layer], num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 ops: Any, final_norm: torch.Tensor, final_eps: float) -> None:
        self.layers = layers
        self.final_norm, self.final_eps = final_norm, final_eps
        self.h, self.kvh, self.d = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.rms_norm = ops.rms_norm.default
        self.add_rms_norm = ops.add_rms_norm.default
        self.act_mul = {act: getattr(ops, name, ops.silu_mul).default for act, name in _ACT_OPS.items()}
        self.rope_cache = ops.rope_cache.default
        self.attention = ops.paged_decode_attention.default
        self.prefill_attention = ops.paged_prefill_attention.default
        # token-tree verification steps (engine/token_tree.py) in the Python loop: each tree row sees its ancestors
        self.tree_attention = getattr(ops, "paged_tree_attention", None)
        # layers with windows of their own (gemma3's local and global layers) leave StreamingLLM's steps to the modules
        self.own_windows = any(layer.window is not None for layer in layers)
        # the whole layer loop in one C++ call (ops/csrc/decode_layers.cpp) for steps of up to max_cpp_rows rows
        self.decode_layers = getattr(ops, "decode_layers", None)
        if self.decode_layers is not None:
            # the overload's C++ entry point: torch's Python wrapper of an op with a torchbind argument (the
            # DecodeWeights below) walks every argument looking for fake script objects, ~15 us a step
            self.decode_layers = getattr(self.decode_layers.default, "_op", self.decode_layers.default)
        # quantized KV caches in the C++ loop: their rotation, writes and attention built too
        self.quantized_cpp = all(hasattr(ops, name) for name in ("rope_qk", "kv_write_int8", "kv_write_int4",
                                                                   "paged_attention_general"))
        # the C++ loop's per-layer layout (ops/csrc/decode_layers.cpp): 6 norm slots, 6 slots per linear of qkv and
        # o, a MoE layer's router and shared-expert gate, 6 slots per linear of the MLP (dense: gate_up, down; MoE:
        # each expert's); 3 ints per linear (kind, bits, group); 8 ints per layer: its window, RoPE table and
        # activation (-1: the step's window, the one table), then E (0: a dense MLP), top-k, normalize, float32
        # weights, shared expert; its eps and scale
        self.params: list[torch.Tensor | None] = []
        self.spec: list[int] = []
        self.layer_spec: list[int] = []
        for layer in layers:
            gates = [] if layer.moe is None else [layer.moe.router, layer.moe.shared_gate]  # (shared: or None)
            self.params += [layer.ln1, layer.ln2, layer.q_norm, layer.k_norm, layer.attn_norm, layer.mlp_norm,
                            *layer.qkv.slots, *layer.o.slots, *gates, *(t for k in layer.mlp_linears for t in k.slots)]
            self.spec += [n for k in layer.linears for n in (int(k.kind), k.bits, k.group_size)]
            self.layer_spec += [-1 if layer.window is None else layer.window, -1 if layer.rope is None else layer.rope,
                                layer.act, *(_DENSE_MLP_INTS if layer.moe is None else layer.moe.ints)]
        self.eps = [layer.eps for layer in layers]
        self.scales = [layer.scale for layer in layers]
        self.moe_layers = [layer.moe for layer in layers if layer.moe is not None]
        # the C++ loop calls every linear's small-row kernel, so a step must fit all of them
        self.max_cpp_rows = min([CPP_MAX_ROWS] + [k.max_rows for layer in layers for k in layer.linears])
        # the C++ loop's copy of params / spec / eps, converted once (not at every step)
        self.weights = None if self.decode_layers is None else torch.classes.brisk.DecodeWeights(
            self.params, self.spec, self.layer_spec, self.eps, self.scales, final_norm, final_eps)
        # LoRA (brisk/lora/manager.py): each row's adapter slot for the next run_cpp, -1 none; None: no adapters
        self.lora_rows: torch.Tensor | None = None
        # and for `run`: per layer the (qkv, o, gate_up, down) LoRALinear modules whose add_delta(x, y) follows
        # each base kernel, while lora_active
        self.lora_modules: list[tuple[Any, Any, Any, Any]] | None = None
        self.lora_active = False

    def set_lora(self, buffers: list[torch.Tensor]) -> None:
        """Give the C++ loop every projection's adapter buffers (per layer: qkv, o, gate_up, down; A [slots, R, K]
        and B^T [slots, R, N] each, float32, read in place at each step); run_cpp then applies them to the rows
        that lora_rows names."""
        assert self.weights is not None, "the C++ layer loop is not built"
        self.weights.set_lora(buffers)

    @staticmethod
    def build(model: LlamaForCausalLM) -> DecodePlan | None:
        ops = kernels.get_ops()
        needed = ("linear_small_m", "rms_norm", "add_rms_norm", "silu_mul", "rope_cache", "paged_decode_attention",
                  "paged_prefill_attention", "quant_linear_small")
        if ops is None or not all(hasattr(ops, n) for n in needed):
            return None
        dtype = model.model.norm.weight.dtype  # the model dtype (a quantized embedding has no float weight)
        if dtype not in _DTYPES or model.config.head_dim % 8 or not len(model.model.layers):
            return None
        layers = [_layer_of(layer, dtype, ops) for layer in model.model.layers]
        if any(layer is None for layer in layers):
            return None
        a = model.model.layers[0].self_attn
        final = model.model.norm
        if _hooked(final) or not _norm_dtype_ok(final, dtype):
            return None
        return DecodePlan(layers, a.num_heads, a.num_kv_heads, a.head_dim, dtype, ops,  # type: ignore[arg-type]
                          final.scale_weight(), final.eps)

    def applies(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[Any]) -> bool:
        return (straight_line_step(x, meta, kv_caches, self.dtype, plan=True)
                and not (meta.evicting and self.own_windows)
                and not (meta.tree_masks and (self.tree_attention is None or self.own_windows)))

    def run_cpp(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """`run` in one C++ call (ops/csrc/decode_layers.cpp), for steps of up to max_cpp_rows rows; the same
        kernels with the same inputs, so the same numbers bit for bit."""
        assert self.decode_layers is not None and x.shape[0] <= self.max_cpp_rows, "see cpp_applies"
        window = meta.sliding_window or 0
        bits, block_size, caches = 0, 0, kv_caches
        first = kv_caches[0]
        if isinstance(first, QuantizedKVCache):  # each layer's tensors, flat (ops/csrc/decode_layers.cpp kv_bits)
            bits, block_size = first.bits, first.block_size
            caches = [t for kv in kv_caches for t in (kv.kernel_tensors() if bits == 8 else kv.write_state())]
        loads = self.moe_layers[0].block.loads if self.moe_layers else None  # record_expert_loads is on
        counts = None
        if loads is not None:  # the loop writes each MoE layer's rows per expert here
            counts = torch.zeros(len(self.layers), max(len(m.experts) for m in self.moe_layers), dtype=torch.int64)
            self.weights.set_expert_counts(counts)
        try:
            return self.decode_layers(x, cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens, caches,
                                      self.weights, window, self.h, self.kvh, self.d,
                                      _query_start(x, meta), PREFILL_Q_TILE, self.lora_rows, bits, block_size,
                                      meta.tree_row_bits() if meta.tree_masks else None)
        finally:
            if counts is not None:
                self.weights.set_expert_counts(None)
                _record_loads(loads, self.layers, counts)

    def cpp_applies(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[Any]) -> bool:
        """Steps of up to max_cpp_rows rows, not under eviction (StreamingLLM's sinks: the Python loop); with an
        int8 / int4 cache, where its kernels built (the loop then rotates with rope_qk and writes with
        kv_write_int8 / kv_write_int4, as the caches' own writes do). Token trees (on a float cache: `applies`)
        where the loop was built with paged_tree_attention."""
        return (self.decode_layers is not None and x.shape[0] <= self.max_cpp_rows and not meta.evicting
                and not (meta.tree_masks and self.tree_attention is None)
                and (self.quantized_cpp or not isinstance(kv_caches[0], QuantizedKVCache)))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
            kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, hidden] embeddings -> (the final norm's output, the residual stream), as the layers and then
        the model's final norm (a fused residual add + RMSNorm) give them. The layer loop in Python."""
        t, h, kvh, d = x.shape[0], self.h, self.kvh, self.d
        slots, tables, lens = meta.slot_mapping, meta.block_tables, meta.context_lens
        qsl = _query_start(x, meta)
        residual = x
        lora = self.lora_modules if self.lora_active else None
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches, strict=True)):
            eps = layer.eps
            hid = self.rms_norm(x, layer.ln1, eps) if i == 0 else self.add_rms_norm(x, residual, layer.ln1, eps)
            qkv = layer.qkv(hid)  # [B, (h + 2 kvh) d]
            if lora is not None:
                lora[i][0].add_delta(hid, qkv)
            if layer.q_norm is not None:
                # (a float32 weight on bfloat16 rows comes only from a norm that rounds once: _norm_dtype_ok)
                rms_norm_qk_heads_(qkv, layer.q_norm, layer.k_norm, eps, h, kvh, round_once=True)
            layer_cos, layer_sin = (cos, sin) if layer.rope is None else (cos[layer.rope], sin[layer.rope])  # [B, d/2]
            window = (meta.sliding_window or 0) if layer.window is None else layer.window
            if isinstance(kv, QuantizedKVCache) or meta.evicting:
                step = meta if layer.window is None else with_sliding_window(meta, layer.window or None)
                o = _module_attention(qkv, layer_cos, layer_sin, kv, step, h, kvh, d, layer.scale)
            else:
                self.rope_cache(qkv, layer_cos, layer_sin, kv, slots, h, kvh)
                q = qkv.view(t, h + 2 * kvh, d)[:, :h]
                o = torch.empty((t, h, d), dtype=x.dtype)
                if qsl is None:
                    self.attention(o, q, kv, tables, lens, layer.scale, window)
                elif meta.tree_masks:  # (trees attend the whole context: no window; straight_line_step)
                    self.tree_attention.default(o, q, kv, qsl, tables, lens, layer.scale, PREFILL_Q_TILE,
                                                meta.tree_row_bits())
                else:
                    self.prefill_attention(o, q, kv, qsl, tables, lens, layer.scale, window, PREFILL_Q_TILE)
            attn = o.view(t, h * d)
            out = layer.o(attn)  # [B, hidden]
            if lora is not None:
                lora[i][1].add_delta(attn, out)
            if layer.attn_norm is not None:
                out = self.rms_norm(out, layer.attn_norm, eps)
            hid = self.add_rms_norm(out, residual, layer.ln2, eps)
            if layer.moe is not None:
                assert lora is None, "LoRA adapters wrap dense layers only"
                x = layer.moe(hid)  # router, top-k, each chosen expert once over its rows (model/moe.py)
            else:
                gate_up = layer.gate_up(hid)  # type: ignore[misc]  # [B, 2 I]
                if lora is not None:
                    lora[i][2].add_delta(hid, gate_up)
                act = self.act_mul[layer.act](gate_up)  # [B, I]
                x = layer.down(act)  # type: ignore[misc]
                if lora is not None:
                    lora[i][3].add_delta(act, x)
            if layer.mlp_norm is not None:
                x = self.rms_norm(x, layer.mlp_norm, eps)
        return self.add_rms_norm(x, residual, self.final_norm, self.final_eps), residual


def _hooked(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _norm_dtype_ok(norm: nn.Module, dtype: torch.dtype) -> bool:
    """Whether the norm kernels compute this norm's numbers: a weight of the model dtype, or a float32 one on a norm
    that applies it in float32 and rounds once (gemma3's 1 + w: the kernels' float32-weight form)."""
    w = norm.scale_weight()
    return w.dtype == dtype or (norm.round_once and w.dtype == torch.float32)


def _layer_of(layer: nn.Module, dtype: torch.dtype, ops: Any) -> _Layer | None:
    """A decoder layer (model/llama.py DecoderLayer: its norms by role, attention, a dense MLP or routed experts)
    as the plan's plain data, or None where a part is not covered: a linear with no kernel for this dtype (an
    unfused MLP among them), hooks, a norm or router weight of another dtype (_norm_dtype_ok)."""
    if not isinstance(layer, DecoderLayer):
        return None
    attn, mlp = layer.self_attn, layer.mlp
    routed = isinstance(mlp, SparseMoeBlock)  # routed experts (model/moe.py) in place of the dense MLP
    act = _activation_of([*mlp.experts, *([mlp.shared_expert] if mlp.shared_expert is not None else [])]
                         if routed else [mlp], ops)
    if act is None or _hooked(layer, attn, mlp):
        return None
    act_mul = getattr(ops, _ACT_OPS[act]).default
    moe = _moe_of(mlp, dtype, act_mul) if routed else None
    dense = None if routed else _mlp_kernels(mlp, dtype)
    if moe is None and dense is None:
        return None
    parts = [_kernel_of(attn.qkv_proj, dtype), _kernel_of(attn.o_proj, dtype), *(dense or (None, None))]
    roles = layer.norms()
    norms = [roles.input, roles.attn_out, roles.mlp, roles.mlp_out, attn.q_norm, attn.k_norm]
    present = [n for n in norms if n is not None]
    if (any(p is None for p in parts[:2]) or _hooked(*present) or any(n.eps != present[0].eps for n in present)
            or any(not _norm_dtype_ok(n, dtype) for n in present)):
        return None
    ln1, attn_norm, ln2, mlp_norm, q_norm, k_norm = (None if n is None else n.scale_weight() for n in norms)
    window = (attn.sliding_window or 0) if attn.own_window else None  # its own (0: a global layer), or the step's
    return _Layer(ln1, ln2, present[0].eps, *parts, scale=attn.scale, act=act, q_norm=q_norm,  # type: ignore[misc]
                  k_norm=k_norm, attn_norm=attn_norm, mlp_norm=mlp_norm, window=window, rope=attn.rope_index,
                  moe=moe)


def _activation_of(mlps: list[nn.Module], ops: Any) -> int | None:
    """The activation kind the MLPs (one dense MLP, or a block's experts) share, or None: unknown, mixed or not
    built."""
    acts = {_ACTIVATIONS.get(getattr(m, "act", None)) for m in mlps}
    act = acts.pop() if len(acts) == 1 else None
    return act if act is not None and hasattr(ops, _ACT_OPS[act]) else None


def _mlp_kernels(mlp: nn.Module, dtype: torch.dtype) -> tuple[LinearKernel, LinearKernel] | None:
    """A (fused) MLP's gate_up and down descriptors, or None where the plan cannot call them."""
    if _hooked(mlp) or getattr(mlp, "gate_up_proj", None) is None:
        return None
    gate_up, down = _kernel_of(mlp.gate_up_proj, dtype), _kernel_of(mlp.down_proj, dtype)
    return None if gate_up is None or down is None else (gate_up, down)


def _moe_of(block: SparseMoeBlock, dtype: torch.dtype, act_mul: Any) -> _Moe | None:
    """A routed expert block as the plan runs it, or None (unfused or uncovered experts, hooks, float weights of
    another dtype)."""
    gates = [block.gate] + ([block.shared_expert_gate] if block.shared_expert_gate is not None else [])
    if _hooked(*gates) or any(g.weight.dtype != dtype for g in gates):
        return None
    experts = [_mlp_kernels(e, dtype) for e in block.experts]
    shared = None if block.shared_expert is None else _mlp_kernels(block.shared_expert, dtype)
    if any(e is None for e in experts) or (block.shared_expert is not None and shared is None):
        return None
    return _Moe(block, block.gate.weight, experts, block.top_k, block.normalize, block.float32_weights,  # type: ignore[arg-type]
                shared, None if block.shared_expert_gate is None else block.shared_expert_gate.weight, act_mul)


# the model's activation kinds (model/llama.py MLP.act) as the C++ loop's ints
_ACTIVATIONS: dict[str | None, int] = {_SILU: SILU, _GELU_TANH: GELU_TANH}


def _record_loads(loads: ExpertLoads, layers: list[_Layer], counts: torch.Tensor) -> None:
    """What SparseMoeBlock records of a step, from the C++ loop's counts [layers, max experts]: each MoE layer's
    rows per expert, and one call of every expert that had rows (the grouped dispatch)."""
    for i, layer in enumerate(layers):
        if layer.moe is not None:
            rows = counts[i, :len(layer.moe.experts)].tolist()
            loads.counts.append((layer.moe.block.layer_idx, rows))
            loads.calls.append([int(n > 0) for n in rows])


def _module_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: Any, meta: AttentionMetadata,
                      h: int, kvh: int, d: int, scale: float) -> torch.Tensor:
    """A layer's attention as the module path takes it (model/llama.py Attention.forward) where rope_cache does
    not apply (an int8 / int4 cache, which quantizes on write; eviction): q and k rotated together, k and v
    written, then ops.attention.paged_attention (the C++ kernel reads codes in place and walks sinks and window),
    so both paths give the same numbers."""
    qkv3 = qkv.view(qkv.shape[0], h + 2 * kvh, d)
    qk = apply_rope(qkv3[:, : h + kvh], cos, sin)
    q, k, v = qk[:, :h], qk[:, h:], qkv3[:, h + kvh:]
    write_kv(kv, k, v, meta.slot_mapping)
    return paged_attention(q, k, v, kv, meta, scale)


def straight_line_step(x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[Any], dtype: torch.dtype,
                       plan: bool = False) -> bool:
    """Whether a step can skip the module path (the decode plan, --compile's graphs): plain caches of the model
    dtype (or bfloat16), no eviction or score collection, and either decode-only or laid out by query_start_loc
    (speculative verification, prefill chunks, mixed steps). The plan (`plan`) also takes int8 / int4 CPU caches
    and StreamingLLM's eviction (a window, no scores collected); H2O's stays on the modules. Token trees
    (engine/token_tree.py) run on the plan's Python loop (paged_tree_attention) where their masks fit its 64-bit rows
    and every cache is a plain float one, else on the modules (tree_attention_reference)."""
    bt = meta.block_tables
    if bt is None or meta.stats is not None:
        return False
    if meta.tree_masks and not (plan and meta.sliding_window is None and not meta.evicting
                                and meta.tree_row_bits() is not None
                                and type(kv_caches[0]) is torch.Tensor):
        return False
    if meta.evicting and not (plan and meta.sliding_window is not None):
        return False
    decode_only = meta.num_decodes == bt.shape[0] == x.shape[0]
    if not ((decode_only or meta.query_start_loc is not None) and x.dtype == dtype and x.is_cpu):
        return False
    cache = kv_caches[0]
    if isinstance(cache, QuantizedKVCache):
        return plan and cache.device.type == "cpu"
    return type(cache) is torch.Tensor and cache.dtype in (dtype, torch.bfloat16) and cache.is_contiguous()


def _query_start(x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
    """None for a decode-only step (one query row per sequence: paged_decode_attention); else query_start_loc,
    rows of sequence b = [qsl[b], qsl[b + 1]) (paged_prefill_attention), as ops.attention.paged_attention does."""
    return None if meta.num_decodes == meta.block_tables.shape[0] == x.shape[0] else meta.query_start_loc
