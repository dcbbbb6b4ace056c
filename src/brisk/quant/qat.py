"""Quantization-aware training (QAT): train through the quantizer, then export brisk's packed checkpoint.

Every planned decoder linear keeps its float weight W [N, K] as the trained parameter and is run, in the
forward, on its fake-quantized copy (a `torch.nn.utils.parametrize` transform applied from outside, so the
training forward and the model code are unchanged):

    w_hat = s * (clamp(round(W / s) + z, 0, qmax) - z)         per group of G inputs: s, z [N, K/G]

round() has derivative 0 almost everywhere, so the backward uses the straight-through estimator (Bengio et
al. 2013): d round(x)/dx := 1. Inside the grid that passes the gradient to W unchanged; a clamped weight
gets none. The step size s is learned as in LSQ (Esser et al. 2020, eq. 3):

    d w_hat / d s = round(W / s) - W / s      inside the grid
                  = (0 or qmax) - z           clamped (the clipping threshold moves with s)

s is stored as log s, so an AdamW step changes it by a relative amount whatever the layer's magnitude (a
step on s itself would be huge for small-scale layers and negligible for large ones). The zero points stay
at their initial integers: their STE gradient is nonzero only on clamped weights, and an integer moves only
when a whole unit is crossed. s and z start from RTN's (or GPTQ's) choice, so step 0 is exactly that
checkpoint; the float weights start from the float model.

The loss is distillation from the float model (train/losses.py); the embedding and the head are snapped to
their 8-bit grid (or left float) and frozen, so the exported model is the trained one, to float rounding.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from brisk.model.loader import LoadedModel
from brisk.quant import primitives
from brisk.quant.checkpoint import EMBEDDING, encode_layer
from brisk.quant.config import LayerQuant, QuantizationConfig
from brisk.quant.rtn import quantize_layer
from brisk.quant.support import MethodSupport
from brisk.train.forward import TRAINABLE_ARCHITECTURES

# every architecture the training forward runs, MoE experts included: brisk keeps each expert as its own MLP of
# nn.Linear layers (model/moe.py), so every expert projection gets its own FakeQuant like any decoder linear (an
# expert no training token is routed to keeps its RTN start); the routers stay float
SUPPORT = MethodSupport("qat", TRAINABLE_ARCHITECTURES, moe_experts=True)

if TYPE_CHECKING:
    from brisk.train.data import TextWindows
    from brisk.train.trainer import TrainConfig


def round_ste(x: Tensor) -> Tensor:
    """round(x) in the forward, identity in the backward."""
    return x + (torch.round(x) - x).detach()


def fake_quantize_ste(w: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """w [N, K], scale and zero [N, K/G] -> s * (clamp(round(w / s) + z, 0, qmax) - z), [N, K], differentiable
    in w (straight-through) and in scale (LSQ); zero is used as given (integer-valued)."""
    n, k = w.shape
    num_groups = scale.shape[1]
    assert scale.shape == zero.shape == (n, num_groups) and k % num_groups == 0, \
        f"scale/zero {tuple(scale.shape)} do not fit w {tuple(w.shape)}"
    wg = w.reshape(n, num_groups, k // num_groups)  # [N, K/G, G]
    s = scale.unsqueeze(-1)  # [N, K/G, 1]
    z = zero.unsqueeze(-1)  # [N, K/G, 1]
    q = torch.clamp(round_ste(wg / s) + z, 0, primitives.QMAX[bits])  # [N, K/G, G]
    return ((q - z) * s).reshape(n, k)


class FakeQuant(nn.Module):
    """The parametrization W -> w_hat of one linear layer: learnable log-scale, fixed integer zero points."""

    def __init__(self, scale: Tensor, zero: Tensor, bits: int) -> None:
        super().__init__()
        assert bool((scale > 0).all()), "scales must be positive"
        self.bits = bits
        self.log_scale = nn.Parameter(scale.float().log())  # [N, K/G]
        self.register_buffer("zero", zero.float().clone())  # [N, K/G]

    @property
    def scale(self) -> Tensor:
        """exp(log s) rounded to float16 (straight through): the scale the checkpoint will store."""
        s = self.log_scale.exp()
        return s + (s.half().float() - s).detach()

    def forward(self, w: Tensor) -> Tensor:
        return fake_quantize_ste(w, self.scale, self.zero, self.bits).to(w.dtype)


@dataclass(frozen=True)
class QATConfig:
    """What `quantize --method qat` records as its method_config (the trainer's settings go in `training`)."""

    init: str = "rtn"  # rtn | gptq: where the scales, zero points (and, for gptq, the first codes) come from
    alpha: float = 1.0  # weight of the KL to the float model (1 - alpha: cross-entropy on the text)
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.init not in ("rtn", "gptq"):
            raise ValueError(f"QAT init must be rtn or gptq, got {self.init!r}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def initial_qparams(weight: Tensor, spec: LayerQuant) -> tuple[Tensor, Tensor]:
    """RTN's (scale, zero) [N, K/G] of a weight, the scale rounded to float16 as the checkpoint stores it."""
    group = None if spec.group_size == -1 else spec.group_size
    scale, zero = primitives.choose_qparams(weight.detach().float(), spec.bits, group_size=group, sym=spec.sym)
    return scale.clamp_min(torch.finfo(torch.float16).tiny).half().float(), zero


def prepare_qat(loaded: LoadedModel, plan: dict[str, LayerQuant],
                init: dict[str, dict[str, Tensor]] | None = None) -> list[str]:
    """Put a FakeQuant on every planned decoder linear of `loaded.model` (unfused, float); snap the embedding and
    a separate lm_head to their planned grid. `init` (module -> GPTQ's encoded tensors) replaces RTN's start:
    the weight becomes GPTQ's dequantized weight and s, z its scales and zero points. Returns the names of the
    parameters to keep frozen (embedding, head)."""
    model = loaded.model
    for name, spec in plan.items():
        if spec.scheme != "int":
            raise ValueError(f"{name}: QAT trains the uniform int grid, not {spec.scheme}")
        module = model.get_submodule(name)
        if name == EMBEDDING or name == "lm_head":
            with torch.no_grad():  # frozen on its own grid: what is exported is what was trained against
                module.weight.copy_(dequantize_encoded(quantize_layer(module.weight, spec), spec,
                                                       module.weight.shape[1]).to(module.weight.dtype))
            continue
        if init is not None and name in init:
            encoded = init[name]
            assert "input_order" not in encoded, "QAT from GPTQ needs static column order (no act-order)"
            w = dequantize_encoded(encoded, spec, module.weight.shape[1])
            scale, zero = _encoded_qparams(encoded, spec)
            with torch.no_grad():
                module.weight.copy_(w.to(module.weight.dtype))
        else:
            scale, zero = initial_qparams(module.weight, spec)
        parametrize.register_parametrization(module, "weight", FakeQuant(scale, zero, spec.bits))
    frozen = [n for n, _ in model.named_parameters() if n.startswith((EMBEDDING + ".", "lm_head."))]
    return frozen


def _encoded_qparams(encoded: dict[str, Tensor], spec: LayerQuant) -> tuple[Tensor, Tensor]:
    scale = encoded["scales"].float()
    if "qzeros" in encoded:
        zero = encoded["qzeros"].float()
    else:
        zero = torch.full_like(scale, 2 ** (spec.bits - 1))
    return scale, zero


def dequantize_encoded(encoded: dict[str, Tensor], spec: LayerQuant, in_features: int) -> Tensor:
    """The float32 weight [N, K] a layer's checkpoint tensors (qweight, scales, [qzeros]) stand for."""
    q = primitives.unpack(encoded["qweight"], spec.bits, in_features)
    scale, zero = _encoded_qparams(encoded, spec)
    return primitives.dequantize(q, scale, zero)


def qat_export(loaded: LoadedModel, plan: dict[str, LayerQuant], default: LayerQuant, qat: QATConfig,
               training: dict[str, object] | None = None) -> tuple[dict[str, Tensor], QuantizationConfig]:
    """Remove the FakeQuants and return checkpoint tensors and config: each layer's codes are those the
    forward used (round(W / s) + z clamped, s rounded to float16 as stored), in RTN's format."""
    from brisk.quant.rtn import checkpoint_tensors

    encoded: dict[str, dict[str, Tensor]] = {}
    model = loaded.model
    for name, spec in plan.items():
        module = model.get_submodule(name)
        if not parametrize.is_parametrized(module, "weight"):
            continue
        fq = module.parametrizations.weight[0]
        with torch.no_grad():
            w = module.parametrizations.weight.original.detach().float()
            scale = fq.scale.detach()
            q = primitives.quantize(w, scale, fq.zero, spec.bits)
        encoded[name] = encode_layer(q, scale, fq.zero, spec)
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    method_config: dict[str, object] = qat.to_dict()
    if training is not None:
        method_config["training"] = training
    qconfig = QuantizationConfig(method="qat", default=default, modules=dict(plan), method_config=method_config)
    return checkpoint_tensors(loaded, plan, encoded), qconfig


def num_scale_parameters(model: nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.endswith("log_scale"))



def qat_quantize(loaded: LoadedModel, plan: dict[str, LayerQuant], default: LayerQuant, qat: QATConfig,
                 config: TrainConfig, data: TextWindows, out: Path,
                 init: dict[str, dict[str, Tensor]] | None = None,
                 teacher: nn.Module | None = None) -> tuple[dict[str, Tensor], QuantizationConfig]:
    """QAT of `loaded` (unfused, float) with the float model as teacher; checkpoint tensors and config.

    `teacher`: the float model, where `loaded`'s weights no longer are (GPTQ, which `init` comes from, writes its
    quantized weights into the model it calibrates); default: a copy of `loaded.model` as it is now. The trainer
    (train/trainer.py) runs the loop and writes its log, loss curve and resumable state to `out`; the caller writes
    the quantized checkpoint over the float one it leaves there.
    """
    from brisk.train.distill import make_distill_loss
    from brisk.train.trainer import train

    # the float model, before any fake-quant
    teacher = (copy.deepcopy(loaded.model) if teacher is None else teacher).requires_grad_(False)
    frozen = prepare_qat(loaded, plan, init)
    loss_fn = make_distill_loss(teacher, qat.alpha, qat.temperature,
                                activation_checkpointing=config.activation_checkpointing)
    method = {"method": "qat", **qat.to_dict(), "quant": default.label}
    result = train(loaded, loss_fn, data, config, out, method=method, frozen=tuple(frozen))
    record = {k: v for k, v in result.record.items() if k != "loss_curve"}
    return qat_export(loaded, plan, default, qat, training=record)
