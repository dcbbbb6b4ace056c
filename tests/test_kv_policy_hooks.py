"""The KV policy's step hooks as the runner calls them, and the one constructor of AttentionMetadata."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from gguf_utils import random_state_dict, tiny_config
from hf_utils import make_tiny_hf_model

from brisk.engine.llm import LLM
from brisk.engine.model_runner import ModelRunner
from brisk.engine.sampling_params import SamplingParams
from brisk.engine.scheduler import ScheduledRequest, SchedulerOutput
from brisk.kvcache.policy import H2OPolicy, KVPolicy, ScheduledSeq, StreamingPolicy
from brisk.model.loader import build_model
from brisk.ops.attention import AttentionMetadata, AttentionStats

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


class RecordingPolicy(KVPolicy):
    """Keeps everything, as the default, and records every hook call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_free(self, req_ids: Sequence[str]) -> None:
        self.calls.append(("on_free", list(req_ids)))

    def on_move_kv(self, dst_slots: list[int], block_size: int) -> None:
        self.calls.append(("on_move_kv", list(dst_slots)))

    def on_copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.calls.append(("on_copy_blocks", list(copies)))

    def begin_step(self, seqs: Sequence[ScheduledSeq], context_lens: list[int],
                   device: torch.device) -> AttentionStats | None:
        self.calls.append(("begin_step", [(s.req_id, len(s.token_ids)) for s in seqs], list(context_lens)))
        return None

    def end_step(self, seqs: Sequence[ScheduledSeq], stats: AttentionStats | None,
                 block_size: int) -> dict[str, list[int]]:
        self.calls.append(("end_step", [s.req_id for s in seqs], stats, block_size))
        return {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hooks") / "m"
    make_tiny_hf_model(path, "llama", seed=11)
    return str(path)


def test_runner_calls_the_hooks_once_per_step_in_row_order(model_dir):
    llm = LLM(model_dir, max_model_len=64, kv_cache_memory="2MiB", block_size=4, max_num_batched_tokens=16,
              enable_prefix_caching=False)  # the second run then computes what the first did
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [100, 101, 102]]
    first_run = llm.generate(prompts, GREEDY)
    plain = [o.outputs[0].token_ids for o in first_run]
    policy = RecordingPolicy()
    llm.engine.runner.kv_policy = policy
    recorded_run = llm.generate(prompts, GREEDY)
    recorded = [o.outputs[0].token_ids for o in recorded_run]
    assert recorded == plain  # hooks that do nothing change nothing
    names = [c[0] for c in policy.calls]
    # per step: on_free, then (no moves or copies here) begin_step before the forward, end_step after it
    steps = [names[i:i + 3] for i in range(0, len(names), 3)]
    assert len(names) % 3 == 0 and all(s == ["on_free", "begin_step", "end_step"] for s in steps), names
    begins = [c for c in policy.calls if c[0] == "begin_step"]
    ends = [c for c in policy.calls if c[0] == "end_step"]
    for (_, seqs, ctx_lens), (_, end_ids, stats, block_size) in zip(begins, ends, strict=True):
        assert [r for r, _ in seqs] == end_ids and stats is None and block_size == 4
        lens = [q for _, q in seqs]
        assert lens == sorted(lens, key=lambda q: q > 1)  # decodes (1 row) first, as the rows are laid out
        assert all(c >= q for (_, q), c in zip(seqs, ctx_lens, strict=True))
    # the first step prefills both prompts whole (10 + 3 tokens fit the budget of 16), then both decode
    assert [q for _, q in begins[0][1]] == [10, 3] and begins[0][2] == [10, 3]
    assert [q for _, q in begins[1][1]] == [1, 1] and begins[1][2] == [11, 4]
    req_ids = {r for _, seqs, _ in begins for r, _ in seqs}
    assert req_ids == {o.request_id for o in recorded_run}
    # a request's end reaches the runner with the next step: the first step frees the first run's requests
    frees = [c[1] for c in policy.calls if c[0] == "on_free"]
    assert set(frees[0]) == {o.request_id for o in first_run}
    assert all(f == [] for f in frees[1:])  # both finish at the last step: freed with the next run


def test_runner_reports_copies_to_the_policy(model_dir):
    """n > 1 forks share the prompt's partly filled last block: the copy-on-write reaches the policy."""
    llm = LLM(model_dir, max_model_len=64, kv_cache_memory="2MiB", block_size=4, max_num_batched_tokens=16)
    policy = RecordingPolicy()
    llm.engine.runner.kv_policy = policy
    llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(n=2, max_tokens=4, temperature=0, ignore_eos=True))
    copies = [c[1] for c in policy.calls if c[0] == "on_copy_blocks"]
    assert copies and all(len(c) >= 1 and all(s != d for s, d in c) for c in copies)
    assert not any(c[0] == "on_move_kv" for c in policy.calls)  # nothing compacts under a non-evicting policy


@pytest.mark.parametrize("policy", [KVPolicy(), StreamingPolicy(budget=8, sink_tokens=2)])
def test_full_and_streaming_hooks_are_no_ops(policy):
    seq = ScheduledRequest("a", [1, 2, 3], num_computed_tokens=0, block_ids=[0], num_samples=1)
    assert policy.begin_step([seq], [3], torch.device("cpu")) is None
    assert policy.end_step([seq], None, 4) == {}
    assert policy.on_free(["a"]) is None and policy.on_move_kv([0, 1], 4) is None
    assert policy.on_copy_blocks([(0, 1)]) is None


def test_h2o_begin_step_hands_in_one_row_buffer_per_sequence():
    policy = H2OPolicy(budget=6, recent=2)
    seqs = [ScheduledRequest("a", [1, 2, 3, 4, 5, 6], 0, [0, 1], 1), ScheduledRequest("b", [1, 2, 3], 0, [2], 1)]
    stats = policy.begin_step(seqs, [6, 3], torch.device("cpu"))
    assert stats is not None and stats.key_mass is None
    assert [tuple(t.shape) for t in stats.row_mass] == [(6, 6), (3, 3)]
    assert all(t.dtype == torch.float32 and not t.any() for t in stats.row_mass)
    # b's 3 entries fit under keep = 5; a's 6 do not: it keeps the 2 recent and the 3 heaviest older entries
    stats.row_mass[0][5] = torch.tensor([0.5, 0.1, 0.4, 0.3, 0.2, 0.9])
    assert policy.end_step(seqs, stats, 4) == {"a": [0, 2, 3, 4, 5]}
    assert policy._scores.scores["a"].tolist() == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.9])
    policy.on_free(["a", "b"])
    assert policy._scores.scores == {}


# ---- AttentionMetadata.for_sequences ---------------------------------------------------------------------

def _tiny_runner(block_size: int) -> ModelRunner:
    config = tiny_config(max_position_embeddings=64)
    model = build_model(config, random_state_dict(config, seed=3), torch.float32)
    model.init_rope(64)
    return ModelRunner(model, num_blocks=16, block_size=block_size, dtype=torch.float32)


def _fields(meta: AttentionMetadata) -> dict:
    names = ("slot_mapping", "query_start_loc", "block_tables", "context_lens", "logits_indices", "sink_cos",
             "sink_sin")
    out = {n: None if getattr(meta, n) is None else getattr(meta, n).tolist() for n in names}
    out.update(num_decodes=meta.num_decodes, sliding_window=meta.sliding_window,
               num_sink_tokens=meta.num_sink_tokens, evicting=meta.evicting, stats=meta.stats)
    return out


def test_for_sequences_equals_what_the_runner_builds():
    runner = _tiny_runner(block_size=4)
    # the scheduler's order puts a prefill chunk first; the runner lays decodes first
    chunk = ScheduledRequest("b", [11, 12, 13, 14, 15, 16], num_computed_tokens=4, block_ids=[7, 2, 9],
                             num_samples=1)
    decode = ScheduledRequest("a", [21], num_computed_tokens=9, block_ids=[3, 5, 8], num_samples=1)
    ids, positions, meta, _ = runner.prepare(SchedulerOutput(scheduled=[chunk, decode]))
    assert ids.tolist() == [21, 11, 12, 13, 14, 15, 16] and positions.tolist() == [9, 4, 5, 6, 7, 8, 9]
    # by hand: entry i of a request lives in slot block_ids[i // 4] * 4 + i % 4
    assert meta.slot_mapping.tolist() == [8 * 4 + 1, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4, 9 * 4 + 1]
    assert meta.num_decodes == 1 and meta.query_start_loc.tolist() == [0, 1, 7]
    assert meta.block_tables.tolist() == [[3, 5, 8], [7, 2, 9]] and meta.context_lens.tolist() == [10, 10]
    assert meta.logits_indices.tolist() == [6, 0]  # the scheduler's order: b's last row, then a's
    built = AttentionMetadata.for_sequences([1, 6], [10, 10], [[3, 5, 8], [7, 2, 9]], 4, logits_indices=[6, 0])
    assert _fields(built) == _fields(meta)


def test_for_sequences_of_a_fresh_prompt_equals_the_runners_prefill():
    """What evaluation builds (one sequence from position 0 over blocks 0, 1, ...) is the runner's prefill."""
    runner = _tiny_runner(block_size=4)
    prompt = ScheduledRequest("p", list(range(3, 13)), num_computed_tokens=0, block_ids=[0, 1, 2], num_samples=1)
    _, _, meta, _ = runner.prepare(SchedulerOutput(scheduled=[prompt]))
    built = AttentionMetadata.for_sequences([10], [10], [[0, 1, 2]], 4, logits_indices=[9])
    assert _fields(built) == _fields(meta)
    assert meta.slot_mapping.tolist() == list(range(10)) and meta.logits_indices.tolist() == [9]
    # every row sampled, in order: no gather before the head
    assert AttentionMetadata.for_sequences([1, 1], [3, 5], [[0], [1, 2]], 4, logits_indices=[0, 1]) \
        .logits_indices is None


def test_for_sequences_sink_rotation_follows_the_streaming_policy():
    policy = StreamingPolicy(budget=8, sink_tokens=2)  # window 6
    runner = ModelRunner(_tiny_runner(4).model, num_blocks=16, block_size=4, dtype=torch.float32, kv_policy=policy)
    decode = ScheduledRequest("a", [5], num_computed_tokens=13, block_ids=[0, -1, 2, 3], num_samples=1)
    _, positions, meta, _ = runner.prepare(SchedulerOutput(scheduled=[decode]))
    assert meta.evicting and meta.sliding_window == 6 and meta.num_sink_tokens == 2
    cos, sin = runner.model.rope.cos_sin(torch.tensor([policy.num_evicted(13)]))  # E = 13 - 6 - 2 + 1 = 6
    assert torch.equal(meta.sink_cos, cos) and torch.equal(meta.sink_sin, sin)
    built = AttentionMetadata.for_sequences([1], [14], [[0, -1, 2, 3]], 4, positions=positions, sliding_window=6,
                                            num_sink_tokens=2, evicting=True, cos_sin=runner.model.rope.cos_sin,
                                            logits_indices=[0])
    assert _fields(built) == _fields(meta)


def test_for_sequences_wants_decodes_first():
    with pytest.raises(AssertionError, match="decodes"):
        AttentionMetadata.for_sequences([3, 1], [3, 5], [[0], [1, 2]], 4)


def test_for_sequences_of_calibration_batches():
    """The calibration form (b sequences of L tokens, one block of L slots each) lays rows sequence by sequence."""
    meta = AttentionMetadata.for_sequences([5, 5], [5, 5], [[0], [1]], 5)
    assert meta.slot_mapping.tolist() == list(range(10)) and meta.num_decodes == 0
    assert meta.query_start_loc.tolist() == [0, 5, 10] and meta.block_tables.tolist() == [[0], [1]]
