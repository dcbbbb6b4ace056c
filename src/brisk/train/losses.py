"""Training losses as plain functions of logits: next-token cross-entropy and logit distillation (Hinton et al.).

Position t of a [B, T] window predicts token t + 1, so every loss reads logits[:, :-1] against ids[:, 1:]
(B * (T - 1) predicted tokens). Log-softmax and the KL run in float32 whatever the logits' dtype: a bfloat16
softmax over a ~50k vocabulary loses the tail mass the KL is made of.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def next_token_ce(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) of ids[:, 1:] under logits[:, :-1]. logits: [B, T, V], ids: [B, T]."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), ids[:, 1:].reshape(-1))


def kd_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * KL(softmax(z_t / T) || softmax(z_s / T)), summed over the vocabulary, averaged over positions.

    Both [B, T, V] (every position scored: the distributions at all T positions are targets). The T^2 factor
    keeps the gradient's scale the same across temperatures (Hinton et al., 2015, section 2).
    """
    v = student_logits.shape[-1]
    log_q = F.log_softmax(student_logits.reshape(-1, v).float() / temperature, dim=-1)  # [B*T, V] student
    log_p = F.log_softmax(teacher_logits.reshape(-1, v).float() / temperature, dim=-1)  # [B*T, V] teacher
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [B*T]
    return kl.mean() * temperature**2


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, ids: torch.Tensor,
                      alpha: float, temperature: float) -> tuple[torch.Tensor, dict[str, float]]:
    """alpha * T^2 * KL(teacher || student) at temperature T + (1 - alpha) * next-token cross-entropy."""
    kl = kd_kl(student_logits, teacher_logits, temperature)
    ce = next_token_ce(student_logits, ids)
    return alpha * kl + (1 - alpha) * ce, {"kl": float(kl.detach()), "ce": float(ce.detach())}


def hidden_state_loss(student_hidden: list[torch.Tensor], teacher_hidden: list[torch.Tensor],
                      layer_map: list[tuple[int, int]]) -> torch.Tensor:
    """Mean over mapped (student layer, teacher layer) pairs of the MSE between their residual streams [B, T, H],
    each divided by the teacher stream's mean square so that deep layers (larger streams) do not dominate."""
    terms = []
    for s, t in layer_map:
        target = teacher_hidden[t].float()
        terms.append(F.mse_loss(student_hidden[s].float(), target) / target.pow(2).mean().clamp_min(1e-12))
    return torch.stack(terms).mean()
