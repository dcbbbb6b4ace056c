"""Many adapters in one batch: a runtime linear plus the low-rank products of every adapter its rows ask for.

Each adapted runtime linear (float, quantized, sparse; fused q/k/v and gate/up included) is wrapped in a
`LoRALinear` that keeps, per engine slot s < max_loras, the adapter's matrices stacked:

    lora_a [max_loras, S R, K]      rows s R .. (s + 1) R - 1 of slice i: that slice's A (zero-padded to R rows)
    lora_bt [max_loras, S R, N]     B transposed: rows i R .. of slice i hold its scaled B^T in columns off_i ..
                                    off_i + n_i; else 0 (B^T: the C++ layer loop adds t_j * row j, contiguous)

where S is the number of output slices (3 for fused q/k/v, 2 for gate/up, 1 otherwise) and R = max_lora_rank.
So a fused layer applies PEFT's per-module q_proj / k_proj / v_proj adapters on its output slices with one pair
of products: B is block-diagonal over the slices.

A step's rows are grouped by adapter slot (Punica's SGMV, S-LoRA: Chen et al. 2023, Sheng et al. 2023): with G
groups of at most L rows each, padded to [G, L],

    y = base(x)                                             every row, the base kernel as without adapters
    X = x[gather].view(G, L, K)                             one gather: the rows of each group (padding repeats a row)
    D = bmm(bmm(X, A[slots]^T), B^T[slots])                 [G, L, S R] -> [G, L, N]: one pair of bmm per layer
    y[rows] += D[valid]                                     the real rows only (gather, add, scatter)

seven tensor ops a layer whatever the number of adapters; rows with no adapter are not touched, and a step with
no adapter rows at all runs the base layer only. The grouping (`LoRAMapping`) is computed once per step by the
manager from the requests' slots, shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from brisk.model.config import MOE_ARCHITECTURES, UnsupportedModelError

Tensor = torch.Tensor


@dataclass
class LoRAMapping:
    """One step's rows grouped by adapter slot (see the module docstring)."""

    num_groups: int  # G
    group_len: int  # L
    slots: Tensor  # [G] int64 engine slots
    gather: Tensor  # [G * L] int64 rows of x (padding: the group's first row again)
    valid: Tensor  # [M] int64 positions in [0, G L) that are real rows
    rows: Tensor  # [M] int64 the real rows, in the order of `valid`

    @staticmethod
    def from_row_slots(row_slots: list[int], device: torch.device | str = "cpu") -> LoRAMapping | None:
        """row_slots: the slot of each row of the step (-1: no adapter) -> the grouping, or None (no adapter)."""
        groups: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(row)
        if not groups:
            return None
        g, length = len(groups), max(len(r) for r in groups.values())
        gather, valid, rows = [], [], []
        for i, members in enumerate(groups.values()):
            gather.extend(members + [members[0]] * (length - len(members)))
            valid.extend(range(i * length, i * length + len(members)))
            rows.extend(members)

        def t(v: list[int]) -> Tensor:
            return torch.tensor(v, dtype=torch.int64, device=device)

        return LoRAMapping(g, length, t(list(groups)), t(gather), t(valid), t(rows))


class LoRAState:
    """What every LoRALinear of one model shares: the current step's mapping (None: no adapter rows)."""

    def __init__(self) -> None:
        self.mapping: LoRAMapping | None = None
        self.row_slots: Tensor | None = None  # [T] int64: each row's slot (-1: none), with `mapping`


@dataclass(frozen=True)
class OutputSlice:
    module: str  # the HF module path PEFT names (model.layers.0.self_attn.k_proj)
    offset: int  # first output feature of this module in the (fused) layer's output
    size: int


class LoRALinear(nn.Module):
    """A runtime linear with the adapters of every engine slot applied batched on top (module docstring)."""

    def __init__(self, base: nn.Module, slices: list[OutputSlice], state: LoRAState, max_loras: int,
                 max_rank: int) -> None:
        super().__init__()
        self.base = base
        self.slices = slices
        self.state = state  # shared with the manager: a plain object, not a submodule
        self.in_features = int(base.in_features)
        self.out_features = int(base.out_features)
        assert sum(s.size for s in slices) == self.out_features, "the slices must cover the layer's outputs"
        self.max_rank = max_rank
        r_total = max_rank * len(slices)
        self.register_buffer("lora_a", torch.zeros(max_loras, r_total, self.in_features))  # [slots, S R, K]
        self.register_buffer("lora_bt", torch.zeros(max_loras, r_total, self.out_features))  # [slots, S R, N]

    @torch.no_grad()
    def set_slot(self, slot: int, weights: dict[str, tuple[Tensor, Tensor]], scaling: float) -> None:
        """Put an adapter's (A [r, K], B [n_i, r]) per module path into `slot` (modules it lacks stay zero)."""
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()
        for i, s in enumerate(self.slices):
            if s.module not in weights:
                continue
            a, b = weights[s.module]
            r = a.shape[0]
            assert r <= self.max_rank and a.shape[1] == self.in_features and tuple(b.shape) == (s.size, r)
            c = i * self.max_rank
            self.lora_a[slot, c:c + r].copy_(a)
            self.lora_bt[slot, c:c + r, s.offset:s.offset + s.size].copy_(b.t() * scaling)

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.add_delta(x, self.base(x))

    def add_delta(self, x: Tensor, y: Tensor) -> Tensor:
        """y = base(x) [..., N] plus the adapters of the step's rows, in place (the decode plan calls it after the
        base kernel)."""
        m = self.state.mapping
        if m is None:
            return y
        k, n = self.in_features, self.out_features
        x2, y2 = x.reshape(-1, k), y.view(-1, n)  # [T, K], [T, N]
        xg = x2.index_select(0, m.gather).view(m.num_groups, m.group_len, k).float()  # [G, L, K]
        a = self.lora_a.index_select(0, m.slots)  # [G, S R, K]
        bt = self.lora_bt.index_select(0, m.slots)  # [G, S R, N]
        d = torch.bmm(torch.bmm(xg, a.transpose(1, 2)), bt)  # [G, L, S R] -> [G, L, N]
        # rows are distinct: a gather, an add and a scatter (CPU index_add_ measured ~100x slower here)
        y2.index_copy_(0, m.rows, y2.index_select(0, m.rows) + d.view(-1, n).index_select(0, m.valid).to(y2.dtype))
        return y

    def extra_repr(self) -> str:
        names = ", ".join(s.module.rsplit(".", 1)[1] for s in self.slices)
        return f"slices=[{names}], max_loras={self.lora_a.shape[0]}, max_rank={self.max_rank}"


def wrap_model(model: nn.Module, state: LoRAState, max_loras: int, max_rank: int) -> dict[str, tuple[int, int]]:
    """Wrap every projection of every decoder layer (fused or not) in a LoRALinear; returns the adaptable
    modules' shapes (HF path -> (out_features, in_features)), for checking adapters against the model."""
    arch = model.config.architecture
    if arch in MOE_ARCHITECTURES:
        raise UnsupportedModelError(
            f"LoRA adapters are served on dense models only; {arch} is a mixture-of-experts model, whose routed "
            "experts have no adapter layers: serve it without --enable-lora")
    shapes: dict[str, tuple[int, int]] = {}
    for i, layer in enumerate(model.model.layers):
        for parent_name, fused_name, parts in (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                               ("self_attn", None, ("o_proj",)),
                                               ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
                                               ("mlp", None, ("down_proj",))):
            parent = getattr(layer, parent_name)
            prefix = f"model.layers.{i}.{parent_name}."
            fused = getattr(parent, fused_name) if fused_name else None
            if fused is not None:
                sizes = _fused_sizes(model.config, parts)
                slices, off = [], 0
                for part, size in zip(parts, sizes, strict=True):
                    slices.append(OutputSlice(prefix + part, off, size))
                    shapes[prefix + part] = (size, int(fused.in_features))
                    off += size
                setattr(parent, fused_name, LoRALinear(fused, slices, state, max_loras, max_rank))
                continue
            for part in parts:
                base = getattr(parent, part)
                n, k = int(base.out_features), int(base.in_features)
                shapes[prefix + part] = (n, k)
                setattr(parent, part, LoRALinear(base, [OutputSlice(prefix + part, 0, n)], state, max_loras, max_rank))
    return shapes


def _fused_sizes(config, parts: tuple[str, ...]) -> list[int]:  # noqa: ANN001 - model.config.ModelConfig
    if parts[0] == "q_proj":
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        return [q, kv, kv]
    return [config.intermediate_size, config.intermediate_size]


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]
