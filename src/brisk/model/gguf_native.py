"""A GGUF model run in its own precision: the repacked tensors (model/gguf_repack.py) become brisk's quantized layers.

Every linear whose GGUF tensor has a packed form runs as a `QuantLinear` on it (q/k/v and gate/up fused when the
parts share a format, as a quantized checkpoint's are). The embedding table stays packed too: a `PackedEmbedding`
dequantizes only the rows a step looks up, and when the head is tied to the embedding (SmolLM2) the head is a
`QuantLinear` on the very same packed tensors, so the table is held once, in its quantized size. Tensors without a
packed form (norms, F16/BF16/F32 matrices, stacked MoE experts) were dequantized by the loader and stay float.
"""

from __future__ import annotations

import torch
from torch import nn

from brisk.model.config import ModelConfig
from brisk.model.gguf_repack import can_concat, concat_rows
from brisk.model.llama import LlamaForCausalLM
from brisk.ops.layers import QuantLinear
from brisk.ops.qlinear import TILE_ROWS, PackedWeight, _from_blocked, _unpack_checkpoint
from brisk.quant.config import LayerQuant

EMBEDDING = "model.embed_tokens"
# fused module -> its parts, in row order (model/fuse.py); the loader may hand a fused weight over under the fused
# module's name, packed in place (model/gguf_place.py)
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def layer_spec(pw: PackedWeight) -> LayerQuant:
    """The packed weight described as brisk's quantization settings (for labels and reports)."""
    return LayerQuant(bits=pw.bits, group_size=pw.group_size, sym=pw.zeros is None)


def gather_rows(pw: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """float32 [T, K]: rows `ids` [T] of the dequantized weight (as dequantize_packed, bit for bit), reading only
    those rows' codes and parameters, in whichever layout the weight is (blocked, tiled, or unblocked)."""
    k, g = pw.in_features, pw.group_size
    ngroups = k // g
    if pw.tiled:  # tiles of 16 rows: data [N/16, K * bits / 32, 16, 4], parameters [N/16, K/G, 16]
        tile, lane = ids // TILE_ROWS, ids % TILE_ROWS
        d = pw.data.view(pw.out_features // TILE_ROWS, -1, TILE_ROWS, 4)[tile, :, lane]  # [T, K * bits / 32, 4]
        if pw.bits == 8:  # row r's dword c = q[4 c .. 4 c + 3]
            q = d.reshape(-1, k)
        else:  # byte j of dword c = q[8 c + j] | q[8 c + 4 + j] << 4
            q = torch.stack([d & 0xF, d >> 4], dim=-2).reshape(-1, k)  # [T, K/8, 2, 4] -> [T, K]

        def params(t: torch.Tensor) -> torch.Tensor:
            return t.view(pw.out_features // TILE_ROWS, ngroups, TILE_ROWS)[tile, :, lane]  # [T, K/G]
    else:
        rows = pw.data.index_select(0, ids)
        q = _from_blocked(rows, pw.bits, k) if pw.blocked else _unpack_checkpoint(rows, pw.bits, k)

        def params(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, ids)
    n = ids.numel()
    scales = params(pw.scales).float()[..., None]  # [T, K/G, 1]
    qf = q.view(n, ngroups, g).float()
    if pw.zeros is not None and pw.zeros.is_floating_point():
        w = torch.addcmul(params(pw.zeros).float()[..., None], qf, scales)
    else:
        zero = float(1 << (pw.bits - 1)) if pw.zeros is None else params(pw.zeros).float()[..., None]
        w = (qf - zero) * scales
    return w.view(n, k)


class PackedEmbedding(nn.Module):
    """Embedding lookup from a packed table [V, H]: only the looked-up rows are dequantized. The table may be
    shared with the tied head's QuantLinear (and be tiled for its kernels: the lookup reads either layout)."""

    def __init__(self, pw: PackedWeight, dtype: torch.dtype, label: str = "") -> None:
        super().__init__()
        self.packed = pw
        self.num_embeddings, self.embedding_dim = pw.out_features, pw.in_features
        self.dtype = dtype
        self.label = label

    def table_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed.data, self.packed.scales, self.packed.zeros) if t is not None]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)  # [T]
        return gather_rows(self.packed, flat).to(self.dtype).view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}" + (f", {self.label}" if self.label else "")


def _quant_linear(pw: PackedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> QuantLinear:
    layer = QuantLinear(pw, None if bias is None else bias.to(dtype), layer_spec(pw))
    # `--quant-activations auto` keeps float activations on a GGUF's own codes (quant/layers.py): int8 ones are
    # measured for brisk's checkpoints only, and on the default Q4_1 file they change greedy answers
    layer.auto_activations = "float"
    return layer


def part_names(name: str) -> list[str]:
    """The modules a packed weight stands for: a fused one's parts, else itself."""
    prefix, _, leaf = name.rpartition(".")
    return [f"{prefix}.{p}" for p in FUSED_PARTS[leaf]] if leaf in FUSED_PARTS else [name]


def packed_module_names(config: ModelConfig, packed: dict[str, PackedWeight]) -> list[str]:
    """Modules whose float weight the loader does not hold (a tied head goes with its packed embedding)."""
    names = [part for name in packed for part in part_names(name)]
    if config.tie_word_embeddings and EMBEDDING in packed:
        names.append("lm_head")
    return names


def take_biases(tensors: dict[str, torch.Tensor], packed: dict[str, PackedWeight]) -> dict[str, torch.Tensor]:
    """Pop the biases of packed modules (they go into the QuantLinear, not into the float model)."""
    parts = [part for name in packed for part in part_names(name)]
    return {name: tensors.pop(f"{name}.bias") for name in parts if f"{name}.bias" in tensors}


def apply_packed_modules(model: LlamaForCausalLM, config: ModelConfig, packed: dict[str, PackedWeight],
                         biases: dict[str, torch.Tensor], dtype: torch.dtype, fuse: bool = True) -> int:
    """Swap every module `packed` names for its quantized version, fusing q/k/v and gate/up when all parts are
    packed in one format (in attention blocks and MLPs wherever they sit: a MoE layer's experts and shared expert
    too). Consumes `packed`; returns the number of modules swapped."""
    count = 0
    if EMBEDDING in packed:
        pw = packed.pop(EMBEDDING)
        model.model.embed_tokens = PackedEmbedding(pw, dtype, layer_spec(pw).label)
        count += 1
        if config.tie_word_embeddings:  # the head computes from the same packed tensors
            model.lm_head = _quant_linear(pw, None, dtype)
    for prefix, parent in list(model.named_modules()):
        for fused_name, names in FUSED_PARTS.items():
            if not fuse or not all(isinstance(getattr(parent, n, None), nn.Linear) for n in names):
                continue
            full = [f"{prefix}.{n}" for n in names]
            parts = [packed.get(f) for f in full]
            has_bias = [f in biases for f in full]
            placed = packed.pop(f"{prefix}.{fused_name}", None)  # fused by the loader, in its final place
            # parts placed one by one in the tiled layout are not concatenated (concat_rows takes blocked rows)
            if placed is not None or (can_concat(parts) and not any(p is not None and p.tiled for p in parts)
                                      and (all(has_bias) or not any(has_bias))):
                pw = placed if placed is not None else concat_rows([packed.pop(f) for f in full])
                bias = torch.cat([biases.pop(f) for f in full]) if all(has_bias) else None
                setattr(parent, fused_name, _quant_linear(pw, bias, dtype))
                for n in names:
                    setattr(parent, n, None)
                count += len(full)
    for name, module in list(model.named_modules()):
        if name in packed and isinstance(module, nn.Linear):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, _quant_linear(packed.pop(name), biases.pop(name, None), dtype))
            count += 1
    assert not packed, f"apply_packed_modules: modules the model does not have: {sorted(packed)[:5]}"
    return count
