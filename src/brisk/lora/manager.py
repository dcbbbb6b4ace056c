"""The engine's adapters: max_loras slots on the model's LoRALinear layers, filled on demand, LRU-evicted.

    request with LoRARequest ──acquire──> slot (already loaded: reuse; free slot: load; else evict the least
                                          recently used slot no running request holds; none: LoRABusyError)
    every step ──set_mapping──> rows grouped by slot (layers.LoRAMapping), shared by every layer
    request finished / aborted ──release──> the slot stays loaded (a later request reuses it) until evicted

An adapter's prefix-cache key is the digest of its weights: two adapters never share KV blocks, and the same
adapter reloaded into another slot finds its own blocks again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from brisk.lora.adapter import AdapterError, LoRAAdapter, check_fits, load_adapter
from brisk.lora.layers import LoRALinear, LoRAMapping, LoRAState, lora_layers, wrap_model
from brisk.lora.request import LoRARequest

if TYPE_CHECKING:
    from brisk.engine.model_runner import ModelRunner
    from brisk.engine.request import Request
    from brisk.engine.scheduler import ScheduledRequest
    from brisk.ops.attention import AttentionMetadata

MAX_LORA_RANK_LIMIT = 512


class LoRABusyError(RuntimeError):
    """Every adapter slot is held by running requests (a server answers 503: retry later)."""


@dataclass
class _Slot:
    request: LoRARequest
    adapter: LoRAAdapter
    refs: int = 0  # running requests using it


class LoRAManager:
    """Adapter slots over one model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.state = LoRAState()
        self.shapes = wrap_model(model, self.state, max_loras, max_lora_rank)
        self.layers = lora_layers(model)
        self.slots: list[_Slot | None] = [None] * max_loras
        self._lru: OrderedDict[int, None] = OrderedDict()  # slot -> None, least recently used first
        self.device = next(iter(self.layers)).lora_a.device if self.layers else torch.device("cpu")

    # ------------------------------------------------------------------ adapters
    def check_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """Read and validate an adapter for this model and these limits (AdapterError says what is wrong)."""
        adapter = load_adapter(request.lora_path)
        if adapter.r > self.max_lora_rank:
            raise AdapterError(f"adapter {request.lora_name!r} has rank {adapter.r}, more than max_lora_rank="
                               f"{self.max_lora_rank}; start the engine with --max-lora-rank {adapter.r} or more")
        check_fits(adapter, self.shapes, f"adapter {request.lora_name!r}")
        return adapter

    def slot_of(self, lora_int_id: int) -> int | None:
        for i, s in enumerate(self.slots):
            if s is not None and s.request.lora_int_id == lora_int_id:
                return i
        return None

    def acquire(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> tuple[int, bytes]:
        """A slot holding `request`'s adapter, counted as held until release(); and its prefix-cache key."""
        slot = self.slot_of(request.lora_int_id)
        if slot is not None and self.slots[slot].request.lora_path != request.lora_path:  # type: ignore[union-attr]
            raise AdapterError(f"lora_int_id {request.lora_int_id} is already loaded from "
                               f"{self.slots[slot].request.lora_path}; give each adapter its own id")  # type: ignore
        if slot is None:
            adapter = adapter or self.check_adapter(request)
            slot = self._free_slot()
            self._fill(slot, request, adapter)
        entry = self.slots[slot]
        assert entry is not None
        entry.refs += 1
        self._lru.move_to_end(slot)
        return slot, _cache_key(entry.adapter)

    def release(self, slot: int) -> None:
        entry = self.slots[slot]
        assert entry is not None and entry.refs > 0, f"releasing slot {slot}, which no request holds"
        entry.refs -= 1

    def remove(self, lora_int_id: int) -> bool:
        """Unload an adapter (False: it is not loaded); LoRABusyError while requests run with it."""
        slot = self.slot_of(lora_int_id)
        if slot is None:
            return False
        entry = self.slots[slot]
        assert entry is not None
        if entry.refs:
            raise LoRABusyError(f"adapter {entry.request.lora_name!r} is in use by {entry.refs} running request(s); "
                                "unload it when they finish")
        self._clear(slot)
        return True

    def loaded(self) -> list[LoRARequest]:
        return [s.request for s in self.slots if s is not None]

    def _free_slot(self) -> int:
        for i, s in enumerate(self.slots):
            if s is None:
                return i
        for slot in self._lru:  # least recently used first
            entry = self.slots[slot]
            if entry is not None and entry.refs == 0:
                self._clear(slot)
                return slot
        raise LoRABusyError(f"all {self.max_loras} adapter slots are held by running requests (max_loras="
                            f"{self.max_loras}); retry when one finishes, or start with a larger --max-loras")

    def _fill(self, slot: int, request: LoRARequest, adapter: LoRAAdapter) -> None:
        weights = {m: (adapter.lora_a[m], adapter.lora_b[m]) for m in adapter.modules}
        for layer in self.layers:
            if any(s.module in weights for s in layer.slices):
                layer.set_slot(slot, weights, adapter.scaling)
            else:
                layer.clear_slot(slot)
        self.slots[slot] = _Slot(request, adapter)
        self._lru[slot] = None

    def _clear(self, slot: int) -> None:
        for layer in self.layers:
            layer.clear_slot(slot)
        self.slots[slot] = None
        self._lru.pop(slot, None)

    # ------------------------------------------------------------------ per step
    def set_mapping(self, order: Sequence[ScheduledRequest], requests: Mapping[str, Request]) -> None:
        """The step's rows (in the runner's batch order) grouped by their request's slot."""
        row_slots: list[int] = []
        any_adapter = False
        for s in order:
            slot = getattr(requests[s.req_id], "lora_slot", -1)
            any_adapter |= slot >= 0
            row_slots.extend([slot] * len(s.token_ids))
        self.state.mapping = LoRAMapping.from_row_slots(row_slots, self.device) if any_adapter else None
        self.state.row_slots = torch.tensor(row_slots, dtype=torch.int64, device=self.device) if any_adapter else None

    def attach(self, runner: ModelRunner) -> None:
        """Route the runner's steps: its rows' slots before each forward, and the executor chosen per step."""
        runner.lora_mapping = self.set_mapping
        runner.executor = LoRAExecutor(runner.executor, self)


class LoRAExecutor:
    """The runner's executor with adapters. A step with none runs the executor built before the layers were
    wrapped (plan / C++ loop on the base kernels). A step with adapter rows runs the path the base executor would
    take with the adapters added after each base kernel: the C++ layer loop (decode batches, short chunks: the
    adapters' buffers are handed to it once, here, and applied per row), the decode plan's Python loop (larger
    steps: each LoRALinear's grouped products), else the module path (the LoRALinear layers)."""

    def __init__(self, base: Any, manager: LoRAManager) -> None:
        self.base = base
        self.manager = manager
        self.model = base.model
        self.execution = base.execution
        plan = getattr(base, "plan", None)
        self.plan_lora = base.path in ("plan", "cpp") and plan is not None
        self.cpp_lora = self.plan_lora and base.path == "cpp" and plan.weights is not None
        if self.plan_lora:
            plan.lora_modules = _loop_modules(self.model)
        if self.cpp_lora:
            plan.set_lora([t for layer in plan.lora_modules for m in layer for t in (m.lora_a, m.lora_bt)])

    @property
    def path(self) -> str:
        return self.base.path

    def warm_up(self, max_tokens: int) -> float:
        return self.base.warm_up(max_tokens)

    def rebuild(self) -> None:
        raise RuntimeError("the executor of a LoRA-enabled engine is fixed once its layers are wrapped")

    # the final hidden states of the rows with logits (trained speculation heads read them): the base's flag
    @property
    def keep_hidden(self) -> bool:
        return self.base.keep_hidden

    @keep_hidden.setter
    def keep_hidden(self, value: bool) -> None:
        self.base.keep_hidden = value

    @property
    def last_hidden(self) -> torch.Tensor | None:
        return self.base.last_hidden

    # the rows prefill-only requests pool (engine/pooling.py): the base's
    @property
    def pool_rows(self) -> torch.Tensor | None:
        return self.base.pool_rows

    @pool_rows.setter
    def pool_rows(self, value: torch.Tensor | None) -> None:
        self.base.pool_rows = value

    @property
    def pooled_hidden(self) -> torch.Tensor | None:
        return self.base.pooled_hidden

    @pooled_hidden.setter
    def pooled_hidden(self, value: torch.Tensor | None) -> None:
        self.base.pooled_hidden = value

    def step_path(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[Any]) -> str:
        base = self.base.step_path(x, meta, kv_caches)
        if self.manager.state.mapping is None:
            return base
        if base == "cpp":
            return "cpp" if self.cpp_lora else "plan"
        return "plan" if base == "plan" and self.plan_lora else "modules"

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[Any], context_lens: torch.Tensor | None = None) -> torch.Tensor:
        if self.manager.state.mapping is None:
            return self.base(input_ids, positions, meta, kv_caches, context_lens)
        model = self.model
        x, cos, sin = model.prologue(input_ids, positions, meta, context_lens)
        path = self.step_path(x, meta, kv_caches)
        if path == "cpp":
            plan = self.base.plan
            plan.lora_rows = self.manager.state.row_slots
            try:
                hidden = plan.run_cpp(x, cos, sin, meta, kv_caches)[0]
            finally:
                plan.lora_rows = None
        elif path == "plan":
            plan = self.base.plan
            plan.lora_active = True
            try:
                hidden = plan.run(x, cos, sin, meta, kv_caches)[0]
            finally:
                plan.lora_active = False
        else:
            hidden = model.run_layers(x, cos, sin, meta, kv_caches)
        self.base.keep_rows(hidden, meta)
        return model.compute_logits(hidden, meta)


def _loop_modules(model: torch.nn.Module) -> list[tuple[LoRALinear, LoRALinear, LoRALinear, LoRALinear]]:
    """Per layer its fused qkv, o, fused gate/up and down LoRALinear, in the decode plan's order (the plan only
    runs models with fused projections)."""
    out = []
    for layer in model.model.layers:
        mods = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        assert all(isinstance(m, LoRALinear) for m in mods), "every projection of a planned model is wrapped"
        out.append(mods)
    return out


def _cache_key(adapter: LoRAAdapter) -> bytes:
    return bytes.fromhex(adapter.digest) if adapter.digest else b"\0" * 32
