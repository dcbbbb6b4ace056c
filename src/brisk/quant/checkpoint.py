"""Quantized checkpoint folders: write them, check them, and build a model from them.

A folder is a Hugging Face model folder whose `config.json` carries a `quantization_config` (quant/config.py)
and whose `model.safetensors` holds, for every quantized module X (HF names, before brisk's load-time fusion):

    X.qweight  uint8    [N, K * bits / 8]  codes packed along the row (layout: quant/primitives.py)
    X.scales   float16  [N, K / G]         per-group scale (NF4: per-group absmax)
    X.qzeros   uint8    [N, K / G]         per-group zero point; absent when symmetric (zero = 2^(bits-1))
    X.bias     float                       when the layer has one
    X.input_order int64 [K]                when the groups are over permuted input columns (GPTQ act-order,
                                           quant/community.py): the codes' column j is input feature order[j]
    X.input_scale float32 [1]              static per-tensor activation scale (SmoothQuant W8A8, quant/w8a8.py)

A module of scheme "lut" (SqueezeLLM, quant/squeezellm.py) has no scales or zero points; instead

    X.qweight  uint8    [N, K * bits / 8]  codes (3 or 4 bits), packed as above
    X.lut      float16  [N, 2^bits]        the row's table: w = lut[n, q]
    X.outlier_row_ptr int32 [N + 1]        the outliers, a CSR matrix added to the table values (absent when
    X.outlier_cols    int32 [nnz]          none were kept): row n's are outlier_cols / outlier_values
    X.outlier_values  float16 [nnz]        [row_ptr[n] : row_ptr[n + 1]]

and every other tensor as in a float checkpoint. The tokenizer, chat template and generation config travel in
the same folder, so `brisk generate --model OUT` and `LLM(model=OUT)` need no other flags.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from brisk.model.config import ModelConfig
from brisk.model.llama import LlamaForCausalLM
from brisk.model.tokenizer import Tokenizer
from brisk.ops.layers import LutLinear, QuantLinear
from brisk.ops.lut import LutWeight, concat_rows, csr_from_dense, pack_nibbles
from brisk.ops.qlinear import PackedWeight, prepack, prepack_nf4
from brisk.quant import primitives
from brisk.quant.config import LayerQuant, QuantConfigError, QuantizationConfig
from brisk.quant.layers import QuantEmbedding

EMBEDDING = "model.embed_tokens"


def encode_layer(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, spec: LayerQuant
                 ) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one layer from its codes q [N, K] (uint8), scale [N, K/G] and zero [N, K/G]."""
    out = {"qweight": primitives.pack(q.to(torch.uint8), spec.bits).contiguous(),
           "scales": scale.to(torch.float16).contiguous()}
    if spec.scheme == "int" and not spec.sym:
        assert zero is not None
        out["qzeros"] = zero.round().to(torch.uint8).contiguous()
    return out


LUT_SUFFIXES = ("lut", "outlier_row_ptr", "outlier_cols", "outlier_values")
_OUTLIER_SUFFIXES = LUT_SUFFIXES[1:]


def encode_lut_layer(q: torch.Tensor, lut: torch.Tensor, sparse: torch.Tensor | None, spec: LayerQuant
                     ) -> dict[str, torch.Tensor]:
    """Checkpoint tensors of one scheme-"lut" layer: codes q [N, K] (uint8), its table lut [N, 2^bits] and the
    outliers as a dense [N, K] matrix, zero off them (None or all zero: no outliers)."""
    assert spec.scheme == "lut", f"encode_lut_layer writes scheme lut, not {spec.scheme}"
    out = {"qweight": primitives.pack(q.to(torch.uint8), spec.bits).contiguous(),
           "lut": lut.to(torch.float16).contiguous()}
    if sparse is not None and bool((sparse != 0).any()):
        row_ptr, cols, values = csr_from_dense(sparse)
        out.update(outlier_row_ptr=row_ptr, outlier_cols=cols, outlier_values=values.half())
    return out


def save_quantized(folder: str | Path, config: ModelConfig, tokenizer: Tokenizer, qconfig: QuantizationConfig,
                   tensors: dict[str, torch.Tensor], generation_config: Mapping[str, Any] | None = None) -> Path:
    """Write config.json (+ quantization_config), model.safetensors, the tokenizer files and generation_config.json
    (the source model's `generation_config` carried on) to `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config_dict = config.to_hf_dict()
    config_dict["quantization_config"] = qconfig.to_dict()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt", "quantization": "brisk"})
    tokenizer.save(folder, generation_config)
    # config.json last: a folder with a config.json is a finished checkpoint
    (folder / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    return folder


# ------------------------------------------------------------------------------------------------ loading
def module_shape(config: ModelConfig, name: str) -> tuple[int, int]:
    """(out_features, in_features) of an HF module name of the Llama family."""
    h, i = config.hidden_size, config.intermediate_size
    if ".mlp.experts." in name:  # a routed expert of a MoE layer (model/moe.py)
        i = config.moe_intermediate_size
    elif ".mlp.shared_expert." in name:
        i = config.shared_expert_intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    leaf = name.rsplit(".", 1)[-1]
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
              "up_proj": (i, h), "down_proj": (h, i), "lm_head": (config.vocab_size, h),
              "embed_tokens": (config.vocab_size, h)}
    if leaf not in shapes:
        raise QuantConfigError(f"quantization_config lists module {name!r}, which is not a linear layer or the "
                               "embedding of this model")
    return shapes[leaf]


def take_layer_tensors(tensors: dict[str, torch.Tensor], config: ModelConfig, name: str, spec: LayerQuant
                       ) -> dict[str, torch.Tensor]:
    """Pop and check one quantized module's tensors; the error names the tensor and what was expected."""
    n, k = module_shape(config, name)
    if spec.scheme == "lut":
        return _take_lut_tensors(tensors, name, spec, n, k)
    groups = spec.groups(k)
    if spec.scheme == "int" and k * spec.bits % 8:
        raise QuantConfigError(f"{name}: {k} {spec.bits}-bit codes do not fill whole bytes")
    expected = {"qweight": ((n, k * spec.bits // 8), torch.uint8), "scales": ((n, groups), None)}
    if spec.scheme == "int" and not spec.sym:
        expected["qzeros"] = ((n, groups), torch.uint8)
    out = _pop_expected(tensors, name, spec, k, expected)
    if spec.sym or spec.scheme == "nf4":
        stray = tensors.pop(f"{name}.qzeros", None)
        if stray is not None:
            raise QuantConfigError(f"{name}.qzeros is present but quantization_config says {name} is symmetric; "
                                   "the config does not match the tensors")
    bias = tensors.pop(f"{name}.bias", None)
    if bias is not None:
        out["bias"] = bias
    input_scale = tensors.pop(f"{name}.input_scale", None)
    if input_scale is not None:
        if input_scale.numel() != 1:
            raise QuantConfigError(f"{name}.input_scale must hold one value, got shape {list(input_scale.shape)}")
        out["input_scale"] = input_scale
    order = tensors.pop(f"{name}.input_order", None)
    if order is not None:
        if tuple(order.shape) != (k,) or not torch.equal(order.sort().values, torch.arange(k, dtype=order.dtype)):
            raise QuantConfigError(f"{name}.input_order must be a permutation of the {k} input features, got "
                                   f"{str(order.dtype).removeprefix('torch.')} {list(order.shape)}")
        out["input_order"] = order
    return out


def _pop_expected(tensors: dict[str, torch.Tensor], name: str, spec: LayerQuant, k: int,
                  expected: dict[str, tuple[tuple[int, ...], torch.dtype | None]]) -> dict[str, torch.Tensor]:
    """Pop `name`.suffix for each expected (shape, dtype) (None: any float dtype), each checked."""
    out = {}
    for suffix, (shape, dtype) in expected.items():
        key = f"{name}.{suffix}"
        if key not in tensors:
            raise QuantConfigError(f"checkpoint lacks {key}, which quantization_config ({spec.label}) implies; "
                                   "the checkpoint and its config.json do not belong together")
        t = tensors.pop(key)
        if tuple(t.shape) != shape or (t.dtype != dtype if dtype is not None else not t.is_floating_point()):
            raise QuantConfigError(
                f"{key} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, but quantization_config says "
                f"{name} is {spec.label} with in_features {k}, which needs "
                f"{str(dtype or 'float').removeprefix('torch.')} {list(shape)}; the config does not match the tensors")
        out[suffix] = t
    return out


def _take_lut_tensors(tensors: dict[str, torch.Tensor], name: str, spec: LayerQuant, n: int, k: int
                      ) -> dict[str, torch.Tensor]:
    """Pop and check one scheme-"lut" module's tensors (qweight, lut, the optional outlier CSR, bias)."""
    if k % 8:
        raise QuantConfigError(f"{name}: {spec.label} needs in_features divisible by 8, got {k}")
    expected = {"qweight": ((n, k * spec.bits // 8), torch.uint8), "lut": ((n, 1 << spec.bits), None)}
    out = _pop_expected(tensors, name, spec, k, expected)
    found = {s: tensors.pop(f"{name}.{s}") for s in _OUTLIER_SUFFIXES if f"{name}.{s}" in tensors}
    if found and len(found) != len(_OUTLIER_SUFFIXES):
        missing = [f"{name}.{s}" for s in _OUTLIER_SUFFIXES if s not in found]
        raise QuantConfigError(f"{name}: the outliers' CSR matrix lacks {', '.join(missing)}")
    if found:
        row_ptr, cols, values = found["outlier_row_ptr"], found["outlier_cols"], found["outlier_values"]
        nnz = values.numel()
        ok = (row_ptr.dtype == torch.int32 and tuple(row_ptr.shape) == (n + 1,) and cols.dtype == torch.int32
              and tuple(cols.shape) == (nnz,) and values.is_floating_point() and values.dim() == 1)
        ok = ok and int(row_ptr[0]) == 0 and int(row_ptr[-1]) == nnz and bool((row_ptr[1:] >= row_ptr[:-1]).all())
        ok = ok and (nnz == 0 or (int(cols.min()) >= 0 and int(cols.max()) < k))
        if not ok:
            raise QuantConfigError(f"{name}: outlier_row_ptr / outlier_cols / outlier_values are not a CSR matrix "
                                   f"of {n} rows and {k} columns (int32 [{n + 1}] from 0 to nnz, int32 [nnz] "
                                   "columns below in_features, float [nnz])")
        out.update(found)
    bias = tensors.pop(f"{name}.bias", None)
    if bias is not None:
        out["bias"] = bias
    return out


def lut_weight(parts: list[dict[str, torch.Tensor]], spec: LayerQuant, in_features: int) -> LutWeight:
    """The runtime LutWeight of one or more scheme-"lut" layers' checkpoint tensors, rows concatenated."""
    weights = []
    for p in parts:
        codes = p["qweight"] if spec.bits == 4 else pack_nibbles(primitives.unpack(p["qweight"], spec.bits,
                                                                                   in_features))
        sparse = {}
        if "outlier_values" in p:
            sparse = {"row_ptr": p["outlier_row_ptr"].contiguous(), "cols": p["outlier_cols"].contiguous(),
                      "values": p["outlier_values"].float().contiguous()}
        weights.append(LutWeight(bits=spec.bits, out_features=p["qweight"].shape[0], in_features=in_features,
                                 codes=codes.contiguous(), lut=p["lut"].float().contiguous(), **sparse))
    return concat_rows(weights)


def _packed(parts: list[dict[str, torch.Tensor]], spec: LayerQuant, in_features: int) -> PackedWeight:
    """One PackedWeight from one or more layers' checkpoint tensors, rows concatenated (load-time fusion)."""
    qweight = torch.cat([p["qweight"] for p in parts])  # [sum(N), K * bits / 8]
    scales = torch.cat([p["scales"] for p in parts])  # [sum(N), groups], float16 as stored (and as prepack keeps)
    group = in_features if spec.group_size == -1 else spec.group_size
    if spec.scheme == "nf4":
        return prepack_nf4(qweight, scales, group, in_features)
    zeros = torch.cat([p["qzeros"] for p in parts]) if "qzeros" in parts[0] else None
    return prepack(qweight, scales, zeros, spec.bits, group, in_features)


def quant_linear(parts: list[dict[str, torch.Tensor]], spec: LayerQuant, in_features: int,
                 dtype: torch.dtype, qconfig: QuantizationConfig | None = None, name: str = "") -> nn.Module:
    """One layer from its checkpoint tensors (`parts`: one dict per fused part, rows concatenated in order): a
    QuantLinear of `spec`'s format, a LutLinear, or a W8A8 checkpoint's int8 layer."""
    from brisk.quant.w8a8 import build_int8_linear, runs_int8_activations

    if runs_int8_activations(qconfig):  # a decoder linear of a W8A8 checkpoint (SmoothQuant, LLM.int8())
        assert qconfig is not None
        return build_int8_linear(parts, qconfig, in_features, name)
    bias = torch.cat([p["bias"] for p in parts]).to(dtype) if "bias" in parts[0] else None
    if spec.scheme == "lut":
        return LutLinear(lut_weight(parts, spec, in_features), bias, spec)
    linear = QuantLinear(_packed(parts, spec, in_features), bias, spec)
    if "input_order" not in parts[0]:
        return linear
    from brisk.quant.community import InputOrderLinear

    return InputOrderLinear(linear, parts[0]["input_order"])


def _same_order(parts: list[dict[str, torch.Tensor]]) -> bool:
    """Whether the parts read their inputs in one order (then their rows can share one fused layer)."""
    orders = [p.get("input_order") for p in parts]
    if all(o is None for o in orders):
        return True
    return all(o is not None and torch.equal(o, orders[0]) for o in orders)


def take_all_quantized(tensors: dict[str, torch.Tensor], config: ModelConfig, qconfig: QuantizationConfig
                       ) -> dict[str, dict[str, torch.Tensor]]:
    """Pop every quantized module's tensors from `tensors` (checked): module name -> its tensors."""
    return {name: take_layer_tensors(tensors, config, name, spec) for name, spec in qconfig.modules.items()}


def quantized_module_names(config: ModelConfig, qconfig: QuantizationConfig) -> list[str]:
    """Modules whose float weight the checkpoint does not hold (a tied head goes with its embedding)."""
    names = list(qconfig.modules)
    if config.tie_word_embeddings and EMBEDDING in qconfig.modules:
        names.append("lm_head")
    return names


def apply_quantized_modules(model: LlamaForCausalLM, config: ModelConfig, qconfig: QuantizationConfig,
                            layer_parts: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype,
                            fuse: bool = True) -> None:
    """Swap every module quantization_config lists for its quantized version (tensors from
    `take_all_quantized`), fusing q/k/v and gate/up when all parts share one setting."""
    layer_parts = dict(layer_parts)
    h = config.hidden_size
    for idx, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{idx}"
        groups = [(layer.self_attn, "qkv_proj", ["q_proj", "k_proj", "v_proj"], "self_attn")]
        groups += [(m, "gate_up_proj", ["gate_proj", "up_proj"], f"mlp.{n}".rstrip("."))  # the MLP, or each expert
                   for n, m in layer.mlp.named_modules() if hasattr(m, "gate_up_proj")]
        for parent, fused_name, names, sub in groups:
            full = [f"{prefix}.{sub}.{n}" for n in names]
            specs = {qconfig.modules.get(f) for f in full}
            if fuse and len(specs) == 1 and None not in specs and _same_order([layer_parts[f] for f in full]):
                spec = specs.pop()
                setattr(parent, fused_name, quant_linear([layer_parts.pop(f) for f in full], spec, h, dtype,
                                                          qconfig, f"{prefix}.{sub}.{fused_name}"))
                for n in names:
                    setattr(parent, n, None)
        subs = [("self_attn", layer.self_attn)] + [(f"mlp.{n}".rstrip("."), m) for n, m in layer.mlp.named_modules()]
        for sub, parent in subs:
            for child, module in list(parent.named_children()):
                full = f"{prefix}.{sub}.{child}"
                if full in layer_parts and isinstance(module, nn.Linear):
                    spec = qconfig.modules[full]
                    setattr(parent, child, quant_linear([layer_parts.pop(full)], spec, module.in_features, dtype,
                                                         qconfig, full))
    if EMBEDDING in layer_parts:
        spec = qconfig.modules[EMBEDDING]
        parts = layer_parts.pop(EMBEDDING)
        model.model.embed_tokens = QuantEmbedding(parts["qweight"], parts["scales"], parts.get("qzeros"), spec, h,
                                                  dtype)
        if config.tie_word_embeddings:  # the head computes from the same codes, in the kernel's layout
            model.lm_head = quant_linear([parts], spec, h, dtype)
    if "lm_head" in layer_parts:
        if config.tie_word_embeddings:
            raise QuantConfigError("quantization_config lists lm_head separately, but the model ties it to the "
                                   "embedding; list model.embed_tokens only")
        model.lm_head = quant_linear([layer_parts.pop("lm_head")], qconfig.modules["lm_head"], h, dtype)
    from brisk.quant.w8a8 import runs_int8_activations

    if runs_int8_activations(qconfig) and isinstance(model.lm_head, QuantLinear):
        # a W8A8 checkpoint runs int8 activations: under quant_activations "auto" its 8-bit head does too (per 32
        # columns, finer than the decoder's per-token scales), the head being a fifth of a batch-64 step here
        model.lm_head.auto_activations = "int8"
    if layer_parts:
        raise QuantConfigError(f"quantization_config lists modules the model does not have: "
                               f"{', '.join(sorted(layer_parts)[:5])}")
