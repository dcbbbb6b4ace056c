"""A pytest plugin that records calls of brisk's kernel ops (torch.ops.brisk.*) made by the x86 kernel tests: the
arguments, what the op returned and what it wrote into its (a!) arguments. tests/arm64/harness.cpp replays them
against another build (the aarch64 one, under qemu-user) and compares.

    BRISK_ARM64_CASES=cases.pt python -m pytest -p record_cases tests/test_qlinear.py ...   (tests/arm64 on sys.path)

At most MAX_PER_OP calls of each op are kept (MAX_PER_OP_OF for some), one per distinct signature (shapes, dtypes,
non-tensor arguments), and only calls whose tensors fit MAX_BYTES: replaying runs under emulation, ~50x slower than
native.
"""

from __future__ import annotations

import os
from typing import Any

import torch

MAX_PER_OP = 24
# ops whose tests sweep formats (bits x zero points x group sizes x rows x dtypes, 144 small calls of 40 x 192 codes):
# the first 24 signatures would be 8-bit codes only
MAX_PER_OP_OF = {"quant_linear_small": 192, "quant_dequantize": 64}
MAX_BYTES = 4 << 20
# ops whose result does not depend on the order of float additions: every build must give the recorded bits
EXACT = frozenset({"rope_cache", "rope_qk", "embedding_q8", "kv_write_int8", "kv_write_int4", "gguf_repack",
                   "gguf_params_fit_half", "packed_retile", "sparse_densify", "half_to_bfloat16", "argmax_rows",
                   "silu_mul", "gelu_tanh_mul", "w8a8_quantize_rows", "fake_quantize_q8", "w8a8_int_mm",
                   "w8a8_shift_terms", "quant_dequantize", "quant_dequantize_t", "lut_dequantize"})
# ops that change process-wide settings, or take objects that cannot be saved
SKIP = frozenset({"w8a8_amx", "linear_small_bf16_gemm_rows", "decode_layers"})

_cases: list[tuple[Any, ...]] = []
_seen: dict[str, set[str]] = {}


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def _signature(args: list[Any]) -> str:
    def one(v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return f"{v.dtype}{tuple(v.shape)}{'c' if v.is_contiguous() else 'n'}"
        if isinstance(v, (list, tuple)):
            return "[" + ",".join(one(x) for x in v) + "]"
        return repr(v)
    return "|".join(one(a) for a in args)


def _tolerance(name: str, out: list[torch.Tensor]) -> tuple[float, float]:
    """(rtol, atol): 0, 0 (bit for bit) for EXACT ops; otherwise what a different order of float additions may
    change: a few float32 ulps of the largest output, or one bfloat16 / float16 rounding step."""
    if name in EXACT:
        return 0.0, 0.0
    floats = [t for t in out if t.is_floating_point() and t.numel()]
    if not floats:
        return 0.0, 0.0
    scale = max(float(t.float().abs().nan_to_num(0, 0, 0).max()) for t in floats)
    if any(t.dtype in (torch.bfloat16, torch.float16) for t in floats):
        return 1e-2, 1e-2 * scale + 1e-6
    return 1e-4, 1e-4 * scale + 1e-6


class _Recorder:
    """Stands in for torch.ops.brisk.<name> (and its .default): records, then calls the real op."""

    def __init__(self, name: str, op: Any, overload: Any) -> None:
        self._name, self._op, self._overload = name, op, overload

    def __getattr__(self, attr: str) -> Any:
        if attr == "default":
            return _Recorder(self._name, self._overload, self._overload)
        return getattr(self._op, attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        schema = self._overload._schema
        full = list(args) + [kwargs[a.name] if a.name in kwargs else a.default_value
                             for a in schema.arguments[len(args):]]
        seen = _seen.setdefault(self._name, set())
        record = (self._name not in SKIP and len(seen) < MAX_PER_OP_OF.get(self._name, MAX_PER_OP)
                  and sum(t.numel() * t.element_size() for t in _tensors(full)) <= MAX_BYTES
                  and all(t.device.type == "cpu" and not t.requires_grad for t in _tensors(full)))
        signature = _signature(full) if record else ""
        record = record and signature not in seen
        before = _copy(full) if record else None
        result = self._op(*args, **kwargs)
        if record:
            seen.add(signature)
            after = [_copy(v) if a.alias_info is not None and a.alias_info.is_write else None
                     for a, v in zip(schema.arguments, full, strict=True)]
            out = _copy(list(result) if isinstance(result, tuple) else [] if result is None else [result])
            rtol, atol = _tolerance(self._name, _tensors(out) + _tensors(after))
            label = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
            _cases.append((self._name, before, after, out, rtol, atol, label))
        return result


def pytest_sessionstart(session: Any) -> None:
    from brisk.ops import kernels

    if kernels.get_ops() is None:
        raise RuntimeError("record_cases: the kernels did not build here")
    names = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("brisk::"))
    for name in names:
        packet = getattr(torch.ops.brisk, name)
        setattr(torch.ops.brisk, name, _Recorder(name, packet, packet.default))


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get("BRISK_ARM64_CASES", "cases.pt")
    torch.save(_cases, path)
    counts: dict[str, int] = {}
    for c in _cases:
        counts[c[0]] = counts.get(c[0], 0) + 1
    print(f"\nrecord_cases: {len(_cases)} calls of {len(counts)} ops -> {path}: "
          + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
