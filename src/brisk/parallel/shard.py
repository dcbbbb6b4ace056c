"""Tensor-parallel sharding of a loaded model, applied from outside it (Megatron-LM's split, as vLLM does it).

    q/k/v, gate/up   column-parallel: each rank keeps its heads' rows / its slice of the intermediate rows. brisk
                     fuses them at load ([q | k | v] and [gate | up] rows), so each PART is cut and the rank's
                     pieces are fused again: [q_r | k_r | v_r], [gate_r | up_r]
    o, down          row-parallel: each rank keeps the input columns of its heads / intermediate slice and
                     multiplies its share; one all-reduce (sum) per layer output gives the full result
    embedding        vocab-parallel: rank r holds rows [v_r, v_r+1); an id outside them looks up zeros, and the
                     all-reduce sums the one rank that has it
    lm_head          vocab-parallel: rank r computes logits of its vocabulary slice; they are gathered on rank 0,
                     which samples

Heads go to ranks in whole KV groups (a KV head with the query heads that read it), as evenly as the group count
allows; with fewer KV heads than ranks each KV head is replicated on world / num_kv_heads ranks and its query
heads are split between them (vLLM's rule). So SmolLM2-135M (9 heads, 3 KV heads) over 2 ranks keeps 6 + 3 heads.
Each rank's paged KV cache then holds its own KV heads only.

Quantized linears (ops/layers.py QuantLinear) are cut along whole quantization groups: the codes are unpacked,
sliced, and packed again into the same runtime layout, so a shard runs the very kernels the full layer runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from brisk.ops.layers import FastLinear, QuantLinear
from brisk.ops.linear import prepack_weight
from brisk.ops.qlinear import PackedWeight, _finish, can_tile, prepack, prepack_nf4, set_tiled, unpack_codes
from brisk.parallel.comm import Group
from brisk.quant.primitives import pack

Ranges = Sequence[tuple[int, int]]  # [start, end) row or column ranges, concatenated in order


class ShardingError(ValueError):
    """The model cannot be split over this many ranks (heads, groups or a layer type that does not divide)."""


# ---------------------------------------------------------------------------- what each rank keeps
@dataclass(frozen=True)
class HeadShard:
    """One rank's heads: query heads [q0, q1), KV heads [kv0, kv1) of the full model."""

    q0: int
    q1: int
    kv0: int
    kv1: int

    @property
    def num_heads(self) -> int:
        return self.q1 - self.q0

    @property
    def num_kv_heads(self) -> int:
        return self.kv1 - self.kv0


def split_evenly(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[0, n) in `parts` contiguous ranges of whole `unit`s, sizes differing by at most one unit."""
    if n % unit:
        raise ShardingError(f"{n} is not a multiple of {unit}")
    units = n // unit
    if units < parts:
        raise ShardingError(f"{n} cannot be split into {parts} parts of whole {unit}s")
    base, extra = divmod(units, parts)
    out, start = [], 0
    for r in range(parts):
        size = (base + (r < extra)) * unit
        out.append((start, start + size))
        start += size
    return out


def head_shard(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadShard:
    """The heads rank `rank` of `world` keeps (see the module docstring)."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= world:
        kv0, kv1 = split_evenly(num_kv_heads, world)[rank]
        return HeadShard(kv0 * group, kv1 * group, kv0, kv1)
    if world % num_kv_heads:
        raise ShardingError(f"{num_kv_heads} KV heads cannot be replicated evenly over {world} ranks; use a "
                            f"tensor-parallel size that divides or is a multiple of {num_kv_heads}")
    replicas = world // num_kv_heads
    if group % replicas:
        raise ShardingError(f"each KV head's {group} query heads cannot be split over {replicas} ranks; use a "
                            f"tensor-parallel size of at most {num_kv_heads * group} that divides it")
    kv = rank // replicas
    per = group // replicas
    q0 = kv * group + (rank % replicas) * per
    return HeadShard(q0, q0 + per, kv, kv + 1)


# ---------------------------------------------------------------------------- cutting one linear
def _quant_unit(module: nn.Module) -> int:
    return module.packed.group_size if isinstance(module, QuantLinear) else 1


def _select(t: torch.Tensor, ranges: Ranges, dim: int) -> torch.Tensor:
    return torch.cat([t.narrow(dim, a, b - a) for a, b in ranges], dim=dim).contiguous()


def _packed_slice(pw: PackedWeight, rows: Ranges | None, cols: tuple[int, int] | None) -> PackedWeight:
    """The codes, scales and zero points of some rows, or of whole groups of columns, packed again."""
    q = unpack_codes(pw)  # [N, K] uint8
    scales, zeros = pw.group_scales(), pw.group_zeros()  # [N, K / G]
    g, k = pw.group_size, pw.in_features
    if rows is not None:
        q, scales = _select(q, rows, 0), _select(scales, rows, 0)
        zeros = None if zeros is None else _select(zeros, rows, 0)
    if cols is not None:
        a, b = cols
        if a % g or b % g:
            raise ShardingError(f"a row-parallel cut at columns [{a}, {b}) splits quantization groups of {g}; "
                                "use a tensor-parallel size whose head / intermediate split falls on group edges")
        q = q[:, a:b].contiguous()
        scales = scales[:, a // g:b // g].contiguous()
        zeros = None if zeros is None else zeros[:, a // g:b // g].contiguous()
        k = b - a
    qweight = pack(q, pw.bits)
    if pw.float_mins:  # GGUF's w = scale * q + min (Q4_1, K-quants): scales and mins kept as they are
        assert zeros is not None
        out = _finish(q, pw.bits, g, k, qweight, scales.contiguous(), zeros.contiguous(), None)
    elif pw.codebook is not None:
        out = prepack_nf4(qweight, scales, g, k, pw.codebook)
    else:
        out = prepack(qweight, scales, zeros, pw.bits, g, k)
    if pw.tiled and can_tile(out):
        set_tiled(out, True)
    return out


def cut_linear(module: nn.Module, rows: Ranges | None = None, cols: tuple[int, int] | None = None,
               keep_bias: bool = True) -> nn.Module:
    """A runtime linear with only `rows` of the outputs (column-parallel) or columns `cols` of the inputs
    (row-parallel) of `module`, of the same kind (FastLinear, QuantLinear); the bias (rows only) where asked."""
    bias = None
    if keep_bias and module.bias is not None:
        bias = module.bias.detach() if rows is None else _select(module.bias.detach(), rows, 0)
    if isinstance(module, QuantLinear):
        out = QuantLinear(_packed_slice(module.packed, rows, cols), bias, module.spec)
        out.quant_activations = module.quant_activations
        return out
    if type(module) not in (nn.Linear, FastLinear):
        raise ShardingError(f"tensor parallelism cannot split a {type(module).__name__} layer (pruned and custom "
                            "layers are not sharded); use float or quantized weights")
    w = module.weight.detach()
    if rows is not None:
        w = _select(w, rows, 0)
    if cols is not None:
        w = w[:, cols[0]:cols[1]].contiguous()
    out = FastLinear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(w, requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    if getattr(module, "packed_weight", None) is not None:
        out.packed_weight = prepack_weight(w)
    return out


# ---------------------------------------------------------------------------- parallel modules
class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r @ W[:, cols_r]^T) + b: this rank's share of the inputs, summed over the ranks."""

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None, group: Group) -> None:
        super().__init__()
        self.inner = inner  # the column slice, without bias
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.group = group
        self.in_features, self.out_features = inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(self.inner(x))  # [..., out]: the sum of every rank's partial product
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the table; the other ranks' ids look up zeros, and the all-reduce sums the one that
    holds each id (exact: one term is non-zero)."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, group: Group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight[start:end].detach().contiguous(), requires_grad=False)  # [V_r, hidden]
        self.start, self.end, self.group = start, end, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.start) | (input_ids >= self.end)  # [T]
        local = (input_ids - self.start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)  # [T, hidden]
        return self.group.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Logits of the vocabulary slice [start, end) on every rank, gathered on rank 0 (which samples): rank 0 gets
    [N, vocab], the others their own [N, V_r] (which nobody reads). `inner` is this rank's slice of the head's
    rows (float or quantized, cut_linear)."""

    def __init__(self, inner: nn.Module, ranges: list[tuple[int, int]], rank: int, group: Group) -> None:
        super().__init__()
        self.inner = inner
        self.ranges, self.group = ranges, group
        self.max_rows = max(b - a for a, b in ranges)  # slices are padded to this for the gather

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.inner(hidden)  # [N, V_r]
        pad = self.max_rows - local.shape[-1]
        parts = self.group.gather(F.pad(local, (0, pad)) if pad else local)  # rank 0: world x [N, max_rows]
        if parts is None:
            return local
        return torch.cat([p[..., :b - a] for p, (a, b) in zip(parts, self.ranges, strict=True)], dim=-1)


# ---------------------------------------------------------------------------- the whole model
def _parts(attn: nn.Module, mlp: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    qkv = [attn.qkv_proj] if attn.qkv_proj is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_up_proj] if mlp.gate_up_proj is not None else [mlp.gate_proj, mlp.up_proj]
    return qkv, gate_up


def shard_model(model: nn.Module, group: Group) -> None:
    """Cut `model` (a LlamaForCausalLM) in place to rank `group.rank`'s share (see the module docstring); its
    config then states the shard's shapes (heads, KV heads, intermediate size), which size the paged KV cache."""
    from brisk.model.llama import LlamaForCausalLM

    assert isinstance(model, LlamaForCausalLM), type(model)
    rank, world = group.rank, group.size
    c = model.config
    d = c.head_dim
    hs = head_shard(c.num_attention_heads, c.num_key_value_heads, rank, world)
    q_rows, kv_rows = (hs.q0 * d, hs.q1 * d), (hs.kv0 * d, hs.kv1 * d)
    num_q, num_kv = c.num_attention_heads * d, c.num_key_value_heads * d
    inter = c.intermediate_size
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = _parts(attn, mlp)
        i0, i1 = split_evenly(inter, world, _quant_unit(mlp.down_proj))[rank]  # whole groups of down's inputs
        if len(qkv) == 1:  # fused rows: | q | k | v |
            attn.qkv_proj = cut_linear(qkv[0], rows=[q_rows, (num_q + kv_rows[0], num_q + kv_rows[1]),
                                                    (num_q + num_kv + kv_rows[0], num_q + num_kv + kv_rows[1])])
        else:
            attn.q_proj = cut_linear(attn.q_proj, rows=[q_rows])
            attn.k_proj = cut_linear(attn.k_proj, rows=[kv_rows])
            attn.v_proj = cut_linear(attn.v_proj, rows=[kv_rows])
        if len(gate_up) == 1:  # fused rows: | gate | up |
            mlp.gate_up_proj = cut_linear(gate_up[0], rows=[(i0, i1), (inter + i0, inter + i1)])
        else:
            mlp.gate_proj = cut_linear(mlp.gate_proj, rows=[(i0, i1)])
            mlp.up_proj = cut_linear(mlp.up_proj, rows=[(i0, i1)])
        o_bias = None if attn.o_proj.bias is None else attn.o_proj.bias
        attn.o_proj = RowParallelLinear(cut_linear(attn.o_proj, cols=q_rows, keep_bias=False), o_bias, group)
        d_bias = None if mlp.down_proj.bias is None else mlp.down_proj.bias
        mlp.down_proj = RowParallelLinear(cut_linear(mlp.down_proj, cols=(i0, i1), keep_bias=False), d_bias, group)
        attn.num_heads, attn.num_kv_heads = hs.num_heads, hs.num_kv_heads
    vocab = split_evenly(c.vocab_size, world)
    embed, head = model.model.embed_tokens, model.lm_head  # (None on a pipeline stage that does not hold it)
    if type(embed) is nn.Embedding:
        model.model.embed_tokens = VocabParallelEmbedding(embed.weight, *vocab[rank], group)
    # a quantized embedding stays whole on every rank (each looks its rows up itself: no all-reduce)
    if head is not None and (head.bias is not None or type(head) not in (nn.Linear, FastLinear, QuantLinear)):
        raise ShardingError(f"tensor parallelism cannot split an lm_head of type {type(head).__name__} (with a "
                            "bias or custom); use a float or quantized lm_head without bias")
    if head is not None:
        model.lm_head = ParallelLMHead(cut_linear(head, rows=[vocab[rank]]), vocab, rank, group)
    model.config = dataclasses.replace(c, num_attention_heads=hs.num_heads, num_key_value_heads=hs.num_kv_heads,
                                       intermediate_size=i1 - i0, head_dim=d)
