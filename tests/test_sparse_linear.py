"""Sparse linear (bitmask + packed values): the kernels against the dense reference, the format's round trips,
the load-time swap, and a pruned tiny model generating the same greedy tokens through the sparse path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import ops_with
from hf_utils import make_tiny_hf_model
from safetensors.torch import load_file, save_file
from test_quant_checkpoint import _greedy_float, quantize_folder

from brisk import LLM, SamplingParams
from brisk.model.loader import load_model
from brisk.ops import sparse as S
from brisk.ops.layers import QuantLinear, SparseLinear
from brisk.ops.qlinear import dequantize_packed, prepack
from brisk.quant.config import LayerQuant
from brisk.quant.rtn import quantize_layer

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def kernels_enabled(kernel_settings):
    kernel_settings(enabled=True)


@pytest.fixture(scope="module")
def ops():
    return ops_with("sparse_linear")


def magnitude_prune(w: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Per output row, the `sparsity` fraction of smallest |w| set to zero (a test-local pruner)."""
    k = w.shape[1]
    drop = int(round(sparsity * k))
    out = w.clone()
    if drop:
        idx = w.abs().argsort(dim=1)[:, :drop]  # [N, drop]
        out.scatter_(1, idx, 0.0)
    return out


def two_four(w: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A random 2:4 pattern: in every 4 consecutive columns exactly 2 kept."""
    n, k = w.shape
    order = torch.rand(n, k // 4, 4, generator=generator).argsort(-1)[..., :2]  # [N, K/4, 2] dropped
    keep = torch.ones(n, k // 4, 4, dtype=torch.bool).scatter_(-1, order, False)
    return w * keep.view(n, k)


def random_sparse(n: int, k: int, pattern: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if pattern == "2:4":
        return two_four(w, g)
    if pattern == "rows":  # whole rows and whole mask bytes empty, others dense: the extremes of the layout
        w[::3] = 0
        w[:, 8:16] = 0
        return w
    return w * (torch.rand(n, k, generator=g) >= float(pattern))


@pytest.mark.parametrize("pattern", ["0.5", "2:4", "0.9", "0.0", "rows"])
@pytest.mark.parametrize("n,k", [(40, 192), (1, 8), (7, 40), (33, 576)])
def test_float_round_trip_is_exact(pattern, n, k):
    w = random_sparse(n, k, pattern, seed=n * k)
    sw = S.compress(w)
    assert sw.nnz == int((w != 0).sum())
    assert torch.equal(S.densify_reference(sw), w)
    assert int(sw.row_ptr[-1]) == sw.nnz and bool((sw.row_ptr.diff() == (w != 0).sum(1)).all())


@pytest.mark.parametrize("pattern", ["0.5", "2:4", "0.9", "rows"])
@pytest.mark.parametrize("n,k", [(40, 192), (1, 8), (7, 40), (13, 1536)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 33])
def test_float_kernel_equals_dense_reference(ops, pattern, n, k, m):
    w = random_sparse(n, k, pattern, seed=n + k + m)
    sw = S.compress(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n)
    ref = x.double() @ w.double().T + bias.double()
    out = S.sparse_linear(x, sw, bias)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # float32 accumulation in a different order: error ~ eps * sqrt(K) * |x||w|
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    assert torch.equal(S.densify(sw), w)  # the C++ densify of the large-M path is exact


def test_leading_dims_bfloat16_and_reference_path(kernel_settings, ops):
    w = random_sparse(24, 64, "0.5", seed=3)
    sw = S.compress(w)
    x = torch.randn(2, 3, 64)
    kernel = S.sparse_linear(x, sw)
    assert kernel.shape == (2, 3, 24)
    torch.testing.assert_close(kernel, F.linear(x, w), rtol=1e-5, atol=1e-5)
    xb = x.bfloat16()
    out_b = S.sparse_linear(xb, sw)
    assert out_b.dtype == torch.bfloat16
    torch.testing.assert_close(out_b.float(), F.linear(xb.float(), w), rtol=1e-2, atol=1e-2)
    kernel_settings(enabled=False)
    torch.testing.assert_close(S.sparse_linear(x, sw), kernel, rtol=1e-5, atol=1e-5)


def packed_layer(w: torch.Tensor, spec: LayerQuant):
    k = w.shape[1]
    t = quantize_layer(w, spec)
    group = k if spec.group_size == -1 else spec.group_size
    return prepack(t["qweight"], t["scales"], t.get("qzeros"), spec.bits, group, k)


CODE_SPECS = [LayerQuant(8, -1, True), LayerQuant(8, 64, True), LayerQuant(4, 64, False), LayerQuant(4, 32, True),
              LayerQuant(3, 64, False), LayerQuant(2, 64, False)]


@pytest.mark.parametrize("spec", CODE_SPECS, ids=lambda s: s.label)
@pytest.mark.parametrize("pattern", ["0.5", "2:4"])
@pytest.mark.parametrize("m", [1, 3, 8, 20])
def test_code_kernel_equals_dequantized_reference(ops, spec, pattern, m):
    n, k = 37, 192
    w = random_sparse(n, k, pattern, seed=m)
    pw = packed_layer(w, spec)
    dense = dequantize_packed(pw)  # [N, K]: the quantized layer's own weights
    assert bool((dense[w == 0] == 0).all())  # pruned weights quantize to exactly zero (q == zero point)
    sw = S.compress_packed(pw)
    assert sw is not None and sw.kind == (8 if spec.bits == 8 else 4)
    torch.testing.assert_close(S.densify_reference(sw), dense, rtol=0, atol=0)
    torch.testing.assert_close(S.densify(sw), dense, rtol=1e-6, atol=1e-7)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(7))
    ref = x.double() @ dense.double().T
    torch.testing.assert_close(S.sparse_linear(x, sw).double(), ref, rtol=1e-5, atol=1e-5 * k ** 0.5)
    # at 50% the stored codes and the mask are smaller than the dense codes (2-3 bit codes ride in 4 bits); the
    # group parameters come on top (float32 scales and mins here, float16 scales and uint8 zero points dense)
    if spec.bits >= 4:
        assert sw.values.nbytes + sw.mask.nbytes < pw.data.nbytes


def test_asymmetric_int8_and_nf4_have_no_sparse_format():
    w = random_sparse(16, 64, "0.5", seed=1)
    assert S.compress_packed(packed_layer(w, LayerQuant(8, -1, False))) is None


def test_sparsify_model_thresholds_and_fused_layers(tmp_path):
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=2)
    dense = load_model(src)
    assert not any(isinstance(m, SparseLinear) for m in dense.model.modules())  # nothing sparse, nothing swapped
    loaded = load_model(src, sparse=False)
    layer = loaded.model.model.layers[0]
    layer.mlp.gate_up_proj.weight.copy_(magnitude_prune(layer.mlp.gate_up_proj.weight, 0.5))
    layer.self_attn.o_proj.weight.copy_(magnitude_prune(layer.self_attn.o_proj.weight, 0.1))  # below threshold
    assert S.sparsify_model(loaded.model) == 1
    assert isinstance(layer.mlp.gate_up_proj, SparseLinear) and abs(layer.mlp.gate_up_proj.sparsity - 0.5) < 1e-6
    assert not isinstance(layer.self_attn.o_proj, SparseLinear)
    assert not isinstance(loaded.model.lm_head, SparseLinear)
    # unfused loads (tools that edit weights by HF name) keep plain layers by default
    assert not any(isinstance(m, SparseLinear) for m in load_model(src, fuse=False).model.modules())


def write_pruned(src, out, sparsity: float):
    """A copy of the HF folder with every decoder linear weight magnitude-pruned per row."""
    import shutil

    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name, t in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            tensors[name] = magnitude_prune(t, sparsity).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_pruned_model_generates_the_same_greedy_tokens_through_the_sparse_path(ops, tmp_path):
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=4)
    pruned = write_pruned(src, tmp_path / "pruned", 0.5)
    llm = LLM(pruned, kv_cache_memory="8MiB")
    swapped = [m for m in llm.engine.loaded.model.modules() if isinstance(m, SparseLinear)]
    assert len(swapped) == 2 * 4  # per layer: fused qkv, o, fused gate_up, down; the tiny model has 2 layers
    prompt = [5, 17, 99, 3, 250, 41, 7]
    got = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    reference = load_model(pruned, sparse=False)  # the dense path on the same pruned weights
    assert got == _greedy_float(reference, prompt, 12)


def test_pruned_quantized_model_through_the_sparse_int8_path(ops, tmp_path):
    src = tmp_path / "float"
    make_tiny_hf_model(src, "llama", seed=6)
    pruned = write_pruned(src, tmp_path / "pruned", 0.5)
    qfolder = quantize_folder(pruned, tmp_path / "q8", LayerQuant(bits=8, group_size=-1, sym=True))
    dense_q = load_model(qfolder)
    sparse_q = load_model(qfolder)
    assert S.sparsify_model(sparse_q.model, {32: None, 8: 0.3, 4: 0.3}) == 8
    for a, b in zip(dense_q.model.modules(), sparse_q.model.modules(), strict=True):
        if isinstance(b, SparseLinear):
            assert isinstance(a, QuantLinear)
            torch.testing.assert_close(S.densify(b.sparse), dequantize_packed(a.packed), rtol=1e-6, atol=1e-7)
    prompt = [9, 8, 7, 100, 200, 31]
    assert _greedy_float(sparse_q, prompt, 8) == _greedy_float(dense_q, prompt, 8)


def test_bench_pruners_are_exact():
    from brisk.bench.sparse import prune_nm, prune_rows

    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    p = prune_rows(w, 0.5)
    assert ((p == 0).sum(1) == 32).all()
    kept_min = p.abs().masked_fill(p == 0, float("inf")).min(1).values  # smallest kept |w| per row
    dropped_max = w.abs().masked_fill(p != 0, 0).max(1).values  # largest dropped |w| per row
    assert (kept_min >= dropped_max).all()
    q = prune_nm(w, 2, 4)
    assert ((q.view(6, 16, 4) != 0).sum(-1) == 2).all()
    assert torch.equal(q[q != 0], w[q != 0])
