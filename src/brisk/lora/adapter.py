"""LoRA adapters in PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`.

A LoRA adapter (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3) adds to a frozen
linear layer W0 [N, K] a low-rank update

    h = W0 x + (alpha / r) * B A x          A [r, K], B [N, r]; B starts at zero, so step 0 is the base model

(rsLoRA, Kalajievo 2023: alpha / sqrt(r), PEFT's `use_rslora`). PEFT stores A and B under the HF module path
of the layer they adapt, behind the `base_model.model.` prefix of its wrapper:

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight    [r, K]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight    [N, r]

and `adapter_config.json` holds `peft_type: "LORA"`, `r`, `lora_alpha`, `target_modules`, `lora_dropout`,
`use_rslora`, `base_model_name_or_path`, ... (PEFT's LoraConfig fields). brisk reads and writes exactly that, so
an adapter trained by `brisk finetune` loads in `peft.PeftModel.from_pretrained` and one PEFT wrote serves here.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."

# PEFT's names of the Llama-family projections, and the short names `brisk finetune --target-modules` takes
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHORT_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
               "down": "down_proj"}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj))"
                  r"\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be read, or does not fit the model or the engine's limits."""


def parse_target_modules(spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """'q,k,v,o' or PEFT names ['q_proj', ...] or 'all-linear' -> PEFT projection names, in the model's order."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    items = [s.strip() for s in items if s.strip()]
    if items in (["all-linear"], ["all"]):
        return list(PROJECTIONS)
    out = []
    for item in items:
        name = SHORT_NAMES.get(item, item)
        if name not in PROJECTIONS:
            raise AdapterError(f"target module {item!r} is not a projection of this model family; use some of "
                               f"{', '.join(SHORT_NAMES)} (or PEFT's names {', '.join(PROJECTIONS)}, or all-linear)")
        out.append(name)
    if not out:
        raise AdapterError("no target modules given; pass e.g. --target-modules q,k,v,o,gate,up,down")
    return [p for p in PROJECTIONS if p in out]


def module_path(layer: int, proj: str) -> str:
    """HF module path of a projection: model.layers.3.self_attn.q_proj."""
    return f"model.layers.{layer}.{_PARENT[proj]}.{proj}"


@dataclass
class LoRAAdapter:
    """One adapter in memory: per adapted module (HF path) its A [r, K] and B [N, r] in float32, and its scaling."""

    r: int
    lora_alpha: float
    target_modules: list[str]  # PEFT projection names
    lora_a: dict[str, torch.Tensor]  # module path -> A [r, K]
    lora_b: dict[str, torch.Tensor]  # module path -> B [N, r]
    lora_dropout: float = 0.0
    use_rslora: bool = False
    base_model_name_or_path: str | None = None
    digest: str = ""  # sha256 of the weights: identifies the adapter's content (prefix-cache keys)
    extra_config: dict = field(default_factory=dict)  # other adapter_config.json fields, written back as read

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @property
    def modules(self) -> list[str]:
        return list(self.lora_a)

    def delta_weight(self, module: str) -> torch.Tensor:
        """scaling * B @ A: [N, K], what merging adds to the module's weight."""
        return self.scaling * (self.lora_b[module].float() @ self.lora_a[module].float())

    def peft_config(self) -> dict:
        cfg = {
            **self.extra_config,
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r, "lora_alpha": self.lora_alpha,
            "lora_dropout": self.lora_dropout, "target_modules": list(self.target_modules), "bias": "none",
            "use_rslora": self.use_rslora, "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
            "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True,
            "base_model_name_or_path": self.base_model_name_or_path,
        }
        return cfg

    def save(self, folder: str | Path) -> Path:
        """Write PEFT's two files to `folder` (weights first: a folder with its config is a finished adapter)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for m in self.modules:
            tensors[f"{PEFT_PREFIX}{m}.lora_A.weight"] = self.lora_a[m].detach().float().contiguous()
            tensors[f"{PEFT_PREFIX}{m}.lora_B.weight"] = self.lora_b[m].detach().float().contiguous()
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        (folder / CONFIG_FILE).write_text(json.dumps(self.peft_config(), indent=2) + "\n")
        return folder


def load_adapter(path: str | Path) -> LoRAAdapter:
    """Read a PEFT LoRA adapter folder; AdapterError says what is missing or unsupported."""
    folder = Path(path)
    cfg_path, w_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not folder.is_dir():
        raise AdapterError(f"LoRA adapter {folder} is not a folder; give a folder with {CONFIG_FILE} and "
                           f"{WEIGHTS_FILE} (what peft's save_pretrained or brisk finetune writes)")
    if not cfg_path.is_file() or not w_path.is_file():
        missing = [p.name for p in (cfg_path, w_path) if not p.is_file()]
        raise AdapterError(f"LoRA adapter {folder} lacks {' and '.join(missing)} (PEFT's adapter format)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"{cfg_path} is not valid JSON: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder} is a {cfg.get('peft_type')} adapter; brisk serves LoRA adapters only")
    for key, bad in (("use_dora", True), ("bias", None)):
        if key == "bias" and cfg.get("bias", "none") != "none":
            raise AdapterError(f"{folder}: adapters with trained biases (bias={cfg['bias']!r}) are not supported")
        if key == "use_dora" and cfg.get("use_dora") is bad:
            raise AdapterError(f"{folder} is a DoRA adapter (use_dora); brisk serves plain LoRA adapters")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{folder} also trains whole modules ({cfg['modules_to_save']}); brisk serves adapters "
                           "whose only weights are lora_A / lora_B")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"{folder} uses per-module rank_pattern / alpha_pattern, which brisk does not read; "
                           "train it with one r and lora_alpha")
    raw = w_path.read_bytes()
    try:
        tensors = load_file(str(w_path))
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{w_path} cannot be read: {e}") from None
    lora_a: dict[str, torch.Tensor] = {}
    lora_b: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{w_path}: tensor {key!r} is not a LoRA weight of a Llama-family projection "
                               "(expected e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight)")
        (lora_a if m.group(5) == "A" else lora_b)[m.group(1)] = t.float()
    if set(lora_a) != set(lora_b) or not lora_a:
        raise AdapterError(f"{w_path}: every adapted module needs both lora_A and lora_B "
                           f"(A for {len(lora_a)}, B for {len(lora_b)} modules)")
    r = int(cfg.get("r", 8))
    for mod in lora_a:
        a, b = lora_a[mod], lora_b[mod]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise AdapterError(f"{w_path}: {mod} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, which is "
                               f"not rank r={r} as adapter_config.json says")
    order = sorted(lora_a, key=lambda p: (int(p.split(".")[2]), PROJECTIONS.index(p.rsplit(".", 1)[1])))
    targets = cfg.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    known = {"peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora",
             "use_dora", "fan_in_fan_out", "inference_mode", "modules_to_save", "rank_pattern", "alpha_pattern",
             "init_lora_weights", "base_model_name_or_path"}
    return LoRAAdapter(
        r=r, lora_alpha=float(cfg.get("lora_alpha", 8)), target_modules=[t for t in targets if isinstance(t, str)],
        lora_a={m: lora_a[m] for m in order}, lora_b={m: lora_b[m] for m in order},
        lora_dropout=float(cfg.get("lora_dropout", 0.0)), use_rslora=bool(cfg.get("use_rslora", False)),
        base_model_name_or_path=cfg.get("base_model_name_or_path"), digest=hashlib.sha256(raw).hexdigest(),
        extra_config={k: v for k, v in cfg.items() if k not in known})


def check_fits(adapter: LoRAAdapter, shapes: dict[str, tuple[int, int]], name: str = "adapter") -> None:
    """AdapterError unless every adapted module exists in the model with A [r, K] / B [N, r] fitting its [N, K].
    `shapes`: module path -> (out_features, in_features) of the model's projections."""
    for mod in adapter.modules:
        if mod not in shapes:
            layers = 1 + max((int(p.split(".")[2]) for p in shapes), default=-1)
            raise AdapterError(f"{name} adapts {mod}, which this model does not have ({layers} layers); the "
                               "adapter was trained for another base model")
        n, k = shapes[mod]
        a, b = adapter.lora_a[mod], adapter.lora_b[mod]
        if a.shape[1] != k or b.shape[0] != n:
            raise AdapterError(f"{name} does not fit this base model: {mod} is [{n}, {k}] here, but the adapter's "
                               f"lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}; use an adapter trained "
                               "on this model")


@torch.no_grad()
def merge_adapter(model: torch.nn.Module, adapter: LoRAAdapter) -> int:
    """W += scaling * B A for every adapted module of an unfused float model (in place); returns how many."""
    for mod in adapter.modules:
        linear = model.get_submodule(mod)
        weight = getattr(linear, "weight", None)
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise AdapterError(f"{mod} is not a float linear layer; merge into a float, unfused model")
        weight += adapter.delta_weight(mod).to(weight.dtype)
    return len(adapter.modules)
