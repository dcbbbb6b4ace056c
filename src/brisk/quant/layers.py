"""Quantized modules that replace nn.Linear / nn.Embedding in a loaded model (applied from outside the model).

The quantized linear itself (`QuantLinear`) lives with the other runtime linears in ops/layers.py; here are
`QuantEmbedding`, which keeps the table in the checkpoint layout and dequantizes only the rows a step looks up,
and the switches applied to a loaded model (activation mode, tiled layout).
"""

from __future__ import annotations

import torch
from torch import nn

from brisk.ops.kernels import get_op
from brisk.ops.layers import LutLinear, QuantLinear
from brisk.quant import primitives
from brisk.quant.config import LayerQuant


class QuantEmbedding(nn.Module):
    """Embedding lookup from a quantized table [V, H]: gathers the packed rows, dequantizes only those."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None, spec: LayerQuant,
                 embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec = spec
        self.embedding_dim = embedding_dim
        self.num_embeddings = qweight.shape[0]
        self.dtype = dtype
        self.register_buffer("qweight", qweight)  # [V, H * bits / 8] uint8, checkpoint layout
        self.register_buffer("scales", scales.float())  # [V, groups]
        self.register_buffer("qzeros", None if qzeros is None else qzeros.float())  # [V, groups] or None (sym)

    @property
    def row_bytes(self) -> int:
        """Bytes one lookup reads: a packed row plus its scales (and zeros)."""
        tables = [t for t in (self.qweight, self.scales, self.qzeros) if t is not None]
        return sum(t.shape[1] * t.element_size() for t in tables)

    def table_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight, self.scales, self.qzeros) if t is not None]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)  # [T]
        if (self.spec.bits == 8 and self.spec.scheme != "nf4" and self.qzeros is None and flat.dtype == torch.int64
                and self.qweight.is_cpu and self.qweight.is_contiguous() and self.scales.dtype == torch.float32):
            op = get_op("embedding_q8")  # the same float32 operations in one op (73-106 -> 35 us a step in the engine)
            if op is not None:
                return op(self.qweight, self.scales, flat).to(self.dtype).view(*input_ids.shape, self.embedding_dim)
        rows = self.qweight.index_select(0, flat)  # [T, H * bits / 8]
        scales = self.scales.index_select(0, flat)  # [T, groups]
        if self.spec.scheme == "nf4":
            out = primitives.dequantize_nf4(primitives.unpack(rows, 4, self.embedding_dim), scales, dtype=self.dtype)
        else:
            q = primitives.unpack(rows, self.spec.bits, self.embedding_dim)  # [T, H]
            zeros = (torch.full_like(scales, 2 ** (self.spec.bits - 1)) if self.qzeros is None
                     else self.qzeros.index_select(0, flat))
            out = primitives.dequantize(q, scales, zeros, dtype=self.dtype)
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.spec.label}"


def set_quant_activations(model: nn.Module, mode: str) -> int:
    """Set how the quantized linears of `model` treat activations: "float" (decode the codes to float), "int8"
    (round x to int8 per 32 columns and use integer dot products, ops/qlinear_q8.py; 8/4-bit affine codes only), or
    "auto": int8 on layers of 4 bits, float on 8-bit ones. At 4 bits the weight rounding dwarfs the activation
    rounding (int4 g64: +0.3% relative perplexity for 1.6x batch-8 decode here, batch 1 about equal), as in
    llama.cpp's Q4 x Q8 dots; an 8-bit layer keeps its +0.02% instead of +0.4% (on the tiled kernels "float" x
    meets 8-bit codes rounded to int16 per 32 columns, 1/256 of int8's rounding error). A GGUF file's own codes
    (model/gguf_native.py) stay on float activations under "auto": on the default Q4_1 file int8 ones move the
    greedy answer of a chat prompt within a few tokens, and their perplexity cost is not measured yet; "int8" takes
    them to the integer kernels (tiled layout, float minimums) all the same; the 8-bit head of a W8A8 checkpoint
    (SmoothQuant, LLM.int8(): int8 activations by design) takes int8 ones under "auto". SqueezeLLM's table layers
    (3 or 4 bits, ops/lut.py) take int8 under "auto" and "int8", their tables then rounded to uint8 per row (on the
    default model at 3 bits: +0.06% relative perplexity, and the integer table kernel's decode). Returns the number
    of layers on the int8 path. Each layer's kernel descriptor (ops/layers.py) follows the setting; an executor
    built over the model before the switch must be rebuilt (engine/executor.py)."""
    from brisk.ops.qlinear_q8 import ACTIVATION_MODES, covers

    if mode not in ACTIVATION_MODES:
        raise ValueError(f"quant_activations must be one of {ACTIVATION_MODES}, got {mode!r}")
    count = 0
    for module in model.modules():
        if type(module) is QuantLinear:
            chosen = getattr(module, "auto_activations", None)  # a layer's own "auto", where its loader set one
            auto_int8 = chosen == "int8" or (chosen is None and module.packed.bits <= 4)
            int8 = covers(module.packed) and (mode == "int8" or (mode == "auto" and auto_int8))
            module.quant_activations = "int8" if int8 else "float"
            count += int8
        elif type(module) is LutLinear:  # SqueezeLLM's 3/4-bit tables: "auto" as for 4-bit affine codes
            int8 = mode in ("int8", "auto") and module.in_features % 32 == 0
            module.quant_activations = "int8" if int8 else "float"
            count += int8
    tile_quantized_layers(model)
    return count


def tile_quantized_layers(model: nn.Module) -> int:
    """Put every 8/4-bit affine QuantLinear of `model` that the tiled kernels take (x86 builds, AVX2 and up; 16-row
    tiles, ops/csrc/quant_q8t.cpp) in the tiled layout, in place: 16 weight rows interleaved so that lane r of the
    kernels' vectors is row r (no horizontal sums, one scale load per 16 rows), for int8 and float activations
    alike. Idempotent; load_model and set_quant_activations call it. Returns the number of tiled layers."""
    from brisk.ops.qlinear import can_tile, set_tiled

    count = 0
    for module in model.modules():
        if type(module) is QuantLinear and can_tile(module.packed):
            set_tiled(module.packed, True)
            count += 1
    return count

