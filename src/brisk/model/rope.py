"""Rotary position embeddings (RoPE) with the scaled variants found in HF configs: linear, dynamic NTK, llama3,
longrope (phi3's "su").

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


def longrope_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any], max_position: int
                      ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE (phi3): (short inv_freq, long inv_freq, attention factor), as transformers computes them.

    Each frequency is divided by its own factor (short_factor within the original context, long_factor beyond);
    cos and sin are scaled by sqrt(1 + ln(factor) / ln(original context)), factor = max / original context."""
    half = inv_freq.shape[0]
    factors = []
    for key in ("short_factor", "long_factor"):
        f = s.get(key)
        if not isinstance(f, (list, tuple)) or len(f) != half:
            raise UnsupportedModelError(f"longrope {key} must be a list of head_dim / 2 = {half} numbers, got "
                                        f"{f if not isinstance(f, (list, tuple)) else f'{len(f)} numbers'}")
        factors.append(torch.tensor(f, dtype=torch.float32))
    orig = int(s["original_max_position_embeddings"])
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        factor = s.get("factor") or max_position / orig
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return inv_freq / factors[0], inv_freq / factors[1], float(attention_factor)


class RotaryEmbedding:
    """Computes cos/sin for arbitrary positions; a table for static variants, per-token math for dynamic NTK."""

    def __init__(self, config: ModelConfig, max_position: int, device: torch.device | str = "cpu") -> None:
        self.head_dim = config.head_dim
        self.theta = config.rope_theta
        s = dict(config.rope_scaling or {})
        self.kind = s.get("rope_type", s.get("type", "default")) or "default"
        inv_freq = base_inv_freq(self.head_dim, self.theta)
        self.dynamic_orig_max = None
        self.long_orig_max = None  # longrope: sequences longer than this use long_inv_freq
        attention_factor = 1.0
        if self.kind == "default":
            pass
        elif self.kind == "linear":
            inv_freq = inv_freq / s["factor"]
        elif self.kind == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, s)
        elif self.kind == "dynamic":
            self.factor = float(s["factor"])
            self.dynamic_orig_max = int(s.get("original_max_position_embeddings", config.max_position_embeddings))
        elif self.kind in ("longrope", "su"):
            inv_freq, long_inv_freq, attention_factor = longrope_inv_freq(
                inv_freq, s, config.max_position_embeddings)
            self.long_orig_max = int(s["original_max_position_embeddings"])
            self.long_inv_freq = long_inv_freq.to(device)
        else:
            raise UnsupportedModelError(
                f"rope scaling {self.kind!r} is not supported; brisk supports default, linear, dynamic, llama3, "
                "longrope")
        self.attention_factor = attention_factor  # multiplies cos and sin (longrope), 1 elsewhere
        self.inv_freq = inv_freq.to(device)
        table_len = max_position if self.dynamic_orig_max is None else self.dynamic_orig_max
        if self.long_orig_max is not None:
            table_len = min(table_len, self.long_orig_max)  # the short factors' table; longer sequences: per token
        t = torch.arange(table_len, dtype=torch.float32, device=device)
        freqs = torch.outer(t, self.inv_freq)  # [P, d/2]
        self.cos_table = freqs.cos() * attention_factor
        self.sin_table = freqs.sin() * attention_factor

    @property
    def length_dependent(self) -> bool:
        """Whether a token's rotation depends on its sequence's length (dynamic NTK, longrope): callers then pass
        `context_lens` per token to cos_sin."""
        return self.dynamic_orig_max is not None or self.long_orig_max is not None

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
        if self.long_orig_max is not None and context_lens is not None:
            # longrope, as HF: a sequence longer than the original context rotates with the long factors (its
            # earlier keys stay cached as they were rotated); shorter ones with the short factors' table
            long = (context_lens > self.long_orig_max).unsqueeze(1)  # [T, 1]
            if bool(long.any()):
                inv = torch.where(long, self.long_inv_freq.unsqueeze(0), self.inv_freq.unsqueeze(0))  # [T, d/2]
                freqs = positions.float().unsqueeze(1) * inv
                return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        try:  # (no max() and item() a step for the bound: index_select checks it)
            return self.cos_table.index_select(0, positions), self.sin_table.index_select(0, positions)
        except IndexError:  # positions beyond the table (a context longer than max_position_embeddings)
            freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)
            return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; cos, sin: [T, d/2]. Rotates pairs (x[i], x[i + d/2])."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c = cos.unsqueeze(1).to(x.dtype)  # [T, 1, d/2]
    s = sin.unsqueeze(1).to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
