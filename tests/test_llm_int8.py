"""LLM.int8(): outlier columns in float beat plain vector-wise int8, the threshold search scores what the layer
computes, and the checkpoint records its threshold and outlier statistics and loads as Int8Linear layers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from test_gptq_awq import outlier_layer
from test_smoothquant import tiny  # noqa: F401 - the module-scoped tiny model fixture

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.model.loader import load_model
from brisk.ops import w8a8
from brisk.ops.layers import LinearKind
from brisk.ops.w8a8 import Int8Linear
from brisk.quant.awq import rtn_codes
from brisk.quant.llm_int8 import THRESHOLD_GRID, fake_llm_int8
from brisk.quant.smoothquant import W8


def test_outlier_decomposition_beats_plain_int8() -> None:
    w, x, _ = outlier_layer(seed=6)  # 4 input channels ~30x the rest (|x| up to ~100)
    codes, scale, _ = rtn_codes(w, W8)
    packed = w8a8.pack_weight(codes, scale.reshape(-1))
    ref = x @ w.t()
    plain = float((w8a8.w8a8_linear(x, packed) - ref).square().mean())
    stats = w8a8.OutlierStats()
    mixed = float((w8a8.llm_int8_linear(x, packed, 6.0, stats=stats) - ref).square().mean())
    assert stats.columns_seen == {3, 77, 150, 201} | (stats.columns_seen or set())  # the injected ones, at least
    assert mixed < 0.2 * plain, (mixed, plain)


def test_checkpoint_records_outliers_and_generates(tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "li8"
    res = CliRunner().invoke(main, ["quantize", str(tiny), str(out), "--method", "llm-int8", "--threshold", "1.5",
                                    "--calib-text", str(tiny / "calib.txt"), "--num-samples", "4", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    assert "LLM.int8() outliers (|x| > 1.5)" in res.output
    mc = json.loads((out / "config.json").read_text())["quantization_config"]["method_config"]
    assert mc["threshold"] == 1.5 and len(mc["outliers"]) == 14  # every decoder linear of the 2 blocks
    assert all(0 <= v["max_per_forward"] <= v["columns"] for v in mc["outliers"].values())
    qloaded = load_model(out)
    down = qloaded.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Int8Linear) and down.kernel().kind is LinearKind.W8A8_OUTLIER
    assert down.outlier_threshold == 1.5
    llm = LLM(model=str(out))
    got = llm.generate(["Emma was"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(got[0].outputs[0].token_ids) == 6
    assert llm.engine.runner.executor.path == "modules"  # outlier columns per call: no fixed kernel for the loop


def test_threshold_must_be_positive(tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    res = CliRunner().invoke(main, ["quantize", str(tiny), str(tmp_path / "x"), "--method", "llm-int8",
                                    "--threshold", "0", "--calib-text", str(tiny / "calib.txt")])
    assert res.exit_code != 0 and "threshold must be positive" in res.output


def test_search_simulation_is_the_layer() -> None:
    """The threshold search scores `fake_llm_int8`; it must compute what the runtime layer does (same outlier
    columns, same int8 rounding), or the search would choose for a different function."""
    w, x, _ = outlier_layer(seed=7)
    codes, scale, zero = rtn_codes(w, W8)
    packed = w8a8.pack_weight(codes, scale.reshape(-1))
    wq = w8a8.weight_columns(packed, torch.arange(w.shape[1]))  # [N, K] float: the int8 weights
    for t in (6.0, 2.0, 0.5):
        ref = w8a8.llm_int8_linear(x, packed, t)
        torch.testing.assert_close(fake_llm_int8(x, wq, t), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_threshold_searched_by_default(tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "auto"
    res = CliRunner().invoke(main, ["quantize", str(tiny), str(out), "--method", "llm-int8",
                                    "--calib-text", str(tiny / "calib.txt"), "--num-samples", "4", "--seq-len", "32"])
    assert res.exit_code == 0, res.output
    mc = json.loads((out / "config.json").read_text())["quantization_config"]["method_config"]
    t, kl = mc["threshold"], mc["search"]
    assert t in THRESHOLD_GRID and f"LLM.int8() threshold {t:g}:" in " ".join(res.output.split())
    assert list(kl) == [f"{g:g}" for g in THRESHOLD_GRID] and all(v >= 0 for v in kl.values())
    larger = [g for g in THRESHOLD_GRID if g > t]
    assert all(kl[f"{g:g}"] > mc["tolerance"] for g in larger)  # the larger thresholds move the outputs too much
    assert kl[f"{t:g}"] <= mc["tolerance"] or t == THRESHOLD_GRID[-1]
    assert kl["0.5"] < kl["6"]  # more columns in float: closer to the float activations
    assert load_model(out).model.model.layers[1].self_attn.o_proj.outlier_threshold == t


def test_threshold_must_be_a_number_or_auto(tiny: Path, tmp_path: Path) -> None:  # noqa: F811
    res = CliRunner().invoke(main, ["quantize", str(tiny), str(tmp_path / "x"), "--method", "llm-int8",
                                    "--threshold", "six", "--calib-text", str(tiny / "calib.txt")])
    assert res.exit_code != 0 and "pass auto or a number" in res.output
