"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE), in plain PyTorch.

A MoE layer replaces the dense MLP with `num_experts` MLPs ("experts") and a router. Each token goes to the
`num_experts_per_tok` (k) experts its router scores highest; the block's output is their outputs weighted by the
routing probabilities (Shazeer et al. 2017; Mixtral: Jiang et al. 2024, eq. 1-2):

    p = softmax(x @ W_router^T)                    float32, over all experts            [T, E]
    (w, e) = top-k(p)                              k probabilities and expert ids       [T, k]
    w = w / sum(w)                                 mixtral always; qwen when norm_topk_prob
    y = sum_j w_j * expert_{e_j}(x)                expert(x) = down(silu(gate(x)) * up(x))
    y += sigmoid(x @ w_shared) * shared(x)         qwen2_moe only: an always-on expert with a scalar gate

(Mixtral's "softmax over the top-k logits" is the same number: softmax then top-k then renormalize.) The
router runs in the model dtype and its softmax in float32, as transformers does; Mixtral keeps the weights in
float32 for the weighted sum, the Qwen models cast them back to the model dtype.

Execution (`grouped_experts`): the picks of every token of the flattened batch are sorted by expert id, so each
expert runs one matmul over all the rows routed to it, and the weighted rows are scatter-added back to their
tokens in one `index_add_`:

    ids [T, k] -> flat [T*k] -> argsort (stable) -> | rows of expert 0 | rows of expert 1 | ... | expert E-1 |
                                                       one expert call per non-empty run; an empty one costs nothing

That sequence (`moe_forward`) is the oracle of the decode fast path too: the decode plan's Python loop calls it with
each expert's kernel descriptors in place of the modules, and its C++ layer loop (steps of up to 8 rows) runs the
same ATen ops (router linear, softmax, topk, index_select, index_add_) around the same expert kernels, so all three
paths give the same numbers (engine/decode_plan.py).

The experts are ordinary `MLP` modules of model/llama.py (gate_proj / up_proj / down_proj, fused into gate_up_proj
at load like any MLP), so every runtime linear (FastLinear, QuantLinear, SparseLinear) and every tool that walks
linears (quantization, pruning by magnitude) sees them with no special case. The router and the shared-expert gate
are not `nn.Linear`: they stay in the checkpoint's float precision, as llama.cpp and the GPTQ/AWQ tools keep them.

Module names follow transformers (Qwen2-MoE / Qwen3-MoE, and Mixtral since transformers 5):
`mlp.gate`, `mlp.experts.{j}.{gate,up,down}_proj`, `mlp.shared_expert.*`, `mlp.shared_expert_gate`; hub Mixtral
files (`block_sparse_moe.experts.{j}.w1/w2/w3`) are renamed at load (`rename_hf_moe_tensors`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from brisk.model.config import ModelConfig

if TYPE_CHECKING:
    from collections.abc import Iterator

Tensor = torch.Tensor


class RouterWeight(nn.Module):
    """A [out, hidden] matrix applied in the model dtype: the router (out = num_experts) or the shared-expert gate
    (out = 1). Not an nn.Linear on purpose: quantizers, pruners and fusion leave it alone."""

    def __init__(self, hidden_size: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)  # [T, out]


def route(router_logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64): softmax in float32 over all
    experts, the k largest, renormalized to sum 1 when `normalize` (transformers' TopKRouter)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: Tensor, weights: Tensor, ids: Tensor, experts: Sequence[Callable[[Tensor], Tensor]],
                    counts: list[int] | None = None) -> Tensor:
    """sum_j weights[t, j] * experts[ids[t, j]](x[t]) for every token t, one call per expert over its rows.

    x [T, H]; weights [T, k] (any float dtype; the product is taken in the promoted dtype, then cast to x's);
    ids [T, k]. `counts`: rows per expert (bincount of ids), when the caller has it already.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)  # [T*k]: pick j of token i at i * k + j
    order = torch.argsort(flat, stable=True)  # [T*k] picks grouped by expert, tokens ascending within each
    if counts is None:
        counts = torch.bincount(flat, minlength=len(experts)).tolist()
    rows = torch.div(order, k, rounding_mode="floor")  # [T*k] the token of each grouped pick
    xs = x.index_select(0, rows)  # [T*k, H] tokens gathered in expert order
    ws = weights.reshape(-1).index_select(0, order).unsqueeze(1)  # [T*k, 1]
    ys = torch.empty_like(xs)  # [T*k, H]
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start:start + n] = (experts[e](xs[start:start + n]) * ws[start:start + n]).to(x.dtype)
            start += n
    # each token's k rows are added in expert order, as transformers' loop over experts adds them
    return torch.zeros_like(x).index_add_(0, rows, ys)  # [T, H]


@dataclass
class ExpertLoads:
    """What `record_expert_loads` collected: per MoE forward, how many rows each expert ran, and the tokens."""

    counts: list[tuple[int, list[int]]] = field(default_factory=list)  # (layer index, rows per expert)
    calls: list[list[int]] = field(default_factory=list)  # per forward, the times each expert was called
    num_tokens: int = 0  # tokens through the first MoE layer (each layer sees the same tokens)


class SparseMoeBlock(nn.Module):
    """The routed experts of one layer (and qwen2_moe's shared expert); forward(x [T, H]) -> [T, H]."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        from brisk.model.llama import MLP  # (llama.py builds this block; the experts are its MLP)

        h = config.hidden_size
        self.layer_idx = layer_idx
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.float32_weights = config.architecture == "mixtral"  # transformers' Mixtral keeps them in float32
        self.gate = RouterWeight(h, config.num_experts)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: RouterWeight | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = RouterWeight(h, 1)
        self.loads: ExpertLoads | None = None  # set while record_expert_loads is active (benchmarks)

    def forward(self, x: Tensor) -> Tensor:
        return moe_forward(x, self.gate, self.top_k, self.normalize, self.float32_weights, self.experts,
                           self.shared_expert, self.shared_expert_gate, self.loads, self.layer_idx)


def moe_forward(x: Tensor, router: Callable[[Tensor], Tensor], top_k: int, normalize: bool, float32_weights: bool,
                experts: Sequence[Callable[[Tensor], Tensor]], shared_expert: Callable[[Tensor], Tensor] | None = None,
                shared_gate: Callable[[Tensor], Tensor] | None = None, loads: ExpertLoads | None = None,
                layer_idx: int = 0) -> Tensor:
    """A MoE block's output for x [T, H] (the module docstring's sum): the one sequence of ops that the module path
    (SparseMoeBlock) and the decode plan's Python loop (engine/decode_plan.py, with each expert's kernel
    descriptors) both run; the C++ layer loop (ops/csrc/decode_layers.cpp moe_block) runs the same ATen ops in
    the same order, so the three give the same numbers. `router` / `shared_gate`: x -> [T, E] / [T, 1] logits;
    `loads`: record the routing (record_expert_loads)."""
    weights, ids = route(router(x), top_k, normalize)  # [T, k] x 2
    if not float32_weights:
        weights = weights.to(x.dtype)
    counts = torch.bincount(ids.reshape(-1), minlength=len(experts)).tolist()
    if loads is not None:  # benchmarks: the routing, and each expert's calls counted as they happen
        loads.counts.append((layer_idx, counts))
        calls = [0] * len(experts)
        loads.calls.append(calls)
        experts = [_counted(e, calls, j) for j, e in enumerate(experts)]
    out = grouped_experts(x, weights, ids, experts, counts)  # [T, H]
    if shared_expert is not None:
        assert shared_gate is not None, "a shared expert comes with its gate"
        out = out + torch.sigmoid(shared_gate(x)) * shared_expert(x)  # [T, 1] * [T, H]
    return out


def _counted(expert: Callable[[Tensor], Tensor], calls: list[int], j: int) -> Callable[[Tensor], Tensor]:
    def call(x: Tensor) -> Tensor:
        calls[j] += 1
        return expert(x)
    return call


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@contextmanager
def record_expert_loads(model: nn.Module) -> Iterator[ExpertLoads]:
    """Within the block, every MoE layer of `model` records how many rows each expert ran per forward, so a
    benchmark can count the expert bytes a step really read (an expert with no rows is not read)."""
    loads = ExpertLoads()
    blocks = moe_blocks(model)
    for b in blocks:
        b.loads = loads
    try:
        yield loads
    finally:
        for b in blocks:
            b.loads = None


def _module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict(keep_vars=True).values())


def expert_bytes(model: nn.Module) -> dict[int, list[int]]:
    """Layer index -> the bytes of each routed expert's weights as they are in memory (float, or packed codes with
    their scales and zero points)."""
    return {b.layer_idx: [_module_bytes(e) for e in b.experts] for b in moe_blocks(model)}


@dataclass
class ExpertBytes:
    """Routed-expert bytes per token of the recorded forwards (all MoE layers together)."""

    read: float  # measured: every expert that ran rows, once per forward (grouped dispatch), / tokens
    routed: float  # the experts the forward's tokens were routed to (distinct per forward) / tokens: read's bound
    active: float  # top-k experts per token (the active-parameter roofline of batch 1)
    dense: float  # every expert of every layer (the dense bound)
    num_forwards: int


def expert_bytes_per_token(model: nn.Module, loads: ExpertLoads, max_tokens: int | None = None) -> ExpertBytes:
    """What `record_expert_loads` saw, in bytes: forwards of more than `max_tokens` tokens (prefills) left out.

    A forward's tokens are its routed rows / top-k. `read` counts every call `grouped_experts` made to an expert
    (each call reads its weights once); `routed` the distinct experts the router chose, each once: read equals it
    when every routed expert runs once a forward, and a per-token loop would read up to top-k x tokens."""
    sizes = expert_bytes(model)
    blocks = {b.layer_idx: b for b in moe_blocks(model)}
    read = routed = active = dense = 0.0
    tokens = forwards = 0
    for (layer, counts), calls in zip(loads.counts, loads.calls, strict=True):
        top_k = blocks[layer].top_k
        n = sum(counts) // top_k
        if n == 0 or (max_tokens is not None and n > max_tokens):
            continue
        b = sizes[layer]
        read += sum(size * c for size, c in zip(b, calls, strict=True))
        routed += sum(size for size, c in zip(b, counts, strict=True) if c)
        active += n * top_k * sum(b) / len(b)
        dense += n * sum(b)
        if layer == min(blocks):
            tokens, forwards = tokens + n, forwards + 1
    t = max(tokens, 1)
    return ExpertBytes(read / t, routed / t, active / t, dense / t, forwards)


# ------------------------------------------------------------------------------------- checkpoint names

# hub Mixtral: block_sparse_moe.gate / experts.{j}.w1 (gate) w3 (up) w2 (down) -> transformers 5's mlp.* names
_MIXTRAL = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|experts\.\d+\.(w1|w2|w3)\.(\w+))$")
_MIXTRAL_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# transformers 5's in-memory layout, should a file hold it: experts.gate_up_proj [E, 2I, H], experts.down_proj
# [E, H, I] (Mixtral's, Qwen-MoE's)
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")


class MoETensorError(ValueError):
    """A MoE checkpoint's expert tensors do not have the layout the config implies."""


def rename_hf_moe_tensors(tensors: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """In place: hub Mixtral names -> brisk's (transformers') mlp.* names, and stacked [E, ...] expert tensors ->
    one tensor per expert. Other tensors are untouched. Returns `tensors`."""
    if not config.is_moe:
        return tensors
    for name in list(tensors):
        if m := _MIXTRAL.match(name):
            prefix, rest, w, suffix = m.groups()
            new = f"{prefix}mlp.gate.weight" if w is None else (
                f"{prefix}mlp.experts.{rest.split('.')[1]}.{_MIXTRAL_W[w]}.{suffix}")
            tensors[new] = tensors.pop(name)
        elif m := _STACKED.match(name):
            prefix, kind = m.groups()
            t = tensors.pop(name)
            inter = config.moe_intermediate_size
            if t.dim() != 3 or t.shape[0] != config.num_experts:
                raise MoETensorError(f"tensor {name} has shape {tuple(t.shape)}, expected [{config.num_experts}, "
                                     "...] (one matrix per expert)")
            for j in range(t.shape[0]):
                if kind == "down_proj":
                    tensors[f"{prefix}{j}.down_proj.weight"] = t[j]
                else:
                    if t.shape[1] != 2 * inter:
                        raise MoETensorError(f"tensor {name} has {t.shape[1]} rows per expert, expected "
                                             f"{2 * inter} (gate and up of moe_intermediate_size {inter})")
                    tensors[f"{prefix}{j}.gate_proj.weight"] = t[j, :inter]
                    tensors[f"{prefix}{j}.up_proj.weight"] = t[j, inter:]
    return tensors


# GGUF (llama.cpp): Mixtral is its `llama` arch with `llama.expert_count`; Qwen2-MoE `qwen2moe`, Qwen3-MoE
# `qwen3moe`. An MoE layer holds the router and the experts stacked into one 3-D tensor per projection:
#     blk.{i}.ffn_gate_inp.weight   [E, H]       router
#     blk.{i}.ffn_gate_exps.weight  [E, I, H]    every expert's gate_proj (ggml ne = [H, I, E])
#     blk.{i}.ffn_up_exps.weight    [E, I, H]
#     blk.{i}.ffn_down_exps.weight  [E, H, I]
#     blk.{i}.ffn_gate_inp_shexp.weight [H]      qwen2moe: the shared expert's sigmoid gate
#     blk.{i}.ffn_{gate,up,down}_shexp.weight    qwen2moe: the shared expert
GGUF_MOE_ARCHS = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # (and llama + expert_count -> mixtral)
# llama.cpp's build_moe_ffn `norm_w` per architecture, where the file has no {arch}.expert_weights_norm
GGUF_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}


def gguf_moe_config(md: dict, gguf_arch: str, num_layers: int, has_router: Callable[[int], bool]) -> dict:
    """ModelConfig fields of a MoE GGUF file's metadata ({} for a dense one). `has_router(i)`: whether layer i
    holds ffn_gate_inp (the rest keep a dense MLP, transformers' mlp_only_layers)."""
    num_experts = int(md.get(f"{gguf_arch}.expert_count", 0) or 0)
    if num_experts == 0:
        return {}
    arch = GGUF_MOE_ARCHS.get(gguf_arch, "mixtral")
    ffn = md.get(f"{gguf_arch}.feed_forward_length", 0)
    return dict(architecture=arch, num_experts=num_experts,
                num_experts_per_tok=int(md.get(f"{gguf_arch}.expert_used_count", 0) or 0),
                moe_intermediate_size=int(md.get(f"{gguf_arch}.expert_feed_forward_length", 0) or 0),
                shared_expert_intermediate_size=int(md.get(f"{gguf_arch}.expert_shared_feed_forward_length", 0)
                                                    or 0),
                norm_topk_prob=bool(md.get(f"{gguf_arch}.expert_weights_norm", GGUF_NORM_TOPK[gguf_arch])),
                mlp_only_layers=[i for i in range(num_layers) if not has_router(i)],
                intermediate_size=int(ffn or md.get(f"{gguf_arch}.expert_feed_forward_length", 0) or 0))


def gguf_moe_layer_tensors(c: ModelConfig, i: int, shared_gate_shape: tuple[int, ...] | None
                           ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """llama.cpp name -> (transformers name, torch shape) of MoE layer i's feed-forward tensors. A stacked tensor's
    transformers name has `*` where the expert index goes: the loader splits it into one tensor per expert.
    `shared_gate_shape`: the file's ffn_gate_inp_shexp shape ([H], or [1, H] as some converters write it)."""
    h, e, inter, s = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    blk, hf = f"blk.{i}.", f"model.layers.{i}.mlp."
    out = {blk + "ffn_gate_inp.weight": (hf + "gate.weight", (e, h)),
           blk + "ffn_gate_exps.weight": (hf + "experts.*.gate_proj.weight", (e, inter, h)),
           blk + "ffn_up_exps.weight": (hf + "experts.*.up_proj.weight", (e, inter, h)),
           blk + "ffn_down_exps.weight": (hf + "experts.*.down_proj.weight", (e, h, inter))}
    if s:
        out |= {blk + "ffn_gate_inp_shexp.weight": (hf + "shared_expert_gate.weight", shared_gate_shape or (h,)),
                blk + "ffn_gate_shexp.weight": (hf + "shared_expert.gate_proj.weight", (s, h)),
                blk + "ffn_up_shexp.weight": (hf + "shared_expert.up_proj.weight", (s, h)),
                blk + "ffn_down_shexp.weight": (hf + "shared_expert.down_proj.weight", (h, s))}
    return out


def place_gguf_moe_tensor(tensors: dict[str, Tensor], hf_name: str, w: Tensor, hidden_size: int) -> None:
    """Store one loaded GGUF MoE tensor under its transformers name(s): a stacked [E, ...] tensor as E views, one
    per expert; the shared-expert gate as [1, H]."""
    if "*" in hf_name:
        for j in range(w.shape[0]):
            tensors[hf_name.replace("*", str(j))] = w[j]  # [rows, cols], a view of the stacked buffer
    elif hf_name.endswith("shared_expert_gate.weight"):
        tensors[hf_name] = w.reshape(1, hidden_size)
    else:
        tensors[hf_name] = w
