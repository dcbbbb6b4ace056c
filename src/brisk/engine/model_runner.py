"""Turns a SchedulerOutput into one forward pass over the flattened batch, then samples."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from brisk.engine.request import Request
from brisk.engine.sampler import Sampler, SamplingMetadata
from brisk.engine.scheduler import RunnerOutput, SchedulerOutput
from brisk.model.llama import LlamaForCausalLM
from brisk.ops.attention import AttentionMetadata, PrefillSeq, causal_mask


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.vocab_size = model.config.vocab_size
        self.sliding_window = model.config.sliding_window
        c = model.config
        # one tensor per layer: [2 (k, v), num_blocks, block_size, kv_heads, head_dim]
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, c.num_key_value_heads, c.head_dim, dtype=dtype, device=device)
            for _ in range(c.num_hidden_layers)
        ]
        self.sampler = Sampler()
        self._arange_block = torch.arange(block_size, device=device)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for kv in self.kv_caches:
            kv[:, dst] = kv[:, src]

    def prepare(self, sched: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                        torch.Tensor | None]:
        """Flatten the scheduled tokens and precompute every cache index attention will need.

        Per request:  | num_computed_tokens (in cache) | token_ids (this step) |  -> context_len = both
        slot of logical position p = block_ids[p // block_size] * block_size + p % block_size
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_chunks: list[torch.Tensor] = []
        ctx_lens: list[int] = []
        decode_rows: list[int] = []
        decode_slots: list[torch.Tensor] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        logits_rows: list[int] = []
        row = 0
        for s in sched.scheduled:
            q_len = len(s.token_ids)
            start = s.num_computed_tokens
            ctx = start + q_len
            blocks = torch.tensor(s.block_ids[: (ctx + bs - 1) // bs], dtype=torch.int64)
            slots = (blocks.unsqueeze(1) * bs + self._arange_block).view(-1)[:ctx]  # [ctx] slot per position
            input_ids.extend(s.token_ids)
            positions.append(torch.arange(start, ctx))
            slot_chunks.append(slots[start:])
            ctx_lens.append(ctx)
            if q_len == 1:
                decode_rows.append(row)
                decode_slots.append(slots)
                decode_lens.append(ctx)
            else:
                needs_mask = start > 0 or self.sliding_window is not None
                prefills.append(PrefillSeq(
                    query_start=row, query_len=q_len, context_len=ctx,
                    context_slots=slots if start > 0 else None,
                    mask=causal_mask(q_len, ctx, self.sliding_window) if needs_mask else None))
            if s.num_samples:
                logits_rows.append(row + q_len - 1)
            row += q_len

        meta = AttentionMetadata(slot_mapping=torch.cat(slot_chunks), prefills=prefills,
                                 logits_indices=torch.tensor(logits_rows, dtype=torch.int64))
        if decode_rows:
            lmax = max(decode_lens)
            padded = torch.zeros(len(decode_rows), lmax, dtype=torch.int64)  # [Bd, Lmax], pad -> slot 0 (masked)
            for i, sl in enumerate(decode_slots):
                padded[i, : sl.shape[0]] = sl
            lens = torch.tensor(decode_lens)
            key = torch.arange(lmax).unsqueeze(0)  # [1, Lmax]
            mask = key < lens.unsqueeze(1)
            if self.sliding_window is not None:
                mask &= key >= (lens - self.sliding_window).unsqueeze(1)
            meta.decode_token_idx = torch.tensor(decode_rows, dtype=torch.int64)
            meta.decode_context_slots = padded
            meta.decode_mask = mask[:, None, None, :]  # [Bd, 1, 1, Lmax]
        context_lens = None
        if self.model.rope is not None and self.model.rope.dynamic_orig_max is not None:
            q_lens = torch.tensor([len(s.token_ids) for s in sched.scheduled])
            context_lens = torch.repeat_interleave(torch.tensor(ctx_lens), q_lens)
        ids = torch.tensor(input_ids, dtype=torch.int64)
        return ids, torch.cat(positions), meta, context_lens

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, requests: Mapping[str, Request]) -> RunnerOutput:
        self.copy_blocks(sched.block_copies)
        ids, positions, meta, context_lens = self.prepare(sched)
        logits = self.model(ids.to(self.device), positions.to(self.device), meta, self.kv_caches, context_lens)
        out = RunnerOutput()
        sampling = [s for s in sched.scheduled if s.num_samples]
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
        meta_s = SamplingMetadata.from_requests(reqs, vocab_size=self.vocab_size, device=logits.device)
        result = self.sampler(logits, meta_s)
        j = 0
        for s in sampling:
            n = s.num_samples
            out.sampled_token_ids[s.req_id] = result.sampled_token_ids[j:j + n]
            if result.logprobs is not None and reqs[j].sampling_params.logprobs is not None:
                out.logprobs[s.req_id] = result.logprobs[j:j + n]
            j += n
        return out
