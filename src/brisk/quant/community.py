"""Community quantized Hugging Face folders, mapped onto brisk's checkpoint form once, at load.

Three layouts are read; each becomes, per quantized module X, the tensors of quant/checkpoint.py (X.qweight
brisk-packed uint8 [N, K * bits / 8], X.scales float16 [N, K / G], X.qzeros uint8 [N, K / G] when asymmetric,
and X.input_order when the groups are over permuted columns) plus a `QuantizationConfig`, so the rest of the
load path (fusion, kernels, tiling) is brisk's own. The codes, scales and zero points are kept as they are:
w = scale * (q - zero) is the same number before and after.

GPTQ (AutoGPTQ / GPTQModel, `quant_method: gptq`), int32 words of 32 / bits codes, lowest field first::

    X.qweight  int32   [K * bits / 32, N]   packed along the input dim:  word [r, n] field i = q[r * 32/bits + i, n]
    X.qzeros   int32   [G, N * bits / 32]   packed along the output dim: word [g, c] field i = z[g, c * 32/bits + i]
    X.scales   float16 [G, N]
    X.g_idx    int32   [K]                  group of every input column (act-order: not k // G)

  `checkpoint_format: gptq` (v1, AutoGPTQ's) stores zero - 1 in each field (a stored 2^bits - 1 is the wrapped
  zero 0); `gptq_v2` (GPTQModel) stores the zero itself. Bits 2, 4 and 8 (3-bit words straddle int32s).

AWQ (AutoAWQ GEMM, `quant_method: awq`, `version: gemm`), 4 bits, packed along the output dim in the
interleaved order [0, 2, 4, 6, 1, 3, 5, 7] (AWQ_ORDER: field i of word [k, c] = q[k, 8 c + AWQ_ORDER[i]])::

    X.qweight int32 [K, N / 8],  X.qzeros int32 [G, N / 8] (same packing, zero as is),  X.scales float16 [G, N]

compressed-tensors `pack-quantized` (llm-compressor W4A16 / W8A16, `quant_method: compressed-tensors`): signed
codes q in [-2^(bits-1), 2^(bits-1) - 1] stored offset by 2^(bits-1), so the stored field is brisk's code::

    X.weight_packed      int32 [N, K * bits / 32]  packed along the input dim (field i of word c = column c*32/bits + i)
    X.weight_scale       float [N, K / G]          (channel: [N, 1]; tensor: [1])
    X.weight_zero_point  int32 [N * bits / 32, K / G] packed along the output dim (older files: int8 [N, K / G]);
                         absent when symmetric
    X.weight_g_idx       int32 [K]                 with actorder "group"
    X.weight_shape       int   [2]                 [N, K]

Act-order (g_idx) is resolved once here: when every aligned run of G columns shares one group, the group
parameters are re-indexed and nothing else changes; otherwise the columns are sorted by group (stable) so that
groups are contiguous, and X.input_order [K] records the order: y = W[:, order] x[order] (`InputOrderLinear`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from brisk.model.config import ModelConfig
from brisk.quant import primitives
from brisk.quant.config import LayerQuant, QuantConfigError, QuantizationConfig

METHODS = ("gptq", "awq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GPTQ_BITS = (2, 4, 8)
CT_BITS = (2, 4, 8)


@dataclass(frozen=True)
class WeightArgs:
    """One config group's weight quantization (compressed-tensors) or the whole folder's (GPTQ, AWQ)."""

    bits: int
    group_size: int  # -1: per output channel
    targets: tuple[str, ...] = ("Linear",)


@dataclass(frozen=True)
class CommunityQuant:
    method: str  # one of METHODS
    groups: tuple[WeightArgs, ...]
    zeros_minus_one: bool = False  # GPTQ v1: each zero field holds zero - 1
    ignore: tuple[str, ...] = ()


def read_community_config(config_dict: dict[str, Any], source: str) -> CommunityQuant | None:
    """The community layout a folder's config.json declares, or None (float, or brisk's own format)."""
    qc = config_dict.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") not in METHODS:
        return None
    method = qc["quant_method"]
    if method == "gptq":
        return _gptq_config(qc, source)
    if method == "awq":
        return _awq_config(qc, source)
    return _ct_config(qc, source)


def _int(qc: dict[str, Any], *keys: str, source: str, default: int | None = None) -> int:
    for key in keys:
        if isinstance(qc.get(key), int) and not isinstance(qc.get(key), bool):
            return qc[key]
    if default is not None:
        return default
    raise QuantConfigError(f"{source}: quantization_config lacks an integer {' / '.join(keys)}")


def _group(g: int, source: str) -> int:
    if g != -1 and g < 1:
        raise QuantConfigError(f"{source}: group_size must be positive or -1 (per channel), got {g}")
    return g


def _gptq_config(qc: dict[str, Any], source: str) -> CommunityQuant:
    bits = _int(qc, "bits", source=source)
    if bits not in GPTQ_BITS:
        raise QuantConfigError(f"{source}: {bits}-bit GPTQ is not supported; brisk reads GPTQ folders of "
                               f"{', '.join(map(str, GPTQ_BITS))} bits (3-bit codes straddle int32 words)")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantConfigError(f"{source}: GPTQ checkpoint_format {fmt!r} is not supported; brisk reads 'gptq' "
                               "(AutoGPTQ, zeros stored minus one) and 'gptq_v2' (GPTQModel)")
    return CommunityQuant("gptq", (WeightArgs(bits, _group(_int(qc, "group_size", source=source), source)),),
                          zeros_minus_one=fmt == "gptq")


def _awq_config(qc: dict[str, Any], source: str) -> CommunityQuant:
    bits = _int(qc, "bits", "w_bit", source=source)
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm" or bits != 4:
        raise QuantConfigError(f"{source}: AWQ version {version!r} with {bits} bits is not supported; brisk reads "
                               "AutoAWQ's GEMM layout at 4 bits (version 'gemm')")
    if qc.get("zero_point", True) is not True:
        raise QuantConfigError(f"{source}: AWQ without zero points is not supported; brisk reads AutoAWQ GEMM "
                               "folders with zero_point true")
    group = _group(_int(qc, "group_size", "q_group_size", source=source), source)
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    return CommunityQuant("awq", (WeightArgs(4, group),), ignore=ignore)


def _ct_config(qc: dict[str, Any], source: str) -> CommunityQuant:
    top_format = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantConfigError(f"{source}: compressed-tensors quantization_config has no config_groups")
    out = []
    for name, group in groups.items():
        fmt = group.get("format") or top_format
        if fmt != "pack-quantized":
            raise QuantConfigError(f"{source}: compressed-tensors format {fmt!r} (config group {name}) is not "
                                   "supported; brisk reads 'pack-quantized' (W4A16 / W8A16)")
        if group.get("input_activations") or group.get("output_activations"):
            raise QuantConfigError(f"{source}: config group {name} quantizes activations; brisk reads "
                                   "weight-only compressed-tensors checkpoints (W4A16 / W8A16)")
        w = group.get("weights") or {}
        bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
        if kind != "int" or bits not in CT_BITS or w.get("dynamic"):
            raise QuantConfigError(f"{source}: config group {name} has weights {kind} {bits}-bit"
                                   f"{' dynamic' if w.get('dynamic') else ''}; brisk reads static int weights of "
                                   f"{', '.join(map(str, CT_BITS))} bits")
        if strategy not in ("group", "channel", "tensor"):
            raise QuantConfigError(f"{source}: weight strategy {strategy!r} (config group {name}) is not "
                                   "supported; brisk reads group, channel and tensor strategies")
        gsize = w.get("group_size") if strategy == "group" else -1
        if not isinstance(gsize, int):
            raise QuantConfigError(f"{source}: config group {name} uses strategy group without a group_size")
        targets = tuple(group.get("targets") or ("Linear",))
        out.append(WeightArgs(bits, _group(gsize, source), targets))
    return CommunityQuant("compressed-tensors", tuple(out), ignore=tuple(qc.get("ignore") or ()))


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == "Linear" or name == pattern or name.endswith("." + pattern)


def _args_for(cq: CommunityQuant, name: str) -> WeightArgs:
    for args in cq.groups:
        if any(_matches(name, t) for t in args.targets):
            return args
    raise QuantConfigError(f"{name} holds packed weights but no config group of quantization_config targets it "
                           f"(targets: {', '.join(t for a in cq.groups for t in a.targets)})")


# ------------------------------------------------------------------------------------------------ unpacking
def _fields(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., W] -> their 32 / bits fields, lowest first: [..., W, 32 / bits] uint8."""
    u = words.to(torch.int64) & 0xFFFFFFFF  # the word's bits as an unsigned value
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    return ((u[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes packed 32 / bits to an int32 along `dim` (0 or 1) of a 2-D tensor, consecutive, lowest field first."""
    if dim == 1:
        return _fields(words, bits).flatten(1)  # [R, W, F] -> [R, W * F]
    return _fields(words.t(), bits).flatten(1).t()  # [W, C] -> [C, W * F] -> [W * F, C]


def _take(tensors: dict[str, torch.Tensor], key: str, what: str) -> torch.Tensor:
    if key not in tensors:
        raise QuantConfigError(f"checkpoint lacks {key}, which the {what} layout needs next to "
                               f"{key.rsplit('.', 1)[0]}'s packed weight; the folder is incomplete")
    return tensors.pop(key)


def _check(t: torch.Tensor, key: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...] | None, layout: str
           ) -> None:
    if tuple(t.shape) != shape or (dtypes is not None and t.dtype not in dtypes):
        want = "/".join(str(d).removeprefix("torch.") for d in dtypes) if dtypes else "float"
        raise QuantConfigError(f"{key} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, but the {layout} "
                               f"layout of this module needs {want} {list(shape)}")


def _gptq_layer(tensors: dict[str, torch.Tensor], name: str, n: int, k: int, args: WeightArgs, cq: CommunityQuant
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    bits, per = args.bits, 32 // args.bits
    g = k if args.group_size == -1 else args.group_size
    layout = f"GPTQ {bits}-bit group {args.group_size}"
    if k % per or n % per or k % g:
        raise QuantConfigError(f"{name}: {layout} needs in_features ({k}) and out_features ({n}) that are multiples "
                               f"of {per} and a group size that divides {k}")
    qweight, qzeros = _take(tensors, f"{name}.qweight", "GPTQ"), _take(tensors, f"{name}.qzeros", "GPTQ")
    scales = _take(tensors, f"{name}.scales", "GPTQ")
    _check(qweight, f"{name}.qweight", (k // per, n), (torch.int32,), layout)
    _check(qzeros, f"{name}.qzeros", (k // g, n // per), (torch.int32,), layout)
    _check(scales, f"{name}.scales", (k // g, n), None, layout)
    codes = unpack_int32(qweight, bits, 0).t()  # [K, N] -> [N, K]
    zeros = unpack_int32(qzeros, bits, 1).t().to(torch.int64)  # [G, N] -> [N, G]
    if cq.zeros_minus_one:
        zeros = (zeros + 1) & ((1 << bits) - 1)
    g_idx = tensors.pop(f"{name}.g_idx", None)
    return codes, scales.t(), zeros, g_idx


def _awq_layer(tensors: dict[str, torch.Tensor], name: str, n: int, k: int, args: WeightArgs
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    g = k if args.group_size == -1 else args.group_size
    layout = f"AWQ GEMM 4-bit group {args.group_size}"
    if n % 8 or k % g:
        raise QuantConfigError(f"{name}: {layout} needs out_features ({n}) a multiple of 8 and a group size that "
                               f"divides in_features ({k})")
    qweight, qzeros = _take(tensors, f"{name}.qweight", "AWQ"), _take(tensors, f"{name}.qzeros", "AWQ")
    scales = _take(tensors, f"{name}.scales", "AWQ")
    _check(qweight, f"{name}.qweight", (k, n // 8), (torch.int32,), layout)
    _check(qzeros, f"{name}.qzeros", (k // g, n // 8), (torch.int32,), layout)
    _check(scales, f"{name}.scales", (k // g, n), None, layout)
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))  # output column 8 c + j sits in field inverse[j]

    def unpack(words: torch.Tensor) -> torch.Tensor:  # [R, N / 8] int32 -> [R, N] codes in column order
        return _fields(words, 4)[..., inverse].flatten(1)

    return unpack(qweight).t(), scales.t(), unpack(qzeros).t().to(torch.int64), None


def _ct_layer(tensors: dict[str, torch.Tensor], name: str, n: int, k: int, args: WeightArgs
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    bits, per = args.bits, 32 // args.bits
    g = k if args.group_size == -1 else args.group_size
    layout = f"compressed-tensors pack-quantized {bits}-bit group {args.group_size}"
    if k % per or k % g:
        raise QuantConfigError(f"{name}: {layout} needs in_features ({k}) a multiple of {per} and a group size "
                               f"that divides it")
    packed, scale = _take(tensors, f"{name}.weight_packed", layout), _take(tensors, f"{name}.weight_scale", layout)
    shape = tensors.pop(f"{name}.weight_shape", None)
    if shape is not None and [int(v) for v in shape.flatten()] != [n, k]:
        raise QuantConfigError(f"{name}.weight_shape says {[int(v) for v in shape.flatten()]}, but the model's "
                               f"{name} is [{n}, {k}]")
    _check(packed, f"{name}.weight_packed", (n, k // per), (torch.int32,), layout)
    if scale.numel() == 1:  # strategy tensor: one scale for the whole weight
        scale = scale.reshape(1, 1).expand(n, 1)
    _check(scale, f"{name}.weight_scale", (n, k // g), None, layout)
    codes = unpack_int32(packed, bits, 1)  # [N, K], offset codes: brisk's
    offset = 1 << (bits - 1)
    zp = tensors.pop(f"{name}.weight_zero_point", None)
    if zp is None:
        zeros = torch.full((n, k // g), offset, dtype=torch.int64)
    elif zp.dtype == torch.int32 and tuple(zp.shape) == (-(-n // per), k // g):  # packed along the output dim
        zeros = unpack_int32(zp, bits, 0)[:n].to(torch.int64)  # stored offset: brisk's zero
    elif zp.dtype == torch.int8 and zp.numel() == n * (k // g):  # older files: signed zero points as they are
        zeros = zp.reshape(n, k // g).to(torch.int64) + offset
    else:
        raise QuantConfigError(f"{name}.weight_zero_point is {str(zp.dtype).removeprefix('torch.')} "
                               f"{list(zp.shape)}; the {layout} layout stores int32 [{-(-n // per)}, {k // g}] "
                               f"(packed) or int8 [{n}, {k // g}]")
    return codes, scale, zeros, tensors.pop(f"{name}.weight_g_idx", None)


# ------------------------------------------------------------------------------------------------ to brisk
def resolve_groups(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor | None,
                   group: int, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes [N, K] whose column k belongs to group g_idx[k] -> contiguous groups of `group` columns.

    Returns (codes, scales, zeros, input_order): scales/zeros [N, K / G] re-indexed per aligned block; input_order
    None when no column moved, else the column order [K] of the returned codes (sorted by group, stable).
    """
    n, k = codes.shape
    num_groups = scales.shape[1]
    if g_idx is None:
        return codes, scales, zeros, None
    g_idx = g_idx.flatten().to(torch.int64)
    if g_idx.numel() != k or bool(((g_idx < 0) | (g_idx >= num_groups)).any()):
        raise QuantConfigError(f"{name}.g_idx must hold {k} group indices in [0, {num_groups}), got "
                               f"{g_idx.numel()} values in [{int(g_idx.min())}, {int(g_idx.max())}]")
    order = None
    blocks = g_idx.view(k // group, group)  # [K / G, G]: the group of every column of every aligned block
    if not bool((blocks == blocks[:, :1]).all()):  # act-order with scattered groups: sort the columns by group
        counts = torch.bincount(g_idx, minlength=num_groups)
        if bool((counts != group).any()):
            raise QuantConfigError(f"{name}.g_idx gives groups of {int(counts.min())}..{int(counts.max())} columns; "
                                   f"brisk's kernels need every group to have group_size = {group} columns")
        order = torch.argsort(g_idx, stable=True)
        codes = codes[:, order]
        blocks = g_idx[order].view(k // group, group)
    per_block = blocks[:, 0]  # [K / G]: the group whose parameters each aligned block uses
    return codes, scales[:, per_block], zeros[:, per_block], order


def _to_brisk(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int, name: str
              ) -> tuple[dict[str, torch.Tensor], LayerQuant]:
    top = (1 << bits) - 1
    if bool(((zeros < 0) | (zeros > top)).any()):
        raise QuantConfigError(f"{name}: zero points outside [0, {top}] cannot be {bits}-bit codes")
    half = scales.to(torch.float16)
    if not bool(torch.isfinite(half).all()):
        raise QuantConfigError(f"{name}: scales outside float16's range; brisk's kernels hold float16 scales")
    sym = bool((zeros == 1 << (bits - 1)).all())
    spec = LayerQuant(bits=bits, group_size=-1 if group == codes.shape[1] else group, sym=sym)
    out = {"qweight": primitives.pack(codes.to(torch.uint8).contiguous(), bits), "scales": half.contiguous()}
    if not sym:
        out["qzeros"] = zeros.to(torch.uint8).contiguous()
    return out, spec


def convert_community_checkpoint(tensors: dict[str, torch.Tensor], config: ModelConfig, cq: CommunityQuant
                                 ) -> QuantizationConfig:
    """Replace every packed module's community tensors in `tensors` by brisk's (in place); their config."""
    from brisk.quant.checkpoint import module_shape

    suffix = ".weight_packed" if cq.method == "compressed-tensors" else ".qweight"
    names = sorted(key[: -len(suffix)] for key in tensors if key.endswith(suffix))
    if not names:
        raise QuantConfigError(f"quantization_config says {cq.method}, but no tensor ends in {suffix}; the "
                               "weights do not belong to this config")
    modules: dict[str, LayerQuant] = {}
    for name in names:
        n, k = module_shape(config, name)
        args = cq.groups[0] if cq.method != "compressed-tensors" else _args_for(cq, name)
        if cq.method == "gptq":
            codes, scales, zeros, g_idx = _gptq_layer(tensors, name, n, k, args, cq)
        elif cq.method == "awq":
            codes, scales, zeros, g_idx = _awq_layer(tensors, name, n, k, args)
        else:
            codes, scales, zeros, g_idx = _ct_layer(tensors, name, n, k, args)
        group = k if args.group_size == -1 else args.group_size
        codes, scales, zeros, order = resolve_groups(codes, scales, zeros, g_idx, group, name)
        out, modules[name] = _to_brisk(codes, scales, zeros, args.bits, group, name)
        if order is not None:
            out["input_order"] = order
        tensors.update({f"{name}.{s}": t for s, t in out.items()})
    default = next(iter(modules.values()))
    return QuantizationConfig(method=cq.method.replace("compressed-tensors", "compressed_tensors"),
                              default=default, modules=modules)


class InputOrderLinear(nn.Module):
    """A linear whose weight columns were sorted by group at load (act-order): y = linear(x[..., order]).

    The inner module keeps every kernel; the gather is one index_select over the K input features per call.
    """

    def __init__(self, linear: nn.Module, order: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("order", order.to(torch.int64).contiguous())  # [K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.index_select(-1, self.order))  # x: [..., K] -> [..., K] in the codes' column order
