"""A frozen quantized base layer that autograd can train through (QLoRA, Dettmers et al. 2023).

The base weight stays packed (brisk's QuantLinear layout: 4- or 8-bit codes, NF4 or affine); only the input
needs a gradient, since the base itself is frozen:

    forward   y = x @ dequant(W)^T + b           brisk's quant_linear (kernels; chunked dequantize + GEMM)
    backward  dL/dx = dL/dy @ dequant(W)         chunk by chunk over W's output rows: each chunk of rows is
                                                 dequantized, multiplied, and dropped, so no float copy of W
                                                 is ever held (peak: one chunk of 2^21 weights, 8 MiB)

Double quantization (QLoRA section 3, "Double Quantization"): the per-group NF4 absmax scales, one per 64
weights, are themselves quantized: their mean is subtracted and blocks of 256 of them are stored as int8 with
one float32 scale per block, which brings the scales from 16 bits (brisk's float16) to 8 + 32/256 = 8.125 bits
per group of 64 weights. The float16 absmax the layer multiplies with is rebuilt from them at every forward
(N K / 64 values: a few microseconds).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from brisk.ops.kernels import get_op
from brisk.ops.qlinear import PackedWeight, dequantize_packed, quant_linear

Tensor = torch.Tensor
DQ_BLOCK = 256  # absmax values per second-level scale, as in the QLoRA paper
_CHUNK_WEIGHTS = 1 << 21  # weights dequantized at a time in the backward


def double_quantize(absmax: Tensor, block: int = DQ_BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """absmax [N, G] (positive) -> (int8 codes [N G], float32 block scales [ceil(N G / block)], float32 mean)."""
    flat = absmax.float().flatten()
    mean = flat.mean()
    centred = flat - mean
    pad = (-flat.numel()) % block
    blocks = torch.nn.functional.pad(centred, (0, pad)).view(-1, block)  # [B, block]
    scale = blocks.abs().amax(dim=1).clamp_min(1e-12) / 127  # [B]
    codes = torch.round(blocks / scale[:, None]).clamp(-127, 127).to(torch.int8).flatten()[:flat.numel()]
    return codes, scale, mean


def double_dequantize(codes: Tensor, scale: Tensor, mean: Tensor, shape: tuple[int, ...], block: int = DQ_BLOCK
                      ) -> Tensor:
    """The inverse of double_quantize: absmax [shape] in float32."""
    n = codes.numel()
    pad = (-n) % block
    blocks = torch.nn.functional.pad(codes.float(), (0, pad)).view(-1, block) * scale[:, None]  # [B, block]
    return (blocks.flatten()[:n] + mean).view(shape)


def chunked_grad_input(grad_out: Tensor, n: int, k: int, rows: Callable[[int, int], Tensor]) -> Tensor:
    """grad_out [..., N] @ W [N, K] with W given a chunk of rows at a time (rows(n0, n1): [n1 - n0, K] float32,
    dropped after use), so no float copy of W is held."""
    g = grad_out.float()
    step = max(1, _CHUNK_WEIGHTS // k)
    out = None
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        part = g[..., n0:n1] @ rows(n0, n1)  # [..., K]
        out = part if out is None else out.add_(part)
    assert out is not None
    return out.to(grad_out.dtype)


class _FrozenQuantMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, layer: FrozenQuantLinear) -> Tensor:  # noqa: ANN001
        ctx.layer = layer
        return quant_linear(x, layer.packed(), layer.bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, None]:  # noqa: ANN001
        layer: FrozenQuantLinear = ctx.layer
        return layer.grad_input(grad_out), None


class FrozenQuantLinear(nn.Module):
    """y = x @ dequant(W)^T + b from packed codes, with a backward to x only (module docstring)."""

    trains_as_module = True  # train/forward.py calls it as a module (it has no float .weight)

    def __init__(self, packed: PackedWeight, bias: Tensor | None = None, double_quant: bool = False) -> None:
        super().__init__()
        assert not packed.tiled, "the training base keeps the row-major layout (slices of rows per chunk)"
        self.bits, self.group_size = packed.bits, packed.group_size
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.blocked = packed.blocked
        self.register_buffer("data", packed.data)
        self.register_buffer("zeros", packed.zeros)
        self.register_buffer("codebook", packed.codebook)
        self.double_quant = double_quant
        self.scale_shape = tuple(packed.scales.shape)
        if double_quant:
            codes, scale, mean = double_quantize(packed.scales)
            self.register_buffer("scale_codes", codes)
            self.register_buffer("scale_scales", scale)
            self.register_buffer("scale_mean", mean)
            self.register_buffer("scales", None)
        else:
            self.register_buffer("scales", packed.scales)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    def group_scales(self) -> Tensor:
        if not self.double_quant:
            return self.scales
        return double_dequantize(self.scale_codes, self.scale_scales, self.scale_mean, self.scale_shape).half()

    def packed(self, rows: slice | None = None, scales: Tensor | None = None) -> PackedWeight:
        """The layer as a PackedWeight (of a range of output rows when given)."""
        scales = self.group_scales() if scales is None else scales
        data, zeros = self.data, self.zeros
        n = self.out_features
        if rows is not None:
            data, scales = data[rows], scales[rows]
            zeros = None if zeros is None else zeros[rows]
            n = data.shape[0]
        return PackedWeight(self.bits, self.group_size, n, self.in_features, data, scales, zeros, self.codebook,
                            self.blocked)

    def grad_input(self, grad_out: Tensor) -> Tensor:
        """dL/dx = grad_out [..., N] @ dequant(W) [N, K], dequantizing W a chunk of rows at a time."""
        scales = self.group_scales()
        op = get_op("quant_dequantize") if self.blocked else None

        def rows(n0: int, n1: int) -> Tensor:
            pw = self.packed(slice(n0, n1), scales)
            return (op(pw.data, pw.scales, pw.zeros, pw.codebook, pw.bits, pw.group_size, pw.in_features)
                    if op is not None else dequantize_packed(pw))
        return chunked_grad_input(grad_out, self.out_features, self.in_features, rows)

    def forward(self, x: Tensor) -> Tensor:
        return _FrozenQuantMatmul.apply(x, self)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers())

    def extra_repr(self) -> str:
        kind = "nf4" if self.codebook is not None else f"int{self.bits}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {kind}-g{self.group_size}"
                + (", double-quantized scales" if self.double_quant else ""))


class _FrozenLutMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, layer: FrozenLutLinear) -> Tensor:  # noqa: ANN001
        ctx.layer = layer
        return layer.lut(x)  # the LutLinear's own kernels

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, None]:  # noqa: ANN001
        layer: FrozenLutLinear = ctx.layer
        return layer.grad_input(grad_out), None


class FrozenLutLinear(nn.Module):
    """A SqueezeLLM layer (ops/layers.py LutLinear: per-row tables, 4-bit codes, float outliers) as a frozen base:
    the forward through its kernels, dL/dx = dL/dy @ W with W decoded from the tables a chunk of output rows at a
    time (ops/lut.py dequantize_lut), as FrozenQuantLinear does for affine codes."""

    trains_as_module = True

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.lut = layer
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def grad_input(self, grad_out: Tensor) -> Tensor:
        from brisk.ops.lut import dequantize_lut

        return chunked_grad_input(grad_out, self.out_features, self.in_features,
                                  lambda n0, n1: dequantize_lut(self.lut.lut_weight, slice(n0, n1)))

    def forward(self, x: Tensor) -> Tensor:
        return _FrozenLutMatmul.apply(x, self)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.lut.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.lut.spec.label}"
