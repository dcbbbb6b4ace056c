"""Who runs a step's forward: the one place that chooses between the module path, the decode plan, its C++ layer
loop and torch.compile.

The engine setting `execution` (EngineConfig) picks the path once, when the model runner is built:

    auto      cpp where the C++ layer loop is built, else plan where the kernels are, else modules
    modules   model.forward: every layer's modules in order (the oracle the other paths are tested against)
    plan      engine/decode_plan.py DecodePlan.run: straight-line kernel calls, the layer loop in Python
    cpp       DecodePlan.run_cpp: that loop in one C++ call (ops/csrc/decode_layers.cpp)
    compiled  engine/compiled.py: torch.compile graphs of the dense parts, attention on the paged kernels

Each step then runs what this table says (the first row that matches it):

    step                                                    modules  plan     cpp       compiled
    model not covered (unfused projections, hooks, a        modules  modules  modules   (refused at build)
      linear with no kernel for the model dtype)
    gemma3, qwen3: as below, except compiled                ...      ...      ...       (refused at build)
    H2O eviction (attention statistics collected), off     modules  modules  modules   modules
      the CPU  (decode_plan.straight_line_step); gemma3
      under StreamingLLM
    StreamingLLM eviction (sinks + window)                  modules  plan     plan      modules
    token-tree verification (engine/token_tree.py;          modules  plan     as below  modules
      trees of up to 64 rows, float caches)
    int8 / int4 KV cache: as below, except compiled         ...      ...      ...       modules
    up to 8 rows: decode batches, verification, chunks      modules  plan     C++ loop  graphs (static rows)
    more rows: prefills, large batches                      modules  plan     plan      graphs (dynamic rows)

A mixture-of-experts model's steps follow the same rows: its routed layers run in both plan loops (router, top-k,
each chosen expert's kernels once over its rows, as model/moe.py's moe_forward); compiled refuses it at build.

So a batch-1 int4 decode step under the default (auto, kernels built) is DecodePlan.run_cpp: one decode_layers
call whose linears are each QuantLinear's kernel descriptor (ops/layers.py: kind QUANT_TILED on x86 builds,
else QUANT; QUANT_Q8_TILED / QUANT_Q8 with int8 activations, as quant_activations "auto" gives 4-bit layers).

Every path starts with model.prologue (embeddings, RoPE, StreamingLLM's sink rotation) and ends with
model.compute_logits; only the layers between differ. What an executor resolved (the plan's kernels and tensors,
the compiled graphs) is fixed when it is built: after switching the quantized layers' activations
(quant.layers.set_quant_activations), replacing layers or prepacking weights, call `rebuild()`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from brisk.engine.config import EXECUTIONS
from brisk.engine.decode_plan import DecodePlan
from brisk.model.llama import LlamaForCausalLM
from brisk.ops.attention import AttentionMetadata

logger = logging.getLogger(__name__)


class Executor:
    """Runs a model's forward on the path `execution` chose, and on the module path where that one does not apply.

    `execution` is what was asked for; `path` what was built (auto resolves to cpp, plan or modules; plan and cpp
    become modules where the kernels are missing or the model is not covered; cpp becomes plan without the C++
    loop)."""

    def __init__(self, model: LlamaForCausalLM, execution: str = "auto") -> None:
        if execution not in EXECUTIONS:
            raise ValueError(f"execution must be one of {', '.join(EXECUTIONS)}; got {execution!r}")
        self.model = model
        self.execution = execution
        self.plan: DecodePlan | None = None
        self.compiled: Any = None  # engine.compiled.CompiledModel
        self.path = "modules"
        # trained speculation heads (spec/medusa.py) read the final hidden state of the rows whose logits are
        # computed: kept here after each step when set
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        # prefill-only requests (engine/pooling.py): the model runner names the rows whose final hidden state it
        # pools for one step; they are kept in pooled_hidden
        self.pool_rows: torch.Tensor | None = None
        self.pooled_hidden: torch.Tensor | None = None
        self.rebuild()

    def rebuild(self) -> None:
        """Resolve the path again from the model as it is now (its layers, their kernels, the kernels built)."""
        self.plan, self.compiled, self.path = None, None, "modules"
        if self.execution == "compiled":
            from brisk.engine.compiled import CompiledModel, check_can_compile

            check_can_compile()
            self.compiled, self.path = CompiledModel(self.model), "compiled"
        elif self.execution != "modules" and len(self.model.model.layers):
            self.plan = DecodePlan.build(self.model)
            if self.plan is not None:
                cpp = self.execution in ("auto", "cpp") and self.plan.decode_layers is not None
                self.path = "cpp" if cpp else "plan"

    def warm_up(self, max_tokens: int) -> float:
        """Compile every shape a step of up to max_tokens rows can reach (compiled only); returns the seconds."""
        if self.compiled is None:
            return 0.0
        seconds = self.compiled.warm_up(max_tokens)
        logger.info("--compile: the decoder's graphs compiled in %.1f s", seconds)
        return seconds

    def step_path(self, x: torch.Tensor, meta: AttentionMetadata, kv_caches: list[Any]) -> str:
        """Which path runs this step (the table in the module docstring): modules, plan, cpp or compiled."""
        if self.compiled is not None:
            return "compiled" if self.compiled.applies(x, meta, kv_caches) else "modules"
        if self.plan is None or not self.plan.applies(x, meta, kv_caches):
            return "modules"
        return "cpp" if self.path == "cpp" and self.plan.cpp_applies(x, meta, kv_caches) else "plan"

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[Any], context_lens: torch.Tensor | None = None) -> torch.Tensor:
        """model(input_ids[T], positions[T], meta, kv_caches) -> logits [N, vocab], on this step's path."""
        model = self.model
        x, cos, sin = model.prologue(input_ids, positions, meta, context_lens)  # [T, hidden], [T, d/2] x 2
        path = self.step_path(x, meta, kv_caches)
        if path == "cpp":
            hidden = self.plan.run_cpp(x, cos, sin, meta, kv_caches)[0]  # type: ignore[union-attr]
        elif path == "plan":
            hidden = self.plan.run(x, cos, sin, meta, kv_caches)[0]  # type: ignore[union-attr]
        elif path == "compiled":
            hidden = self.compiled.run(x, cos, sin, meta, kv_caches)
        else:
            hidden = model.run_layers(x, cos, sin, meta, kv_caches)
        self.keep_rows(hidden, meta)
        return model.compute_logits(hidden, meta)  # [N, vocab]

    def keep_rows(self, hidden: torch.Tensor, meta: AttentionMetadata) -> None:
        """Keep what was asked of a step's final hidden states [T, hidden]: the rows with logits (keep_hidden) and
        the rows pooled (pool_rows)."""
        if self.keep_hidden:
            idx = meta.logits_indices
            self.last_hidden = hidden if idx is None else hidden.index_select(0, idx)  # [N, hidden]
        if self.pool_rows is not None:
            self.pooled_hidden = hidden.index_select(0, self.pool_rows)  # [P, hidden]
