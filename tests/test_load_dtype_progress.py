"""A model runs in its file's precision unless told otherwise (HF folders), and its load shows a byte-counting
progress bar only on a terminal and only when it is slow."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from hf_utils import make_tiny_hf_model
from rich.console import Console

from brisk.engine.config import resolve_dtype
from brisk.engine.settings import build_engine_config
from brisk.model.load_progress import LoadProgress


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same tiny model saved by transformers in float32, bfloat16 and float16."""
    root = tmp_path_factory.mktemp("dtypes")
    model = make_tiny_hf_model(root / "float32", "llama", seed=5)
    out = {"float32": root / "float32"}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        make_tiny_hf_model(root / name, "llama", seed=5)  # tokenizer and generation config
        model.to(dtype).save_pretrained(root / name, safe_serialization=True)
        out[name] = root / name
    return out


def _stored(folder: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    return config.get("torch_dtype") or config.get("dtype")


def test_auto_is_the_precision_the_folder_states(folders: dict[str, Path]) -> None:
    assert {name: _stored(f) for name, f in folders.items()} == {n: n for n in folders}  # what transformers wrote
    assert resolve_dtype("auto", str(folders["bfloat16"])) == torch.bfloat16
    assert resolve_dtype("auto", str(folders["float32"])) == torch.float32
    assert resolve_dtype("auto", str(folders["float16"])) == torch.float32  # widened exactly, not rounded to bf16
    assert resolve_dtype("float32", str(folders["bfloat16"])) == torch.float32  # an explicit dtype wins
    assert resolve_dtype("auto", None) == torch.float32  # the default model (GGUF)
    assert resolve_dtype("auto", str(folders["bfloat16"]), "dummy") == torch.float32
    assert build_engine_config(model=str(folders["bfloat16"])).torch_dtype == torch.bfloat16
    assert build_engine_config(model=str(folders["bfloat16"]), dtype="float32").torch_dtype == torch.float32


def test_a_bfloat16_folder_runs_in_bfloat16_unless_float32_is_asked(folders: dict[str, Path]) -> None:
    from brisk.engine.llm import LLM
    from brisk.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = {}
    for dtype in (None, "bfloat16", "float32"):
        kwargs = {} if dtype is None else {"dtype": dtype}
        llm = LLM(str(folders["bfloat16"]), max_model_len=64, kv_cache_memory="2MiB", **kwargs)
        loaded = llm.engine.loaded
        assert loaded.model.model.embed_tokens.weight.dtype == loaded.dtype
        runs[dtype] = (loaded.dtype, llm.generate(["Hello there"], params)[0].outputs[0].token_ids)
    assert runs[None][0] == torch.bfloat16 and runs["float32"][0] == torch.float32
    assert runs[None] == runs["bfloat16"]  # the default is exactly the bfloat16 engine


def test_eval_ppl_follows_the_folder(folders: dict[str, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from brisk.cli import main

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    docs = {}
    for extra in ([], ["--dtype", "float32"]):
        out = tmp_path / f"{len(extra)}.json"
        r = CliRunner().invoke(main, ["eval", "ppl", "--model", str(folders["bfloat16"]), "--text", str(text),
                                      "--window", "32", "--max-windows", "2", "--json", str(out)] + extra)
        assert r.exit_code == 0, r.output
        docs[len(extra)] = json.loads(out.read_text())
    assert docs[0]["params"]["dtype"] == "auto" and docs[2]["params"]["dtype"] == "float32"
    # the same bfloat16 weights scored at two precisions: close, and not bit-identical
    assert docs[0]["ppl"] == pytest.approx(docs[2]["ppl"], rel=0.05) and docs[0]["ppl"] != docs[2]["ppl"]


# ---------------------------------------------------------------------------- the progress bar
def _terminal() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, force_terminal=True, width=100), buf


def test_the_bar_shows_on_a_terminal_once_the_load_is_slow() -> None:
    console, buf = _terminal()
    with LoadProgress("loading x", 3 * 2**20, delay_s=0.0, console=console) as bar:
        for _ in range(3):
            bar.advance(2**20)
        assert bar.shown and bar.done_bytes == 3 * 2**20
    assert not bar.shown and "loading x" in buf.getvalue() and "3.0/3.0 MiB" in buf.getvalue()


def test_the_bar_stays_quiet_for_fast_loads_and_off_a_terminal() -> None:
    console, buf = _terminal()
    with LoadProgress("fast", 100, delay_s=60.0, console=console) as bar:  # done long before the delay
        bar.advance(100)
        assert not bar.shown
    piped = io.StringIO()
    with LoadProgress("piped", 100, delay_s=0.0, console=Console(file=piped)) as bar:  # not a terminal
        bar.advance(100)
        assert not bar.shown
    with LoadProgress("off", 100, delay_s=0.0, console=_terminal()[0], enabled=False) as bar:
        bar.advance(100)
        assert not bar.shown
    assert buf.getvalue() == "" and piped.getvalue() == ""


@pytest.mark.parametrize("fuse", [False, True])
def test_readers_count_every_stored_byte(folders: dict[str, Path], fuse: bool) -> None:
    """The HF reader advances once per tensor by its stored bytes: the bar ends at the total it was given."""
    from safetensors import safe_open

    from brisk.model.hf import load_hf_folder

    folder = folders["bfloat16"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = {k: f.get_slice(k).get_shape() for k in f.keys()}
    expected = sum(2 * torch.Size(shape).numel() for shape in stored.values())
    ticks: list[int] = []
    ckpt = load_hf_folder(folder, dtype=torch.float32, fuse=fuse, progress=ticks.append)
    assert len(ticks) == len(stored) and sum(ticks) == expected
    assert ckpt.tensors  # loaded as usual


def test_gguf_and_dummy_readers_count_every_byte(tmp_path: Path) -> None:
    from gguf_utils import random_state_dict, tiny_config, write_tiny_model

    from brisk.model.dummy import random_tensors
    from brisk.model.gguf import load_gguf, read_gguf

    config = tiny_config()
    path = write_tiny_model(tmp_path / "t.gguf", random_state_dict(config, seed=1), config)
    ticks: list[int] = []
    load_gguf(path, progress=ticks.append)
    assert sum(ticks) == sum(t.n_bytes for t in read_gguf(path).tensors.values())
    ticks.clear()
    tensors = random_tensors(config, torch.bfloat16, progress=ticks.append)
    assert sum(ticks) == sum(t.nbytes for t in tensors.values())
