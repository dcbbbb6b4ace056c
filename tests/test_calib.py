"""The layer-wise calibration driver: samples, observers, and block runs that match the model's own forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk.data import calibration_text_path
from brisk.model.loader import load_model
from brisk.quant.calib import (
    TRUE_SEQUENTIAL,
    ActStatsObserver,
    CalibConfig,
    CalibrationError,
    HessianObserver,
    load_calibration_ids,
    run_layerwise,
    stages,
)

TEXT = calibration_text_path()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_hf_model(path, num_kv_heads=2, num_attention_heads=4, num_hidden_layers=3)
    (path / "calib.txt").write_text(TEXT.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    return path


def test_incremental_hessian_equals_batch_hessian() -> None:
    torch.manual_seed(0)
    x = torch.randn(1000, 48) * torch.linspace(0.1, 30, 48)  # very different channel scales
    obs = HessianObserver(48)
    for chunk in torch.split(x, [1, 333, 200, 466]):  # uneven batches, one of a single token
        obs.update(chunk)
    x64 = x.double()
    batch = 2 / x.shape[0] * x64.t() @ x64
    assert obs.num_tokens == 1000
    torch.testing.assert_close(obs.hessian().double(), batch, rtol=1e-6, atol=1e-6 * float(batch.abs().max()))


def test_activation_stats_match_direct_formulas() -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 70, 16)  # [batch, seq, K]: observers flatten the leading dims
    obs = ActStatsObserver(16)
    obs.update(x[:2])
    obs.update(x[2:])
    flat = x.reshape(-1, 16)
    torch.testing.assert_close(obs.mean_abs(), flat.abs().mean(0))
    torch.testing.assert_close(obs.sq_norm(), flat.square().sum(0))


def test_calibration_ids_are_seeded_windows_of_the_text(tiny: Path) -> None:
    loaded = load_model(tiny, fuse=False)
    config = CalibConfig(str(tiny / "calib.txt"), num_samples=5, seq_len=32, seed=3)
    ids = load_calibration_ids(loaded.tokenizer, config)
    assert ids.shape == (5, 32) and ids.dtype == torch.long
    assert torch.equal(ids, load_calibration_ids(loaded.tokenizer, config))  # same seed, same samples
    other = load_calibration_ids(loaded.tokenizer, CalibConfig(config.calib_text, 5, 32, seed=4))
    assert not torch.equal(ids, other)
    text_ids = loaded.tokenizer.encode((tiny / "calib.txt").read_text(encoding="utf-8"), add_special_tokens=False)
    joined = " ".join(map(str, text_ids))
    for row in ids.tolist():  # every sample is a contiguous window of the tokenized text
        assert " ".join(map(str, row)) in joined
    assert config.to_dict() == {"calib_text": "calib.txt", "num_samples": 5, "seq_len": 32, "seed": 3}


def test_calibration_errors_say_what_to_do(tiny: Path, tmp_path: Path) -> None:
    loaded = load_model(tiny, fuse=False)
    short = tmp_path / "short.txt"
    short.write_text("only a few words", encoding="utf-8")
    with pytest.raises(CalibrationError, match="shorter --seq-len"):
        load_calibration_ids(loaded.tokenizer, CalibConfig(str(short), 2, 64))
    with pytest.raises(CalibrationError, match="does not exist"):
        load_calibration_ids(loaded.tokenizer, CalibConfig(str(tmp_path / "missing.txt")))
    with pytest.raises(CalibrationError, match="positive integer"):
        CalibConfig(str(short), num_samples=0)
    fused = load_model(tiny)  # fuse=True: q/k/v are one linear, the driver cannot observe them apart
    with pytest.raises(CalibrationError, match="fuse=False"):
        run_layerwise(fused.model, torch.zeros(1, 4, dtype=torch.long), lambda ctx: None, progress=False)


def reference_block_inputs(loaded, ids: torch.Tensor) -> list[torch.Tensor]:  # noqa: ANN001
    """Hidden state entering each decoder block in the model's own forward (one sequence at a time)."""
    from brisk.eval.ppl import sequence_logits

    per_block: list[list[torch.Tensor]] = [[] for _ in loaded.model.model.layers]
    handles = []
    for i, layer in enumerate(loaded.model.model.layers):
        def hook(_m, args, i=i):  # noqa: ANN001, ANN202
            x, residual = args[0], args[1]
            per_block[i].append((x if residual is None else x + residual).clone())
        handles.append(layer.register_forward_pre_hook(hook))
    try:
        for row in ids:
            sequence_logits(loaded, row)
    finally:
        for h in handles:
            h.remove()
    return [torch.stack(xs) for xs in per_block]  # each [N, L, hidden]


def test_driver_block_inputs_match_the_model_forward(tiny: Path) -> None:
    loaded = load_model(tiny, fuse=False)
    ids = load_calibration_ids(loaded.tokenizer, CalibConfig(str(tiny / "calib.txt"), num_samples=5, seq_len=24))
    expected = reference_block_inputs(loaded, ids)
    seen: list[torch.Tensor] = []
    # batch_size 2 of 5 samples: the last mini-batch is partial
    run_layerwise(loaded.model, ids, lambda ctx: seen.append(ctx.inputs.clone()), batch_size=2, progress=False)
    assert len(seen) == len(expected) == 3
    for got, want in zip(seen, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_observe_shares_inputs_stops_early_and_ignores_the_batch_split(tiny: Path) -> None:
    loaded = load_model(tiny, fuse=False)
    ids = load_calibration_ids(loaded.tokenizer, CalibConfig(str(tiny / "calib.txt"), num_samples=4, seq_len=16))
    results: dict[int, dict[str, torch.Tensor]] = {}
    mlp_calls = []

    def apply(ctx, batch_size: int) -> None:  # noqa: ANN001
        if ctx.index != 1:
            return
        handle = ctx.block.mlp.register_forward_hook(lambda *_: mlp_calls.append(1))
        qkv = ctx.observe(list(TRUE_SEQUENTIAL[0]), lambda _n, m: HessianObserver(m.in_features))
        handle.remove()
        assert qkv["self_attn.q_proj"] is qkv["self_attn.k_proj"] is qkv["self_attn.v_proj"]
        every = ctx.observe(list(ctx.linears()), lambda _n, m: HessianObserver(m.in_features))
        assert every["mlp.gate_proj"] is every["mlp.up_proj"]
        assert every["self_attn.o_proj"] is not every["self_attn.q_proj"]
        assert every["mlp.down_proj"].num_tokens == 4 * 16
        # the q/k/v input is the input norm of the block input: check its Hessian from scratch
        x = ctx.block.input_layernorm(ctx.inputs.reshape(-1, ctx.inputs.shape[-1])).double()
        torch.testing.assert_close(qkv["self_attn.q_proj"].hessian().double(), 2 / x.shape[0] * x.t() @ x,
                                   rtol=1e-5, atol=1e-6)
        results[batch_size] = {n: o.hessian() for n, o in every.items()}
        assert stages(ctx) == [tuple(s) for s in TRUE_SEQUENTIAL]

    for batch_size in (1, 3):
        run_layerwise(loaded.model, ids, lambda ctx, b=batch_size: apply(ctx, b), batch_size=batch_size,
                      progress=False)
    assert not mlp_calls  # observing q/k/v alone stopped each forward before the MLP
    for name, h in results[1].items():
        torch.testing.assert_close(results[3][name], h, rtol=1e-5, atol=1e-6)


def test_modified_weights_feed_the_next_block(tiny: Path) -> None:
    loaded = load_model(tiny, fuse=False)
    ids = load_calibration_ids(loaded.tokenizer, CalibConfig(str(tiny / "calib.txt"), num_samples=2, seq_len=16))
    original = reference_block_inputs(loaded, ids)
    inputs: list[torch.Tensor] = []

    def apply(ctx) -> None:  # noqa: ANN001
        inputs.append(ctx.inputs.clone())
        if ctx.index == 0:
            ctx.block.mlp.down_proj.weight.data.mul_(0.5)
    run_layerwise(loaded.model, ids, apply, progress=False)
    modified = reference_block_inputs(loaded, ids)  # the model's own forward, with block 0's change
    assert not torch.allclose(inputs[1], original[1], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(inputs[1], modified[1], rtol=1e-4, atol=1e-5)
