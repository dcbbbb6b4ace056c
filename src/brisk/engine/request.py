"""A request's state inside the engine: its tokens, how many of them have KV in the cache, its status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from brisk.engine.pooling import PoolingParams
    from brisk.engine.sampling_params import SamplingParams
    from brisk.structured.backend import StructuredState


class RequestStatus(enum.IntEnum):
    """Ordered: everything after PREEMPTED is finished."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence. `all_token_ids = prompt + outputs`; tokens [0, num_computed_tokens) have KV in the cache.

    The scheduler only ever moves `num_computed_tokens` towards `num_tokens`: a prefill, a chunk of one, a
    decode step and a recompute after preemption are all "compute the tokens not yet computed".
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        generator: torch.Generator | None = None,
        parent_id: str | None = None,
        sample_index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority  # lower value = served first (vLLM convention)
        self.generator = generator  # per-request RNG when sampling_params.seed is set
        self.parent_id = parent_id  # n > 1: the request whose prompt this sample shares
        self.sample_index = sample_index

        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first schedule
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] = []  # one {token_id: logprob} per output token when requested
        self.first_token_time: float | None = None
        # Speculative decoding: tokens a proposer drafted after all_token_ids, verified by the next step, and
        # the draft distributions q they were drawn from ([len, V]; None = point masses). Never part of
        # all_token_ids: a draft only becomes a token when the verifier accepts it.
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: torch.Tensor | None = None
        # a token tree instead of a chain (engine/token_tree.py): the parent of each drafted token, an index into
        # spec_token_ids or -1 for the request's last token; parents come before their children. None = a chain
        self.spec_tree_parents: list[int] | None = None
        # trained heads (spec/medusa.py, spec/eagle.py): the target's final hidden states [n, H] of the rows that
        # produced the last step's n tokens, the last of them all_token_ids[spec_hidden_index]; written by the
        # model runner when a proposer asks for them
        self.spec_hidden: torch.Tensor | None = None
        self.spec_hidden_index = -1
        # LoRA (brisk/lora): the engine slot of the request's adapter (-1: none) and the adapter's prefix-cache key,
        # which seeds the block-hash chain so that two adapters never share KV
        self.lora_slot = -1
        self.lora_key: bytes | None = None
        # structured outputs: the grammar matcher, advanced with every output token (structured/backend.py)
        self.structured: StructuredState | None = None
        # a prefill-only request (engine/pooling.py): its pooling, the state pooled so far over the computed rows,
        # and the result once its last token was computed
        self.pooling: PoolingParams | None = None
        self.pool_state: torch.Tensor | None = None
        self.pooled: list[float] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
