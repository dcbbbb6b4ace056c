"""SqueezeLLM: the LUT kernel against gather-then-matmul, weighted k-means against a plain loop, the dense-and-sparse
split, better than RTN on real weights with real sensitivities, and its checkpoint reloading to the same outputs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from conftest import ops_with
from hf_utils import make_tiny_hf_model
from test_model import prefill_logits

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.data import calibration_text_path
from brisk.eval.size import model_size
from brisk.model.loader import LoadedModel, load_model
from brisk.ops import kernels
from brisk.ops.layers import LutLinear
from brisk.ops.lut import (
    LutWeight,
    csr_from_dense,
    dequantize_lut,
    lut_linear,
    lut_linear_q8,
    lut_q8_reference,
    pack_nibbles,
    quantize_tables,
    unpack_nibbles,
)
from brisk.quant import primitives
from brisk.quant.calib import CalibConfig, load_calibration_ids
from brisk.quant.checkpoint import encode_lut_layer, lut_weight, save_quantized
from brisk.quant.config import LayerQuant, QuantConfigError, QuantizationConfig
from brisk.quant.rtn import plan_layers
from brisk.quant.squeezellm import (
    SqueezeLLMConfig,
    fisher_diagonal,
    floored_sensitivity,
    outlier_mask,
    parse_outliers,
    sensitivity_weighted_error,
    squeezellm_gptq_weight,
    squeezellm_quantize,
    squeezellm_quantize_weight,
    top_mask,
    weighted_kmeans,
)

TEXT = calibration_text_path()
IDS = torch.tensor([5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 120])


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201 - torch.ops.brisk
    return ops_with("lut_linear")


def int8_table_ops():  # noqa: ANN201 - torch.ops.brisk or None
    """The kernels, which hold lut_linear_q8 in every build (AVX2 + FMA: the AVX-512 VBMI kernel on the avx512 tier,
    the 256-bit one, with AVX-VNNI where the tier has it, on the others); None on the generic tier, where nothing
    builds and every path is the reference."""
    return None if kernels.kernel_tier().name == "generic" else ops_with("lut_linear_q8")


def random_lut_weight(bits: int, n: int, k: int, nnz: int, seed: int = 0) -> LutWeight:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    lut = torch.sort(torch.randn(n, 1 << bits, generator=gen), dim=1).values
    sparse = torch.zeros(n * k)
    sparse[torch.randperm(n * k, generator=gen)[:nnz]] = torch.randn(nnz, generator=gen) * 3
    parts = csr_from_dense(sparse.view(n, k)) if nnz else (None, None, None)
    return LutWeight(bits, n, k, pack_nibbles(q), lut, *parts)


# ---------------------------------------------------------------------------------------------- the kernel

@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("nnz", [0, 37])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("k", [96, 200, 256])  # whole blocks of 128 codes, a partial one, both
def test_lut_kernel_equals_gather_then_matmul(ops, bits: int, nnz: int, rows: int, k: int) -> None:
    # 43 weight rows: groups of 4 that share a pass, then 3 alone
    lw = random_lut_weight(bits, 43, k, nnz, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(43)
    # the oracle: a gather from the tables, then the matmul. The AVX-512 BF16 build multiplies bfloat16 tables
    # and activations (float32 sums, outliers in float32): its oracle takes the same roundings
    bf16 = kernels.kernel_tier().name.startswith("avx512")
    dense = dataclasses.replace(lw, row_ptr=None, cols=None, values=None)
    sparse = dequantize_lut(lw) - dequantize_lut(dense)  # the outliers alone
    if bf16:
        dense = dataclasses.replace(dense, lut=lw.lut.bfloat16().float())

    def oracle(xa: torch.Tensor) -> torch.Tensor:
        xd = xa.bfloat16().float() if bf16 else xa
        return F.linear(xd, dequantize_lut(dense)) + F.linear(xa, sparse)

    want = oracle(x) + bias
    got = ops.lut_linear(x, lw.codes, lw.lut, lw.row_ptr, lw.cols, lw.values, bias)
    # float32 sums of K products in another order: a few ulps of the |sum| (~10) apart
    torch.testing.assert_close(got, want, rtol=1e-5, atol=4e-5)
    torch.testing.assert_close(lut_linear(x, lw, bias), want, rtol=1e-5, atol=4e-5)  # the dispatcher takes it too
    xb = x.bfloat16()  # bfloat16 activations: widened exactly, float32 arithmetic, the result rounded once
    torch.testing.assert_close(ops.lut_linear(xb, lw.codes, lw.lut, lw.row_ptr, lw.cols, lw.values, None),
                               oracle(xb.float()).bfloat16())


@pytest.mark.parametrize("bits", [3, 4])
def test_lut_dequantize_and_the_large_row_path_are_exact(ops, bits: int) -> None:
    lw = random_lut_weight(bits, 50, 64, 41)
    ref = dequantize_lut(lw)
    assert torch.equal(ops.lut_dequantize(lw.codes, lw.lut, lw.row_ptr, lw.cols, lw.values, 7, 33), ref[7:33])
    assert torch.equal(dequantize_lut(lw, slice(7, 33)), ref[7:33])
    x = torch.randn(40, 64)  # past MAX_SMALL_M rows: dequantize + GEMM
    torch.testing.assert_close(lut_linear(x, lw), F.linear(x, ref), rtol=1e-5, atol=1e-5)


def test_lut_reference_path_without_kernels(kernel_settings) -> None:
    lw = random_lut_weight(4, 24, 40, 9)  # K = 40: a multiple of 8, so the kernels would take it
    x = torch.randn(2, 40)
    kernel_settings(enabled=False)
    assert torch.equal(lut_linear(x, lw), F.linear(x, dequantize_lut(lw)))


def test_rounded_tables_stay_within_half_a_step() -> None:
    for bits in (3, 4):
        lw = random_lut_weight(bits, 30, 64, 5)
        lw.lut[3] = 0.0  # an all-zero table: scale 0, every entry at the zero point
        rt = quantize_tables(lw)
        e = 1 << bits
        t = rt.qlut[:, 16:].contiguous().view(torch.float32).reshape(-1)
        assert torch.equal(t, lw.lut.abs().amax(1) / 127)
        u = rt.qlut[:, :e].long()
        assert int(u.min()) >= 1 and int(u.max()) <= 255 and torch.all(rt.qlut[:, e:16] == 128)
        assert torch.all(u[3] == 128) and torch.all(rt.weight.lut[3] == 0)
        assert torch.all((rt.weight.lut - lw.lut).abs() <= t[:, None] / 2 * (1 + 1e-5))
        assert torch.equal(rt.weight.lut, t[:, None] * (u.float() - 128))
        assert rt.weight.codes is lw.codes and rt.weight.values is lw.values


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("nnz", [0, 37, 900])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
@pytest.mark.parametrize("k", [32, 128, 576])  # a partial 128-column chunk alone, a whole one, both
def test_int8_table_kernel_equals_its_integer_reference(bits: int, nnz: int, rows: int, k: int) -> None:
    ops = int8_table_ops()
    # 43 weight rows: groups of 4 sharing a pass and 3 alone, outlier blocks of 16 rows and a partial one; 900
    # outliers put more than 16 in a block
    lw = random_lut_weight(bits, 43, k, min(nnz, 43 * k // 4), seed=rows + k)
    rt = quantize_tables(lw)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    x[:, k // 3] = 60.0  # an outlier column: its 32-column block gets a coarser int8 grid
    bias = torch.randn(43)
    want = lut_q8_reference(x, rt, bias)  # exact integer sums per block, float64 after
    # float32 sums of float32 products: a few ulps of the largest partial sums (~1e3)
    if ops is not None:
        got = ops.lut_linear_q8(x, lw.codes, rt.qlut, lw.row_ptr, lw.cols, lw.values, bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-4)
        xb = x.bfloat16()  # bfloat16 rows: widened exactly, the result rounded once
        torch.testing.assert_close(ops.lut_linear_q8(xb, lw.codes, rt.qlut, lw.row_ptr, lw.cols, lw.values, None),
                                   lut_q8_reference(xb.float(), rt).bfloat16())
    # the dispatcher: the kernel where it built, else the rounded x through lut_linear's reference path
    torch.testing.assert_close(lut_linear_q8(x, rt, bias), want, rtol=1e-5, atol=2e-4)
    many = torch.randn(40, k)  # past MAX_SMALL_M rows: the rounded x, dequantized rounded tables, a GEMM
    torch.testing.assert_close(lut_linear_q8(many, rt), lut_q8_reference(many, rt), rtol=1e-5, atol=2e-4)
    with kernels.disabled():  # and the reference path
        torch.testing.assert_close(lut_linear_q8(x, rt, bias), want, rtol=1e-5, atol=2e-4)


@pytest.mark.parametrize("k", [96, 128])
def test_int8_table_kernel_is_bit_exact_where_float_adds_nothing(k: int) -> None:
    """Integer activations with a 127 in every 32-column block (scale exactly 1), tables whose largest entry is
    127 / 8 (row scale exactly 1/8) and outliers on the 1/8 grid: every product and partial sum is exact in
    float32, so the kernel must equal the integer reference bit for bit (a wrong code, table byte, zero point or
    lane shows up). The last case puts +-127 in every activation and table entry: every pair of products is
    2 * 127 * 127 in magnitude, where a saturating int16 step (the AVX2 kernel's vpmaddubsw) would show."""
    ops = int8_table_ops()
    if ops is None:  # (the reference path is checked against the integer reference above)
        pytest.skip("no kernels are built for this CPU (generic tier)")
    gen = torch.Generator().manual_seed(k)
    n = 43
    for bits, extreme in ((3, False), (4, False), (4, True)):
        lw = random_lut_weight(bits, n, k, 40, seed=k + bits)
        u = torch.randint(-127, 128, (n, 1 << bits), generator=gen)
        if extreme:
            u = torch.where(u < 0, -127, 127)
        u[:, 0] = 127  # the largest |entry|: t = (127 / 8) / 127 = 1 / 8
        lw = dataclasses.replace(lw, lut=u.float() / 8, values=torch.randint(-40, 41, (lw.nnz,), generator=gen) / 8)
        rt = quantize_tables(lw)
        assert torch.equal(rt.weight.lut, lw.lut)  # the rounding is exact here
        for m in (1, 5):
            x = torch.randint(-127, 128, (m, k), generator=gen).float()
            if extreme:
                x = torch.where(x < 0, -127.0, 127.0)
            x[:, ::32] = 127.0
            got = ops.lut_linear_q8(x, lw.codes, rt.qlut, lw.row_ptr, lw.cols, lw.values, None)
            assert torch.equal(got, lut_q8_reference(x, rt)), (bits, extreme, m)


def test_int8_activations_need_whole_blocks_of_32() -> None:
    lw = random_lut_weight(4, 8, 40, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        lut_linear_q8(torch.randn(1, 40), quantize_tables(lw))


def test_nibble_packing_round_trips_and_matches_the_4_bit_checkpoint_layout() -> None:
    q = torch.randint(0, 16, (5, 24), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q)
    assert torch.equal(pack_nibbles(q), primitives.pack(q, 4))  # 4-bit checkpoints load as they are


# ---------------------------------------------------------------------------------------------- k-means

def nearest(v: float, cent: list[float]) -> int:
    """The closest centroid, the lower one on a tie."""
    return min(range(len(cent)), key=lambda i: (abs(v - cent[i]), i))


def plain_weighted_kmeans(w: torch.Tensor, f: torch.Tensor, c: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same algorithm, one row and one weight at a time in Python floats."""
    cents, codes = [], []
    for row, fr in zip(w.tolist(), f.tolist(), strict=True):
        if sum(fr) == 0:
            fr = [1.0] * len(fr)
        pairs = sorted(zip(row, fr, strict=True))
        total, cum, cent = sum(fr), 0.0, []
        targets = [(i + 0.5) / c * total for i in range(c)]
        acc = []
        for _, weight in pairs:
            cum += weight
            acc.append(cum)
        for t in targets:
            j = next((j for j, a in enumerate(acc) if a >= t), len(acc) - 1)
            cent.append(pairs[j][0])

        for _ in range(iters):
            num, den = [0.0] * c, [0.0] * c
            for v, weight in zip(row, fr, strict=True):
                i = nearest(v, cent)
                num[i] += weight * v
                den[i] += weight
            cent = sorted(num[i] / den[i] if den[i] > 0 else cent[i] for i in range(c))
        cents.append(cent)
        codes.append([nearest(v, cent) for v in row])
    return torch.tensor(cents), torch.tensor(codes)


def test_weighted_kmeans_matches_a_plain_loop() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(6, 48, generator=gen)
    f = torch.rand(6, 48, generator=gen) ** 3  # skewed, as squared gradients are
    f[2] = 0  # a row with no sensitivity anywhere: plain (unweighted) k-means
    cents, codes = weighted_kmeans(w, f, 8, iters=12)
    want_cents, want_codes = plain_weighted_kmeans(w, f, 8, 12)
    torch.testing.assert_close(cents, want_cents, rtol=1e-5, atol=1e-6)
    assert torch.equal(codes, want_codes)
    assert bool((cents[:, 1:] >= cents[:, :-1]).all())


def test_weighted_kmeans_follows_the_weights() -> None:
    w = torch.linspace(-1, 1, 64).repeat(2, 1)
    f = torch.ones(2, 64)
    f[1, 10] = 1e6  # one weight that matters far more than the rest: a centroid lands on it
    cents, codes = weighted_kmeans(w, f, 4, iters=20)
    assert not torch.isclose(cents[0], w[1, 10]).any()
    assert torch.isclose(cents[1, codes[1, 10]], w[1, 10], atol=1e-4)


# ---------------------------------------------------------------------------------------------- dense-and-sparse

def test_dense_and_sparse_reconstruction() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 128, generator=gen) * 0.02
    spots = torch.randperm(w.numel(), generator=gen)[:20]
    w.view(-1)[spots] = torch.randn(20, generator=gen).sign() * (1 + torch.rand(20, generator=gen))  # 50-100x
    f = torch.rand(32, 128, generator=gen)
    fraction = 20 / w.numel()
    mask = outlier_mask(w, fraction)
    assert int(mask.sum()) == 20 and bool(mask.view(-1)[spots].all())  # exactly the planted ones
    result = squeezellm_quantize_weight(w, f, 3, outliers=fraction)
    # the outliers come back to float16 precision (their residual w - table value is stored), the rest from tables
    torch.testing.assert_close(result.w_hat[mask], w[mask], rtol=2e-3, atol=1e-3)
    assert torch.equal(result.w_hat[~mask], torch.gather(result.lut, 1, result.codes.long())[~mask])
    assert int((result.sparse != 0).sum()) <= 20 and bool((result.sparse[~mask] == 0).all())
    dense_only = squeezellm_quantize_weight(w, f, 3, outliers=0.0)
    assert (sensitivity_weighted_error(w, result.w_hat, f) < 0.2 * sensitivity_weighted_error(w, dense_only.w_hat, f))
    # the checkpoint tensors decode to exactly w_hat, through the reference and the kernel's layout alike
    spec = LayerQuant(bits=3, group_size=-1, sym=True, scheme="lut")
    tensors = encode_lut_layer(result.codes, result.lut, result.sparse, spec)
    assert tensors["qweight"].shape == (32, 128 * 3 // 8) and tensors["outlier_values"].dtype == torch.float16
    assert torch.equal(dequantize_lut(lut_weight([tensors], spec, 128)), result.w_hat)


def test_the_most_sensitive_weights_join_the_sparse_part() -> None:
    """The paper's sensitive values: the weights of largest Fisher value kept in float besides the largest ones,
    with or without error feedback."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(32, 128, generator=gen) * 0.02
    f = torch.rand(32, 128, generator=gen)
    hot = torch.randperm(w.numel(), generator=gen)[:12]
    f.view(-1)[hot] = 50.0  # twelve weights the loss is most sensitive to
    keep = top_mask(f, 12 / w.numel())
    assert int(keep.sum()) == 12 and bool(keep.view(-1)[hot].all())
    mask = outlier_mask(w, 0.005) | keep
    plain = squeezellm_quantize_weight(w, f, 3, outliers=0.005, keep=keep)
    torch.testing.assert_close(plain.w_hat[keep], w[keep], rtol=2e-3, atol=1e-4)  # float16 residuals
    assert bool((plain.sparse[~mask] == 0).all())
    # with error feedback a kept weight takes its value after the updates from earlier columns: still in the sparse
    # part, so it passes no error on
    x = torch.randn(256, 128, generator=gen)
    fed = squeezellm_gptq_weight(w, 2 * x.T @ x / 256, f, 3, outliers=0.005, keep=keep)
    assert bool((fed.sparse[~mask] == 0).all()) and int((fed.sparse[keep] != 0).sum()) >= 10
    without = squeezellm_gptq_weight(w, 2 * x.T @ x / 256, f, 3, outliers=0.005)
    assert bool((without.sparse[keep & ~outlier_mask(w, 0.005)] == 0).all())
    assert top_mask(f, 0.0).sum() == 0


def test_error_feedback_keeps_the_table_and_lowers_the_output_error() -> None:
    """Step 4: the same table and outliers, codes chosen with GPTQ's OBS updates against H = 2 X^T X / T of
    correlated inputs: the layer's output error ||(W - W_hat) X^T||^2 falls (measured 0.59x of nearest-entry
    codes on this draw), and the checkpoint form decodes to W_hat exactly."""
    gen = torch.Generator().manual_seed(0)
    n, k, t = 64, 256, 1024
    x = torch.randn(t, k, generator=gen) @ (torch.randn(k, k, generator=gen) / k ** 0.5 + torch.eye(k))
    w = torch.randn(n, k, generator=gen) * 0.05
    f = torch.rand(n, k, generator=gen)
    plain = squeezellm_quantize_weight(w, f, 3)
    fed = squeezellm_gptq_weight(w, 2 * x.T @ x / t, f, 3)
    assert torch.equal(fed.lut, plain.lut)
    mask = outlier_mask(w, 0.0045)
    assert bool((fed.sparse[~mask] == 0).all()) and int((fed.sparse != 0).sum()) > 0
    assert torch.equal(fed.w_hat, torch.gather(fed.lut, 1, fed.codes.long()) + fed.sparse)

    def out_err(r) -> float:  # noqa: ANN001
        return float(((w - r.w_hat) @ x.T).square().mean())
    assert out_err(fed) < 0.75 * out_err(plain), (out_err(fed), out_err(plain))


# ---------------------------------------------------------------------------------------------- real weights

def test_squeezellm_beats_rtn_on_real_weights_and_sensitivities() -> None:
    """The default model's own weights and Fisher sensitivities from the calibration text (two of the last
    layers, so the backward stops early), 3 bits: the objective SqueezeLLM minimises, sum F (W - W_hat)^2."""
    loaded = load_model(None, fuse=False, show_progress=False)
    ids = load_calibration_ids(loaded.tokenizer, CalibConfig(str(TEXT), num_samples=2, seq_len=48, seed=1))
    last = loaded.config.num_hidden_layers - 1
    names = [f"model.layers.{last - 1}.self_attn.q_proj", f"model.layers.{last}.mlp.down_proj"]
    fisher = fisher_diagonal(loaded.model, ids, names)
    assert all(not p.requires_grad for p in loaded.model.parameters())  # the model is left as it was
    for name in names:
        w, f = loaded.model.get_submodule(name).weight.detach(), fisher[name]
        assert float(f.min()) >= 0 and float(f.max()) > 0
        sq = sensitivity_weighted_error(w, squeezellm_quantize_weight(w, f, 3).w_hat, f)
        rtn = {}
        for group in (None, 64):
            s, z = primitives.choose_qparams(w.float(), 3, group_size=group)
            rtn[group] = sensitivity_weighted_error(w, primitives.dequantize(primitives.quantize(w, s, z, 3), s, z), f)
        # measured 3-5x below per-channel RTN (the same layout: one set of levels per row) and ~2x below RTN g64
        # (which spends 0.5 bit a weight more on its group scales and zero points)
        assert sq < 0.5 * rtn[None], (name, sq, rtn)
        assert sq < rtn[64], (name, sq, rtn)


# ---------------------------------------------------------------------------------------------- checkpoints

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_hf_model(path, arch="qwen2", num_kv_heads=2, num_attention_heads=4, tie_word_embeddings=True)
    (path / "calib.txt").write_text(TEXT.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


def squeeze(tiny: Path, bits: int) -> tuple[LoadedModel, dict[str, LayerQuant], dict[str, torch.Tensor],
                                             QuantizationConfig]:
    loaded = load_model(tiny, fuse=False)
    spec = LayerQuant(bits=bits, group_size=-1, sym=True, scheme="lut")
    plan = plan_layers(loaded.model, True, spec)
    calib = CalibConfig(str(tiny / "calib.txt"), num_samples=3, seq_len=32)
    tensors, qconfig = squeezellm_quantize(loaded, plan, spec, calib, SqueezeLLMConfig(outliers=0.01),
                                           progress=False)
    return loaded, plan, tensors, qconfig


@pytest.fixture(scope="module")
def squeezed3(tiny: Path) -> tuple[LoadedModel, dict[str, LayerQuant], dict[str, torch.Tensor], QuantizationConfig]:
    return squeeze(tiny, 3)


@pytest.mark.parametrize("bits", [3, 4])
def test_checkpoint_reloads_with_equal_outputs(tiny: Path, squeezed3, tmp_path: Path, bits: int) -> None:  # noqa: ANN001
    loaded, plan, tensors, qconfig = squeezed3 if bits == 3 else squeeze(tiny, bits)
    loaded = load_model(tiny, fuse=False)  # a fresh float model to turn into the float twin
    out = save_quantized(tmp_path / "sq", loaded.config, loaded.tokenizer, qconfig, tensors)
    written = json.loads((out / "config.json").read_text())["quantization_config"]
    assert written["method"] == "squeezellm" and written["scheme"] == "lut" and written["bits"] == bits
    assert written["method_config"]["outliers"] == 0.01
    # the float twin: every decoder linear's weight replaced by what its tensors decode to, the embedding by RTN's
    for name, spec_ in plan.items():
        module = loaded.model.get_submodule(name)
        if spec_.scheme == "lut":
            assert f"{name}.outlier_values" in tensors
            module.weight.data.copy_(dequantize_lut(lut_weight([{k.removeprefix(name + "."): v for k, v in
                                                                 tensors.items() if k.startswith(name + ".")}],
                                                               spec_, module.in_features)))
        else:
            q = primitives.unpack(tensors[f"{name}.qweight"], 8, module.weight.shape[1])
            scale = tensors[f"{name}.scales"].float()
            module.weight.data.copy_(primitives.dequantize(q, scale, torch.full_like(scale, 128)))
    want = prefill_logits(loaded, IDS)
    # 1e-3: the 8-bit head runs its own kernels, and every kernel sums in its own order (logits ~ 10); the AVX-512
    # build's table kernel multiplies in bfloat16 (tables and activations rounded: ~0.4% a product), measured up to
    # 0.07 apart on these logits
    tol = 1e-1 if kernels.kernel_tier().name.startswith("avx512") else 1e-3
    for fuse in (True, False):  # fused q/k/v and gate/up (their CSR matrices concatenated) and one by one
        qloaded = load_model(out, fuse=fuse)
        assert any(isinstance(m, LutLinear) for m in qloaded.model.modules())
        torch.testing.assert_close(prefill_logits(qloaded, IDS), want, rtol=tol, atol=tol)
    with kernels.disabled():  # the reference path gives the same numbers
        torch.testing.assert_close(prefill_logits(load_model(out), IDS), want, rtol=1e-3, atol=1e-3)
    llm = LLM(model=str(out))  # no flags: the folder says what it is
    got = llm.generate(["Emma was"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(got[0].outputs[0].token_ids) == 6
    # eval size counts the outliers (values, columns, row pointers) with the codes, the tables as overhead
    report = {t.name: t for t in model_size(out).tensors}
    q_proj = "model.layers.0.self_attn.q_proj"
    stored = {k: v for k, v in tensors.items() if k.startswith(q_proj + ".")}
    row = report[q_proj]
    assert row.payload_bytes == sum(stored[f"{q_proj}.{s}"].nbytes for s in ("qweight", "outlier_values",
                                                                             "outlier_cols", "outlier_row_ptr"))
    assert row.overhead_bytes == stored[f"{q_proj}.lut"].nbytes
    assert row.params == 64 * 64 and row.dtype == f"lut{bits}-ch + outliers"
    loaded_row = {t.name: t for t in model_size(load_model(out, fuse=False)).tensors}[q_proj]
    assert loaded_row.params == 64 * 64 and loaded_row.payload_bytes > 64 * 64 // 2  # 4-bit fields + outliers


def test_int8_activations_switch_the_kernel_and_the_bytes_read(squeezed3, tmp_path: Path) -> None:  # noqa: ANN001
    from brisk.bench.roofline import weight_bytes_per_token
    from brisk.ops.layers import LinearKind
    from brisk.quant.layers import set_quant_activations

    loaded, _, tensors, qconfig = squeezed3
    qloaded = load_model(save_quantized(tmp_path / "sq", loaded.config, loaded.tokenizer, qconfig, tensors))
    luts = [m for m in qloaded.model.modules() if isinstance(m, LutLinear)]
    before = weight_bytes_per_token(qloaded.model)
    assert set_quant_activations(qloaded.model, "auto") == len(luts)  # 3-bit tables: int8 under auto
    assert all(m.kernel().kind is LinearKind.LUT_Q8 and "int8 activations" in repr(m) for m in luts)
    # a decode step reads 20 bytes a row of uint8 tables and scale instead of 8 float32 entries
    assert weight_bytes_per_token(qloaded.model) == before - sum(m.out_features * (32 - 20) for m in luts)
    x = torch.randn(3, luts[0].in_features)
    torch.testing.assert_close(luts[0](x), lut_linear_q8(x, luts[0].rounded_tables(), luts[0].bias),
                               rtol=0, atol=0)  # the module runs lut_linear_q8's dispatch
    assert set_quant_activations(qloaded.model, "float") == 0
    assert all(m.kernel().kind is LinearKind.LUT for m in luts) and weight_bytes_per_token(qloaded.model) == before


def test_checkpoint_mismatch_is_named(squeezed3, tmp_path: Path) -> None:  # noqa: ANN001
    loaded, _, tensors, qconfig = squeezed3
    tensors = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.outlier_cols"}
    out = save_quantized(tmp_path / "bad", loaded.config, loaded.tokenizer, qconfig, tensors)
    with pytest.raises(QuantConfigError, match="up_proj.*outlier_cols"):
        load_model(out)
    with pytest.raises(QuantConfigError, match="bits 3 or 4 and group_size -1"):
        LayerQuant(bits=4, group_size=64, scheme="lut")


# ---------------------------------------------------------------------------------------------- the command

def test_quantize_cli_squeezellm_and_its_errors(tiny: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    calib = ["--calib-text", str(tiny / "calib.txt"), "--num-samples", "2", "--seq-len", "16"]

    def run(*args: str):  # noqa: ANN202 - click Result
        return runner.invoke(main, ["quantize", str(tiny), str(tmp_path / "q"), "--method", "squeezellm", *args])

    for args, message in [(["--bits", "2"], "--bits 3 or 4"), (["--bits", "8"], "--bits 3 or 4"),
                          (["--outliers", "20%"], "between 0 and 10%"), (["--outliers", "-1"], "between 0 and 10%"),
                          (["--outliers", "lots"], "not a number"), (["--group-size", "32"], "drop --group-size")]:
        res = run(*args, *calib)
        assert res.exit_code != 0 and message in res.output, (args, res.output)
    res = runner.invoke(main, ["quantize", str(tiny), str(tmp_path / "r"), "--outliers", "1%"])
    assert res.exit_code != 0 and "--method squeezellm" in res.output
    res = run("--bits", "3", "--outliers", "0.5%", *calib)
    assert res.exit_code == 0, res.output
    assert "2 x 16 = 32 calibration tokens for layers of 128 inputs" in res.output  # warned, still written
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["method"] == "squeezellm" and qc["bits"] == 3 and qc["method_config"]["outliers"] == 0.005
    assert qc["modules"]["model.embed_tokens"]["scheme"] == "int"  # the embedding / head: RTN int8
    assert qc["method_config"]["error_feedback"] is True
    assert qc["method_config"]["sensitivity_floor"] == 1.0 and qc["method_config"]["sensitive"] == 0.0005  # 3-bit
    res = run("--bits", "4", "--no-error-feedback", "--force", *calib)
    assert res.exit_code == 0, res.output
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["method_config"]["error_feedback"] is False
    res = runner.invoke(main, ["quantize", str(tiny), str(tmp_path / "r"), "--no-error-feedback"])
    assert res.exit_code != 0 and "--method squeezellm" in res.output
    res = runner.invoke(main, ["quantize", str(tiny), str(tmp_path / "r"), "--sensitivity-floor", "1"])
    assert res.exit_code != 0 and "--method squeezellm" in res.output
    assert qc["method_config"]["sensitivity_floor"] == 2.0  # the 4-bit default
    for option, value, key in (("--sensitivity-floor", "0", "sensitivity_floor"), ("--sensitive", "0", "sensitive")):
        res = run("--bits", "3", option, value, "--force", *calib)
        assert res.exit_code == 0, res.output
        qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
        assert qc["method_config"][key] == 0.0, option
    res = run("--bits", "3", "--sensitivity-floor", "-1", "--force", *calib)
    assert res.exit_code != 0 and "sensitivity_floor must be" in res.output
    res = run("--bits", "3", "--sensitive", "many", "--force", *calib)
    assert res.exit_code != 0 and "--sensitive 'many' is not a number" in res.output
    res = runner.invoke(main, ["quantize", str(tiny), str(tmp_path / "r"), "--sensitive", "1%"])
    assert res.exit_code != 0 and "--sensitive is SqueezeLLM's" in res.output


def test_sensitivity_floor_normalises_each_row() -> None:
    f = torch.tensor([[0.0, 1.0, 3.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.0]])
    assert torch.equal(floored_sensitivity(f, 0.0), f)  # the paper's weights, as measured
    torch.testing.assert_close(floored_sensitivity(f, 3.0), torch.tensor([[3.0, 3.75, 5.25], [4.0, 4.0, 4.0],
                                                                          [3.0, 3.0, 3.0]]))
    with pytest.raises(ValueError, match="sensitivity_floor"):
        SqueezeLLMConfig(sensitivity_floor=float("inf"))


def test_parse_outliers() -> None:
    assert parse_outliers("0.45%") == pytest.approx(0.0045)
    assert parse_outliers("0.0045") == pytest.approx(0.0045)
    assert parse_outliers("0") == 0.0
    with pytest.raises(ValueError, match="0.45%"):
        parse_outliers("0.45 percent")


def test_gguf_export_writes_what_the_tables_decode_to(squeezed3, tmp_path: Path) -> None:  # noqa: ANN001
    """`brisk export gguf` of a SqueezeLLM folder: each table layer is decoded (lookups + outliers) and re-encoded,
    and the report says so; at F16 the file holds the decoded weights to float16 precision."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from brisk.model.gguf_export import export_gguf

    loaded, plan, tensors, qconfig = squeezed3
    out = save_quantized(tmp_path / "sq", loaded.config, loaded.tokenizer, qconfig, tensors)
    report = export_gguf(out, tmp_path / "sq.gguf", "f16")
    assert report.how["blk.1.ffn_down.weight"] == "dequantized from lut3-ch and re-encoded as F16"
    name = "model.layers.1.mlp.down_proj"
    parts = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
    want = dequantize_lut(lut_weight([parts], plan[name], loaded.model.get_submodule(name).in_features)).numpy()
    got = {t.name: t for t in GGUFReader(tmp_path / "sq.gguf").tensors}["blk.1.ffn_down.weight"]
    np_got = dequantize(got.data, got.tensor_type)
    torch.testing.assert_close(torch.from_numpy(np_got.astype("float32")), torch.from_numpy(want),
                               rtol=1e-3, atol=1e-4)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert len(LLM(model=str(tmp_path / "sq.gguf")).generate(["Emma was"], greedy)[0].outputs[0].token_ids) == 6


def test_frozen_lut_base_trains_through_the_tables(squeezed3, tmp_path: Path) -> None:  # noqa: ANN001
    """LoRA on a SqueezeLLM checkpoint: each table layer becomes a frozen base whose forward runs its kernels and
    whose backward to x equals autograd through the decoded weight (chunked over rows)."""
    from brisk.lora.frozen import FrozenLutLinear
    from brisk.lora.train import base_bytes, prepare_base

    lw = random_lut_weight(3, 96, 128, nnz=37)
    bias = torch.randn(96)
    layer = LutLinear(lw, bias, LayerQuant(bits=3, group_size=-1, sym=True, scheme="lut"))
    frozen = FrozenLutLinear(layer)
    x = torch.randn(3, 5, 128, requires_grad=True)
    y = frozen(x)
    assert torch.equal(y.detach(), layer(x.detach()))  # the layer's own kernels (bfloat16 products on AVX-512)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    y2 = F.linear(x2, dequantize_lut(lw), bias)
    (y2 * g).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, atol=1e-4, rtol=1e-4)  # float32, from the decoded tables

    loaded, _, tensors, qconfig = squeezed3
    out = save_quantized(tmp_path / "sq", loaded.config, loaded.tokenizer, qconfig, tensors)
    base = load_model(out, fuse=False)
    info = prepare_base(base, "nf4")  # the checkpoint's own codes are kept whatever base is asked for
    frozen_layers = [m for m in base.model.modules() if isinstance(m, FrozenLutLinear)]
    assert len(frozen_layers) == 7 * base.config.num_hidden_layers and info["base"].startswith("checkpoint's own")
    assert info["base_bytes"] == base_bytes(base.model) > 0


def test_start_up_estimate_prices_the_tables_as_loaded(squeezed3, tmp_path: Path) -> None:  # noqa: ANN001
    """The engine's footprint of a SqueezeLLM folder: 3-bit codes held as 4-bit nibbles, float32 tables, the tied
    head's own int8 table; within 2% of the bytes the loaded model holds."""
    from brisk.engine.memory import model_footprint
    from brisk.model.hugepages import model_tensors

    loaded, _, tensors, qconfig = squeezed3
    out = save_quantized(tmp_path / "sq", loaded.config, loaded.tokenizer, qconfig, tensors)
    held = sum({t.data_ptr(): t.nbytes for t in model_tensors(load_model(out).model)}.values())
    priced = model_footprint(str(out)).weight_bytes(torch.float32)
    assert abs(priced - held) <= 0.02 * held, (priced, held)
