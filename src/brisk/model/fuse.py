"""Load-time fusion: q/k/v projections into one matmul, gate/up projections into another.

Applied from outside the model (model code stays plain; checkpoints keep HF names). One wide matmul instead of
three reads the same bytes but pays one op's overhead instead of three, and at batch 1 the per-op overhead is
a real share of a decode step. Only plain `nn.Linear` layers are fused: a layer swapped for a quantized or
sharded one keeps its own module.

Fusion happens at conversion time: the loaders write each layer's q/k/v (and gate/up) rows, as they convert
them, into one buffer per layer (`FusedBuffers`), so the parts are adjacent views of it and `fuse_projections`
takes the fused weight as one view of that buffer instead of concatenating a second float copy.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from brisk.model.config import ModelConfig
from brisk.model.llama import MLP, LlamaForCausalLM


class FusedTensorError(ValueError):
    """A checkpoint's fused qkv_proj / gate_up_proj tensor does not have the rows its config implies."""


def split_fused_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi3's checkpoints store `self_attn.qkv_proj` ([q heads | k heads | v heads] rows) and `mlp.gate_up_proj`
    ([gate | up] rows); split them into HF's q/k/v_proj and gate/up_proj names in place, so the model, the
    quantizers and fuse_projections see one layout. Returns `tensors`."""
    q, kv, inter = (config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim,
                    config.intermediate_size)
    splits = {"self_attn.qkv_proj.": (("self_attn.q_proj.", q), ("self_attn.k_proj.", kv), ("self_attn.v_proj.", kv)),
              "mlp.gate_up_proj.": (("mlp.gate_proj.", inter), ("mlp.up_proj.", inter))}
    for name in [n for n in tensors if any(f".{fused}" in n for fused in splits)]:
        fused = next(f for f in splits if f".{f}" in name)
        parts = splits[fused]
        t = tensors[name]
        rows = sum(n for _, n in parts)
        if t.shape[0] != rows:
            raise FusedTensorError(f"tensor {name} has {t.shape[0]} rows, expected {rows} "
                                   f"({' + '.join(str(n) for _, n in parts)}) from the model config")
        for (part, _), piece in zip(parts, torch.split(t, [n for _, n in parts]), strict=True):
            tensors[name.replace(fused, part)] = piece.contiguous()
        del tensors[name]
    return tensors


_PART = re.compile(r"^(.*\.)(self_attn|mlp)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")


class FusedBuffers:
    """Conversion-time fusion: `place(name, t)` writes a q/k/v or gate/up weight (or bias) into its rows of the
    layer's fused buffer and returns that view; any other tensor, or a part whose shape is not the config's
    (build_model reports it), comes back as `t.to(dtype)`.

        qkv buffer [q_rows + 2 * kv_rows, hidden]:  | q_proj rows | k_proj rows | v_proj rows |
        gate_up buffer [2 * intermediate, hidden]:  | gate_proj rows | up_proj rows |
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        q, kv, inter = (config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim,
                        config.intermediate_size)
        # part -> (its first row, its rows, the buffer's rows)
        self.rows = {"q_proj": (0, q, q + 2 * kv), "k_proj": (q, kv, q + 2 * kv), "v_proj": (q + kv, kv, q + 2 * kv),
                     "gate_proj": (0, inter, 2 * inter), "up_proj": (inter, inter, 2 * inter)}
        self.hidden, self.dtype = config.hidden_size, dtype
        self.buffers: dict[tuple[str, str, str], torch.Tensor] = {}

    @staticmethod
    def takes(name: str) -> bool:
        """Whether `name` is a part that `place` writes into a fused buffer (when its shape fits)."""
        return _PART.match(name) is not None

    def slot(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The rows of its layer's fused buffer that part `name` of `shape` goes to (uninitialized), or None if
        `name` is no part or `shape` is not the config's."""
        m = _PART.match(name)
        if m is None:
            return None
        prefix, module, part, kind = m.groups()
        first, rows, total = self.rows[part]
        expected = (rows, self.hidden) if kind == "weight" else (rows,)
        if tuple(shape) != expected:
            return None
        key = (prefix, module, kind)
        if key not in self.buffers:
            self.buffers[key] = torch.empty((total, *expected[1:]), dtype=self.dtype)
        return self.buffers[key][first:first + rows]  # [rows, hidden] or [rows]

    def place(self, name: str, t: torch.Tensor) -> torch.Tensor:
        out = self.slot(name, tuple(t.shape)) if t.is_floating_point() else None
        if out is None:
            return t.to(self.dtype)
        out.copy_(t)  # converts to the buffer's dtype
        return out


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one view, when they are contiguous row ranges, in order, of one storage; else None."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or t.storage_offset() != offset):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return joined if (joined := _adjacent(tensors)) is not None else torch.cat(tensors)


def _concat_linear(layers: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output rows are the given layers' rows, in order: a view when the loader placed them in
    one buffer (FusedBuffers), else a concatenated copy."""
    weight = _concat([m.weight for m in layers])  # [sum(out), in]
    has_bias = layers[0].bias is not None
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(_concat([m.bias for m in layers]), requires_grad=False)
    return fused


def _plain(*modules: nn.Module | None) -> bool:
    return all(type(m) is nn.Linear for m in modules)


def fuse_projections(model: LlamaForCausalLM) -> int:
    """Fuse every layer's q/k/v and gate/up projections in place (a MoE layer's: every expert's); returns the
    number of fusions done."""
    done = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        if attn.qkv_proj is None and _plain(attn.q_proj, attn.k_proj, attn.v_proj):
            attn.qkv_proj = _concat_linear([attn.q_proj, attn.k_proj, attn.v_proj])
            attn.q_proj = attn.k_proj = attn.v_proj = None
            done += 1
        for mlp in [m for m in layer.mlp.modules() if isinstance(m, MLP)]:  # the MLP, or the experts (model/moe.py)
            if mlp.gate_up_proj is None and _plain(mlp.gate_proj, mlp.up_proj):
                mlp.gate_up_proj = _concat_linear([mlp.gate_proj, mlp.up_proj])
                mlp.gate_proj = mlp.up_proj = None
                done += 1
    return done
