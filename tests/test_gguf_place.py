"""GGUF matrices repacked in one pass into their final layout and place (model/gguf_place.py).

Oracle: the multi-pass way (repack into the blocked layout, concatenate q/k/v and gate/up, tile, copy to huge
pages), which tests/test_gguf_repack.py checks against gguf's reference dequantization. The loaded model's
packed tensors must be those of the multi-pass way bit for bit (bytes, parameters and their dtypes, layout), and
so must the greedy tokens.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_utils import (
    _add_metadata,
    hf_to_gguf_tensors,
    model_metadata,
    random_state_dict,
    tiny_config,
    tiny_gpt2_tokenizer_metadata,
)
from test_gguf_repack import _NO_ENCODER, _bits_equal, _encode, _random_blocks
from test_moe import prefill_logits

from brisk.model import gguf_place, hugepages
from brisk.model.gguf_native import PackedEmbedding
from brisk.model.gguf_repack import REPACKED, repack
from brisk.model.loader import load_model
from brisk.ops import kernels
from brisk.ops.layers import QuantLinear
from brisk.ops.qlinear import can_tile

pytestmark = pytest.mark.skipif(kernels.get_op("gguf_repack") is None, reason="the C++ kernels are not built here")

_WIDE = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q3_K, T.Q2_K)  # rows of 256-weight super-blocks


def _write_model(path, qtype: T, config, state, zero_scales: tuple[str, ...] = (),
                 qtypes: dict[str, T] | None = None) -> None:
    """Every matrix as `qtype` (or `qtypes[gguf name]`): the type's quantizer where there is one, random blocks
    otherwise. GGUF tensors in `zero_scales` get all-zero block parameters (float16-exact, where the others'
    K-quant products are not)."""
    w = gguf.GGUFWriter(path, config.architecture)
    for key, value in (model_metadata(config) | tiny_gpt2_tokenizer_metadata()).items():
        _add_metadata(w, key, value)
    for i, (name, t) in enumerate(hf_to_gguf_tensors(state, config).items()):
        t = np.ascontiguousarray(t, dtype=np.float32)
        if t.ndim != 2:
            w.add_tensor(name, t)
            continue
        q = (qtypes or {}).get(name, qtype)
        raw = _random_blocks(q, *t.shape, seed=i) if q in _NO_ENCODER else _encode(t, q)
        if name in zero_scales:
            raw = np.zeros_like(raw)
        w.add_tensor(name, raw, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _multi_pass(monkeypatch: pytest.MonkeyPatch, path, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(gguf_place, "placeable", lambda names, expected: set())
        return load_model(path, keep_quantized=True, show_progress=False, **kwargs)


def _packed_modules(model) -> dict[str, object]:
    return {name: module.packed for name, module in model.named_modules()
            if isinstance(module, (QuantLinear, PackedEmbedding))}


def _assert_same_model(a, b) -> None:
    pa, pb = _packed_modules(a.model), _packed_modules(b.model)
    assert set(pa) == set(pb)
    for name in pa:
        x, y = pa[name], pb[name]
        assert (x.bits, x.group_size, x.out_features, x.in_features, x.blocked, x.tiled) == \
            (y.bits, y.group_size, y.out_features, y.in_features, y.blocked, y.tiled), name
        assert torch.equal(x.data, y.data), name
        for s, t in ((x.scales, y.scales), (x.zeros, y.zeros)):
            assert (s is None) == (t is None), name
            if s is not None:
                assert s.dtype == t.dtype and s.shape == t.shape and _bits_equal(s.float(), t.float()), name


def _greedy(loaded, steps: int = 6) -> list[int]:
    """Greedy continuation by full re-prefill each step."""
    ids = [1, 7, 42, 99, 3]
    for _ in range(steps):
        ids.append(int(prefill_logits(loaded, torch.tensor(ids))[-1].argmax()))
    return ids[5:]


@pytest.mark.parametrize("qtype", list(REPACKED), ids=lambda t: t.name)
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_single_pass_load_equals_the_multi_pass_one(tmp_path, monkeypatch, qtype: T, fuse: bool) -> None:
    wide = qtype in _WIDE
    config = tiny_config(hidden_size=256, intermediate_size=256, head_dim=64) if wide else tiny_config()
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    _write_model(path, qtype, config, random_state_dict(config, seed=3))
    new = load_model(path, keep_quantized=True, show_progress=False, fuse=fuse)
    old = _multi_pass(monkeypatch, path, fuse=fuse)
    _assert_same_model(new, old)
    layer = new.model.model.layers[0]
    assert (layer.self_attn.qkv_proj is not None) == fuse
    assert _greedy(new) == _greedy(old)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_single_pass_fuses_biases_ties_and_places_in_huge_pages(tmp_path, monkeypatch, arch: str) -> None:
    # qwen2: q/k/v biases go with the fused weight; a tied table of whole tiles: the head's QuantLinear shares it,
    # tiled where it can be; the packed weights live in the loader's own huge-page arena (and no second copy is made
    # of them)
    config = tiny_config(arch, vocab_size=320, tie_word_embeddings=True)
    path = tmp_path / f"{arch}.gguf"
    _write_model(path, T.Q8_0, config, random_state_dict(config, seed=4))
    new = load_model(path, keep_quantized=True, show_progress=False)
    old = _multi_pass(monkeypatch, path)
    _assert_same_model(new, old)
    head = new.model.lm_head.packed
    assert head is new.model.model.embed_tokens.packed
    assert head.tiled == can_tile(head)  # tiled where the tiled kernels (AVX2 and up) are built
    assert _greedy(new) == _greedy(old)
    if hugepages.huge_pages_available():
        qkv = new.model.model.layers[0].self_attn.qkv_proj.packed
        down = new.model.model.layers[1].mlp.down_proj.packed
        assert qkv.data.untyped_storage().data_ptr() == down.scales.untyped_storage().data_ptr()


def test_k_quant_parts_of_different_parameter_dtypes_stay_unfused(tmp_path, monkeypatch) -> None:
    # k_proj's parameters all float16-exact (zero), q_proj's and v_proj's float32: the multi-pass way cannot
    # concatenate them (can_concat), so neither fuses; gate/up still do
    config = tiny_config(hidden_size=256, intermediate_size=256, head_dim=64)
    path = tmp_path / "mixed.gguf"
    _write_model(path, T.Q4_K, config, random_state_dict(config, seed=5), zero_scales=("blk.0.attn_k.weight",))
    new = load_model(path, keep_quantized=True, show_progress=False)
    old = _multi_pass(monkeypatch, path)
    _assert_same_model(new, old)
    layers = new.model.model.layers
    assert layers[0].self_attn.qkv_proj is None and layers[1].self_attn.qkv_proj is not None
    assert layers[0].self_attn.k_proj.packed.scales.dtype == torch.float16
    assert layers[0].mlp.gate_up_proj is not None


@pytest.mark.parametrize("qtype", [t for t in REPACKED if t in _WIDE], ids=lambda t: t.name)
def test_params_fit_half_is_the_repacks_dtype_choice(qtype: T) -> None:
    op = kernels.get_op("gguf_params_fit_half")
    for raw in (_random_blocks(qtype, 32, 512, seed=9), np.zeros_like(_random_blocks(qtype, 32, 512, seed=9))):
        pw = repack(torch.from_numpy(raw), qtype, (32, 512))
        fit = op(torch.from_numpy(raw), int(qtype), 512)
        assert bool(fit & 1) == (pw.scales.dtype == torch.float16)
        assert bool(fit & 2) == (pw.zeros is None or pw.zeros.dtype == torch.float16)


def test_repack_kernel_writes_tiled_rows_at_an_offset() -> None:
    # a part written at row 8 of a 48-row tiled buffer: those rows of the whole weight repacked and then tiled
    from brisk.ops.qlinear import set_tiled

    qtype = T.Q4_1
    raw = torch.from_numpy(_random_blocks(qtype, 48, 256, seed=11))
    whole = repack(raw, qtype, (48, 256))
    set_tiled(whole, True)
    data, scales, mins = torch.zeros_like(whole.data), torch.zeros_like(whole.scales), torch.zeros_like(whole.zeros)
    op = kernels.get_op("gguf_repack")
    for r0, r1 in ((0, 8), (8, 35), (35, 48)):
        op(raw.view(48, -1)[r0:r1].contiguous(), int(qtype), 256, None, data, scales, mins, r0, True)
    assert torch.equal(data, whole.data) and torch.equal(scales, whole.scales) and torch.equal(mins, whole.zeros)
    with pytest.raises(RuntimeError, match="do not fit"):
        op(raw.view(48, -1), int(qtype), 256, None, data, scales, mins, 8, True)


def test_without_the_kernels_the_multi_pass_pytorch_path_loads_the_same_weights(tmp_path) -> None:
    # no C++ extension: nothing is placed (gguf_place.placeable), the PyTorch repack runs and nothing is tiled; the
    # dequantized weights are the one-pass load's
    from brisk.ops.qlinear import dequantize_packed

    config = tiny_config()
    path = tmp_path / "q4_1.gguf"
    _write_model(path, T.Q4_1, config, random_state_dict(config, seed=6))
    new = load_model(path, keep_quantized=True, show_progress=False)
    with kernels.disabled():
        assert gguf_place.placeable({"blk.0.attn_q.weight"}, {"blk.0.attn_q.weight": ("x.weight", (32, 32))}) == set()
        plain = load_model(path, keep_quantized=True, show_progress=False)
        pa, pb = _packed_modules(new.model), _packed_modules(plain.model)
        assert set(pa) == set(pb) and not any(p.tiled for p in pb.values())
        for name in pa:
            assert _bits_equal(dequantize_packed(pa[name]), dequantize_packed(pb[name])), name


def test_parts_of_two_types_in_one_container_fuse_as_the_multi_pass_way_does(tmp_path, monkeypatch) -> None:
    # llama.cpp's Q4_K_M mixes: Q5_0 q/k beside a Q8_0 v (and Q5_0 gate beside Q8_0 up) share brisk's 8-bit g32
    # container, so the multi-pass way concatenates them; the one-pass plan must fuse them too, each part decoded
    # by its own type
    config = tiny_config()
    path = tmp_path / "two-types.gguf"
    mixed = {f"blk.{i}.{n}.weight": T.Q8_0 for i in range(config.num_hidden_layers) for n in ("attn_v", "ffn_up")}
    _write_model(path, T.Q5_0, config, random_state_dict(config, seed=6), qtypes=mixed)
    new = load_model(path, keep_quantized=True, show_progress=False)
    old = _multi_pass(monkeypatch, path)
    _assert_same_model(new, old)
    layer = new.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None
    assert _greedy(new) == _greedy(old)


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_chunks_shared_by_several_threads_give_the_multi_pass_weights(tmp_path, monkeypatch, qtype: T) -> None:
    # one tile (16 rows) per chunk, three threads taking chunks as they come: every tensor is written by several
    # threads in turn, some of them into rows of a fused buffer another thread is writing
    wide = qtype in _WIDE
    config = tiny_config(hidden_size=256, intermediate_size=256, head_dim=64) if wide else tiny_config()
    path = tmp_path / f"chunks-{qtype.name}.gguf"
    _write_model(path, qtype, config, random_state_dict(config, seed=8))
    old = _multi_pass(monkeypatch, path)
    ticks: list[int] = []
    previous = torch.get_num_threads()
    monkeypatch.setattr(gguf_place, "_CHUNK_BYTES", 1)
    torch.set_num_threads(3)
    try:
        chunked = gguf_place._repack_chunks

        def counted(base, chunks, workers, progress):  # noqa: ANN001
            assert workers == 3 and len(chunks) > 2 * len({id(c[0]) for c in chunks})  # several chunks per tensor
            return chunked(base, chunks, workers, ticks.append)

        monkeypatch.setattr(gguf_place, "_repack_chunks", counted)
        new = load_model(path, keep_quantized=True, show_progress=False)
    finally:
        torch.set_num_threads(previous)
    assert torch.get_num_threads() == previous
    _assert_same_model(new, old)
    # progress: every repacked tensor's bytes in the file, once
    from brisk.model.gguf import read_gguf

    assert sum(ticks) == sum(info.n_bytes for info in read_gguf(path).tensors.values() if info.qtype == qtype)


def test_an_error_in_a_repack_thread_reaches_the_caller(tmp_path, monkeypatch) -> None:
    config = tiny_config()
    path = tmp_path / "error.gguf"
    _write_model(path, T.Q4_1, config, random_state_dict(config, seed=8))
    kernel = kernels.get_op("gguf_repack")
    calls = []

    def failing(*args):  # noqa: ANN002
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("gguf_repack: injected failure")
        return kernel(*args)

    monkeypatch.setattr(gguf_place, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(gguf_place, "get_op", lambda name: failing if name == "gguf_repack" else kernels.get_op(name))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            load_model(path, keep_quantized=True, show_progress=False)
    finally:
        torch.set_num_threads(previous)
    assert torch.get_num_threads() == previous
