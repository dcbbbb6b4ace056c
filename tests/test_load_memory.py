"""Loading GGUF files of a few hundred MB: the start-up estimate prices them as they load (packed matrices at their
packed size), and the load's peak RSS growth stays near the weights (measured in a subprocess: a memory ceiling)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from brisk.bench.shape_gguf import write_shape_gguf
from brisk.engine.memory import InsufficientMemoryError, MiB, check_memory, estimate_memory, model_footprint
from brisk.engine.settings import build_engine_config
from brisk.model.hugepages import _holders
from brisk.model.loader import load_model

# a llama of the default tokenizer's vocabulary (the shape writer pads nothing below it)
_SMALL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 256,
          "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False}


def _shape_file(tmp_path: Path, qtype: str, **changes: int) -> Path:
    config = tmp_path / f"config-{qtype}.json"
    config.write_text(json.dumps(_SMALL | changes))
    return write_shape_gguf(str(config), tmp_path / f"model.{qtype}.gguf", seed=0, qtype=qtype)


def _resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct tensors the loaded model holds (parameters, buffers, packed fields)."""
    return sum({t.data_ptr(): t.nbytes for _, _, t in _holders(model) if t.device.type == "cpu"}.values())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_native_gguf_estimate_is_the_loaded_bytes(tmp_path: Path, qtype: str) -> None:
    path = _shape_file(tmp_path, qtype)
    fp = model_footprint(str(path), keep_quantized=True)
    assert fp.fixed_bytes > 0 and fp.float_linear_params == 0  # every matrix packed, the head included
    loaded = load_model(str(path), keep_quantized=True, show_progress=False)
    actual = _resident_weight_bytes(loaded.model)
    assert abs(fp.weight_bytes(torch.float32) - actual) <= 0.02 * actual, (fp.weight_bytes(torch.float32), actual)
    # dequantized under a float --dtype: every tensor at that dtype
    bf16 = model_footprint(str(path), keep_quantized=False)
    assert bf16.fixed_bytes == 0 and bf16.native is not None and bf16.native.fixed_bytes == fp.fixed_bytes
    loaded = load_model(str(path), dtype=torch.bfloat16, keep_quantized=False, show_progress=False)
    actual = _resident_weight_bytes(loaded.model)
    assert abs(bf16.weight_bytes(torch.bfloat16) - actual) <= 0.02 * actual


def test_a_q4_file_is_priced_packed_and_refused_with_its_numbers(tmp_path: Path) -> None:
    path = _shape_file(tmp_path, "Q4_1")
    native = build_engine_config(model=str(path), num_kv_blocks=16)  # --dtype auto: the file's own precision
    est = estimate_memory(native, model_footprint(str(path), keep_quantized=True))
    f32 = build_engine_config(model=str(path), dtype="float32", num_kv_blocks=16)
    est32 = estimate_memory(f32, model_footprint(str(path)))
    assert est.weights < 0.2 * est32.weights  # 0.625 bytes a weight against 4
    assert check_memory(native, available=est.total) is not None
    with pytest.raises(InsufficientMemoryError) as e:
        check_memory(native, available=est.total - 1)
    assert f"weights {est.weights / MiB:.0f} MiB" in str(e.value) and "in its own precision" in str(e.value)
    # float32 does not fit where the file's own precision does: that is offered, with its estimate
    with pytest.raises(InsufficientMemoryError) as e:
        check_memory(f32, available=est.total + MiB)
    assert "  --dtype auto   (about" in str(e.value)


_PEAK_SCRIPT = """
import sys, torch
from brisk.model.loader import load_model
from brisk.model.hugepages import _holders, release_free_memory
from brisk.console import peak_rss_bytes, reset_peak_rss
# the imports, kernels and tokenizer before the baseline: a first load of a tiny file
load_model(sys.argv[2], dtype=getattr(torch, sys.argv[3]), keep_quantized=sys.argv[4] == "1", show_progress=False)
release_free_memory()
assert reset_peak_rss()
base = peak_rss_bytes()
loaded = load_model(sys.argv[1], dtype=getattr(torch, sys.argv[3]), keep_quantized=sys.argv[4] == "1",
                    show_progress=False)
weights = sum({t.data_ptr(): t.nbytes for _, _, t in _holders(loaded.model)}.values())
print(peak_rss_bytes() - base, weights)
"""


@pytest.mark.parametrize("qtype,dtype,native", [("Q8_0", "float32", True), ("F16", "bfloat16", False)])
def test_gguf_load_peak_rss_stays_near_the_weights(tmp_path: Path, qtype: str, dtype: str, native: bool) -> None:
    """A ~200 MB model: the load's peak RSS growth under 1.2x its resident weights + 64 MiB (the tokenizer's
    objects, RoPE tables). Copying the weights into the huge-page arena while the old ones stayed resident, or a
    fused copy next to its parts, peaks at about twice the weights."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's resettable peak RSS (/proc/self/clear_refs)")
    big = _shape_file(tmp_path, qtype, hidden_size=1024, intermediate_size=3072, num_hidden_layers=6,
                      num_attention_heads=16, num_key_value_heads=4)
    warm = tmp_path / "warm"
    warm.mkdir()
    warm_file = _shape_file(warm, qtype)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    run = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(big), str(warm_file), dtype, "1" if native else "0"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    growth, weights = (int(x) for x in run.stdout.split()[-2:])
    assert weights > 150 * MiB
    assert growth < 1.2 * weights + 64 * MiB, f"peak RSS grew {growth / MiB:.0f} MiB for {weights / MiB:.0f} MiB " \
                                              "of weights"
