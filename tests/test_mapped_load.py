"""Memory-mapped and conversion-time-fused loading: the same tensors, bit for bit, as reading every tensor into
a fresh buffer and concatenating q/k/v and gate/up afterwards; mapped weights really are views of the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_utils import random_state_dict, tiny_config, write_tiny_model
from hf_utils import make_tiny_hf_model
from safetensors.torch import load_file, save_file

from brisk.model.gguf import load_gguf
from brisk.model.loader import load_model


def _fused(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """What fuse_projections builds from unfused tensors (torch.cat), under the fused module names."""
    out = dict(tensors)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for parts, fused in ((("q_proj", "k_proj", "v_proj"), "self_attn.qkv_proj"),
                             (("gate_proj", "up_proj"), "mlp.gate_up_proj")):
            module = fused.split(".")[0]
            for kind in ("weight", "bias"):
                names = [f"{p}{module}.{part}.{kind}" for part in parts]
                if names[0] in out:
                    out[f"{p}{fused}.{kind}"] = torch.cat([out.pop(n) for n in names])
    return out


def _assert_state_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = {k: v for k, v in model.state_dict().items() if k in expected or k.endswith(("weight", "bias"))}
    state.pop("lm_head.weight", None) if "lm_head.weight" not in expected else None
    assert state.keys() == expected.keys()
    for name, t in expected.items():
        assert state[name].dtype == t.dtype and torch.equal(state[name], t), name


def _file_mapped(t: torch.Tensor, path) -> bool:
    """Whether `t`'s first byte lies in a mapping of file `path` (Linux /proc/self/maps)."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return len(fields) > 5 and fields[5] == str(path)
    return False


@pytest.mark.parametrize("stored,dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])  # qwen2: q/k/v biases; phi3: fused qkv in the file
def test_safetensors_load_equals_reading_every_tensor(tmp_path, arch, stored, dtype):
    make_tiny_hf_model(tmp_path, arch)
    file = tmp_path / "model.safetensors"
    if stored != torch.float32:
        save_file({k: v.to(stored) for k, v in load_file(file).items()}, str(file))
    loaded = load_model(str(tmp_path), dtype=dtype, sparse=False)
    reference = {k: v.to(dtype) for k, v in load_model(str(tmp_path), dtype=dtype, fuse=False).model.state_dict()
                 .items()}
    raw = {k: v.to(dtype) for k, v in load_file(file).items()}
    for name in [n for n in raw if ".qkv_proj." in n or ".gate_up_proj." in n]:  # phi3 stores them fused
        assert torch.equal(loaded.model.state_dict()[name], raw[name]), name
    _assert_state_equal(loaded.model, _fused(reference, loaded.config.num_hidden_layers))
    if arch == "llama":  # unfused tensors equal the file's, converted
        for name, t in reference.items():
            assert torch.equal(t, raw[name]), name
    o_proj = loaded.model.model.layers[0].self_attn.o_proj.weight
    assert _file_mapped(o_proj, file) == (stored == dtype)  # a view of the file exactly when stored as it runs


@pytest.mark.parametrize("qtype,dtype", [(T.F32, torch.float32), (T.F16, torch.float32), (T.F16, torch.float16),
                                         (T.BF16, torch.bfloat16), (T.Q8_0, torch.float32), (T.Q4_0, torch.bfloat16)])
def test_gguf_load_equals_dequantizing_every_tensor(tmp_path, qtype, dtype):
    config = tiny_config("llama", attention_bias=True)
    path = write_tiny_model(tmp_path / "m.gguf", random_state_dict(config, seed=3), config, qtype)
    reference = load_gguf(path, dtype=dtype, mmap_weights=False).tensors  # a fresh buffer per tensor
    mapped = load_gguf(path, dtype=dtype)
    assert mapped.tensors.keys() == reference.keys()
    for name, t in reference.items():
        assert mapped.tensors[name].dtype == t.dtype and torch.equal(mapped.tensors[name], t), name
    loaded = load_model(path, dtype=dtype, sparse=False)
    _assert_state_equal(loaded.model, _fused(reference, config.num_hidden_layers))
    o_proj = loaded.model.model.layers[0].self_attn.o_proj.weight
    # F16 / BF16 files of this shape store 2-D tensors in that type; F32 files too: mapped when the dtype matches
    stored = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}.get(qtype)
    assert _file_mapped(o_proj, path) == (stored == dtype)


def test_mapped_weights_are_private_copy_on_write(tmp_path):
    """Writing to a mapped weight (pruning does, in place) changes this process's copy, never the file."""
    make_tiny_hf_model(tmp_path, "llama")
    before = (tmp_path / "model.safetensors").read_bytes()
    w = load_model(str(tmp_path), sparse=False).model.model.layers[0].self_attn.o_proj.weight
    with torch.no_grad():
        w.zero_()
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert not np.any(w.numpy())


def test_fused_part_of_the_wrong_shape_keeps_its_error(tmp_path):
    make_tiny_hf_model(tmp_path, "llama")
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.layers.1.self_attn.k_proj.weight"] = tensors["model.layers.1.self_attn.k_proj.weight"][:-2]
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match="k_proj.weight has shape"):
        load_model(str(tmp_path))
