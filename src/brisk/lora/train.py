"""LoRA / QLoRA fine-tuning on brisk's trainer: a frozen (optionally quantized) base, float32 adapters.

    prepare_base(loaded, base)      every decoder projection (and a quantized head) becomes a FrozenQuantLinear
                                    (nf4: NF4 g64 + double-quantized scales, QLoRA's recipe; int4 g64, int8
                                    per channel), or stays a frozen float linear (float); a checkpoint that is
                                    already quantized keeps its codes
    add_adapters(model, ...)        each target module gets A [r, K] (Kaiming-uniform, as PEFT) and B [N, r] = 0:
                                    step 0 is exactly the base model
    train(...)                      brisk's trainer (train/trainer.py) over the adapters' parameters only
    adapter_of(model)               the trained A, B -> LoRAAdapter -> PEFT's adapter folder

    LoRATrainLinear.forward(x) = base(x) + (alpha / r) * dropout(x) @ A^T @ B^T

The loss is next-token cross-entropy over the labelled positions only (all of them for plain text, the
assistant turns for chat data: data.py), the head's logits formed a chunk of positions at a time
(train/losses.py head_loss), so the [B, T, vocab] logits of a whole batch are never held at once.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from brisk.lora.adapter import LoRAAdapter, module_path
from brisk.lora.frozen import FrozenLutLinear, FrozenQuantLinear
from brisk.model.config import ModelConfig
from brisk.model.hugepages import release_free_memory
from brisk.model.loader import LoadedModel
from brisk.ops.layers import LutLinear, QuantLinear
from brisk.ops.qlinear import prepack, prepack_nf4
from brisk.quant.config import LayerQuant
from brisk.quant.rtn import quantize_layer
from brisk.train.forward import causal_lm_forward
from brisk.train.losses import head_loss, next_token_labels

BASES = ("nf4", "int4", "int8", "float")
BASE_SPECS = {"nf4": LayerQuant(4, 64, scheme="nf4"), "int4": LayerQuant(4, 64), "int8": LayerQuant(8, -1, sym=True)}


class LoRATrainLinear(nn.Module):
    """A frozen base layer plus a trainable low-rank update (module docstring)."""

    trains_as_module = True

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float, generator: torch.Generator,
                 use_rslora: bool = False) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = int(base.in_features), int(base.out_features)
        self.r = r
        self.scaling = alpha / (math.sqrt(r) if use_rslora else r)
        a = torch.empty(r, self.in_features)
        # PEFT's init: A ~ kaiming_uniform(a=sqrt(5)) (nn.Linear's), B = 0
        bound = 1 / math.sqrt(self.in_features)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a)  # [r, K]
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r))  # [N, r]
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.base, nn.Linear):
            y = F.linear(x, self.base.weight, self.base.bias)
        else:
            y = self.base(x)
        xa = F.linear(self.dropout(x).float(), self.lora_A)  # [..., r]
        return y + (F.linear(xa, self.lora_B) * self.scaling).to(y.dtype)


def _frozen_from_float(weight: torch.Tensor, bias: torch.Tensor | None, spec: LayerQuant, double_quant: bool
                       ) -> FrozenQuantLinear:
    enc = quantize_layer(weight.detach(), spec)
    k = weight.shape[1]
    if spec.scheme == "nf4":
        pw = prepack_nf4(enc["qweight"], enc["scales"], spec.group_size, k)
    else:
        pw = prepack(enc["qweight"], enc["scales"], enc.get("qzeros"), spec.bits, k if spec.group_size == -1
                     else spec.group_size, k)
    return FrozenQuantLinear(pw, None if bias is None else bias.detach(), double_quant=double_quant)


def _dequantized(q: QuantLinear | LutLinear) -> torch.Tensor:
    """A quantized layer's weight [N, K] in float32 (the values its kernels multiply with)."""
    from brisk.ops.qlinear import dequantize_packed, set_tiled

    if isinstance(q, LutLinear):
        from brisk.ops.lut import dequantize_lut

        return dequantize_lut(q.lut_weight)
    set_tiled(q.packed, False)
    return dequantize_packed(q.packed)


def _frozen_from_quant(q: QuantLinear, double_quant: bool) -> FrozenQuantLinear:
    from brisk.ops.qlinear import set_tiled

    pw = q.packed
    set_tiled(pw, False)  # FrozenQuantLinear reads the blocked layout (a no-op when it already is)
    return FrozenQuantLinear(pw, q.bias, double_quant=double_quant and pw.codebook is not None)


def check_lora_trainable(config: ModelConfig) -> None:
    """ValueError for a model whose adapters brisk could train but not serve: every dense architecture trains
    (train/forward.py); a mixture-of-experts model is refused, its routed experts having no adapter slots in the
    engine's LoRA layers (lora/layers.py) or in the decode plan's LoRA path."""
    if config.is_moe:
        raise ValueError(f"LoRA fine-tuning does not support mixture-of-experts models ({config.architecture}): "
                         "brisk serves adapters on dense MLP and attention projections only, not on routed experts "
                         "(brisk distill and quantize --method qat train MoE models)")


def prepare_base(loaded: LoadedModel, base: str, double_quant: bool = True, requantize: bool = False
                 ) -> dict[str, Any]:
    """Freeze the model and put its decoder projections on the training base `base` (module docstring).
    requantize: quantized layers (a GGUF file loaded in its own precision) are dequantized and quantized to
    `base` one at a time, so the float decoder is never held whole; otherwise they keep their codes.
    Returns what was done, for the training record."""
    if base not in BASES:
        raise ValueError(f"base must be one of {', '.join(BASES)}, got {base!r}")
    model = loaded.model
    model.requires_grad_(False)
    spec = BASE_SPECS.get(base)
    converted, kept = 0, 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if not name.endswith("_proj"):
                    continue
                dq = spec is not None and double_quant and spec.scheme == "nf4"
                if isinstance(child, QuantLinear | LutLinear) and requantize and spec is not None:
                    setattr(parent, name, _frozen_from_float(_dequantized(child), child.bias, spec, dq))
                    converted += 1
                elif isinstance(child, QuantLinear):
                    setattr(parent, name, _frozen_from_quant(child, double_quant))
                    kept += 1
                elif isinstance(child, LutLinear):  # SqueezeLLM's tables: kept, trained through
                    setattr(parent, name, FrozenLutLinear(child))
                    kept += 1
                elif isinstance(child, nn.Linear) and spec is not None:
                    setattr(parent, name, _frozen_from_float(child.weight, child.bias, spec, dq))
                    converted += 1
        if converted:
            release_free_memory()  # each layer's quantization temporaries, before the next layer's pile on them
    if isinstance(model.lm_head, QuantLinear):  # a quantized checkpoint's head (tied to an 8-bit embedding)
        model.lm_head = _frozen_from_quant(model.lm_head, double_quant)
    if not isinstance(model.model.embed_tokens, nn.Embedding):
        model.model.embed_tokens.trains_as_module = True  # a frozen lookup: no gradient needed
    if converted:
        _own_storage(model)
        release_free_memory()
    base_label = base if not kept else f"checkpoint's own ({kept} quantized layers)"
    return {"base": base_label, "base_spec": None if spec is None or kept else spec.label,
            "double_quant": bool(double_quant and base == "nf4" and not kept),
            "base_bytes": base_bytes(model), "quantized_at_load": converted}


def _own_storage(model: nn.Module) -> None:
    """Give every tensor left in the model (embedding, head, norms) a storage of its own. The loader places all
    weights in one arena (model/hugepages.py); while any view of it lives, the whole arena does, so without this
    the float decoder weights just replaced by packed codes would stay resident for the whole fine-tune."""
    from brisk.ops.qlinear import PackedWeight

    clones: dict[int, torch.Tensor] = {}  # a tied embedding and head stay one tensor

    def own(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().nbytes() <= t.numel() * t.element_size():
            return t
        if id(t) not in clones:
            copy = t.detach().clone()
            clones[id(t)] = nn.Parameter(copy, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else copy
        return clones[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = own(t)
        pw = getattr(module, "packed", None)  # a packed embedding's table (PackedEmbedding) is no buffer
        if isinstance(pw, PackedWeight):
            for field in ("data", "scales", "zeros", "codebook"):
                if (t := getattr(pw, field)) is not None:
                    setattr(pw, field, own(t))


def base_bytes(model: nn.Module) -> int:
    """Bytes of the frozen decoder projections (codes, scales) or float weights."""
    total = 0
    for module in model.modules():
        if isinstance(module, FrozenQuantLinear | FrozenLutLinear):
            total += module.nbytes()
        elif isinstance(module, nn.Linear) and not isinstance(module, LoRATrainLinear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def add_adapters(model: nn.Module, targets: list[str], r: int, alpha: float, dropout: float = 0.0,
                 seed: int = 0, use_rslora: bool = False) -> list[str]:
    """Wrap every target projection of every layer in a LoRATrainLinear; returns their HF module paths."""
    if r < 1:
        raise ValueError(f"lora rank must be at least 1, got {r}")
    if not 0 <= dropout < 1:
        raise ValueError(f"lora dropout must be in [0, 1), got {dropout}")
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for i, layer in enumerate(model.model.layers):
        for proj in targets:
            parent = layer.self_attn if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            child = getattr(parent, proj, None)
            if child is None:
                raise ValueError(f"model.layers.{i} has no {proj} to adapt (fused projections: load with "
                                 "fuse=False)")
            setattr(parent, proj, LoRATrainLinear(child, r, alpha, dropout, gen, use_rslora))
            paths.append(module_path(i, proj))
    return paths


def adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".lora_A" in n or ".lora_B" in n}


def adapter_of(model: nn.Module, targets: list[str], r: int, alpha: float, dropout: float, use_rslora: bool,
               base_name: str | None) -> LoRAAdapter:
    """The trained adapters of `model` as a LoRAAdapter (PEFT's names)."""
    lora_a, lora_b = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, LoRATrainLinear):
            lora_a[name] = module.lora_A.detach().float().clone()
            lora_b[name] = module.lora_B.detach().float().clone()
    return LoRAAdapter(r=r, lora_alpha=alpha, target_modules=list(targets), lora_a=lora_a, lora_b=lora_b,
                       lora_dropout=dropout, use_rslora=use_rslora, base_model_name_or_path=base_name)


def decode_labels(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of data.py's encoding (id >= 0: a labelled token, -1 - id: context only) -> (ids, labelled mask)."""
    labelled = batch >= 0
    return torch.where(labelled, batch, -1 - batch), labelled


def make_lora_loss(activation_checkpointing: bool = False):  # noqa: ANN201 - trainer.LossFn
    """Mean next-token cross-entropy over the labelled target positions (module docstring)."""

    def loss_fn(model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        ids, labelled = decode_labels(batch)
        hidden = causal_lm_forward(model, ids, activation_checkpointing=activation_checkpointing, head=False)
        rows = hidden.last_hidden.reshape(-1, hidden.last_hidden.shape[-1])  # [B*T, hidden]
        labels = next_token_labels(ids, labelled)  # position t predicts token t + 1
        loss, _, _ = head_loss(model.lm_head, rows, labels, softcap=model.config.final_logit_softcapping)
        return loss, {"tokens": float((labels != -100).sum())}

    return loss_fn


def save_adapter_output(out: Path, loaded: LoadedModel, record: dict[str, Any], *, adapter: LoRAAdapter) -> Path:
    """The finished run's folder: PEFT's adapter files, the tokenizer, and the training record."""
    import json

    adapter.extra_config = {**adapter.extra_config}
    adapter.save(out)
    loaded.tokenizer.save(out, loaded.generation_config)
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return out
