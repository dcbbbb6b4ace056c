"""Fused elementwise ops of the decoder layer: RMSNorm, residual add + RMSNorm, SiLU(gate) * up and GELU-tanh(gate)
* up (Gemma's GeGLU).

At batch-1 decode a step is ~150 small ops and each costs microseconds of dispatch whatever its size: ATen's
rms_norm alone is ~8 ops (pow, mean, add, rsqrt, mul, ...) and runs twice per layer. The C++ kernels
(ops/csrc/fused_ops.cpp) do each of these in one pass, and the residual add rides along with the norm that
follows it, as in vLLM:

    residual = embed                  x = norm_in_0(embed)
    layer i:  x = attn(x);            x = norm_post_i(residual += x)
              x = mlp(x);             x = norm_in_{i+1}(residual += x)      (the last: the final norm)

Each function has a pure-PyTorch reference path with the same results and the same in-place contract, taken
when the kernels are disabled or unbuilt, off the CPU, or for a dtype or layout the kernel does not cover.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from brisk.ops.kernels import get_op

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, round_once: bool = False) -> torch.Tensor:
    """RMSNorm as HF transformers computes it: statistics in float32, the weight applied in the model dtype (Llama's
    norm: a float32 weight on bfloat16 rows gives float32, as `weight * normed.to(dtype)` promotes). round_once: a
    float32 weight on lower-precision rows multiplies in float32 and the result is rounded once (Gemma3RMSNorm,
    whose 1 + w is float32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    if round_once and weight.dtype == torch.float32:
        return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _kernel_rows(x: torch.Tensor, weight: torch.Tensor, round_once: bool) -> bool:
    """True when the C++ kernels cover x: [T, H] contiguous rows and weight: [H] of x's dtype (or, round_once,
    float32), on the CPU.

    Kept to cheap attribute reads (is_cpu, not device.type): at decode this runs ~60 times a step, and a
    wrapper that costs more than the kernel would eat the gain.
    """
    return (x.is_cpu and x.dtype in _KERNEL_DTYPES and (weight.dtype == x.dtype or (round_once and weight.dtype ==
                                                                                  torch.float32))
            and x.is_contiguous() and weight.is_contiguous() and weight.shape == x.shape[-1:])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_once: bool = False) -> torch.Tensor:
    """x: [..., H], weight: [H] -> [..., H] normalized over the last dim (see rms_norm_reference)."""
    if _kernel_rows(x, weight, round_once):
        op = get_op("rms_norm")
        if op is not None:
            if x.dim() == 2:
                return op(x, weight, eps)
            if x.numel() > 0:
                return op(x.view(-1, x.shape[-1]), weight, eps).view(x.shape)  # kernel on [T, H] rows
    return rms_norm_reference(x, weight, eps, round_once)


def rms_norm_qk_heads_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       num_heads: int, num_kv_heads: int, round_once: bool = False) -> torch.Tensor:
    """Per-head RMSNorm of the q and k heads of a fused projection output, in place (qwen3's and gemma3's q_norm /
    k_norm, applied before RoPE). qkv: [T, (h + 2 kvh) d]; q_weight, k_weight: [d]. The module path and the decode
    plan both call this, so they normalize with the same kernel on the same rows."""
    t, d = qkv.shape[0], q_weight.shape[0]
    heads = qkv.view(t, num_heads + 2 * num_kv_heads, d)  # [T, h + 2 kvh, d]: q heads, k heads, v heads
    q, k = heads[:, :num_heads], heads[:, num_heads:num_heads + num_kv_heads]
    # rows of d, contiguous for the kernel (one k head, as MQA has, reshapes to a strided view of qkv)
    q.copy_(rms_norm(q.reshape(t * num_heads, d).contiguous(), q_weight, eps, round_once).view(t, num_heads, d))
    k.copy_(rms_norm(k.reshape(t * num_kv_heads, d).contiguous(), k_weight, eps, round_once).view(t, num_kv_heads,
                                                                                                   d))
    return qkv


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 round_once: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place, then (rms_norm(residual), residual): vLLM's fused_add_rms_norm.

    The sum is rounded to the residual's dtype before it is normalized, exactly like `residual + x` followed
    by a separate norm. Both paths update `residual` in place and return that same tensor.
    """
    if (_kernel_rows(residual, weight, round_once) and x.dtype == residual.dtype and x.shape == residual.shape
            and x.is_contiguous() and x.is_cpu):
        op = get_op("add_rms_norm")
        if op is not None:
            if x.dim() == 2:
                return op(x, residual, weight, eps), residual
            if x.numel() > 0:
                h = x.shape[-1]
                out = op(x.view(-1, h), residual.view(-1, h), weight, eps)  # [T, H]; residual updated via the view
                return out.view(x.shape), residual
    residual.add_(x)
    return rms_norm_reference(residual, weight, eps, round_once), residual


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # [..., 2I] -> 2 x [..., I]
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2I] (gate columns, then up columns) -> silu(gate) * up: [..., I] (SwiGLU's product)."""
    return _act_mul("silu_mul", gate_up, silu_mul_reference)


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # [..., 2I] -> 2 x [..., I]
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2I] -> gelu_tanh(gate) * up: [..., I] (GeGLU with HF's gelu_pytorch_tanh: Gemma's MLP)."""
    return _act_mul("gelu_tanh_mul", gate_up, gelu_tanh_mul_reference)


def _act_mul(name: str, gate_up: torch.Tensor, reference: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The kernel `name` on gate_up's rows where it applies, else `reference`."""
    if (gate_up.is_cpu and gate_up.dtype in _KERNEL_DTYPES and gate_up.shape[-1] % 2 == 0
            and gate_up.is_contiguous()):
        op = get_op(name)
        if op is not None:
            if gate_up.dim() == 2:
                return op(gate_up)
            if gate_up.numel() > 0:
                out = op(gate_up.view(-1, gate_up.shape[-1]))  # [T, 2I] -> [T, I]
                return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    return reference(gate_up)
