"""Round-to-nearest (RTN) quantization of a whole model, and the layer plan every quantization method shares.

RTN needs no data: each weight group gets its scale and zero point from its own min/max (or absmax) and every
weight is rounded to the nearest code. It is the baseline that GPTQ and AWQ are measured against, and at 8 bits
(per channel) it is already lossless in practice.

Which layers: every linear layer of the decoder at the run's setting; the embedding table (and a separate
lm_head) at 8 bits per channel unless told otherwise, as llama.cpp (Q8_0/Q6_K token_embd and output in its
mixes), GPTQ and AWQ do: the head's errors land directly on the logits and it is the one layer whose input is
not renormalised downstream.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
from torch import nn

from brisk.model.config import SUPPORTED_ARCHITECTURES
from brisk.model.loader import LoadedModel
from brisk.quant import primitives
from brisk.quant.checkpoint import EMBEDDING, encode_layer
from brisk.quant.config import LayerQuant, QuantConfigError, QuantizationConfig
from brisk.quant.support import MethodSupport

SUPPORT = MethodSupport("rtn", SUPPORTED_ARCHITECTURES, moe_experts=True)  # every linear rounds on its own

HEAD_DEFAULT = LayerQuant(bits=8, group_size=-1, sym=True)


def plan_layers(model: nn.Module, tied: bool, default: LayerQuant, head: LayerQuant | None = HEAD_DEFAULT,
                skip: Iterable[str] = ()) -> dict[str, LayerQuant]:
    """Module name -> setting for every module to quantize. `head` None keeps embedding/lm_head in float;
    `skip` holds fnmatch patterns of module names kept in float (e.g. "model.layers.0.*", "*.down_proj")."""
    patterns = list(skip)
    plan: dict[str, LayerQuant] = {}
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in patterns):
            continue
        if name == EMBEDDING or (name == "lm_head" and not tied):
            if head is not None:
                plan[name] = head
        elif isinstance(module, nn.Linear) and name != "lm_head":
            plan[name] = default
    for name, spec in plan.items():  # every group size must divide its layer's row before any work is done
        in_features = model.get_submodule(name).weight.shape[1]
        try:
            spec.groups(in_features)
        except QuantConfigError as e:
            raise QuantConfigError(f"{name}: {e}") from None
    return plan


def quantize_layer(weight: torch.Tensor, spec: LayerQuant) -> dict[str, torch.Tensor]:
    """RTN codes of one weight [N, K] in checkpoint form (qweight, scales, [qzeros]).

    The scale is rounded to float16 (the checkpoint's precision) before the codes are chosen, so the codes are
    the nearest ones for the scale that will actually be used at inference.
    """
    w = weight.detach().float()
    group = None if spec.group_size == -1 else spec.group_size
    if spec.scheme == "nf4":
        codes, absmax = primitives.quantize_nf4(w, group_size=spec.group_size)
        return encode_layer(codes, absmax, None, spec)
    scale, zero = primitives.choose_qparams(w, spec.bits, group_size=group, sym=spec.sym)
    scale = scale.clamp_min(torch.finfo(torch.float16).tiny).half().float()
    q = primitives.quantize(w, scale, zero, spec.bits)
    return encode_layer(q, scale, zero, spec)


def rtn_quantize(loaded: LoadedModel, plan: dict[str, LayerQuant], default: LayerQuant,
                 progress: bool = True) -> tuple[dict[str, torch.Tensor], QuantizationConfig]:
    """Checkpoint tensors (quantized modules packed, the rest as they are) and the config that describes them.

    `loaded` must be unfused (load_model(..., fuse=False)) so module names are the checkpoint's HF names.
    """
    names = list(plan)
    encoded = {name: quantize_layer(loaded.model.get_submodule(name).weight, plan[name])
               for name in _progress(names, progress, "RTN")}
    return checkpoint_tensors(loaded, plan, encoded), QuantizationConfig(method="rtn", default=default,
                                                                        modules=dict(plan))


def checkpoint_tensors(loaded: LoadedModel, plan: dict[str, LayerQuant],
                       encoded: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The model's state dict with every planned module's weight replaced by its checkpoint tensors: those in
    `encoded` (a calibrated method's codes) or, for the rest (the embedding/head), RTN's."""
    state = dict(loaded.model.state_dict())
    if loaded.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, spec in plan.items():
        weight = state.pop(f"{name}.weight")
        tensors = encoded[name] if name in encoded else quantize_layer(weight, spec)
        for suffix, t in tensors.items():
            state[f"{name}.{suffix}"] = t
    return state


def _progress(items: list[str], enabled: bool, label: str) -> Iterable[str]:
    if not enabled:
        yield from items
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), transient=False) as bar:
        task = bar.add_task("", total=len(items))
        for item in items:
            bar.update(task, description=item)
            yield item
            bar.advance(task)
