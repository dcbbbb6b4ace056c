"""Turns a SchedulerOutput into one forward pass over the flattened batch, then samples.

The KV policy takes part through its step hooks (kvcache/policy.py `KVPolicy`): it follows the step's K/V moves
and copies, may hand in statistics buffers for attention to fill (`begin_step`, H2O's attention mass), and after
the forward names the cache entries each request keeps (`end_step`), which the manager compacts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import torch

from brisk.engine import pooling as pool
from brisk.engine import token_tree
from brisk.engine.executor import Executor
from brisk.engine.request import Request
from brisk.engine.sampler import Sampler, SamplerOutput, SamplingMetadata, greedy_sample, plain_greedy
from brisk.engine.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput
from brisk.engine.verify import verify
from brisk.kvcache.policy import KVPolicy, StreamingPolicy
from brisk.kvcache.quant import QuantizedKVCache, make_kv_caches
from brisk.model.llama import LlamaForCausalLM
from brisk.ops.attention import AttentionMetadata, KVCache


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", kv_cache_dtype: str = "auto",
                 num_residual_blocks: int = 16, kv_policy: KVPolicy | None = None, execution: str = "auto") -> None:
        self.model = model
        # which path runs the forward (engine/executor.py); rebuild it after changing the model's layers
        self.executor = Executor(model, execution)
        # LoRA (brisk/lora/manager.py): told each step's rows and their requests before the forward
        self.lora_mapping: Callable[[list[ScheduledRequest], Mapping[str, Request]], None] | None = None
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.vocab_size = model.config.vocab_size
        self.sliding_window = model.config.sliding_window
        # an evicting policy (kvcache/policy.py): attention sees sinks + a window, evicted blocks are -1
        self.kv_policy = kv_policy or KVPolicy()
        self.num_sink_tokens = 0
        if isinstance(self.kv_policy, StreamingPolicy):
            self.sliding_window = self.kv_policy.window
            self.num_sink_tokens = self.kv_policy.sink_tokens
        c = model.config
        self.kv_caches: list[KVCache]
        # per layer a [2 (k, v), num_blocks, block_size, kv_heads, head_dim] tensor of the model dtype ("auto") or
        # bfloat16 (K/V rounded on write; attention widens them to float32 as it reads); or int8 / int4:
        # quantized on write, read in place by attention (kvcache/quant.py)
        self.kv_caches = make_kv_caches(kv_cache_dtype, c.num_hidden_layers, num_blocks, block_size,
                                        c.num_key_value_heads, c.head_dim, dtype, device, num_residual_blocks)
        self.sampler = Sampler()
        self.last_timing = (0.0, 0.0, 0.0)  # seconds of the last execute(): prepare, forward, sample
        # the step's prefill-only requests (engine/pooling.py), from prepare(): which rows of the executor's
        # pool_rows each one reads, and the logits row (after the sampled ones) of each score request
        self._pool_plan: list[tuple[ScheduledRequest, int, int, int | None]] = []
        self._pool_rows: list[int] = []

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.nbytes if isinstance(t, QuantizedKVCache) else t.numel() * t.element_size()
                   for t in self.kv_caches)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for kv in self.kv_caches:
            if isinstance(kv, QuantizedKVCache):
                kv.copy_blocks(src.tolist(), dst.tolist())
            else:
                kv[:, dst] = kv[:, src]
        self.kv_policy.on_copy_blocks(copies)

    def move_kv(self, moves: tuple[list[int], list[int]]) -> None:
        """H2O compactions: every layer's K/V from slot src[i] to slot dst[i]. All sources are read before any
        destination is written (a slot may be both), as kvcache/manager.py `_compact` requires."""
        src, dst = moves
        if not src:
            return
        src_t = torch.tensor(src, device=self.device)
        dst_t = torch.tensor(dst, device=self.device)
        for kv in self.kv_caches:
            assert not isinstance(kv, QuantizedKVCache), "h2o runs on the float cache only (engine/config.py)"
            flat = kv.view(2, kv.shape[1] * kv.shape[2], *kv.shape[3:])  # [2, num_slots, kvh, d]
            flat[:, dst_t] = flat[:, src_t]  # the gather is a copy: sources are read before the scatter
        self.kv_policy.on_move_kv(dst, self.block_size)

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                        torch.Tensor | None]:
        """Flatten the scheduled tokens, decodes first, and describe every sequence's cache for attention.

        Per request:  | cache_len (in cache) | token_ids (this step) |  -> context_len = both
        slot of cache entry i = block_ids[i // block_size] * block_size + i % block_size
        cache_len is num_computed_tokens (entry = position) except under H2O after a compaction; positions (RoPE)
        are always the tokens' own: num_computed_tokens + j.

        Rows:  | decode 0 | decode 1 | ... | prefill 0 tokens | prefill 1 tokens | ... |
        (decodes first, so the kernel-less path runs them as one contiguous batch). Decodes are plain Python
        ints until one tensor per field: this runs every step, and at batch 1 it must stay far below the forward.
        """
        bs = self.block_size
        order = batch_order(sched)
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        first_row: dict[str, int] = {}
        trees: list[tuple[int, torch.Tensor]] = []  # token-tree drafts (engine/token_tree.py): (sequence, in-step mask)
        num_rows = 0
        for b, s in enumerate(order):
            start, q_len = s.num_computed_tokens, len(s.token_ids)
            cache_start = start if s.cache_len is None else s.cache_len
            first_row[s.req_id] = num_rows
            input_ids.extend(s.token_ids)
            if q_len == 1:
                positions.append(start)
            elif s.tree_parents is not None:  # a draft's position is its root's plus its depth
                num_real = q_len - len(s.tree_parents)
                positions.extend(range(start, start + num_real))
                positions.extend(start + num_real - 1 + d for d in token_tree.tree_depths(s.tree_parents))
                trees.append((b, token_tree.tree_mask(s.tree_parents, num_real)))
            else:
                positions.extend(range(start, start + q_len))
            num_rows += q_len
            query_lens.append(q_len)
            context_lens.append(cache_start + q_len)
        # rows whose logits are sampled, in the scheduler's order (execute() pairs them with requests that way);
        # a request with k drafts has its last k + 1 rows verified
        logits_rows = [r for s in sched.scheduled if s.num_samples
                       for r in range(first_row[s.req_id] + len(s.token_ids) - 1 - s.num_draft_tokens,
                                      first_row[s.req_id] + len(s.token_ids))]
        self._plan_pooling(order, first_row, logits_rows)
        positions_t = torch.tensor(positions, dtype=torch.int64)
        meta = AttentionMetadata.for_sequences(
            query_lens, context_lens, [s.block_ids for s in order], bs, positions=positions_t,
            sliding_window=self.sliding_window, num_sink_tokens=self.num_sink_tokens,
            evicting=self.kv_policy.evicts, cos_sin=self.model.rope.cos_sin if self.model.rope is not None else None,
            stats=self.kv_policy.begin_step(order, context_lens, self.device), logits_indices=logits_rows,
            tree_masks=trees, device=self.device)
        token_context_lens = None
        if self.model.rope is not None and self.model.rope.length_dependent:
            q_lens = torch.tensor(query_lens)
            token_context_lens = torch.repeat_interleave(meta.context_lens.long(), q_lens)  # [T]
        ids_t = torch.tensor(input_ids, dtype=torch.int64)
        return ids_t, positions_t, meta, token_context_lens

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> RunnerOutput:
        t0 = time.perf_counter()
        self.kv_policy.on_free(sched.freed_req_ids)
        self.move_kv(sched.kv_moves)  # before the copies: a block freed by a compaction may be a copy's target
        self.copy_blocks(sched.block_copies)
        self.recompute_for_long_rope(sched, requests)
        ids, positions, meta, context_lens = self.prepare(sched)
        if self.lora_mapping is not None:
            self.lora_mapping(batch_order(sched), requests)
        t1 = time.perf_counter()
        if self._pool_rows:
            self.executor.pool_rows = torch.tensor(self._pool_rows, dtype=torch.int64, device=self.device)
        try:
            logits = self.executor(ids.to(self.device), positions.to(self.device), meta, self.kv_caches, context_lens)
        finally:
            self.executor.pool_rows = None
        t2 = time.perf_counter()
        self.last_timing = (t1 - t0, t2 - t1, 0.0)
        out = RunnerOutput(kept_entries=self.kv_policy.end_step(batch_order(sched), meta.stats, self.block_size))
        if self._pool_plan:
            self._pool(logits, requests, out)
        sampling = [s for s in sched.scheduled if s.num_samples]
        if not sampling:
            return out
        plain_hidden_rows = list(range(len(sampling)))  # each plain request's row of executor.last_hidden
        if any(s.num_draft_tokens for s in sampling):
            logits, sampling, plain_hidden_rows = self._verify_drafts(logits, sampling, requests, out)
            if not sampling:
                return out
        # one logits row per sampled token; a fork (n > 1) draws n samples from its prompt's last row
        rows: list[int] = []
        reqs: list[Request] = []
        for i, s in enumerate(sampling):
            parent = requests[s.req_id]
            samples = [parent] + [requests[f"{s.req_id}#{k}"] for k in range(1, s.num_samples)]
            rows.extend([i] * s.num_samples)
            reqs.extend(samples)
        logits = logits.float()
        if len(rows) != logits.shape[0]:
            logits = logits.index_select(0, torch.tensor(rows))
        constrained = any(r.structured is not None for r in reqs)
        if constrained:  # structured outputs: forbidden tokens to -inf on the constrained rows only
            from brisk.structured.runner import mask_logits, sync_states

            logits = mask_logits(logits, sync_states(reqs))
        if all(plain_greedy(r.sampling_params, len(r.output_token_ids)) for r in reqs):
            result = SamplerOutput(sampled_token_ids=greedy_sample(logits).tolist())
        else:
            meta_s = SamplingMetadata.from_requests(reqs, vocab_size=self.vocab_size, device=logits.device)
            result = self.sampler(logits, meta_s)
        if constrained:  # advance the matchers; jump-forward tokens ride along in the output
            from brisk.structured.runner import advance

            out.forced_token_ids.update(advance(reqs, result.sampled_token_ids))
        self.last_timing = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        hidden = self.executor.last_hidden if self.executor.keep_hidden else None
        j = 0
        for i, s in enumerate(sampling):
            n = s.num_samples
            out.sampled_token_ids[s.req_id] = result.sampled_token_ids[j:j + n]
            if hidden is not None:
                row = plain_hidden_rows[i]
                _keep_hidden(requests[s.req_id], hidden[row:row + 1], 1)
            if result.logprobs is not None and reqs[j].sampling_params.logprobs is not None:
                out.logprobs[s.req_id] = result.logprobs[j:j + n]
            j += n
        return out

    def _plan_pooling(self, order: list[ScheduledRequest], first_row: dict[str, int], logits_rows: list[int]) -> None:
        """The rows the step's prefill-only requests read (engine/pooling.py): hidden-state rows into
        self._pool_rows, a score request's last row appended to logits_rows (after the sampled ones)."""
        self._pool_plan, self._pool_rows = [], []
        for s in order:
            p = s.pooling
            if p is None:
                continue
            q_len = len(s.token_ids)
            rows = p.rows(s.num_computed_tokens, q_len, s.pool_end)
            at = len(self._pool_rows)
            self._pool_rows.extend(first_row[s.req_id] + r for r in rows)
            logits_row = None
            if p.score_token_ids is not None and s.pool_end:
                logits_row = len(logits_rows)
                logits_rows.append(first_row[s.req_id] + q_len - 1)
            self._pool_plan.append((s, at, len(rows), logits_row))

    def _pool(self, logits: torch.Tensor, requests: Mapping[str, Request], out: RunnerOutput) -> None:
        """Accumulate each prefill-only request's rows; the finished ones' results into out.pooled."""
        hidden = self.executor.pooled_hidden
        for s, at, n, logits_row in self._pool_plan:
            req, p = requests[s.req_id], s.pooling
            assert p is not None
            if n:
                assert hidden is not None
                req.pool_state = pool.accumulate(p, req.pool_state, hidden[at:at + n])
            if not s.pool_end:
                continue
            if p.score_token_ids is not None:
                assert logits_row is not None
                out.pooled[s.req_id] = [pool.yes_probability(logits[logits_row], p.score_token_ids)]
            else:
                assert req.pool_state is not None
                out.pooled[s.req_id] = pool.finish(p, req.pool_state, req.num_tokens)
        self.executor.pooled_hidden = None

    def recompute_for_long_rope(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> None:
        """LongRoPE (phi3): a sequence rotates with the short factors up to the original context and with the long
        ones past it, every key included. transformers' Phi-3 drops its cache and recomputes the whole sequence at
        the step its length first passes original_max_position_embeddings; the same here: a sequence whose cache
        holds tokens [0, c) with c <= original < its length after this step has that prefix run again at its new
        length (long factors), each layer's K/V overwriting the cached entries, before the step itself.

            | 0 .. c-1: cached with the short factors -> recomputed, long | this step's tokens (long) |
        """
        rope = self.model.rope
        orig = rope.long_orig_max if rope is not None else None
        if orig is None or self.kv_policy.evicts:
            return
        for s in sched.scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)
            if not (0 < start <= orig < end) or s.cache_len not in (None, start):  # (H2O: entries moved)
                continue
            ids = torch.tensor(requests[s.req_id].all_token_ids[:start], dtype=torch.int64)
            positions = torch.arange(start)
            if self.lora_mapping is not None:  # the prefix's rows take the request's adapter
                self.lora_mapping([dataclasses.replace(s, token_ids=ids.tolist(), num_computed_tokens=0)], requests)
            meta = AttentionMetadata.for_sequences([start], [start], [s.block_ids], self.block_size,
                                                   positions=positions, sliding_window=self.sliding_window,
                                                   logits_indices=[start - 1], device=self.device)
            self.executor(ids.to(self.device), positions.to(self.device), meta, self.kv_caches,
                          torch.full((start,), end))

    def _verify_drafts(self, logits: torch.Tensor, sampling: list[ScheduledRequest], requests: Mapping[str, Request],
                       out: RunnerOutput) -> tuple[torch.Tensor, list[ScheduledRequest], list[int]]:
        """Verify the requests with drafts (engine/verify.py; token trees: engine/token_tree.py) into `out`; return
        the other rows for the sampler, those requests, and their rows in the step's logits."""
        spec_rows: list[int] = []
        plain_rows: list[int] = []
        tree_rows: list[int] = []
        spec, plain, trees = [], [], []
        row = 0
        for s in sampling:
            n = 1 + s.num_draft_tokens
            if s.tree_parents is not None:
                tree_rows.extend(range(row, row + n))
                trees.append(s)
            else:
                (spec_rows if s.num_draft_tokens else plain_rows).extend(range(row, row + n))
                (spec if s.num_draft_tokens else plain).append(s)
            row += n
        if trees:
            self._verify_trees(logits, trees, tree_rows, requests, out)
        if not spec:
            if plain:
                logits = logits.index_select(0, torch.tensor(plain_rows, device=logits.device))
            return logits, plain, plain_rows
        reqs = [requests[s.req_id] for s in spec]
        drafts = [s.token_ids[len(s.token_ids) - s.num_draft_tokens:] for s in spec]
        probs = [None if r.spec_draft_probs is None else r.spec_draft_probs[:s.num_draft_tokens]
                 for r, s in zip(reqs, spec, strict=True)]
        spec_logits = logits.index_select(0, torch.tensor(spec_rows, device=logits.device)).float()
        constrained = any(r.structured is not None for r in reqs)
        if constrained:  # mask the target before the acceptance test: forbidden drafts are rejected
            from brisk.structured.runner import accept_verified, mask_draft_rows, sync_states

            sync_states(reqs)
            mask_draft_rows(spec_logits, reqs, drafts)
        result = verify(spec_logits, reqs, drafts, probs)
        if constrained:
            out.forced_token_ids.update(accept_verified(reqs, result.token_ids))
        hidden = self.executor.last_hidden if self.executor.keep_hidden else None
        at = 0
        for s, tokens, lps, pred in zip(spec, result.token_ids, result.logprobs, result.predictions, strict=True):
            out.sampled_token_ids[s.req_id] = tokens
            out.draft_predictions[s.req_id] = pred
            if lps is not None:
                out.logprobs[s.req_id] = lps
            if hidden is not None:  # the rows that gave the emitted tokens
                _keep_hidden(requests[s.req_id], hidden[spec_rows[at]:spec_rows[at] + len(tokens)], len(tokens))
            at += 1 + s.num_draft_tokens
        if plain:
            logits = logits.index_select(0, torch.tensor(plain_rows, device=logits.device))
        return logits, plain, plain_rows

    def _verify_trees(self, logits: torch.Tensor, trees: list[ScheduledRequest], rows: list[int],
                      requests: Mapping[str, Request], out: RunnerOutput) -> None:
        """Verification of token trees (engine/token_tree.py: greedy, or exact multi-draft sampling), then the accepted
        nodes' K/V moved to the entries right after the root, where the next step's attention expects them."""
        reqs = [requests[s.req_id] for s in trees]
        drafts = [s.token_ids[len(s.token_ids) - s.num_draft_tokens:] for s in trees]
        parents = [s.tree_parents for s in trees]
        tree_logits = logits.index_select(0, torch.tensor(rows, device=logits.device)).float()
        paths, tokens, token_rows = token_tree.verify_tree(tree_logits, reqs, drafts, parents)  # type: ignore[arg-type]
        src: list[int] = []
        dst: list[int] = []
        bs = self.block_size
        for s, path, toks in zip(trees, paths, tokens, strict=True):
            out.sampled_token_ids[s.req_id] = toks
            root = (s.num_computed_tokens if s.cache_len is None else s.cache_len) + len(s.token_ids) \
                - s.num_draft_tokens - 1  # the root's cache entry
            for a, b in token_tree.accepted_moves(path):
                src.append(s.block_ids[(root + a) // bs] * bs + (root + a) % bs)
                dst.append(s.block_ids[(root + b) // bs] * bs + (root + b) % bs)
        if src:
            src_t, dst_t = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
            for kv in self.kv_caches:
                assert not isinstance(kv, QuantizedKVCache), "token trees run on the float cache only"
                flat = kv.view(2, kv.shape[1] * kv.shape[2], *kv.shape[3:])
                flat[:, dst_t] = flat[:, src_t]  # a gather, then the scatter: sources are read first
        if any(r.sampling_params.logprobs is not None for r in reqs):
            from brisk.engine.sampler import gather_logprobs

            flat_rows = [r for rr in token_rows for r in rr]
            raw = torch.log_softmax(tree_logits.index_select(0, torch.tensor(flat_rows)), dim=-1)
            wanted = [r.sampling_params.logprobs for r, rr in zip(reqs, token_rows, strict=True) for _ in rr]
            lps = gather_logprobs(raw, torch.tensor([t for ts in tokens for t in ts]), wanted,
                                  max(w for w in wanted if w is not None))
            at = 0
            for s, r, ts in zip(trees, reqs, tokens, strict=True):
                if r.sampling_params.logprobs is not None:
                    out.logprobs[s.req_id] = [d for d in lps[at:at + len(ts)] if d is not None]
                at += len(ts)
        hidden = self.executor.last_hidden if self.executor.keep_hidden else None
        if hidden is not None:
            for req, rr, ts in zip(reqs, token_rows, tokens, strict=True):
                _keep_hidden(req, hidden[[rows[r] for r in rr]], len(ts))


def _keep_hidden(req: Request, row: torch.Tensor, num_emitted: int) -> None:
    """Remember the final hidden states [num_emitted, H] of the rows that produced the request's tokens of this
    step (read by trained proposers: spec/medusa.py, spec/eagle.py), with the index its last token will have."""
    req.spec_hidden = row.detach().clone()
    req.spec_hidden_index = req.num_tokens + num_emitted - 1


def batch_order(sched: SchedulerOutput) -> list[ScheduledRequest]:
    """The rows' order: decodes first, then prefill chunks (see ModelRunner.prepare)."""
    return ([s for s in sched.scheduled if len(s.token_ids) == 1]
            + [s for s in sched.scheduled if len(s.token_ids) > 1])
