"""LoRA / QLoRA: adapters in PEFT's format (adapter.py), many of them batched at runtime (layers.py, manager.py),
and their training on a frozen, possibly 4-bit base (train.py)."""

from brisk.lora.adapter import AdapterError, LoRAAdapter, load_adapter
from brisk.lora.request import LoRARequest

__all__ = ["AdapterError", "LoRAAdapter", "LoRARequest", "load_adapter"]
