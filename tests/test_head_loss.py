"""The chunked head + loss (train/losses.py head_loss) against the plain [N, V] logits formulas: values and
gradients, fused and module paths, labelled subsets, chunks smaller than the batch, bfloat16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from brisk.train import losses
from brisk.train.losses import distillation_loss, head_loss, next_token_labels


class _Wrapped(nn.Module):
    """A head that is not an nn.Linear (as a frozen quantized or LoRA-wrapped head is): the module path."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.inner = linear
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def _reference(head: nn.Linear, hidden: torch.Tensor, teacher_w: torch.Tensor, labels: torch.Tensor, alpha: float,
               temp: float) -> torch.Tensor:
    z = F.linear(hidden, head.weight, head.bias).float()
    zt = hidden.detach() @ teacher_w.t()
    log_q, log_p = F.log_softmax(z / temp, -1), F.log_softmax(zt / temp, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean() * temp**2
    ce = F.cross_entropy(z, labels, ignore_index=-100)
    return alpha * kl + (1 - alpha) * ce


@pytest.mark.parametrize("wrapped", [False, True])
@pytest.mark.parametrize("temp", [1.0, 2.0])
def test_head_loss_equals_the_plain_formula_and_its_gradients(monkeypatch, wrapped, temp):
    monkeypatch.setattr(losses, "_CHUNK_ELEMENTS", 3 * 37)  # 3 rows a chunk: 5 chunks of a 14-row batch
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(8, 37, bias=True)
    teacher_w = torch.randn(37, 8, generator=g)
    hidden = torch.randn(14, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 37, (14,), generator=g)
    labels[[2, 9, 13]] = -100  # rows without a label: no CE, their KL still counts
    alpha = 0.3
    ref = _reference(head, hidden, teacher_w, labels, alpha, temp)
    ref_grads = torch.autograd.grad(ref, [hidden, head.weight, head.bias])
    rows = hidden.detach()
    loss, ce, kl = head_loss(_Wrapped(head) if wrapped else head, hidden, labels, ce_weight=1 - alpha,
                             kd_weight=alpha, teacher=lambda a, b: rows[a:b] @ teacher_w.t(), temperature=temp)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(ce, F.cross_entropy(F.linear(rows, head.weight, head.bias), labels))
    assert not ce.requires_grad and not kl.requires_grad
    grads = torch.autograd.grad(2.5 * loss, [hidden, head.weight, head.bias])  # the backward scales by d out/d loss
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, 2.5 * want, rtol=1e-5, atol=1e-6)


def test_a_frozen_head_gets_no_gradient_and_the_hidden_rows_do():
    head = nn.Linear(6, 11, bias=False).requires_grad_(False)
    hidden = torch.randn(5, 6, requires_grad=True)
    labels = torch.tensor([1, 2, 3, 4, -100])
    loss, _, _ = head_loss(head, hidden, labels)
    loss.backward()
    assert head.weight.grad is None
    ref = torch.autograd.grad(F.cross_entropy(hidden @ head.weight.t(), labels), hidden)[0]
    torch.testing.assert_close(hidden.grad, ref)


def test_the_windows_labels_and_the_old_distillation_loss_agree():
    g = torch.Generator().manual_seed(1)
    head = nn.Linear(4, 9, bias=False)
    teacher_w = torch.randn(9, 4, generator=g)
    hidden = torch.randn(2, 5, 4, generator=g)  # [B, T, H]
    ids = torch.randint(0, 9, (2, 5), generator=g)
    labels = next_token_labels(ids)
    assert labels.view(2, 5)[:, -1].eq(-100).all() and torch.equal(labels.view(2, 5)[:, :-1], ids[:, 1:])
    rows = hidden.reshape(-1, 4)
    loss, parts = distillation_loss(head(hidden), hidden @ teacher_w.t(), ids, 0.6, 2.0)
    fused, ce, kl = head_loss(head, rows, labels, ce_weight=0.4, kd_weight=0.6,
                              teacher=lambda a, b: rows[a:b] @ teacher_w.t(), temperature=2.0)
    torch.testing.assert_close(fused, loss)
    assert float(ce) == pytest.approx(parts["ce"], rel=1e-5) and float(kl) == pytest.approx(parts["kl"], rel=1e-5)
    only = torch.zeros(2, 5, dtype=torch.bool)
    only[0, 3] = True  # one labelled target token: row (0, 2) predicts it
    masked = next_token_labels(ids, only)
    assert (masked != -100).nonzero().flatten().tolist() == [2] and int(masked[2]) == int(ids[0, 3])


def test_bf16_autocast_stays_close_to_float32():
    g = torch.Generator().manual_seed(2)
    head = nn.Linear(32, 64, bias=False)
    hidden = torch.randn(16, 32, generator=g)
    labels = torch.randint(0, 64, (16,), generator=g)
    full = head_loss(head, hidden, labels)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = head_loss(head, hidden.bfloat16(), labels)[0]
    assert half.dtype == torch.float32
    assert float(half.detach()) == pytest.approx(float(full.detach()), rel=2e-2)


def test_a_kl_term_without_a_teacher_is_refused():
    with pytest.raises(ValueError, match="teacher"):
        head_loss(nn.Linear(2, 3), torch.randn(1, 2), torch.tensor([0]), kd_weight=0.5)
