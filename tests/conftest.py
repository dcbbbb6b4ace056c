"""Shared fixtures. The real default model is loaded once per session, by brisk and by transformers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
# the weights cache (model/weights_cache.py) stays off unless a test turns it on in a folder of its own: loads in
# tests convert what they load, as they always did, and nothing is written to the user's cache
os.environ["BRISK_WEIGHTS_CACHE"] = "0"


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    from brisk.model.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_gguf_path: Path):  # noqa: ANN201
    """transformers' own load of the default GGUF (dequantized to float32): the reference (~20 s)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf_path.parent), gguf_file=default_gguf_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_llm():  # noqa: ANN201
    from brisk import LLM

    # float32: the dequantized weights transformers loads too (the default, dtype auto, runs the file's Q4_1 codes)
    return LLM(max_model_len=1024, kv_cache_memory="128MiB", dtype="float32")


@pytest.fixture
def kernel_settings():  # noqa: ANN201 - kernels.configure
    """`kernel_settings(enabled=False)` switches brisk's kernels (kernels.configure) for the rest of this test;
    the settings are restored when it ends. What tests use instead of the BRISK_* variables read at start-up."""
    import dataclasses

    from brisk.ops import kernels

    saved = kernels.settings
    yield kernels.configure
    kernels.configure(**dataclasses.asdict(saved))


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201 - torch.ops.brisk
    """brisk's C++ kernels (torch.ops.brisk). A failed build fails the tests that need them, never skips them.
    Modules with their own needs (environment, a particular op) define their own `ops`."""
    from brisk.ops import kernels

    found = kernels.get_ops()
    if found is None:
        pytest.fail("the C++ kernels did not build; see the warning logged by brisk.ops.kernels")
    return found


def ops_with(op_name: str):  # noqa: ANN201 - torch.ops.brisk
    """brisk's C++ kernels, switched on whatever the environment said, failing (never skipping) when `op_name` did not
    build: the module-scoped `ops` fixture of kernel tests that need one particular op."""
    from brisk.ops import kernels

    with kernels.override(enabled=True):
        found = kernels.get_ops()
    if found is None or not hasattr(found, op_name):
        pytest.fail(f"the C++ kernel {op_name} did not build; see the warning logged by brisk.ops.kernels")
    return found
