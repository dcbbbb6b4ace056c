"""The runtime linear layers (float, quantized, pruned) and the one description of the kernel each one runs.

Every runtime linear exposes `module.kernel() -> LinearKernel`: which kernel it takes (`kind`, numbered as
ops/csrc/decode_layers.cpp numbers them), the tensors that kernel reads (six `slots`, in the C++ layer loop's
order), bits, group size, and `max_rows`, the most activation rows its small-row kernel takes. Calling the
descriptor does the layer's one dispatch:

    rows <= max_rows, on the CPU, kernels built  ->  the small-row kernel (decode, verification, short chunks)
    otherwise                                    ->  the large-row path of its ops module (GEMM after a
                                                     dequantize / densify), or the PyTorch reference there
                                                     when the kernels are off

The module forward, the decode plan's Python loop and the C++ layer loop (engine/decode_plan.py) all read this
one descriptor, so the three cannot drift apart: the same kernel with the same tensors gives the same numbers.

    kind                  slots                                          small-row kernel
    0 FLOAT               weight, bias                                   linear_small_m
    1 QUANT_Q8            data, scales, zeros, bias                      quant_linear_q8   (int8 activations)
    2 QUANT               data, scales, zeros, codebook, bias            quant_linear_small
    3 SPARSE              mask, row_ptr, values, scales, mins, bias      sparse_linear     (bits = value kind)
    4 SPARSE_Q8           mask, row_ptr, values, scales, bias            sparse_q8_linear  (int8 activations)
    5 QUANT_Q8_TILED      data, scales, zeros, bias                      quant_linear_q8t  (int8 activations)
    6 QUANT_TILED         data, scales, zeros, codebook, bias            quant_linear_t
    7 W8A8                data, w_scale, shift_terms, input_scale, bias  w8a8_linear       (at every row count)
    8 W8A8_OUTLIER        data, w_scale, shift_terms, -, bias            (none: LLM.int8(), ops/w8a8.py)
    9 LUT                 codes, lut, row_ptr, cols, values, bias        lut_linear        (SqueezeLLM, ops/lut.py)
   10 LUT_Q8              codes, qlut, row_ptr, cols, values, bias       lut_linear_q8     (int8 activations)

Kind 8 (LLM.int8(), ops/w8a8.py) has no fixed kernel the C++ layer loop could call (its outlier columns change with
every call): its descriptor gives no loop dtypes, so the decode plan refuses it and the executor runs the model's
modules. Kind 7 (SmoothQuant) joins the loop for float32 models.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from brisk.ops import kernels, lut, qlinear, qlinear_q8, sparse, sparse_q8
from brisk.ops.linear import MAX_SMALL_M as FLOAT_MAX_ROWS
from brisk.ops.linear import linear
from brisk.ops.lut import LutWeight, lut_linear
from brisk.ops.qlinear import PackedWeight, quant_linear
from brisk.ops.sparse import SparseWeight, sparse_linear

if TYPE_CHECKING:
    from brisk.quant.config import LayerQuant

Tensor = torch.Tensor
_ACT_DTYPES = (torch.float32, torch.bfloat16)


class LinearKind(IntEnum):
    """A linear's kernel; the values are ops/csrc/decode_layers.cpp's `kind` numbers."""

    FLOAT = 0
    QUANT_Q8 = 1
    QUANT = 2
    SPARSE = 3
    SPARSE_Q8 = 4
    QUANT_Q8_TILED = 5
    QUANT_TILED = 6
    W8A8 = 7
    W8A8_OUTLIER = 8
    LUT = 9
    LUT_Q8 = 10


ANY_ROWS = sys.maxsize
# The most activation rows each kind's small-row kernel takes; beyond, the large-row path. Each limit is where the
# kernel stops beating the large-row path, measured in the kernel's own module:
MAX_ROWS: dict[LinearKind, int] = {
    # 8: past it a blocked GEMM (oneDNN, else MKL) outruns the GEMV that streams each weight row once
    LinearKind.FLOAT: FLOAT_MAX_ROWS,
    # 256: past it the float GEMM of dequantized weights on the rounded x is faster than the integer dots
    LinearKind.QUANT_Q8: qlinear_q8.MAX_Q8_ROWS,
    # 16: decoding codes inside the kernel wins up to ~24 rows; at 32+ MKL's register blocking wins
    LinearKind.QUANT: qlinear.MAX_SMALL_M,
    # 8: the kernel keeps one accumulator per row in one pass over the mask
    LinearKind.SPARSE: sparse.MAX_SMALL_M,
    LinearKind.SPARSE_Q8: sparse.MAX_SMALL_M,
    # no limit: the tiled integer dots outran the GEMM path at every row count measured (plain AVX2: 256, see
    # max_rows)
    LinearKind.QUANT_Q8_TILED: ANY_ROWS,
    # 256: the tiled float-activation kernel against dequantize + GEMM, level near 256-512 rows (AVX2: 32)
    LinearKind.QUANT_TILED: qlinear.MAX_TILED_M,
    # the integer GEMM takes every row count (ops/w8a8.py)
    LinearKind.W8A8: ANY_ROWS,
    LinearKind.W8A8_OUTLIER: ANY_ROWS,
    # 16: as QUANT, a table decode inside the GEMV against dequantize + GEMM (not measured apart)
    LinearKind.LUT: lut.MAX_SMALL_M,
    LinearKind.LUT_Q8: lut.MAX_SMALL_M,
}


def max_rows(kind: LinearKind) -> int:
    """MAX_ROWS[kind], the tiled kinds' limits as this build's kernels have them (lower on the AVX2 builds:
    qlinear.max_tiled_rows, qlinear_q8.max_tiled_q8_rows)."""
    if kind is LinearKind.QUANT_TILED:
        return qlinear.max_tiled_rows()
    if kind is LinearKind.QUANT_Q8_TILED:
        return qlinear_q8.max_tiled_q8_rows()
    return MAX_ROWS[kind]


@dataclass(frozen=True, eq=False)
class LinearKernel:
    """One linear layer's kernel; `kernel(x)` runs it (see the module docstring)."""

    kind: LinearKind
    slots: tuple[Tensor | None, ...]  # six, as decode_layers takes them for this kind
    bits: int
    group_size: int
    max_rows: int
    out_features: int
    small: Callable[[Tensor], Tensor] | None  # x2 [M, K] -> [M, N]; None: not built, or not for this weight
    large: Callable[[Tensor], Tensor]  # x [..., K] -> [..., N]: GEMM path, or the reference without kernels
    # model dtypes for which the decode plan and the C++ loop may call `small` as is (empty: never)
    loop_dtypes: tuple[torch.dtype, ...] = ()

    def __call__(self, x: Tensor) -> Tensor:
        k = x.shape[-1]
        rows = x.numel() // k if x.dim() and k else 0
        if (self.small is not None and 0 < rows <= self.max_rows and x.is_cpu and x.dtype in _ACT_DTYPES):
            return self.small(x.reshape(rows, k)).view(*x.shape[:-1], self.out_features)
        return self.large(x)


def _slots(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    return (*tensors, *([None] * (6 - len(tensors))))


class _CachedKernel:
    """The module's descriptor, rebuilt when what it was built from changes (kernels switched on or off, a new
    weight, prepacking, the activation mode, the layout); the key is cheap enough for every forward."""

    _kernel_cache: tuple[tuple[Any, ...], LinearKernel] | None = None

    def _kernel_key(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def _build_kernel(self, ops: Any) -> LinearKernel:
        raise NotImplementedError

    def kernel(self) -> LinearKernel:
        ops = kernels.get_ops()
        key = (id(ops), *self._kernel_key())
        cached = self._kernel_cache
        if cached is None or cached[0] != key:
            cached = (key, self._build_kernel(ops))
            self._kernel_cache = cached
        return cached[1]


class FastLinear(_CachedKernel, nn.Linear):
    """nn.Linear whose forward takes the small-M kernel when it can (same parameters, same state dict), and
    oneDNN's GEMM on a prepacked copy of the weight for many rows once `prepack_linears` gave it one."""

    packed_weight: Tensor | None = None  # not a parameter or buffer: never saved, rebuilt at load

    def _kernel_key(self) -> tuple[Any, ...]:
        return id(self.weight), id(self.bias), id(self.packed_weight)

    def _build_kernel(self, ops: Any) -> LinearKernel:
        w, b, packed = self.weight, self.bias, self.packed_weight
        op = getattr(ops, "linear_small_m", None) if w.is_contiguous() else None
        small = None if op is None else (lambda x2: op(x2, w, b))
        loopable = op is not None and w.dtype in _ACT_DTYPES and (b is None or b.dtype == w.dtype)
        return LinearKernel(LinearKind.FLOAT, _slots(w, b), 0, 0, MAX_ROWS[LinearKind.FLOAT], w.shape[0], small,
                            lambda x: linear(x, w, b, packed), _ACT_DTYPES if loopable else ())

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel()(x)


class QuantLinear(_CachedKernel, nn.Module):
    """y = x @ dequant(W)^T + b, computed from the packed codes. The packed tensors are buffers, so
    state_dict() and memory accounting see what is really held."""

    def __init__(self, packed: PackedWeight, bias: Tensor | None, spec: LayerQuant) -> None:
        super().__init__()
        self.packed = packed
        self.spec = spec
        self.in_features = packed.in_features
        self.out_features = packed.out_features
        for f in dataclasses.fields(packed):
            value = getattr(packed, f.name)
            if isinstance(value, Tensor):
                self.register_buffer(f"packed_{f.name}", value)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # "int8": decode rows round x to int8 per 32 columns for integer dot products (set_quant_activations)
        self.quant_activations = "float"

    def _kernel_key(self) -> tuple[Any, ...]:
        return id(self.packed), self.packed.tiled, self.quant_activations, id(self.bias)

    def _build_kernel(self, ops: Any) -> LinearKernel:
        pw, b = self.packed, self.bias
        int8_flag = self.quant_activations == "int8"
        large = lambda x: quant_linear(x, pw, b, int8_activations=int8_flag)  # noqa: E731
        data, scales, zeros, codebook, bits, group = pw.data, pw.scales, pw.zeros, pw.codebook, pw.bits, pw.group_size
        if int8_flag and qlinear_q8.covers(pw):  # ops.qlinear_q8.quant_linear_q8's kernels
            kind = LinearKind.QUANT_Q8_TILED if pw.tiled else LinearKind.QUANT_Q8
            op = getattr(ops, "quant_linear_q8t" if pw.tiled else "quant_linear_q8", None)
            small = None if op is None else (lambda x2: op(x2, data, scales, zeros, bits, group, b))
            slots = _slots(data, scales, zeros, b)
        else:  # ops.qlinear.quant_linear's float-activation kernels
            kind = LinearKind.QUANT_TILED if pw.tiled else LinearKind.QUANT
            op = getattr(ops, "quant_linear_t" if pw.tiled else "quant_linear_small", None) if pw.blocked else None
            small = None if op is None else (lambda x2: op(x2, data, scales, zeros, codebook, bits, group, b))
            slots = _slots(data, scales, zeros, codebook, b)
        return LinearKernel(kind, slots, bits, group, max_rows(kind), pw.out_features, small, large,
                            _ACT_DTYPES if small is not None else ())

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel()(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.label}"


class LutLinear(_CachedKernel, nn.Module):
    """y = x @ W^T + b for SqueezeLLM's dense-and-sparse weight (ops/lut.py LutWeight: per-row tables, 4-bit codes,
    float outliers). The tensors are buffers, so state_dict() and `brisk eval size` see what is held."""

    def __init__(self, weight: LutWeight, bias: Tensor | None, spec: LayerQuant) -> None:
        super().__init__()
        self.lut_weight = weight
        self.spec = spec
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("packed_data", weight.codes)  # [N, K / 2] uint8
        self.register_buffer("packed_lut", weight.lut)  # [N, 2^bits] float32
        for name in ("row_ptr", "cols", "values"):
            self.register_buffer(f"outlier_{name}", getattr(weight, name))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # "int8": x rounded to int8 per 32 columns against tables rounded to uint8 (set_quant_activations)
        self.quant_activations = "float"
        self._rounded: lut.RoundedTables | None = None  # quantize_tables(lut_weight), made on first use

    def rounded_tables(self) -> lut.RoundedTables:
        """The tables rounded for int8 activations (ops/lut.py quantize_tables): 20 bytes a row, not saved."""
        if self._rounded is None or self._rounded.weight.codes is not self.lut_weight.codes:
            self._rounded = lut.quantize_tables(self.lut_weight)
        return self._rounded

    def _kernel_key(self) -> tuple[Any, ...]:
        return id(self.lut_weight), id(self.bias), self.quant_activations

    def _build_kernel(self, ops: Any) -> LinearKernel:
        lw, b = self.lut_weight, self.bias
        if self.quant_activations == "int8" and lw.in_features % 32 == 0:
            rt = self.rounded_tables()
            op = getattr(ops, "lut_linear_q8", None)
            small = None if op is None else (lambda x2: op(x2, lw.codes, rt.qlut, lw.row_ptr, lw.cols, lw.values, b))
            # without the integer kernel (the kernels off or not built) every call takes lut_linear_q8's float paths
            return LinearKernel(LinearKind.LUT_Q8, _slots(lw.codes, rt.qlut, lw.row_ptr, lw.cols, lw.values, b),
                                lw.bits, -1, MAX_ROWS[LinearKind.LUT_Q8], lw.out_features, small,
                                lambda x: lut.lut_linear_q8(x, rt, b), _ACT_DTYPES if small is not None else ())
        op = getattr(ops, "lut_linear", None) if lw.in_features % 8 == 0 else None
        small = None if op is None else (lambda x2: op(x2, lw.codes, lw.lut, lw.row_ptr, lw.cols, lw.values, b))
        # the decode plan and the C++ layer loop (kind 9) call `small` as is, for float32 and bfloat16 rows
        return LinearKernel(LinearKind.LUT, _slots(lw.codes, lw.lut, lw.row_ptr, lw.cols, lw.values, b), lw.bits, -1,
                            MAX_ROWS[LinearKind.LUT], lw.out_features, small, lambda x: lut_linear(x, lw, b),
                            _ACT_DTYPES if small is not None else ())

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel()(x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.spec.label}, "
                f"{self.lut_weight.nnz} outliers" + (", int8 activations" if self.quant_activations == "int8" else ""))


class SparseLinear(_CachedKernel, nn.Module):
    """y = x @ W^T + b from a SparseWeight. Its tensors are buffers, so state_dict() and the roofline's byte count
    see what is really held and read."""

    def __init__(self, sw: SparseWeight, bias: Tensor | None, label: str = "", int8_dot: bool = False) -> None:
        super().__init__()
        self.sparse = sw
        self.int8_dot = int8_dot and sparse_q8.covers(sw)
        self.in_features = sw.in_features
        self.out_features = sw.out_features
        self.label = label
        for f in dataclasses.fields(sw):
            value = getattr(sw, f.name)
            if isinstance(value, Tensor):
                self.register_buffer(f"sparse_{f.name}", value)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def sparsity(self) -> float:
        return 1.0 - self.sparse.nnz / (self.in_features * self.out_features)

    def _kernel_key(self) -> tuple[Any, ...]:
        return id(self.sparse), self.int8_dot, id(self.bias)

    def _build_kernel(self, ops: Any) -> LinearKernel:
        sw, b, int8_dot = self.sparse, self.bias, self.int8_dot
        bf = None if b is None else b.float()
        large = lambda x: sparse_linear(x, sw, b, int8_dot=int8_dot)  # noqa: E731
        mask, row_ptr, values, scales, group = sw.mask, sw.row_ptr, sw.values, sw.scales, sw.group_size
        # the kernels take float32 activations: x is widened and the result narrowed back, as sparse_linear does
        q8 = getattr(ops, "sparse_q8_linear", None) if int8_dot else None
        if q8 is not None:  # int8 values with int8 activations (ops/sparse_q8.py)
            kind, slots = LinearKind.SPARSE_Q8, _slots(mask, row_ptr, values, scales, bf)
            small = lambda x2: q8(x2.float().contiguous(), mask, row_ptr, values, scales, group, bf).to(x2.dtype)  # noqa: E731
        else:
            kind, slots = LinearKind.SPARSE, _slots(mask, row_ptr, values, scales, sw.mins, bf)
            op = getattr(ops, "sparse_linear", None)
            small = None if op is None else (lambda x2: op(x2.float().contiguous(), mask, row_ptr, values, scales,
                                                            sw.mins, sw.kind, group, bf).to(x2.dtype))
        # the C++ loop passes the model's activations straight in: float32 models only
        return LinearKernel(kind, slots, 8 if kind is LinearKind.SPARSE_Q8 else sw.kind, group, MAX_ROWS[kind],
                            sw.out_features, small, large, (torch.float32,) if small is not None else ())

    def forward(self, x: Tensor) -> Tensor:
        return self.kernel()(x)

    def extra_repr(self) -> str:
        kind = "float32" if self.sparse.kind == 32 else f"int{self.sparse.kind} g{self.sparse.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {kind}, "
                f"sparsity={self.sparsity:.3f}" + (", int8 dot" if self.int8_dot else "")
                + (f", {self.label}" if self.label else ""))


RUNTIME_LINEARS = (FastLinear, QuantLinear, SparseLinear, LutLinear)
