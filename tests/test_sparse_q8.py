"""Sparse int8 weights times int8-rounded activations (ops/csrc/sparse_q8.cpp): the activation rounding bit for bit
against a naive loop, the kernel against its float64 oracle over shapes (odd column counts, M = 1..8), its error
against the exact product (an SQNR floor), the fallbacks, and a pruned int8 checkpoint through the kernel."""

from __future__ import annotations

import pytest
import torch
from conftest import ops_with
from hf_utils import make_tiny_hf_model
from test_model import prefill_logits
from test_quant_checkpoint import quantize_folder
from test_sparse_linear import packed_layer, random_sparse, write_pruned

from brisk.model.loader import load_model
from brisk.ops import sparse as S
from brisk.ops import sparse_q8 as Q
from brisk.ops.layers import SparseLinear
from brisk.ops.qlinear import dequantize_packed
from brisk.quant.config import LayerQuant


@pytest.fixture(autouse=True)
def kernels_enabled(kernel_settings):
    kernel_settings(enabled=True)


@pytest.fixture(scope="module")
def ops():
    return ops_with("sparse_q8_linear")


def naive_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of 32 columns at a time, one element at a time, in float32."""
    m, k = x.shape
    nb = -(-k // 32)
    xq = torch.zeros(m, nb * 32, dtype=torch.int8)
    xs = torch.zeros(m, nb)
    for r in range(m):
        for j in range(nb):
            block = x[r, 32 * j: 32 * j + 32]
            amax = block.abs().max()
            xs[r, j] = amax / torch.tensor(127.0)
            inv = torch.tensor(127.0) / amax if amax > 0 else torch.tensor(0.0)
            for c in range(block.numel()):
                xq[r, 32 * j + c] = int(torch.round(block[c] * inv))
    return xq, xs


def test_activation_rounding_is_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 72, generator=g) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    x[1, 32:64] = 0  # an all-zero block: scale 0, codes 0
    x[2, 5] = 0.5 * x[2, :32].abs().max()  # values on rounding boundaries happen; the order of operations decides
    xq, xs = Q.quantize_activations_q8(x)
    want_q, want_s = naive_quantize(x)
    assert torch.equal(xq, want_q) and torch.equal(xs, want_s)
    assert xq.shape == (3, 96) and bool((xq[:, 72:] == 0).all())  # zero padding past K


SHAPES = [(37, 40, -1), (5, 8, -1), (3, 56, -1), (33, 192, -1), (17, 192, 64), (9, 1536, 32), (20, 576, -1)]


@pytest.mark.parametrize("n,k,group", SHAPES)
@pytest.mark.parametrize("pattern", ["0.5", "2:4", "0.9"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8])
def test_int8_dot_kernel_equals_reference(ops, n, k, group, pattern, m):
    w = random_sparse(n, k, pattern, seed=n + m)
    sw = S.compress_packed(packed_layer(w, LayerQuant(8, group, True)))
    assert sw is not None and Q.covers(sw)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    ref = Q.sparse_q8_reference(x, sw, bias)
    out = S.sparse_linear(x, sw, bias, int8_dot=True)
    # the integer dot products are exact in both; what differs is float32 against float64 summation of at most
    # K / 32 scaled partial sums
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_int8_dot_error_against_the_exact_product(ops):
    n, k = 64, 576
    w = random_sparse(n, k, "0.5", seed=3)
    pw = packed_layer(w, LayerQuant(8, -1, True))
    sw = S.compress_packed(pw)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(4))
    exact = x.double() @ dequantize_packed(pw).double().T
    err = S.sparse_linear(x, sw, int8_dot=True).double() - exact
    sqnr = 10 * torch.log10(exact.pow(2).mean() / err.pow(2).mean()).item()
    # rounding x to 8 bits per 32 columns: step max|x| / 127 with max|x| ~ 2.2 sigma for Gaussian blocks, i.e. noise
    # power ~ (2.2 / 127)^2 / 12 = 2.5e-5 of the signal's -> ~46 dB; 40 dB fails a kernel that drops or misplaces
    # even a few weights
    assert sqnr > 40, sqnr
    assert sqnr < 80, sqnr  # and x really is rounded (the float kernel would be ~140 dB)


def test_uncovered_groups_and_disabled_kernels_fall_back(kernel_settings, ops):
    w = random_sparse(9, 48, "0.5", seed=5)
    sw = S.compress_packed(packed_layer(w, LayerQuant(8, 16, True)))  # 16-column groups: not whole 32-col blocks
    assert sw is not None and not Q.covers(sw)
    x = torch.randn(2, 48, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(S.sparse_linear(x, sw, int8_dot=True), S.sparse_linear(x, sw), rtol=0, atol=0)
    assert not SparseLinear(sw, None, int8_dot=True).int8_dot
    covered = S.compress_packed(packed_layer(w, LayerQuant(8, -1, True)))
    kernel_settings(enabled=False)  # no kernel: the float reference path, whatever was asked
    assert Q.sparse_q8_linear(x, covered) is None
    exact = x @ S.densify_reference(covered).T
    torch.testing.assert_close(S.sparse_linear(x, covered, int8_dot=True), exact, rtol=1e-5, atol=1e-5)


def test_pruned_int8_checkpoint_through_the_int8_dot_kernel(ops, tmp_path, monkeypatch):
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=6)
    pruned = write_pruned(src, tmp_path / "pruned", 0.5)
    qfolder = quantize_folder(pruned, tmp_path / "q8", LayerQuant(bits=8, group_size=-1, sym=True))
    dense_q = load_model(qfolder)
    sparse_q = load_model(qfolder)
    assert S.sparsify_model(sparse_q.model, {32: None, 8: 0.3, 4: 0.3}, int8_dot=True) == 8
    assert all(m.int8_dot for m in sparse_q.model.modules() if isinstance(m, SparseLinear))
    ids = torch.tensor([9, 8, 7, 100, 200, 31, 5])

    def decode_logits(loaded):  # every prefix (<= 8 rows) goes through the kernel at each decoder linear
        return torch.stack([prefill_logits(loaded, ids[: i + 1])[-1] for i in range(len(ids))])

    got, want = decode_logits(sparse_q), decode_logits(dense_q)
    # the oracle: the same model with the kernel replaced by its float64 reference (same rounding of x)
    monkeypatch.setattr(Q, "sparse_q8_linear", lambda x2, sw, bias=None: Q.sparse_q8_reference(x2, sw, bias))
    torch.testing.assert_close(got, decode_logits(sparse_q), rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # against the dense int8 model: x rounded to int8 at every decoder linear (2 layers x 4 of a random tiny model)
    # moves the logits by 2.3e-2 relative (measured); 5e-2 bounds it, a wrong scale or a lost group gives O(1)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 5e-2, rel


def test_kernel_sweep_reports_the_int8_dot_kernel_for_int8_only(ops):
    from brisk.bench.sparse import kernel_sweep

    points = kernel_sweep(["4:8"], layers=1, reps=1)
    assert [p["kind"] for p in points] == ["float32", "int8", "int4"]
    for p in points:
        assert p["sparsity"] == "4:8" and p["dense_ms"] > 0 and p["sparse_ms"] > 0
        assert (p["int8dot_ms"] is not None) == (p["kind"] == "int8")
    assert points[1]["int8dot_speedup"] == pytest.approx(points[1]["dense_ms"] / points[1]["int8dot_ms"])
