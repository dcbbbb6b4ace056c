"""GGUF tensors repacked into brisk's quantized formats (model/gguf_repack.py) and run natively (model/gguf_native.py).

Oracle: the gguf package's reference dequantization (`gguf.quants.dequantize`), bit for bit in float32.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from gguf_utils import (
    _add_metadata,
    hf_to_gguf_tensors,
    model_metadata,
    random_state_dict,
    tiny_config,
    tiny_gpt2_tokenizer_metadata,
    write_tiny_model,
)

from brisk.model.gguf import GGUFError, load_gguf
from brisk.model.gguf_export import export_gguf
from brisk.model.gguf_kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k
from brisk.model.gguf_native import PackedEmbedding, gather_rows
from brisk.model.gguf_repack import REPACKED, repack
from brisk.model.loader import load_model
from brisk.ops.layers import QuantLinear
from brisk.ops.qlinear import can_tile, dequantize_packed, quant_linear, set_tiled
from brisk.ops.qlinear_q8 import covers, quant_linear_q8, quant_q8_reference

_K_ENCODER = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}  # brisk's (gguf has none)
_NO_ENCODER = (T.Q3_K, T.Q2_K)  # neither gguf nor brisk encodes these: random blocks only
# byte offset of a block's float16 d (and dmin / m right after it, where the type has one)
_PARAM_AT = {T.Q6_K: 208, T.Q3_K: 108, T.Q2_K: 80}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _encode(w: np.ndarray, qtype: T) -> np.ndarray:
    return _K_ENCODER[qtype](w) if qtype in _K_ENCODER else gguf_quantize(w, qtype)


def _random_blocks(qtype: T, n: int, k: int, seed: int) -> np.ndarray:
    """Random bytes in `qtype`'s block layout, every code and sub-scale pattern, with finite float16 d / dmin."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block_size * type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, type_size)
    params = (rng.standard_normal((blocks.shape[0], 2)) * 0.02).astype(np.float16).view(np.uint8)
    width = 2 if qtype in (T.Q8_0, T.Q4_0, T.Q5_0, T.Q6_K, T.Q3_K) else 4  # d, or d and m / dmin
    at = _PARAM_AT.get(qtype, 0)  # at the block's start, or (Q6_K / Q3_K / Q2_K) after the codes and scales
    blocks[:, at:at + width] = params.reshape(-1, 4)[:, :width]
    return raw


@pytest.mark.parametrize("qtype", list(REPACKED), ids=lambda t: t.name)
def test_repacked_dequantization_is_gguf_reference_bit_for_bit(qtype: T) -> None:
    # real shapes of a model whose rows hold whole K-quant super-blocks; weights from the type's own quantizer, and
    # random bytes (every code, sub-scale and sign pattern the format can hold)
    w = torch.randn(48, 512, generator=torch.Generator().manual_seed(0)).numpy() * 0.05
    raws = [] if qtype in _NO_ENCODER else [_encode(w, qtype)]
    for raw in (*raws, _random_blocks(qtype, 48, 512, seed=1)):
        ref = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(48, 512).astype(np.float32))
        pw = repack(torch.from_numpy(raw), qtype, (48, 512))
        assert (pw.bits, pw.group_size) == REPACKED[qtype][:2]
        assert _bits_equal(dequantize_packed(pw), ref)
        if can_tile(pw):
            set_tiled(pw, True)
            assert _bits_equal(dequantize_packed(pw), ref)


def _same_packed(a, b) -> bool:
    return (torch.equal(a.data, b.data) and _bits_equal(a.scales.float(), b.scales.float())
            and a.scales.dtype == b.scales.dtype and (a.zeros is None) == (b.zeros is None)
            and (a.zeros is None or (a.zeros.dtype == b.zeros.dtype and _bits_equal(a.zeros.float(), b.zeros.float()))))


@pytest.mark.parametrize("qtype", list(REPACKED), ids=lambda t: t.name)
def test_repack_kernel_equals_the_pytorch_path(qtype: T) -> None:
    # ops/csrc/repack.cpp against the PyTorch reference: the same bytes, scales and minimums, with and without a
    # row permutation (llama.cpp's Q/K order); then tiling and untiling in C++ against the PyTorch shuffles
    from brisk.ops import kernels

    if kernels.get_op("gguf_repack") is None:
        pytest.skip("the C++ kernels are not built here")
    raw = torch.from_numpy(_random_blocks(qtype, 48, 512, seed=7))
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(8))
    for rows_perm in (None, perm):
        fast = repack(raw, qtype, (48, 512), rows_perm=rows_perm)
        with kernels.disabled():
            slow = repack(raw, qtype, (48, 512), rows_perm=rows_perm)
        assert _same_packed(fast, slow)
        if fast.bits in (8, 4):
            set_tiled(fast, True)
            with kernels.disabled():
                slow.tiled = False
                from brisk.ops.qlinear import _from_blocked, _tile_rows, _to_tiled

                tiled = _to_tiled(_from_blocked(slow.data, slow.bits, 512), slow.bits)
            assert torch.equal(fast.data, tiled.view_as(fast.data))
            assert _bits_equal(fast.scales.float(), _tile_rows(slow.scales).float())
            set_tiled(fast, False)
            assert torch.equal(fast.data, slow.data) and _bits_equal(fast.scales.float(), slow.scales.float())


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q5_1, T.Q8_0, T.Q6_K, T.Q3_K, T.Q2_K], ids=lambda t: t.name)
def test_kernels_on_repacked_weights_match_the_reference_product(qtype: T) -> None:
    # the float-minimum form (float16 / float32 minimums, float32 scales) through every kernel: blocked and tiled,
    # few rows (in-kernel decode) and many (C++ dequantize + GEMM); float32 rounding of the sums only
    raw = _random_blocks(qtype, 32, 512, seed=2)
    ref = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(32, 512).astype(np.float32))
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(32)
    expected = torch.nn.functional.linear(x.double(), ref.double(), bias.double())
    pw = repack(torch.from_numpy(raw), qtype, (32, 512))
    tol = 2e-5 * float(expected.abs().max())
    for rows in (1, 5, 64):
        torch.testing.assert_close(quant_linear(x[:rows], pw, bias).double(), expected[:rows], rtol=0, atol=tol)
    if not can_tile(pw):
        pytest.skip("the tiled kernels (AVX2 and AVX-512 tiers) are not built here")
    set_tiled(pw, True)
    for rows in (1, 5, 300):
        torch.testing.assert_close(quant_linear(x[:rows], pw, bias).double(), expected[:rows], rtol=0, atol=tol)
    if pw.group_size < 32:  # 16-weight groups: the float-activation kernels only
        assert not covers(pw)
        return
    # int8 activations: the kernel against its exact oracle (integer dots of the rounded activations)
    assert covers(pw)
    torch.testing.assert_close(quant_linear_q8(x[:3], pw, bias), quant_q8_reference(x[:3], pw, bias),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K, T.Q2_K], ids=lambda t: t.name)
def test_gather_rows_reads_any_layout(qtype: T) -> None:
    raw = _random_blocks(qtype, 48, 256, seed=4)
    pw = repack(torch.from_numpy(raw), qtype, (48, 256))
    full = dequantize_packed(pw)
    ids = torch.tensor([0, 17, 47, 17, 5])
    assert _bits_equal(gather_rows(pw, ids), full[ids])
    if can_tile(pw):
        set_tiled(pw, True)
        assert _bits_equal(gather_rows(pw, ids), full[ids])


def test_repack_refuses_bad_input() -> None:
    raw = torch.zeros(4 * 18, dtype=torch.uint8)  # 4 Q4_0 blocks
    with pytest.raises(GGUFError, match="needs 144 bytes, got 72"):
        repack(raw, T.Q4_0, (4, 64))
    with pytest.raises(GGUFError, match="BF16 has no packed form; types that do: Q8_0, Q4_0, Q4_1"):
        repack(raw, T.BF16, (1, 256))


def _write_k_model(path, qtype: T, config, state) -> None:
    """A tiny model file with every matrix as `qtype` (K-quants: brisk's encoders), norms F32."""
    w = gguf.GGUFWriter(path, config.architecture)
    for key, value in (model_metadata(config) | tiny_gpt2_tokenizer_metadata()).items():
        _add_metadata(w, key, value)
    for name, t in hf_to_gguf_tensors(state, config).items():
        t = np.ascontiguousarray(t, dtype=np.float32)
        if t.ndim == 2:
            w.add_tensor(name, _encode(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_native_model_holds_the_files_weights(tmp_path, qtype: T) -> None:
    # K-quants need rows of 256: a wider tiny model for them
    wide = qtype in _K_ENCODER
    config = tiny_config(hidden_size=256, intermediate_size=256, head_dim=64) if wide else tiny_config()
    state = random_state_dict(config, seed=5)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    if wide:
        _write_k_model(path, qtype, config, state)
    else:
        write_tiny_model(path, state, config, qtype)
    native = load_gguf(path, keep_quantized=True)
    plain = load_gguf(path)
    # every matrix packed (the Q/K rows un-permuted like the float path's), nothing dequantized but the norms
    assert set(native.packed) == {n.removesuffix(".weight") for n, t in plain.tensors.items() if t.dim() == 2}
    assert all(t.dim() == 1 for t in native.tensors.values())
    for module, pw in native.packed.items():
        assert _bits_equal(dequantize_packed(pw), plain.tensors[f"{module}.weight"]), module
    # the model runs on them: quantized layers (fused q/k/v, gate/up), a packed embedding, logits of the float path
    loaded = load_model(path, keep_quantized=True)
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and isinstance(layer.mlp.gate_up_proj, QuantLinear)
    assert isinstance(loaded.model.model.embed_tokens, PackedEmbedding)
    assert isinstance(loaded.model.lm_head, QuantLinear)
    reference = load_model(path)
    ids = torch.tensor([[1, 7, 42, 99, 3, 250]])
    torch.testing.assert_close(loaded.model.model.embed_tokens(ids), reference.model.model.embed_tokens(ids),
                               rtol=0, atol=0)


def test_native_tied_embedding_is_held_once(tmp_path) -> None:
    config = tiny_config(tie_word_embeddings=True)
    path = write_tiny_model(tmp_path / "tied.gguf", random_state_dict(config, seed=6), config, T.Q4_1)
    loaded = load_model(path, keep_quantized=True)
    assert loaded.model.lm_head.packed is loaded.model.model.embed_tokens.packed


def test_export_then_native_load_of_the_default_models_q4_k(tmp_path) -> None:
    # `brisk export gguf --type q4_k` of a tiny model whose rows are not multiples of 256: llama.cpp's fallback
    # (Q5_0) for those, all repacked
    config = tiny_config()
    src = write_tiny_model(tmp_path / "src.gguf", random_state_dict(config, seed=7), config)
    out = tmp_path / "q4k.gguf"
    export_gguf(src, out, "q4_k")
    ckpt = load_gguf(out, keep_quantized=True)
    assert set(ckpt.packed_types.values()) == {"Q5_0"}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])  # (qwen2_moe's tiny shared expert: rows of 48, no Q8_0)
def test_native_moe_experts_are_repacked_per_expert(tmp_path, arch: str) -> None:
    # stacked ffn_*_exps [E, N, K] tensors: one packed weight per expert, each its slice of the stack bit for bit;
    # the routers stay float; logits as the dequantized float path's up to the kernels' summation order
    from test_moe import make_tiny_moe, prefill_logits, write_moe_gguf

    make_tiny_moe(tmp_path / "hf", arch, seed=1)
    path = write_moe_gguf(tmp_path / "moe.gguf", tmp_path / "hf", qtype=T.Q8_0)
    native = load_gguf(path, keep_quantized=True)
    plain = load_gguf(path)
    assert "model.layers.0.mlp.experts.7.down_proj" in native.packed
    assert not any(n.endswith(("mlp.gate", "shared_expert_gate")) for n in native.packed)
    for module, pw in native.packed.items():
        assert _bits_equal(dequantize_packed(pw), plain.tensors[f"{module}.weight"]), module
    loaded = load_model(path, keep_quantized=True)
    block = loaded.model.model.layers[1].mlp
    assert all(isinstance(e.gate_up_proj, QuantLinear) and isinstance(e.down_proj, QuantLinear)
               for e in block.experts)
    reference = load_model(path)
    ids = torch.randint(3, 250, (24,), generator=torch.Generator().manual_seed(5))
    # the same weights bit for bit: through the blocked kernels only float32 summation order differs from the float
    # GEMM (the tiled 8-bit kernel rounds x to int16, ~4e-5 of a layer's output, which can flip a near-tie of the
    # router: tests/test_qlinear_q8t.py checks that kernel)
    for module in loaded.model.modules():
        if isinstance(module, QuantLinear):
            set_tiled(module.packed, False)
    torch.testing.assert_close(prefill_logits(loaded, ids), prefill_logits(reference, ids), atol=5e-4, rtol=1e-3)
