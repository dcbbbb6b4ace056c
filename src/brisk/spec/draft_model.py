"""A draft model proposes: a smaller model with the target's tokenizer, an RTN-quantized copy of the target
(`self:int4`), or the target with layers skipped (`layerskip`). Each has its own paged KV cache and block
manager; its requests are shadows of the engine's, holding the target's tokens plus the current drafts.

One propose() call runs γ batched draft forwards:

    step 0:   | shadow computed | tokens the draft has not seen yet (>= 1) |  -> logits of the last -> x_1
    step i:   | ... | x_i |                                                  -> x_{i+1}     (i = 1 .. γ-1)

x_γ is never fed. Next call, the shadow's KV stays valid up to the longest common prefix of (old tokens +
drafts) and the target's new tokens (accepted drafts count); everything past it is recomputed, so rejected
drafts, preemption of the target request and any other divergence need no special case.

A self-draft (`self:intN`, the target's own weights rounded) has the target's cache layout, and does not
recompute what the target already holds: positions the target has computed and the draft has not (the whole
prompt of a new request, the tokens decoded while adaptive γ was 0, the bonus token) are copied from the
target's cache, so the draft's step-0 forward is one row, not a second prefill of the prompt (on a 300-token
prompt the draft's prefill cost as much as the target's). The draft then attends to the target's keys and
values for those positions: that only moves the acceptance rate (up, if anything), never the output.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from brisk.engine.config import SELF_DRAFT_BITS, SpecConfig
from brisk.engine.model_runner import ModelRunner
from brisk.engine.request import Request
from brisk.engine.sampler import SamplingMetadata, greedy_sample, random_sample
from brisk.engine.sampling_params import SAMPLING_EPS, SamplingParams
from brisk.engine.scheduler import ScheduledRequest, SchedulerOutput
from brisk.engine.verify import probs_from_processed, processed_logits
from brisk.kvcache.manager import KVCacheManager
from brisk.model.llama import LlamaForCausalLM
from brisk.spec.proposer import Draft, Proposer

if TYPE_CHECKING:
    from brisk.engine.llm_engine import LLMEngine

_SHADOW_PARAMS = SamplingParams(temperature=0, max_tokens=None)


class DraftModelProposer(Proposer):
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", name: str = "draft", draft_cost: float = 0.3,
                 kv_cache_dtype: str = "auto", execution: str = "auto", vocab: torch.Tensor | None = None) -> None:
        self.name = name
        self.draft_cost = draft_cost
        self.runner = ModelRunner(model, num_blocks, block_size, dtype, device, kv_cache_dtype, execution=execution)
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
        self.vocab_size = model.config.vocab_size
        # the token ids of the draft head's rows (spec/vocab.py restrict_head), None: the whole vocabulary
        self.vocab = vocab
        self._shadows: dict[str, Request] = {}
        self.forward_seconds = 0.0  # last steady-state draft forward (0 until one ran)
        self._num_target_tokens: dict[str, int] = {}  # the target's length when the shadow last drafted
        self._target: tuple[list[torch.Tensor], KVCacheManager] | None = None  # see share_target_kv
        self._adopted: dict[str, int] = {}  # positions below this hold the target's K/V in the draft's cache

    def share_target_kv(self, kv_caches: list, manager: KVCacheManager) -> bool:
        """Copy positions the target has computed from its cache instead of recomputing them (a self-draft:
        same layers, same cache layout). Returns whether the layouts allow it (plain caches, equal shapes)."""
        mine = self.runner.kv_caches
        ok = (len(kv_caches) == len(mine) and manager.block_size == self.kv.block_size
              and all(type(t) is torch.Tensor and type(m) is torch.Tensor and t.dtype == m.dtype
                      and t.shape[2:] == m.shape[2:] and t.is_contiguous() and m.is_contiguous()
                      for t, m in zip(kv_caches, mine, strict=False)))
        self._target = (list(kv_caches), manager) if ok else None
        return ok

    def _adopt_target_kv(self, req: Request, shadow: Request) -> None:
        """Positions [start, target computed) from the target's cache into the draft's (whose slots are
        allocated); the shadow's tokens equal the target's there (step 0, right after _sync). start is where the
        draft's own K/V begins: its accepted drafts are overwritten with the target's too, so the draft always
        attends to the target's keys and values for every position the target has verified."""
        assert self._target is not None
        caches, manager = self._target
        start = min(shadow.num_computed_tokens, self._adopted.get(req.request_id, 0))
        end = min(req.num_computed_tokens, shadow.num_tokens - 1)
        if end <= start:
            return
        bs = self.kv.block_size
        pos = torch.arange(start, end)
        theirs = torch.tensor(manager.get_block_ids(req.request_id), dtype=torch.int64)
        ours = torch.tensor(self.kv.get_block_ids(shadow.request_id), dtype=torch.int64)
        if bool((theirs[pos // bs] < 0).any()):
            return  # an evicted block: recompute instead
        src_slots = theirs[pos // bs] * bs + pos % bs
        dst_slots = ours[pos // bs] * bs + pos % bs
        for src, dst in zip(caches, self.runner.kv_caches, strict=True):
            flat_src = src.view(2, -1, *src.shape[3:])  # [2, slots, kvh, d]
            dst.view(2, -1, *dst.shape[3:]).index_copy_(1, dst_slots, flat_src.index_select(1, src_slots))
        shadow.num_computed_tokens = max(shadow.num_computed_tokens, end)
        self._adopted[req.request_id] = end

    def live_ids(self) -> set[str]:
        return set(self._shadows)

    def free(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            shadow = self._shadows.pop(req_id, None)
            self._num_target_tokens.pop(req_id, None)
            self._adopted.pop(req_id, None)
            if shadow is not None:
                self.kv.free(shadow)

    def _sync(self, req: Request) -> Request:
        """The shadow of `req`, its tokens reset to the target's and its computed count to the valid prefix."""
        shadow = self._shadows.get(req.request_id)
        if shadow is None:
            shadow = Request(req.request_id, req.all_token_ids, _SHADOW_PARAMS)
            self._shadows[req.request_id] = shadow
            return shadow
        old, new = shadow.all_token_ids, req.all_token_ids
        valid = min(self._num_target_tokens[req.request_id], len(new))
        while valid < min(len(old), len(new)) and old[valid] == new[valid]:  # accepted drafts
            valid += 1
        shadow.all_token_ids = list(new)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, valid, len(new) - 1)
        return shadow

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> list[Draft]:
        shadows = [self._sync(r) for r in requests]
        for req in requests:
            self._num_target_tokens[req.request_id] = req.num_tokens
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        for step in range(max(num_drafts)):
            active = [j for j in active if len(drafts[j]) < num_drafts[j]]
            scheduled, kept = [], []
            for j in active:
                shadow = shadows[j]
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if self.kv.allocate_slots(shadow, num_new) is None:
                    # the draft's pool is full: this request drafts nothing more now and gives its blocks back
                    # (it recomputes them when there is room); the others go on
                    self.kv.free(shadow)
                    shadow.num_computed_tokens = 0
                    continue
                if step == 0 and self._target is not None:
                    self._adopt_target_kv(requests[j], shadow)
                scheduled.append(ScheduledRequest(shadow.request_id, shadow.all_token_ids[shadow.num_computed_tokens:],
                                                  shadow.num_computed_tokens, self.kv.get_block_ids(shadow.request_id),
                                                  1))
                kept.append(j)
            active = kept
            if not active:
                break
            sched = SchedulerOutput(scheduled=scheduled)
            start = time.perf_counter()
            ids, positions, meta, ctx = self.runner.prepare(sched)
            dev = self.runner.device
            logits = self.runner.executor(ids.to(dev), positions.to(dev), meta, self.runner.kv_caches, ctx)  # [B, V]
            if self.vocab is not None:  # [B, Vd] -> [B, V], -inf outside the draft vocabulary
                full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
                logits = full.index_copy_(1, self.vocab.to(logits.device), logits)
            if max(len(s.token_ids) for s in scheduled) <= 2:
                # a steady-state draft forward (no catch-up prefill of a new prompt): what adaptive γ should
                # pay per drafted position
                self.forward_seconds = time.perf_counter() - start
            tokens = self._sample(logits, [requests[j] for j in active], [drafts[j] for j in active],
                                  [probs[j] for j in active])
            for j, s, token in zip(active, scheduled, tokens, strict=True):
                shadows[j].num_computed_tokens += len(s.token_ids)
                shadows[j].all_token_ids.append(token)
                drafts[j].append(token)
        return [Draft(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs, strict=True)]

    def _sample(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                probs_out: list[list[torch.Tensor]]) -> list[int]:
        """The next draft token per row, processed exactly like the target's rows (verify.position_metadata):
        greedy requests take the argmax (q is not needed); random ones draw from q and keep it."""
        params = [r.sampling_params for r in requests]
        gens = {i: r.generator for i, r in enumerate(requests) if r.generator is not None}
        meta = SamplingMetadata.from_params(params, [r.output_token_ids + d for r, d in zip(requests, drafts,
                                                                                            strict=True)],
                                            [r.prompt_token_ids for r in requests], gens, vocab_size=self.vocab_size,
                                            eos_token_ids=[r.eos_token_ids for r in requests], device=logits.device)
        penalized = processed_logits(logits, meta)  # [B, V]
        tokens = greedy_sample(penalized)
        if not meta.all_greedy:
            q = probs_from_processed(penalized, meta)  # [B, V]
            sampled = random_sample(q.clone(), meta.generators)
            random_rows = meta.temperature >= SAMPLING_EPS
            tokens = torch.where(random_rows, sampled, tokens)
            for i in torch.nonzero(random_rows).flatten().tolist():
                probs_out[i].append(q[i])
        return tokens.tolist()


# ---------------------------------------------------------------------------------------------- building


def self_draft_model(engine: LLMEngine, bits: int, group_size: int = 64) -> LlamaForCausalLM:
    """An RTN-quantized copy of the engine's model (INT8 / INT4 / INT2 decoder linears, int8 embedding/head),
    built in memory the way `brisk quantize` + load would: RTN codes, then the packed QuantLinear modules. Its
    8/4-bit linears take int8 activations (integer dot products: faster drafting, see BENCHMARKS.md): a draft's numerics
    only move the acceptance rate, never the output, which verification against the target decides."""
    from brisk.model.fuse import fuse_projections
    from brisk.model.loader import build_model, load_model
    from brisk.ops.linear import use_fast_linear
    from brisk.quant.checkpoint import apply_quantized_modules, quantized_module_names, take_all_quantized
    from brisk.quant.config import LayerQuant
    from brisk.quant.layers import set_quant_activations
    from brisk.quant.rtn import HEAD_DEFAULT, plan_layers, rtn_quantize

    dtype = engine.loaded.dtype
    float_copy = load_model(engine.loaded.path, dtype=torch.float32, fuse=False)  # unfused: HF module names
    config = float_copy.config
    default = LayerQuant(bits=bits, group_size=group_size, sym=False)
    plan = plan_layers(float_copy.model, config.tie_word_embeddings, default, head=HEAD_DEFAULT)
    tensors, qconfig = rtn_quantize(float_copy, plan, default, progress=False)
    del float_copy
    parts = take_all_quantized(tensors, config, qconfig)
    net = build_model(config, tensors, dtype, engine.config.device,
                      quantized=quantized_module_names(config, qconfig))
    apply_quantized_modules(net, config, qconfig, parts, dtype, fuse=True)
    net.init_rope(max(engine.max_model_len, config.max_position_embeddings), engine.config.device)
    fuse_projections(net)
    use_fast_linear(net)
    set_quant_activations(net, "int8")
    if torch.device(engine.config.device).type == "cpu":
        from brisk.model.hugepages import to_huge_pages

        to_huge_pages(net)  # as load_model does for the target (model/hugepages.py)
    return net


def layer_skip_model(model: LlamaForCausalLM, skip_layers: Iterable[int]) -> LlamaForCausalLM:
    """A view of `model` that runs only the layers not in skip_layers; it shares every weight (no copy)."""
    skip = set(skip_layers)
    num_layers = len(model.model.layers)
    bad = [i for i in skip if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"skip_layers {bad} are out of range for a model with {num_layers} layers")
    if len(skip) >= num_layers:
        raise ValueError("skip_layers would skip every layer; keep at least one")
    view = LlamaForCausalLM.__new__(LlamaForCausalLM)
    torch.nn.Module.__init__(view)
    view.config = dataclasses.replace(model.config, num_hidden_layers=num_layers - len(skip))  # sizes its KV
    view.rope, view.local_rope = model.rope, model.local_rope
    view.sliding_window, view.embed_scale = model.sliding_window, model.embed_scale
    view.lm_head = model.lm_head
    backbone = torch.nn.Module()
    backbone.embed_tokens = model.model.embed_tokens
    backbone.norm = model.model.norm
    backbone.layers = torch.nn.ModuleList(layer for i, layer in enumerate(model.model.layers) if i not in skip)
    view.model = backbone
    return view


def build_draft_proposer(config: SpecConfig, engine: LLMEngine) -> DraftModelProposer:
    """draft:PATH, self:intN or layerskip; the draft's KV pool holds as many tokens as the target's. A draft
    folder holding a draft vocabulary (spec/vocab.py) drafts from those tokens only."""
    from brisk.model.loader import load_model
    from brisk.quant.layers import set_quant_activations
    from brisk.spec.vocab import load_vocab, restrict_head

    vocab = None

    target = engine.loaded
    dtype = target.dtype
    if config.method == "draft":
        loaded = load_model(config.model, dtype=dtype, device=engine.config.device,
                            max_model_len=engine.max_model_len)
        if loaded.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"draft model {config.model} has a vocabulary of {loaded.config.vocab_size} tokens but "
                             f"the target has {target.config.vocab_size}; a draft must share the target's tokenizer")
        if loaded.tokenizer.encode("The quick brown fox, 42!") != target.tokenizer.encode("The quick brown fox, 42!"):
            raise ValueError(f"draft model {config.model} tokenizes differently from the target; a draft must share "
                             "the target's tokenizer")
        model, name, cost = loaded.model, "draft", 0.3
        folder = Path(loaded.path)
        vocab = load_vocab(folder, target.config.vocab_size) if folder.is_dir() else None
        if vocab is not None:
            restrict_head(model, vocab)
        # a quantized draft's 8/4-bit linears take int8 activations, as a self-draft's (faster drafting; the
        # draft's numerics move the acceptance rate, never the output)
        set_quant_activations(model, "int8")
    elif config.method == "self":
        model, name, cost = self_draft_model(engine, SELF_DRAFT_BITS[config.model]), f"self:{config.model}", 0.35
    else:
        from brisk.spec.layerskip import load_skip_layers

        skip = config.skip_layers if config.skip_layers is not None else load_skip_layers(target.path)
        model = layer_skip_model(target.model, skip)
        name = "layerskip"
        cost = len(model.model.layers) / len(target.model.model.layers)
    # a 16-bit target cache is matched (a self-draft then adopts the target's K/V as they are); the draft keeps
    # a float cache under a quantized one
    kv_dtype = "bfloat16" if engine.config.cache.kv_cache_dtype == "bfloat16" else "auto"
    # the target's execution path, except torch.compile: the draft's graphs would be compiled at start-up too
    execution = "auto" if engine.config.execution == "compiled" else engine.config.execution
    proposer = DraftModelProposer(model, engine.num_blocks, engine.config.cache.block_size, dtype,
                                  engine.config.device, name=name, draft_cost=cost, kv_cache_dtype=kv_dtype,
                                  execution=execution, vocab=vocab)
    if config.method == "self":
        proposer.share_target_kv(*engine.target_kv())
    return proposer
