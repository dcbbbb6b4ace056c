"""A GGUF file's quantized matrices repacked straight into their final form and place: one pass per matrix.

The multi-pass way (gguf.py `_repack_tensors`, then model/loader.py) moves every byte of the file about five times:
read(2) into a buffer, repack into the blocked layout, concatenate q/k/v and gate/up, retile in place for the
tiled kernels, copy into the huge-page arena. Here the final layout of every packed weight is planned from the
file's header first, as those later steps would make it:

- fused: q/k/v (gate/up) of one layer become one weight when `fuse` is on, all parts are packed in one format and
  the biases are all there or all absent (gguf_native.py `apply_packed_modules`, `can_concat`); its parts are
  row ranges of it:  | q_proj rows | k_proj rows | v_proj rows |  ->  model.layers.i.self_attn.qkv_proj;
- tiled: 8- and 4-bit codes of whole 16-row tiles where the tiled kernels are built (ops/qlinear.py `can_tile`),
  for every weight a QuantLinear runs on (all but an untied embedding table, which stays blocked);
- parameters: float16 for the legacy types, and for a K-quant tensor float16 exactly when every value fits
  (`gguf_params_fit_half`, the test of gguf_repack.py `_param_dtype`), float32 otherwise;
- placed: every buffer in one huge-page arena (model/hugepages.py `huge_empty`) allocated up front, which
  `to_huge_pages` then leaves where it is; ordinary buffers where huge pages are not available.

Then the C++ kernel (ops/csrc/repack.cpp `gguf_repack`) decodes each tensor from the file's memory map straight
into its rows of the final buffers: the same bytes, scales and minimums as the multi-pass way, bit for bit
(tests/test_gguf_place.py). The source pages are unmapped again a chunk at a time (mapped.py `drop_pages`), so that
the file's pages do not add to the resident set. The chunks are shared by one thread per intra-op thread, each
taking the next in file order (`_repack_chunks`). Stacked MoE experts, and every matrix where the C++ kernels are
not built, take the multi-pass way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from brisk.model import mapped
from brisk.model.config import ModelConfig
from brisk.model.gguf_native import EMBEDDING, FUSED_PARTS
from brisk.model.gguf_repack import REPACKED, T
from brisk.ops.kernels import get_op
from brisk.ops.qlinear import BLOCK, TILE_ROWS, PackedWeight

if TYPE_CHECKING:
    from brisk.model.gguf import GGUFFile

_LEGACY = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)  # parameters: stored float16 values
_CHUNK_BYTES = 32 << 20  # source bytes decoded (and their pages dropped) at a time


@dataclass
class _Part:
    gguf_name: str
    module: str  # transformers module name (no ".weight")
    row0: int  # first row in its weight
    rows: int
    perm: torch.Tensor | None  # llama.cpp's Q/K row order, undone as it is repacked


@dataclass
class _Target:
    """One final packed weight: its parts, format and layout."""

    name: str
    qtype: GGMLQuantizationType
    in_features: int
    parts: list[_Part]
    scale_dtype: torch.dtype
    min_dtype: torch.dtype | None
    tiled: bool = False

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    def buffers(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of data, scales and (forms with a minimum) mins."""
        bits, group, _ = REPACKED[self.qtype]
        n, k = self.rows, self.in_features
        out = [((n, k // BLOCK * 4 * bits), torch.uint8), ((n, k // group), self.scale_dtype)]
        return out + ([((n, k // group), self.min_dtype)] if self.min_dtype is not None else [])


def placeable(names: set[str], expected: dict[str, tuple[str, tuple[int, ...]]]) -> set[str]:
    """The GGUF tensors among `names` that `place_packed` takes: all but stacked experts, where the kernel is
    built (the rest take gguf.py `_repack_tensors`)."""
    if get_op("gguf_repack") is None or get_op("gguf_params_fit_half") is None:
        return set()
    return {n for n in names if "*" not in expected[n][0]}


def place_packed(f: GGUFFile, config: ModelConfig, expected: dict[str, tuple[str, tuple[int, ...]]], names: set[str],
                 fuse: bool, huge_pages: bool, row_perm: Callable[[str, int], torch.Tensor | None],
                 progress: Callable[[int], None] | None = None
                 ) -> tuple[dict[str, PackedWeight], dict[str, str], list[torch.Tensor]]:
    """Repack the GGUF tensors `names` (of the open GGUFFile `f`) into their final packed weights (see the module
    docstring). Returns (weight name -> PackedWeight: fused ones under their fused module's name, each part's GGUF
    type by module name, the arena buffers that hold them). `row_perm(gguf_name, rows)`: the tensor's row order."""
    base = mapped.map_file(f.path)
    targets = _plan(f, config, expected, names, fuse, base, row_perm)
    specs = [spec for t in targets for spec in t.buffers()]
    from brisk.model.hugepages import huge_empty

    arena = huge_empty(specs) if huge_pages else None
    buffers = iter(arena[0] if arena is not None else [torch.empty(shape, dtype=dtype) for shape, dtype in specs])
    packed, types, jobs = {}, {}, []
    for t in targets:
        data, scales = next(buffers), next(buffers)
        mins = next(buffers) if t.min_dtype is not None else None
        bits, group, _ = REPACKED[t.qtype]
        packed[t.name] = PackedWeight(bits=bits, group_size=group, out_features=t.rows, in_features=t.in_features,
                                      data=data, scales=scales, zeros=mins, codebook=None, blocked=True,
                                      tiled=t.tiled)
        for p in t.parts:
            types[p.module] = f.tensors[p.gguf_name].qtype.name
            jobs.append((f.tensors[p.gguf_name].offset, p, t, packed[t.name]))
    chunks = []
    for _, p, t, pw in sorted(jobs, key=lambda job: job[0]):  # in file order: the map is read front to back
        info = f.tensors[p.gguf_name]
        # a chunk of whole tiles at a time; a permuted tensor (Q/K, a few MB) in one go
        step = p.rows if p.perm is not None else max(TILE_ROWS, _CHUNK_BYTES // (info.n_bytes // p.rows)
                                                     // TILE_ROWS * TILE_ROWS)
        chunks += [(info, p, t, pw, r0, min(p.rows, r0 + step)) for r0 in range(0, p.rows, step)]
    _repack_chunks(base, chunks, torch.get_num_threads(), progress)
    return packed, types, [] if arena is None else [arena[1]]


def _repack_chunks(base: torch.Tensor, chunks: list[tuple], workers: int,
                   progress: Callable[[int], None] | None) -> None:
    """Run the repack kernel on every (tensor info, part, target, packed weight, row0, row1) chunk, `workers` threads
    taking the next chunk in file order as they finish one (the kernel releases the GIL), each kernel on one
    intra-op thread; then unmap the chunk's source pages.

    Why not the kernel's own at::parallel_for on two threads: it splits every call in halves and waits for both,
    and on a busy 2-core machine the second half waits for a scheduler slice at every one of the load's hundreds
    of calls (the 1B file's repack took 1.7-1.8 s with it against 0.5-0.8 s on one thread). Taking whole chunks
    from a shared queue, a thread that is not scheduled leaves its chunks to the others and costs nothing but its
    last chunk's wait; where both cores are free, both work."""
    kernel = get_op("gguf_repack")
    assert kernel is not None, "place_packed: the repack kernel is not built (see `placeable`)"
    lock = threading.Lock()
    todo = iter(chunks)
    state = {"done": 0, "error": None}

    def work(main: bool) -> None:
        torch.set_num_threads(1)  # this thread's intra-op threads (a helper's first parallel region reads it)
        while True:
            with lock:
                job = next(todo, None) if state["error"] is None else None
            if job is None:
                return
            info, p, t, pw, r0, r1 = job
            row_bytes = info.n_bytes // p.rows
            chunk = base[info.offset + r0 * row_bytes:info.offset + r1 * row_bytes].view(r1 - r0, row_bytes)
            try:
                kernel(chunk, int(info.qtype), t.in_features, p.perm, pw.data, pw.scales, pw.zeros, p.row0 + r0,
                       t.tiled)
            except Exception as e:  # noqa: BLE001 - re-raised by the calling thread
                with lock:
                    state["error"] = state["error"] or e
                return
            mapped.drop_pages(chunk)
            with lock:
                state["done"] += chunk.numel()
                done, state["done"] = (state["done"], 0) if main else (0, state["done"])
            if main and progress is not None and done:
                progress(done)

    previous = torch.get_num_threads()
    helpers = [threading.Thread(target=work, args=(False,), daemon=True) for _ in range(max(0, workers - 1))]
    try:
        torch.set_num_threads(1)
        for h in helpers:
            h.start()
        work(True)
        for h in helpers:
            h.join()
    finally:
        torch.set_num_threads(previous)
    if state["error"] is not None:
        raise state["error"]
    if progress is not None and state["done"]:
        progress(state["done"])


def _plan(f: GGUFFile, config: ModelConfig, expected: dict[str, tuple[str, tuple[int, ...]]], names: set[str],
          fuse: bool, base: torch.Tensor, row_perm: Callable[[str, int], torch.Tensor | None]) -> list[_Target]:
    """The final packed weights, in the order of the GGUF tensors they start with."""
    by_module = {hf.removesuffix(".weight"): n for n, (hf, _) in expected.items() if n in names}
    hf_names = {hf for hf, _ in expected.values()}
    dtypes = {n: _param_dtypes(f, n, expected[n][1], base) for n in by_module.values()}

    def target(parts: list[str], name: str) -> _Target:
        g0 = by_module[parts[0]]
        qtype, (_, k) = f.tensors[g0].qtype, expected[g0][1]
        out, row0 = [], 0
        for m in parts:
            g = by_module[m]
            rows = expected[g][1][0]
            out.append(_Part(g, m, row0, rows, row_perm(g, rows)))
            row0 += rows
        scale_dtype, min_dtype = dtypes[g0]
        return _Target(name, qtype, k, out, scale_dtype, min_dtype)

    targets, taken = [], set()
    for module in list(by_module) if fuse else []:  # fused weights first: their parts may come in any order
        prefix, _, leaf = module.rpartition(".")
        for fused_name, leaves in FUSED_PARTS.items():
            if leaves[0] != leaf:
                continue
            full = [f"{prefix}.{p}" for p in leaves]
            sources = [by_module.get(m) for m in full]
            has_bias = [f"{m}.bias" in hf_names for m in full]
            if (all(g is not None for g in sources) and (all(has_bias) or not any(has_bias))
                    # one packed format (bits, group, form; K; parameter dtypes), as gguf_repack.py `can_concat`
                    # fuses: a Q5_0 q/k beside a Q8_0 v share the 8-bit container, each part decoded by its type
                    and len({(REPACKED[f.tensors[g].qtype], expected[g][1][1], dtypes[g]) for g in sources if g}) == 1):
                targets.append(target(full, f"{prefix}.{fused_name}"))
                taken.update(full)
    targets += [target([m], m) for m in by_module if m not in taken]
    targets.sort(key=lambda t: min(f.tensors[p.gguf_name].offset for p in t.parts))
    tiled_kernels = get_op("quant_linear_q8t") is not None
    for t in targets:  # as tile_quantized_layers would leave it (ops/qlinear.py `can_tile`)
        in_linear = t.name != EMBEDDING or config.tie_word_embeddings  # an untied table is no QuantLinear's
        t.tiled = tiled_kernels and in_linear and REPACKED[t.qtype][0] in (8, 4) and t.rows % TILE_ROWS == 0
    return targets


def _param_dtypes(f: GGUFFile, name: str, shape: tuple[int, ...], base: torch.Tensor
                  ) -> tuple[torch.dtype, torch.dtype | None]:
    """(scales' dtype, minimums' dtype or None) of a GGUF tensor's packed form, as gguf_repack.py `repack` picks
    them: float16 for the legacy types' stored values; for a K-quant's products, float16 where all of them fit."""
    info = f.tensors[name]
    has_mins = REPACKED[info.qtype][2] == "min"
    if info.qtype in _LEGACY:
        return torch.float16, torch.float16 if has_mins else None
    kernel = get_op("gguf_params_fit_half")
    assert kernel is not None
    rows, k = shape
    raw = base[info.offset:info.offset + info.n_bytes]
    row_bytes = k // GGML_QUANT_SIZES[info.qtype][0] * GGML_QUANT_SIZES[info.qtype][1]
    step, fit = max(1, _CHUNK_BYTES // row_bytes), 3
    for r0 in range(0, rows, step):
        if fit == 0:
            break
        chunk = raw[r0 * row_bytes:(r0 + step) * row_bytes].view(-1, row_bytes)  # [rows of the chunk, row_bytes]
        fit &= kernel(chunk, int(info.qtype), k)
        mapped.drop_pages(chunk)
    scale = torch.float16 if fit & 1 else torch.float32
    return scale, (torch.float16 if fit & 2 else torch.float32) if has_mins else None
