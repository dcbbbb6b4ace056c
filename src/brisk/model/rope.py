"""Rotary position embeddings (RoPE) with the scaled variants found in HF configs: linear, dynamic NTK, llama3.

Layout follows HF transformers ("rotate half"): the first and second halves of each head's dimensions form the
rotation pairs. GGUF checkpoints are un-permuted to this layout at load time.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from brisk.model.config import ModelConfig, UnsupportedModelError


def base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # [head_dim / 2]: theta^(-2i/d)
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between."""
    factor = s["factor"]
    low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    orig = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > orig / low, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= orig / high) & (wavelen <= orig / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding:
    """Computes cos/sin for arbitrary positions; a table for static variants, per-token math for dynamic NTK."""

    def __init__(self, config: ModelConfig, max_position: int, device: torch.device | str = "cpu") -> None:
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        s = dict(config.rope_scaling or {})
        self.kind = s.get("rope_type", s.get("type", "default")) or "default"
        inv_freq = base_inv_freq(self.head_dim, self.theta)
        self.dynamic_orig_max = None
        if self.kind == "default":
            pass
        elif self.kind == "linear":
            inv_freq = inv_freq / s["factor"]
        elif self.kind == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, s)
        elif self.kind == "dynamic":
            self.factor = float(s["factor"])
            self.dynamic_orig_max = int(s.get("original_max_position_embeddings", config.max_position_embeddings))
        else:
            raise UnsupportedModelError(
                f"rope scaling {self.kind!r} is not supported; brisk supports default, linear, dynamic, llama3")
        self.inv_freq = inv_freq.to(device)
        table_len = max_position if self.dynamic_orig_max is None else self.dynamic_orig_max
        t = torch.arange(table_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, self.inv_freq)  # [P, d/2]
        self.cos_table = freqs.cos()
        self.sin_table = freqs.sin()

    def cos_sin(self, positions: torch.Tensor, context_lens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] -> cos, sin: [T, d/2] float32.

        Dynamic NTK follows HF: a sequence whose length (context_lens, per token) exceeds the original context
        uses base' = base * (factor * len / orig - (factor - 1)) ^ (d / (d - 2)); shorter ones use plain RoPE.
        """
        if self.dynamic_orig_max is not None and context_lens is not None:
            long = context_lens > self.dynamic_orig_max
            if bool(long.any()):
                d = self.head_dim
                lens = context_lens.float().clamp(min=self.dynamic_orig_max)
                base = self.theta * (self.factor * lens / self.dynamic_orig_max - (self.factor - 1)) ** (d / (d - 2))
                expo = torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d  # [d/2]
                inv = 1.0 / base.unsqueeze(1) ** expo.unsqueeze(0)  # [T, d/2]
                freqs = positions.float().unsqueeze(1) * inv
                return freqs.cos(), freqs.sin()
        try:  # (no max() and item() a step for the bound: index_select checks it)
            return self.cos_table.index_select(0, positions), self.sin_table.index_select(0, positions)
        except IndexError:  # positions beyond the table (a context longer than max_position_embeddings)
            freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
            return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; cos, sin: [T, d/2]. Rotates pairs (x[i], x[i + d/2])."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c = cos.unsqueeze(1).to(x.dtype)  # [T, 1, d/2]
    s = sin.unsqueeze(1).to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
