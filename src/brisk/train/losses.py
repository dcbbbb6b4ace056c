"""Training losses as plain functions of logits: next-token cross-entropy and logit distillation (Hinton et al.).

Position t of a [B, T] window predicts token t + 1, so every loss reads logits[:, :-1] against ids[:, 1:]
(B * (T - 1) predicted tokens). Log-softmax and the KL run in float32 whatever the logits' dtype: a bfloat16
softmax over a ~50k vocabulary loses the tail mass the KL is made of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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


# --- the head and the loss in one pass over row chunks ------------------------------------------------------------
#
# A [B, T, V] float32 logits tensor of a 49k vocabulary is 200 KB a position: at 4 x 256 positions that is 200 MB
# for the logits alone, and the log-softmaxes, their product and the gradients multiply it. head_loss forms the
# logits of CHUNK rows at a time, computes the loss and d loss / d logits of those rows right there, and keeps only
# their products with the head (d hidden, d weight): the gradient is complete when the forward returns, and the
# backward only scales it (the trick of fused linear cross-entropy kernels, e.g. Liger's, done with plain matmuls).
#
#   z = h @ W^T + b                           [C, V], float32 (bfloat16 matmul under bf16 autocast)
#   z = cap * tanh(z / cap)                   where the model soft-caps its logits (gemma3); the gradient below is
#                                               then multiplied by d z / d z_raw = 1 - (z / cap)^2
#   ce  = mean over labelled rows of -log softmax(z)[y]      d ce / dz  = (softmax(z) - onehot(y)) / M
#   kl  = T^2 mean over rows of KL(p_T || softmax(z / T))     d kl / dz  = T (softmax(z / T) - p_T) / N
#   loss = ce_weight * ce + kd_weight * kl

_CHUNK_ELEMENTS = 1 << 22  # logits formed at once (rows x vocabulary): 16 MB of float32 (85 rows of 49k)

TeacherLogits = Callable[[int, int], torch.Tensor]  # (row start, row end) -> the teacher's logits [end - start, V]


def _chunk_terms(z: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None, temperature: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Sums over one chunk's rows: (CE sum, d CE sum / dz, KL sum (T^2 not applied), d KL sum / dz or None).

    z: [C, V] float32 logits, labels: [C] (-100: not labelled), teacher: [C, V] logits or None."""
    labelled = labels != -100
    log_q = torch.log_softmax(z, dim=-1)  # [C, V]
    safe = torch.where(labelled, labels, 0)
    ce = -(log_q.gather(1, safe[:, None]).squeeze(1) * labelled).sum()
    d_ce = log_q.exp()
    d_ce[labelled.nonzero().squeeze(1), labels[labelled]] -= 1.0
    d_ce *= labelled[:, None]
    if teacher is None:
        return ce, d_ce, z.new_zeros(()), None
    log_p = torch.log_softmax(teacher.float() / temperature, dim=-1)  # [C, V]
    log_q_t = log_q if temperature == 1.0 else torch.log_softmax(z / temperature, dim=-1)
    p = log_p.exp()
    kl = (p * (log_p - log_q_t)).sum()
    d_kl = log_q_t.exp().sub_(p).div_(temperature)  # d KL sum / dz: (q_T - p_T) / T
    return ce, d_ce, kl, d_kl


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, teacher: TeacherLogits | None, ce_weight: float, kd_weight: float,
                temperature: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, v = hidden.shape[0], weight.shape[0]
        m = max(int((labels != -100).sum()), 1)
        dtype = hidden.dtype if hidden.dtype == torch.bfloat16 else torch.float32  # bfloat16: autocast's
        w = weight.to(dtype)
        want_h = ctx.needs_input_grad[0]
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty(hidden.shape, dtype=torch.float32) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32) if want_w else None
        grad_b = torch.zeros(v, dtype=torch.float32) if want_b else None
        ce_sum, kl_sum = torch.zeros(()), torch.zeros(())
        rows = max(1, _CHUNK_ELEMENTS // v)
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            for s in range(0, n, rows):
                e = min(s + rows, n)
                h = hidden[s:e].to(dtype)
                z = (h @ w.t()).float()
                if bias is not None:
                    z += bias.float()
                if softcap:
                    z = torch.tanh(z.div_(softcap)).mul_(softcap)
                t = teacher(s, e) if teacher is not None and kd_weight else None
                ce, d_ce, kl, d_kl = _chunk_terms(z, labels[s:e], t, temperature)
                ce_sum += ce
                kl_sum += kl
                dz = d_ce.mul_(ce_weight / m)
                if d_kl is not None:
                    dz.add_(d_kl, alpha=kd_weight * temperature**2 / n)
                if softcap:  # back through the cap: d z / d z_raw = 1 - tanh^2 = 1 - (z / cap)^2
                    dz.mul_(1.0 - z.div_(softcap).square_())
                if grad_h is not None:
                    grad_h[s:e] = (dz.to(dtype) @ w).float()
                if grad_w is not None:
                    grad_w.addmm_(dz.t(), h.float())
                if grad_b is not None:
                    grad_b += dz.sum(0)
        ctx.grads = (None if grad_h is None else grad_h.to(hidden.dtype),
                     None if grad_w is None else grad_w.to(weight.dtype),
                     None if grad_b is None else grad_b.to(bias.dtype))
        ce_mean, kl_mean = ce_sum / m, kl_sum * temperature**2 / n
        loss = ce_weight * ce_mean + kd_weight * kl_mean
        ctx.mark_non_differentiable(ce_mean, kl_mean)
        return loss, ce_mean, kl_mean

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, *_: Any) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w, grad_b = ctx.grads
        del ctx.grads
        scale = grad_loss.to(torch.float32)
        return (None if grad_h is None else grad_h * scale.to(grad_h.dtype),
                None if grad_w is None else grad_w * scale.to(grad_w.dtype),
                None if grad_b is None else grad_b * scale.to(grad_b.dtype), None, None, None, None, None, None)


def head_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, *, ce_weight: float = 1.0,
              kd_weight: float = 0.0, teacher: TeacherLogits | None = None, temperature: float = 1.0,
              softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ce_weight * mean CE of `labels` + kd_weight * T^2 * mean KL(teacher || student) at temperature T, the
    student's logits being head(hidden) (soft-capped to softcap * tanh(logits / softcap) when `softcap` is set:
    gemma3's final_logit_softcapping), formed a chunk of rows at a time (never all at once).

    hidden: [N, H] rows (the final-norm output); labels: [N] token ids, -100 where a row has no label (its CE is
    skipped, its KL still counts); teacher(start, end) gives the teacher's logits of rows start:end. Returns
    (loss, ce, kl), ce and kl detached. A plain float nn.Linear head takes the fused path (the gradient computed
    in the forward); any other head module (a frozen quantized base, a LoRA-wrapped head) runs chunk by chunk
    under activation checkpointing, the same math.
    """
    if kd_weight and teacher is None:
        raise ValueError("a KL term needs the teacher's logits")
    if isinstance(head, nn.Linear) and head.weight.is_floating_point() and head.weight.layout == torch.strided:
        return _FusedHeadLoss.apply(hidden, head.weight, head.bias, labels, teacher, ce_weight, kd_weight,
                                    temperature, softcap)
    from torch.utils.checkpoint import checkpoint

    n, v = hidden.shape[0], int(head.out_features)
    m = max(int((labels != -100).sum()), 1)
    rows = max(1, _CHUNK_ELEMENTS // v)
    ce_sum = hidden.new_zeros((), dtype=torch.float32)
    kl_sum = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, n, rows):
        e = min(s + rows, n)
        t = None
        if teacher is not None and kd_weight:
            with torch.no_grad():
                t = teacher(s, e)
        ce, kl = checkpoint(_module_chunk, head, hidden[s:e], labels[s:e], t, temperature, softcap,
                            use_reentrant=False)
        ce_sum, kl_sum = ce_sum + ce, kl_sum + kl
    ce_mean, kl_mean = ce_sum / m, kl_sum * temperature**2 / n
    return ce_weight * ce_mean + kd_weight * kl_mean, ce_mean.detach(), kl_mean.detach()


def _module_chunk(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None,
                  temperature: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE sum, KL sum) of one chunk through an arbitrary head module, differentiable by autograd."""
    z = head(hidden).float()
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    ce = F.cross_entropy(z, labels, ignore_index=-100, reduction="sum")
    if teacher is None:
        return ce, z.new_zeros(())
    log_q = F.log_softmax(z / temperature, dim=-1)
    log_p = F.log_softmax(teacher.float() / temperature, dim=-1)
    return ce, (log_p.exp() * (log_p - log_q)).sum()


def next_token_labels(ids: torch.Tensor, labelled: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] ids -> [B * T] labels of the rows of a [B, T] window: row (b, t) is labelled ids[b, t + 1], the last
    position of each window nothing (-100); `labelled` [B, T] (optional) marks the tokens that count as labels."""
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:] if labelled is None else torch.where(labelled[:, 1:], ids[:, 1:], -100)
    return labels.reshape(-1)
