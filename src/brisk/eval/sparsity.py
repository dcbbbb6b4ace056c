"""How sparse a model is: exact zeros per decoder linear, per layer and in total, and N:M conformance.

Read from the checkpoint's tensors as stored (no model is built): a float weight counts its zeros; a brisk
quantized module (qweight + scales [+ qzeros]) counts the codes equal to their group's zero point, which are
exactly the weights that dequantize to 0 (scale * (q - zero)). A GGUF file is read dequantized.

N:M conformance: a module conforms to N:M when every run of M consecutive weights of every row holds at most
N nonzeros; the report lists the patterns (2:4, 4:8) that every decoder linear satisfies.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from brisk.prune.masks import nm_conforms

PATTERNS = ((2, 4), (4, 8))
# a decoder linear; a MoE layer's routed experts (mlp.experts.{j}.*) and shared expert (mlp.shared_expert.*) too
_LINEAR = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(?:(?:experts\.\d+|shared_expert)\.)?"
                     r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)$")


@dataclass
class ModuleSparsity:
    name: str
    layer: int
    short: str  # q_proj, ..., down_proj
    num_params: int
    num_zeros: int
    patterns: list[str] = field(default_factory=list)  # N:M patterns it conforms to

    @property
    def sparsity(self) -> float:
        return self.num_zeros / max(self.num_params, 1)


@dataclass
class SparsityReport:
    model: str
    modules: list[ModuleSparsity]
    num_params_total: int  # every parameter of the checkpoint (embedding, norms, head when stored)
    num_zeros_total: int
    sparsity_config: dict[str, Any] | None

    @property
    def linear_params(self) -> int:
        return sum(m.num_params for m in self.modules)

    @property
    def linear_zeros(self) -> int:
        return sum(m.num_zeros for m in self.modules)

    @property
    def linear_sparsity(self) -> float:
        return self.linear_zeros / max(self.linear_params, 1)

    @property
    def patterns(self) -> list[str]:
        """N:M patterns every decoder linear conforms to."""
        if not self.modules:
            return []
        common = set(self.modules[0].patterns)
        for m in self.modules[1:]:
            common &= set(m.patterns)
        return [f"{n}:{m}" for n, m in PATTERNS if f"{n}:{m}" in common]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "linear_sparsity": self.linear_sparsity, "linear_params": self.linear_params,
                "linear_zeros": self.linear_zeros, "num_params_total": self.num_params_total,
                "num_zeros_total": self.num_zeros_total, "patterns": self.patterns,
                "sparsity_config": self.sparsity_config,
                "modules": [{**asdict(m), "sparsity": m.sparsity} for m in self.modules]}


def _module_weights(model: str | None) -> tuple[str, dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                dict[str, Any] | None]:
    """(name, float weights by module, zero masks by quantized module, sparsity_config) of a checkpoint."""
    from brisk.model.loader import resolve_model
    from brisk.prune.checkpoint import read_sparsity_config

    path = resolve_model(model)
    if path.is_dir():
        from brisk.model.hf import load_hf_folder

        ckpt = load_hf_folder(path)
        tensors, quant = dict(ckpt.tensors), ckpt.quantization
    else:
        from brisk.model.gguf import load_gguf

        ckpt = load_gguf(path)
        tensors, quant = dict(ckpt.tensors), None
    zero_masks: dict[str, torch.Tensor] = {}
    if quant is not None:
        from brisk.quant import primitives

        for name, spec in quant.modules.items():
            qweight = tensors.pop(f"{name}.qweight")
            scales = tensors.pop(f"{name}.scales")
            qzeros = tensors.pop(f"{name}.qzeros", None)
            k = qweight.shape[1] * 8 // spec.bits
            codes = primitives.unpack(qweight, spec.bits, k)  # [N, K]
            groups = scales.shape[1]
            if spec.scheme == "nf4":
                w = primitives.dequantize_nf4(codes, scales.float())
                zero_masks[name] = w == 0
                continue
            zero = qzeros.float() if qzeros is not None else torch.full_like(scales.float(), 2 ** (spec.bits - 1))
            zero = zero.repeat_interleave(k // groups, dim=1)  # [N, K]
            zero_masks[name] = (codes.float() == zero) | (scales.float().repeat_interleave(k // groups, 1) == 0)
    weights = {k.removesuffix(".weight"): v for k, v in tensors.items() if k.endswith(".weight")}
    other = {k: v for k, v in tensors.items() if not k.endswith(".weight")}
    weights.update({f"__other__{k}": v for k, v in other.items()})
    return path.name, weights, zero_masks, read_sparsity_config(path) if path.is_dir() else None


def sparsity_report(model: str | None) -> SparsityReport:
    """Zeros of every decoder linear and of the whole checkpoint (quantized tensors: of the dequantized values)."""
    name, weights, zero_masks, config = _module_weights(model)
    modules = []
    total = zeros = 0
    items = [(k, (v == 0)) for k, v in weights.items()] + list(zero_masks.items())
    for key, is_zero in items:
        total += is_zero.numel()
        zeros += int(is_zero.sum())
        match = _LINEAR.match(key)
        if not match:
            continue
        nonzero = (~is_zero).float()
        patterns = [f"{n}:{m}" for n, m in PATTERNS if nm_conforms(nonzero, n, m)]
        modules.append(ModuleSparsity(key, int(match.group(1)), match.group(3), is_zero.numel(),
                                      int(is_zero.sum()), patterns))
    order = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    modules.sort(key=lambda m: (m.layer, order.index(m.short), m.name))
    return SparsityReport(name, modules, total, zeros, config)


def print_sparsity_report(report: SparsityReport) -> None:
    from rich.console import Console
    from rich.table import Table

    shorts = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    table = Table(title=f"sparsity of {report.model} (exact zeros of the decoder's linear weights)",
                  title_justify="left")
    table.add_column("layer", justify="right")
    for s in shorts:
        table.add_column(s.removesuffix("_proj"), justify="right")
    table.add_column("layer total", justify="right")
    by_layer: dict[int, list[ModuleSparsity]] = {}
    for m in report.modules:
        by_layer.setdefault(m.layer, []).append(m)
    for layer, mods in sorted(by_layer.items()):
        per_short: dict[str, list[int]] = {}  # short -> [zeros, params], a MoE layer's experts summed
        for m in mods:
            acc = per_short.setdefault(m.short, [0, 0])
            acc[0], acc[1] = acc[0] + m.num_zeros, acc[1] + m.num_params
        cells = {k: f"{z / max(n, 1):.1%}" for k, (z, n) in per_short.items()}
        params, zero = sum(m.num_params for m in mods), sum(m.num_zeros for m in mods)
        table.add_row(str(layer), *[cells.get(s, "-") for s in shorts], f"{zero / max(params, 1):.2%}")
    console = Console()
    console.print(table)
    method = (report.sparsity_config or {}).get("method")
    console.print(f"decoder linears: {report.linear_zeros:,} zeros of {report.linear_params:,} weights = "
                  f"[bold]{report.linear_sparsity:.2%}[/] sparse")
    console.print(f"whole checkpoint: {report.num_zeros_total:,} zeros of {report.num_params_total:,} values = "
                  f"{report.num_zeros_total / max(report.num_params_total, 1):.2%}")
    console.print("N:M conformance (every decoder linear): "
                  + (", ".join(report.patterns) if report.patterns else "none of " +
                     ", ".join(f"{n}:{m}" for n, m in PATTERNS)))
    if method:
        console.print(f"pruned by brisk: method {method}, recorded in config.json sparsity_config")
    if method == "structured":  # no zeros to count: the model itself is smaller
        cfg = report.sparsity_config or {}
        before, after = cfg.get("num_parameters_before"), cfg.get("num_parameters_after")
        if isinstance(before, int) and isinstance(after, int) and before:
            console.print(f"structured: {before:,} -> {after:,} parameters ({1 - after / before:.2%} removed)")
