"""GPTQ (AutoGPTQ / GPTQModel), AWQ (AutoAWQ GEMM) and compressed-tensors pack-quantized folders load into brisk.

Each folder is written here from brisk's own quantized checkpoint, following the format's published packing rules
with writers of this file (independent of brisk.quant.community), and must load to a model whose logits equal
those of brisk's checkpoint of the same codes bit for bit. Act-order with scattered groups is checked against a
float model holding the dequantized weights (the columns move, so the float32 sums run in another order).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_utils import make_tiny_hf_model
from safetensors.torch import load_file, save_file
from test_model import prefill_logits

from brisk import LLM, SamplingParams
from brisk.model.loader import build_model, load_model
from brisk.quant import primitives
from brisk.quant.checkpoint import save_quantized
from brisk.quant.community import InputOrderLinear
from brisk.quant.config import LayerQuant, QuantConfigError
from brisk.quant.rtn import plan_layers, rtn_quantize

IDS = torch.tensor([5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 8, 120])
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# --------------------------------------------------------------------------- writers (the formats' packing rules)
def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> int32 [R / (32 / bits), C]: word [r, c] field i = q[r * 32/bits + i, c] (AutoGPTQ qweight)."""
    per = 32 // bits
    out = torch.zeros(q.shape[0] // per, q.shape[1], dtype=torch.int64)
    for i in range(per):
        out |= q[i::per].to(torch.int64) << (bits * i)
    return _to_int32(out)


def pack_cols(q: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] codes -> int32 [R, C / (32 / bits)]: word [r, c] field i = q[r, c * 32/bits + order[i]]."""
    per = 32 // bits
    order = order or list(range(per))
    out = torch.zeros(q.shape[0], q.shape[1] // per, dtype=torch.int64)
    for i in range(per):
        out |= q[:, order[i]::per].to(torch.int64) << (bits * i)
    return _to_int32(out)


def brisk_folder(root: Path, spec: LayerQuant, seed: int = 4) -> Path:
    """A tiny float llama and brisk's RTN checkpoint of its decoder linears (embedding and head kept float)."""
    make_tiny_hf_model(root / "float", "llama", seed=seed)
    loaded = load_model(root / "float", fuse=False)
    plan = plan_layers(loaded.model, loaded.config.tie_word_embeddings, spec, head=None)
    tensors, qconfig = rtn_quantize(loaded, plan, spec, progress=False)
    return save_quantized(root / "brisk", loaded.config, loaded.tokenizer, qconfig, tensors)


def brisk_codes(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, ...]], dict, int]:
    """(other tensors, module -> (codes [N, K], scales [N, G] float16, zeros [N, G] int64), config.json, bits)."""
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    layers = {}
    for name, spec in config["quantization_config"]["modules"].items():
        scales = tensors.pop(f"{name}.scales")
        packed = tensors.pop(f"{name}.qweight")
        k = packed.shape[1] * 8 // spec["bits"]
        codes = primitives.unpack(packed, spec["bits"], k).to(torch.int64)
        zeros = tensors.pop(f"{name}.qzeros", None)
        zeros = torch.full(scales.shape, 2 ** (spec["bits"] - 1), dtype=torch.int64) if zeros is None \
            else zeros.to(torch.int64)
        layers[name] = (codes, scales, zeros)
    return tensors, layers, config, spec["bits"]


def write_folder(src: Path, out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> Path:
    shutil.copytree(src, out)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def gptq_folder(src: Path, out: Path, version: str = "gptq", relabel_groups: bool = False) -> Path:
    """AutoGPTQ (v1: zeros - 1) or GPTQModel (v2) layout of brisk's codes; relabel_groups: act-order's g_idx with
    the groups numbered in another order (every aligned run of G columns still one group)."""
    tensors, layers, config, bits = brisk_codes(src)
    group = config["quantization_config"]["group_size"]
    for name, (codes, scales, zeros) in layers.items():
        k, num_groups = codes.shape[1], scales.shape[1]
        g = k // num_groups
        label = torch.randperm(num_groups, generator=torch.Generator().manual_seed(num_groups + k)) \
            if relabel_groups else torch.arange(num_groups)
        g_idx = label[torch.arange(k) // g]  # column c's group
        stored_scales = torch.empty_like(scales.t())
        stored_scales[label] = scales.t()  # group label[j] holds block j's parameters
        z = zeros.t().clone()
        stored_zeros = torch.empty_like(z)
        stored_zeros[label] = z
        if version == "gptq":
            stored_zeros = (stored_zeros - 1) & ((1 << bits) - 1)
        tensors[f"{name}.qweight"] = pack_rows(codes.t(), bits)  # [K / 8, N]
        tensors[f"{name}.qzeros"] = pack_cols(stored_zeros, bits)  # [G, N / 8]
        tensors[f"{name}.scales"] = stored_scales.half()  # [G, N]
        tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": relabel_groups,
          "sym": config["quantization_config"]["sym"], "checkpoint_format": version, "static_groups": False}
    return write_folder(src, out, tensors, qc)


def awq_folder(src: Path, out: Path) -> Path:
    tensors, layers, config, bits = brisk_codes(src)
    for name, (codes, scales, zeros) in layers.items():
        tensors[f"{name}.qweight"] = pack_cols(codes.t(), 4, AWQ_ORDER)  # [K, N / 8]
        tensors[f"{name}.qzeros"] = pack_cols(zeros.t(), 4, AWQ_ORDER)  # [G, N / 8]
        tensors[f"{name}.scales"] = scales.t().half()  # [G, N]
    qc = {"quant_method": "awq", "bits": 4, "group_size": config["quantization_config"]["group_size"],
          "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
    return write_folder(src, out, tensors, qc)


def ct_folder(src: Path, out: Path, packed_zero_points: bool = True) -> Path:
    """compressed-tensors pack-quantized: signed codes offset by 2^(bits-1) packed along the row, zero points
    (asymmetric) packed along the output dim (older files: int8 signed)."""
    tensors, layers, config, bits = brisk_codes(src)
    qc_brisk = config["quantization_config"]
    offset = 1 << (bits - 1)
    for name, (codes, scales, zeros) in layers.items():
        signed = codes - offset  # what compressed-tensors quantizes to (int8), before its pack offset
        tensors[f"{name}.weight_packed"] = pack_cols(signed + offset, bits)  # [N, K / (32 / bits)]
        tensors[f"{name}.weight_scale"] = scales  # [N, G], float16 (llm-compressor writes the model's dtype)
        tensors[f"{name}.weight_shape"] = torch.tensor(list(codes.shape), dtype=torch.int32)
        if not qc_brisk["sym"]:
            zp = zeros - offset
            tensors[f"{name}.weight_zero_point"] = pack_rows(zp + offset, bits) if packed_zero_points \
                else zp.to(torch.int8)
    strategy = "channel" if qc_brisk["group_size"] == -1 else "group"
    weights = {"num_bits": bits, "type": "int", "symmetric": qc_brisk["sym"], "strategy": strategy,
               "group_size": None if strategy == "channel" else qc_brisk["group_size"], "dynamic": False,
               "actorder": None, "observer": "minmax"}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                        "output_activations": None, "format": "pack-quantized"}},
          "ignore": ["lm_head"]}
    return write_folder(src, out, tensors, qc)


# --------------------------------------------------------------------------------------------------- tests
def _logits(folder: Path) -> torch.Tensor:
    return prefill_logits(load_model(folder), IDS)


CASES = [
    ("gptq-v1-asym", LayerQuant(bits=4, group_size=32, sym=False), lambda s, o: gptq_folder(s, o, "gptq")),
    ("gptq-v1-sym", LayerQuant(bits=4, group_size=32, sym=True), lambda s, o: gptq_folder(s, o, "gptq")),
    ("gptq-v2-8bit-ch", LayerQuant(bits=8, group_size=-1, sym=False), lambda s, o: gptq_folder(s, o, "gptq_v2")),
    ("gptq-2bit", LayerQuant(bits=2, group_size=32, sym=False), lambda s, o: gptq_folder(s, o, "gptq_v2")),
    ("gptq-act-order-relabelled", LayerQuant(bits=4, group_size=32, sym=False),
     lambda s, o: gptq_folder(s, o, "gptq", relabel_groups=True)),
    ("awq-gemm", LayerQuant(bits=4, group_size=32, sym=False), awq_folder),
    ("ct-w4a16-sym", LayerQuant(bits=4, group_size=32, sym=True), ct_folder),
    ("ct-w4a16-asym", LayerQuant(bits=4, group_size=64, sym=False), ct_folder),
    ("ct-w4a16-asym-int8-zp", LayerQuant(bits=4, group_size=32, sym=False),
     lambda s, o: ct_folder(s, o, packed_zero_points=False)),
    ("ct-w8a16-channel", LayerQuant(bits=8, group_size=-1, sym=True), ct_folder),
]


@pytest.mark.parametrize("what,spec,write", CASES, ids=[c[0] for c in CASES])
def test_community_folder_loads_to_the_same_model_as_brisks_checkpoint(tmp_path, what, spec, write):
    src = brisk_folder(tmp_path, spec)
    folder = write(src, tmp_path / what)
    assert torch.equal(_logits(folder), _logits(src))
    net = load_model(folder).model
    assert not any(isinstance(m, InputOrderLinear) for m in net.modules())  # aligned groups: no column moved


def _scattered_act_order(src: Path, out: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A GPTQ act-order folder whose groups are scattered over the columns (g_idx[c] = perm[c] // G, as AutoGPTQ
    writes with desc_act and no static groups), and the dequantized float weights it stands for."""
    tensors, layers, config, bits = brisk_codes(src)
    weights = {}
    perms: dict[tuple[str, int], torch.Tensor] = {}
    for name, (codes, scales, zeros) in layers.items():
        k, num_groups = codes.shape[1], scales.shape[1]
        g = k // num_groups
        # modules that read one input (q/k/v, gate/up) share one column order, as in an act-order run
        key = (name.rsplit(".", 1)[0] + (".o" if "o_proj" in name else ".down" if "down" in name else ""), k)
        perm = perms.setdefault(key, torch.randperm(k, generator=torch.Generator().manual_seed(len(perms))))
        c_codes = codes[:, perm]  # column c holds the codes of brisk's column perm[c] ...
        g_idx = perm // g  # ... and so its group
        w = scales.float()[:, g_idx] * (c_codes - zeros[:, g_idx]).float()  # [N, K]: what the folder means
        weights[f"{name}.weight"] = w
        z = (zeros.t() - 1) & ((1 << bits) - 1)
        tensors[f"{name}.qweight"] = pack_rows(c_codes.t(), bits)
        tensors[f"{name}.qzeros"] = pack_cols(z, bits)
        tensors[f"{name}.scales"] = scales.t().half()
        tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": config["quantization_config"]["group_size"],
          "desc_act": True, "sym": False, "checkpoint_format": "gptq"}
    return write_folder(src, out, tensors, qc), weights


def test_gptq_act_order_with_scattered_groups_is_reordered_once_at_load(tmp_path):
    src = brisk_folder(tmp_path, LayerQuant(bits=4, group_size=32, sym=False))
    folder, weights = _scattered_act_order(src, tmp_path / "actorder")
    loaded = load_model(folder)
    wrapped = [m for m in loaded.model.modules() if isinstance(m, InputOrderLinear)]
    assert len(wrapped) == 2 * 4  # per layer: fused qkv, o, fused gate_up, down
    # the oracle: a float model holding the dequantized weights of the folder
    float_loaded = load_model(tmp_path / "float", fuse=False)
    state = {**float_loaded.model.state_dict(), **weights}
    ref = build_model(float_loaded.config, state, torch.float32)
    ref.init_rope(float_loaded.config.max_position_embeddings)
    ref_loaded = type(float_loaded)(ref, float_loaded.config, float_loaded.tokenizer, src, torch.float32, 0.0)
    got, want = prefill_logits(loaded, IDS), prefill_logits(ref_loaded, IDS)
    # same weights; only the order of the float32 sums differs (K <= 128 terms of size ~1): 1e-4 absolute
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # and the engine (decode path included) generates the oracle's greedy tokens
    ids = IDS.tolist()
    expected = []
    for _ in range(GREEDY.max_tokens):
        expected.append(int(prefill_logits(ref_loaded, torch.tensor(ids + expected))[-1].argmax()))
    out = LLM(folder, kv_cache_memory="8MiB").generate([ids], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected


@pytest.fixture(scope="module")
def gptq_good(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gptq")
    src = brisk_folder(root, LayerQuant(bits=4, group_size=32, sym=False))
    return gptq_folder(src, root / "gptq", "gptq", relabel_groups=True)


def _edit(good: Path, tmp_path: Path, config=None, tensors=None) -> Path:
    out = tmp_path / "bad"
    shutil.copytree(good, out)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg["quantization_config"])
        (out / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(str(out / "model.safetensors"))
        tensors(t)
        save_file(t, str(out / "model.safetensors"))
    return out


L0 = "model.layers.0.mlp.up_proj"
BAD = [
    ("missing scales", None, lambda t: t.pop(f"{L0}.scales"), f"lacks {L0}.scales, which the GPTQ layout needs"),
    ("missing qzeros", None, lambda t: t.pop(f"{L0}.qzeros"), f"lacks {L0}.qzeros"),
    ("missing module", None, lambda t: [t.pop(f"{L0}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")],
     f"missing 1 tensor.*{L0}.weight"),
    ("qweight uint8", None, lambda t: t.update({f"{L0}.qweight": t[f"{L0}.qweight"].to(torch.uint8)}),
     r"qweight is uint8 \[8, 128\], but the GPTQ 4-bit group 32 layout of this module needs int32 \[8, 128\]"),
    ("qweight transposed", None, lambda t: t.update({f"{L0}.qweight": t[f"{L0}.qweight"].t().contiguous()}),
     r"needs int32 \[8, 128\]"),
    ("group size disagrees", lambda c: c.update(group_size=64), None,
     r"down_proj.qzeros is int32 \[4, 8\], but the GPTQ 4-bit group 64 layout of this module needs int32 \[2, 8\]"),
    ("3-bit", lambda c: c.update(bits=3), None, "3-bit GPTQ is not supported; brisk reads GPTQ folders of 2, 4, 8"),
    ("marlin format", lambda c: c.update(checkpoint_format="marlin"), None, "checkpoint_format 'marlin'"),
    ("uneven act-order groups", None, lambda t: t[f"{L0}.g_idx"].__setitem__(slice(0, 3), 1 - t[f"{L0}.g_idx"][0]),
     "groups of .* columns; brisk's kernels need every group to have group_size = 32"),
    ("g_idx out of range", None, lambda t: t[f"{L0}.g_idx"].__setitem__(0, 9), r"g_idx must hold 64 group indices"),
    ("bitsandbytes", lambda c: c.update(quant_method="bitsandbytes"), None,
     "quant_method 'bitsandbytes', which brisk does not read; it reads 'brisk'.*'gptq'.*'awq'.*'compressed-tensors'"),
]


@pytest.mark.parametrize("what,config,tensors,message", BAD, ids=[b[0] for b in BAD])
def test_broken_gptq_folder_gives_a_clear_error(gptq_good, tmp_path, what, config, tensors, message):
    with pytest.raises(ValueError, match=message):
        load_model(_edit(gptq_good, tmp_path, config, tensors))


def _awq_config(c: dict) -> None:
    c.clear()
    c.update(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemv")


def _ct_config(fmt: str, activations: dict | None = None) -> callable:
    def edit(c: dict) -> None:
        c.clear()
        c.update(quant_method="compressed-tensors", format=fmt, config_groups={"group_0": {
            "targets": ["Linear"], "input_activations": activations,
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}})
    return edit


@pytest.mark.parametrize("config,message", [
    (_awq_config, "AWQ version 'gemv' with 4 bits is not supported; brisk reads AutoAWQ's GEMM layout"),
    (_ct_config("float-quantized"), "compressed-tensors format 'float-quantized' .* brisk reads 'pack-quantized'"),
    (_ct_config("pack-quantized", {"num_bits": 8, "type": "int"}), "quantizes activations; brisk reads weight-only"),
], ids=["awq-gemv", "ct-float", "ct-w8a8"])
def test_unsupported_community_layouts_are_refused_by_name(gptq_good, tmp_path, config, message):
    with pytest.raises(QuantConfigError, match=message):
        load_model(_edit(gptq_good, tmp_path, config))
