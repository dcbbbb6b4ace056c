"""The checkpoint side of brisk's W8A8 layers (SmoothQuant, LLM.int8()): which methods run int8 activations, and
the runtime layer built from a module's checkpoint tensors.

Both methods store RTN's 8-bit symmetric per-channel format (`X.qweight` uint8 codes q + 128, `X.scales` float16
[N, 1]), so `brisk eval size` and every tool that reads that format read them. What makes them W8A8 is the
checkpoint's `quantization_config`: `method` "smoothquant" or "llm-int8", and `method_config.activations`
("token": per-token scales at run time; "tensor": a calibrated per-tensor scale, `X.input_scale` float32 [1], the
name vLLM's compressed-tensors checkpoints give it) or `method_config.threshold` (LLM.int8()'s outlier threshold).
The embedding and lm_head keep their 8-bit weight-only layers: the head's input is the final norm's output, and
its 49k rows make it the one layer where the weight-only kernel's reading of 1 byte a weight is all that counts.
"""

from __future__ import annotations

import torch

from brisk.ops.w8a8 import Int8Linear, pack_weight
from brisk.quant import primitives
from brisk.quant.config import QuantConfigError, QuantizationConfig

ACTIVATION_METHODS = ("smoothquant", "llm-int8")
ACTIVATIONS = ("token", "tensor")


def runs_int8_activations(qconfig: QuantizationConfig | None) -> bool:
    """Whether the checkpoint's decoder linears are W8A8 layers (Int8Linear) rather than weight-only ones."""
    return qconfig is not None and qconfig.method in ACTIVATION_METHODS


def build_int8_linear(parts: list[dict[str, torch.Tensor]], qconfig: QuantizationConfig, in_features: int,
                      name: str) -> Int8Linear:
    """One Int8Linear from one or more modules' checkpoint tensors, rows concatenated (q/k/v and gate/up fusion)."""
    spec = qconfig.default
    if spec.bits != 8 or spec.group_size != -1 or not spec.sym:
        raise QuantConfigError(f"{name}: {qconfig.method} checkpoints hold int8 symmetric per-channel weights, but "
                               f"quantization_config says {spec.label}; re-run brisk quantize --method "
                               f"{qconfig.method}")
    mc = qconfig.method_config or {}
    codes = torch.cat([primitives.unpack(p["qweight"], 8, in_features) for p in parts])  # [N, K] uint8, q + 128
    scales = torch.cat([p["scales"] for p in parts]).float().reshape(-1)  # [N]
    bias = torch.cat([p["bias"] for p in parts]).float() if "bias" in parts[0] else None
    weight = pack_weight(codes, scales)
    if qconfig.method == "llm-int8":
        threshold = mc.get("threshold")
        if not isinstance(threshold, (int, float)) or threshold <= 0:
            raise QuantConfigError(f"{name}: an llm-int8 checkpoint needs method_config.threshold > 0, got "
                                   f"{threshold!r}")
        return Int8Linear(weight, bias, outlier_threshold=float(threshold), label="llm-int8")
    activations = mc.get("activations", "token")
    if activations not in ACTIVATIONS:
        raise QuantConfigError(f"{name}: method_config.activations must be one of {ACTIVATIONS}, got "
                               f"{activations!r}")
    input_scale = None
    if activations == "tensor":
        scales_in = [p.get("input_scale") for p in parts]
        if any(s is None for s in scales_in):
            raise QuantConfigError(f"{name}: static (per-tensor) activations need {name}.input_scale in the "
                                   "checkpoint; it is missing")
        if any(not torch.equal(s, scales_in[0]) for s in scales_in):
            raise QuantConfigError(f"{name}: fused parts with different input scales")
        input_scale = scales_in[0].float().reshape(1)
        if not float(input_scale) > 0:
            raise QuantConfigError(f"{name}.input_scale must be positive, got {float(input_scale)}")
    return Int8Linear(weight, bias, input_scale=input_scale, label="smoothquant")
