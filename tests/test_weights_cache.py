"""The weights cache (model/weights_cache.py): a GGUF file's converted weights written on the first load and mapped
back by the next, bit for bit the converted ones, never stale, never trusted when damaged.

Oracle: the same file loaded with the cache off (the loader every other test checks)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from gguf import GGMLQuantizationType as T
from gguf_utils import random_state_dict, tiny_config, write_tiny_model
from test_gguf_place import _greedy, _write_model

from brisk.model import weights_cache
from brisk.model.loader import load_model
from brisk.ops.qlinear import PackedWeight


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache on, in a folder of this test's, caching every load however small."""
    folder = tmp_path / "weights-cache"
    monkeypatch.setenv("BRISK_WEIGHTS_CACHE", str(folder))
    monkeypatch.setenv("BRISK_WEIGHTS_CACHE_MIN_MB", "0")
    monkeypatch.delenv("BRISK_WEIGHTS_CACHE_MAX_GB", raising=False)
    return folder


def _load(path: Path, **kwargs):  # noqa: ANN202 - LoadedModel
    return load_model(path, show_progress=False, **kwargs)


def _uncached(path: Path, monkeypatch: pytest.MonkeyPatch, **kwargs):  # noqa: ANN202 - LoadedModel
    with monkeypatch.context() as m:
        m.setenv("BRISK_WEIGHTS_CACHE", "0")
        return _load(path, **kwargs)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and packed-weight field by name (what the model computes with)."""
    out = dict(model.state_dict())
    for name, module in model.named_modules():
        pw = getattr(module, "packed", None)
        if isinstance(pw, PackedWeight):
            for field in ("data", "scales", "zeros"):
                if (t := getattr(pw, field)) is not None:
                    out[f"{name}.packed.{field}"] = t
            out[f"{name}.packed.tiled"] = torch.tensor(pw.tiled)
    return out


def _assert_bit_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    wa, wb = _weights(a), _weights(b)
    assert set(wa) == set(wb)
    for name in wa:
        x, y = wa[name], wb[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.uint8) if x.is_floating_point() else x,
                           y.view(torch.uint8) if y.is_floating_point() else y), name


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_a_hit_maps_the_converted_weights_bit_for_bit(tmp_path, monkeypatch, cache, qtype: T) -> None:
    wide = qtype in (T.Q4_K, T.Q6_K)
    config = tiny_config(hidden_size=256, intermediate_size=256, head_dim=64) if wide else tiny_config()
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    _write_model(path, qtype, config, random_state_dict(config, seed=3))
    plain = _uncached(path, monkeypatch, keep_quantized=True)
    first = _load(path, keep_quantized=True)
    second = _load(path, keep_quantized=True)
    assert (plain.weights_cache, first.weights_cache, second.weights_cache) == (None, "written", "hit")
    _assert_bit_equal(second.model, plain.model)
    _assert_bit_equal(first.model, plain.model)
    assert _greedy(second) == _greedy(plain)
    # the hit's packed weights are views of the entry's file, not copies
    qkv = second.model.model.layers[0].self_attn.qkv_proj.packed
    (entry,) = cache.glob("*.bin")
    base = qkv.data.untyped_storage().data_ptr()
    assert base == second.model.model.layers[1].mlp.down_proj.packed.data.untyped_storage().data_ptr()
    assert qkv.data.untyped_storage().nbytes() == entry.stat().st_size


@pytest.mark.parametrize(("stored", "dtype"), [(T.F32, torch.float32), (T.F16, torch.bfloat16),
                                               (T.F16, torch.float32)], ids=["f32", "f16-as-bf16", "f16-as-f32"])
def test_float_files_hit_with_their_fused_buffers_and_file_views(tmp_path, monkeypatch, cache, stored: T,
                                                                  dtype: torch.dtype) -> None:
    # in float32 the F32 tensors (the norms; an F32 file's o/down too) stay views of the GGUF file (recorded, not
    # copied) and the fused q/k/v and gate/up buffers go to the entry; F16 in bfloat16: everything converted
    config = tiny_config()
    path = write_tiny_model(tmp_path / f"{stored.name}.gguf", random_state_dict(config, seed=4), config, stored)
    plain = _uncached(path, monkeypatch, dtype=dtype)
    assert _load(path, dtype=dtype).weights_cache == "written"
    hit = _load(path, dtype=dtype)
    assert hit.weights_cache == "hit"
    _assert_bit_equal(hit.model, plain.model)
    meta = json.loads(next(cache.glob("*.json")).read_text())
    assert meta["uses_source"] == (dtype == torch.float32)  # F32 norms (and F32 matrices) map from the file
    assert _greedy(hit) == _greedy(plain)


def test_each_setting_has_its_own_entry_and_an_edited_file_misses(tmp_path, cache) -> None:
    config = tiny_config()
    path = tmp_path / "q8.gguf"
    _write_model(path, T.Q8_0, config, random_state_dict(config, seed=5))
    assert _load(path, keep_quantized=True).weights_cache == "written"
    assert _load(path, keep_quantized=True, fuse=False).weights_cache == "written"
    assert _load(path, keep_quantized=False).weights_cache == "written"  # dequantized to float32
    assert len(list(cache.glob("*.json"))) == 3
    assert _load(path, keep_quantized=True, fuse=False).weights_cache == "hit"
    # the file rewritten with other weights (new size, mtime): a miss, and the new weights are what loads
    _write_model(path, T.Q8_0, config, random_state_dict(config, seed=6))
    os.utime(path, ns=(1, 1))
    fresh = _load(path, keep_quantized=True)
    assert fresh.weights_cache == "written"
    with pytest.MonkeyPatch.context() as m:
        m.setenv("BRISK_WEIGHTS_CACHE", "0")
        _assert_bit_equal(fresh.model, _load(path, keep_quantized=True).model)


@pytest.mark.parametrize("damage", ["truncated", "bad json", "missing bin"])
def test_a_damaged_entry_is_deleted_and_the_file_converted_again(tmp_path, monkeypatch, cache, caplog,
                                                                 damage: str) -> None:
    config = tiny_config()
    path = tmp_path / "q4.gguf"
    _write_model(path, T.Q4_1, config, random_state_dict(config, seed=7))
    _load(path, keep_quantized=True)
    (meta,), (bin_path,) = list(cache.glob("*.json")), list(cache.glob("*.bin"))
    if damage == "truncated":
        with open(bin_path, "r+b") as f:
            f.truncate(bin_path.stat().st_size // 2)
    elif damage == "bad json":
        meta.write_text("{not json")
    else:
        bin_path.unlink()
    again = _load(path, keep_quantized=True)
    assert again.weights_cache == "written"
    assert "damaged" in caplog.text
    _assert_bit_equal(again.model, _uncached(path, monkeypatch, keep_quantized=True).model)
    assert _load(path, keep_quantized=True).weights_cache == "hit"


def test_writing_a_hit_weight_in_place_leaves_the_entry_alone(tmp_path, cache) -> None:
    # the entry is mapped copy-on-write: pruning or a test's in-place edit never reaches the file
    config = tiny_config()
    path = tmp_path / "f16.gguf"
    write_tiny_model(path, random_state_dict(config, seed=8), config, T.F16)
    _load(path, dtype=torch.bfloat16)
    hit = _load(path, dtype=torch.bfloat16)
    before = next(cache.glob("*.bin")).read_bytes()
    for p in hit.model.parameters():
        p.data.zero_()
    assert next(cache.glob("*.bin")).read_bytes() == before
    assert _load(path, dtype=torch.bfloat16).weights_cache == "hit"


def test_small_loads_and_the_off_switch_write_nothing(tmp_path, monkeypatch, cache) -> None:
    config = tiny_config()
    path = tmp_path / "q8.gguf"
    _write_model(path, T.Q8_0, config, random_state_dict(config, seed=9))
    monkeypatch.setenv("BRISK_WEIGHTS_CACHE_MIN_MB", "256")  # the default: a tiny model converts far less
    assert _load(path, keep_quantized=True).weights_cache is None
    monkeypatch.setenv("BRISK_WEIGHTS_CACHE_MIN_MB", "0")
    monkeypatch.setenv("BRISK_WEIGHTS_CACHE", "0")
    assert _load(path, keep_quantized=True).weights_cache is None
    assert not cache.exists()


def test_a_disk_that_would_fill_up_gets_no_entry(tmp_path, monkeypatch, cache, caplog) -> None:
    config = tiny_config()
    path = tmp_path / "q8.gguf"
    _write_model(path, T.Q8_0, config, random_state_dict(config, seed=9))
    real = shutil.disk_usage
    monkeypatch.setattr(weights_cache.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    loaded = _load(path, keep_quantized=True)
    assert loaded.weights_cache is None and "1 GiB free" in caplog.text
    assert not list(cache.glob("*.bin")) and not list(cache.glob("*.partial"))


def test_least_recently_used_entries_go_beyond_the_size_limit(tmp_path, cache) -> None:
    config = tiny_config()
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"m{i}.gguf")
        _write_model(paths[-1], T.Q8_0, config, random_state_dict(config, seed=i))
        _load(paths[-1], keep_quantized=True)
    s = weights_cache.Settings.from_env()
    sizes = {e.file: e.bytes for e in weights_cache.entries(s)}
    assert len(sizes) == 3
    _load(paths[0], keep_quantized=True)  # used again: now the most recent
    (cache / "stale.999999999.partial").write_bytes(b"x")  # a write whose process is gone
    s.max_bytes = sum(sizes.values()) - 1
    gone = weights_cache.evict(s)
    left = {Path(e.file).name for e in weights_cache.entries(s)}
    assert len(gone) == 1 and left == {"m0.gguf", "m2.gguf"}
    assert not (cache / "stale.999999999.partial").exists()
    # a file deleted (a benchmark's temporary one) or rewritten: its entry goes at the next eviction
    paths[2].unlink()
    s.max_bytes = 32 << 30
    assert weights_cache.evict(s) and {Path(e.file).name for e in weights_cache.entries(s)} == {"m0.gguf"}


def test_settings_from_the_environment() -> None:
    s = weights_cache.Settings.from_env({"XDG_CACHE_HOME": "/x"})
    assert (s.folder, s.min_bytes, s.max_bytes) == (Path("/x/brisk/weights"), 256 << 20, 32 << 30)
    assert weights_cache.Settings.from_env({"BRISK_WEIGHTS_CACHE": "off"}).folder is None
    assert weights_cache.Settings.from_env({"BRISK_WEIGHTS_CACHE": "/y/z"}).folder == Path("/y/z")
    assert weights_cache.Settings.from_env({"BRISK_WEIGHTS_CACHE_MAX_GB": "1.5"}).max_bytes == int(1.5 * 2**30)
    with pytest.raises(ValueError, match="BRISK_WEIGHTS_CACHE_MIN_MB='lots' is not a number"):
        weights_cache.Settings.from_env({"BRISK_WEIGHTS_CACHE_MIN_MB": "lots"})
    with pytest.raises(ValueError, match="must be >= 0"):
        weights_cache.Settings.from_env({"BRISK_WEIGHTS_CACHE_MAX_GB": "-1"})


def test_cache_cli_lists_and_clears(tmp_path, cache) -> None:
    from brisk.cli import main

    config = tiny_config()
    path = tmp_path / "q8.gguf"
    _write_model(path, T.Q8_0, config, random_state_dict(config, seed=10))
    _load(path, keep_quantized=True)
    out = CliRunner().invoke(main, ["cache", "info"])
    assert out.exit_code == 0, out.output
    assert str(path.resolve()) in out.output and "1 entries" in out.output
    out = CliRunner().invoke(main, ["cache", "clear"])
    assert out.exit_code == 0 and "freed" in out.output
    assert not list(cache.glob("*.bin")) and not list(cache.glob("*.json"))
    assert _load(path, keep_quantized=True).weights_cache == "written"


def test_bench_compare_reports_the_converting_load_beside_the_hit() -> None:
    from brisk.bench.compare import EngineFigures
    from brisk.bench.compare_child import EngineRun

    f = EngineFigures()
    f.add(EngineRun(3.0, 0, 0, 0, 1.0))
    f.add(EngineRun(0.6, 0, 0, 0, 1.0, weights_cache_hit=True))
    assert (f.load_s, f.load_converting_s, f.weights_cache_hit) == (0.6, 3.0, True)
