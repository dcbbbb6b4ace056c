"""KV eviction policies: the kept tokens on hand-made cases, blocks returned to the pool (none leaked, shared
ones intact), StreamingLLM's RoPE handling against the paper's re-rotated cache, and chunking invariance."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from gguf_utils import random_state_dict, tiny_config

from brisk.engine.config import CacheConfig, EngineConfig, SpecConfig
from brisk.engine.request import Request
from brisk.eval.longppl import h2o_stream_nll, oracle_nll, stream_nll
from brisk.eval.ppl import sequence_logits
from brisk.kvcache.manager import KVCacheManager
from brisk.kvcache.policy import H2OPolicy, KVPolicy, StreamingPolicy, h2o_keep, make_policy
from brisk.model.loader import LoadedModel, build_model
from brisk.model.rope import apply_rope, base_inv_freq
from brisk.ops.attention import AttentionMetadata, AttentionStats, paged_attention, write_kv


def tiny_loaded() -> LoadedModel:
    """A random 2-layer model (no tokenizer needed: the stream is given as ids)."""
    config = tiny_config(max_position_embeddings=64)
    model = build_model(config, random_state_dict(config, seed=3), torch.float32)
    model.init_rope(64)
    return LoadedModel(model, config, None, Path("tiny"), torch.float32, 0.0)  # type: ignore[arg-type]


def make_request(req_id: str, num_tokens: int) -> Request:
    return Request(req_id, list(range(100, 100 + num_tokens)), sampling_params=None)


# ---- the policy on its own ----------------------------------------------------------------------------

def test_streaming_keeps_sinks_and_window_exactly():
    p = StreamingPolicy(budget=8, sink_tokens=2)  # window 6
    kept = [j for j in range(20) if p.is_kept(j, 19)]
    assert kept == [0, 1, 14, 15, 16, 17, 18, 19]
    assert [j for j in range(6) if p.is_kept(j, 5)] == [0, 1, 2, 3, 4, 5]  # nothing evicted yet
    assert p.num_evicted(19) == 12 and p.num_evicted(7) == 0 and p.num_evicted(8) == 1
    window_only = StreamingPolicy(budget=8, sink_tokens=0)
    assert [j for j in range(20) if window_only.is_kept(j, 19)] == list(range(12, 20))


def test_streaming_evictable_blocks():
    p = StreamingPolicy(budget=8, sink_tokens=2)  # window 6, blocks of 4
    # the next query at 13 sees the window 8..13 (lo = 8): block 0 holds the sinks, block 1 (4..7) can go
    assert p.evictable_blocks(13, 4, 4) == range(1, 2)
    assert p.evictable_blocks(12, 4, 4) == range(1, 1)  # lo = 7: block 1 (4..7) still needed
    assert p.evictable_blocks(3, 1, 4) == range(1, 1)
    assert StreamingPolicy(budget=8, sink_tokens=5).evictable_blocks(30, 8, 4) == range(2, 7)  # sinks span 2; lo = 28
    assert KVPolicy().evictable_blocks(100, 10, 4) == range(0)


# ---- the manager: blocks back to the pool, nothing leaked, shared blocks untouched -----------------------

def test_manager_evicts_blocks_and_frees_everything():
    m = KVCacheManager(num_blocks=6, block_size=4, enable_caching=False, policy=StreamingPolicy(8, 2))
    r = make_request("r", 40)
    held = []
    for _ in range(40):  # decode-like: one token per step
        assert m.allocate_slots(r, 1) == []
        held.append(m.get_num_blocks("r"))
        r.num_computed_tokens += 1
    # sink block + at most 3 window blocks (6 tokens over block boundaries) at any time
    assert max(held) <= 4 and held[-1] <= 4
    ids = m.get_block_ids("r")
    assert ids[0] >= 0 and ids[1] == -1 and ids[-1] >= 0
    m.free(r)
    assert m.num_free_blocks == 6


def test_eviction_never_touches_a_shared_prefix_block():
    m = KVCacheManager(num_blocks=12, block_size=4, enable_caching=True, policy=StreamingPolicy(8, 0))
    a = make_request("a", 16)
    assert m.allocate_slots(a, 16) == []
    a.num_computed_tokens = 16
    b = make_request("b", 17)  # same first 16 tokens: 4 full blocks hit
    hits, num_hit = m.get_computed_blocks(b)
    assert num_hit == 16
    assert m.allocate_slots(b, 1, hits, num_hit) == []
    b.num_computed_tokens = 17
    shared = m.get_block_ids("b")[:4]
    assert shared == m.get_block_ids("a")
    assert [m.block_pool.blocks[i].ref_cnt for i in shared] == [2, 2, 2, 2]
    b.all_token_ids.append(7)
    m.allocate_slots(b, 1)  # next query at 17 sees 10..17: b drops blocks 0 and 1, only its own references
    assert m.get_block_ids("b")[:2] == [-1, -1]
    assert [m.block_pool.blocks[i].ref_cnt for i in shared] == [1, 1, 2, 2]
    assert m.get_block_ids("a") == shared  # a's table and the cache map are unchanged
    assert all(m.block_pool.blocks[i].block_hash is not None for i in shared)
    m.free(a)
    m.free(b)
    assert m.num_free_blocks == 12


def test_randomized_streams_never_leak():
    rng = random.Random(0)
    m = KVCacheManager(num_blocks=40, block_size=4, enable_caching=True, policy=StreamingPolicy(10, 3))
    live: dict[str, Request] = {}
    for step in range(300):
        if len(live) < 4 and rng.random() < 0.2:
            r = make_request(f"r{step}", rng.randint(2, 60))
            hits, num_hit = m.get_computed_blocks(r)
            if m.allocate_slots(r, rng.randint(1, r.num_tokens - num_hit), hits, num_hit) is not None:
                r.num_computed_tokens = num_hit
                live[r.request_id] = r
                continue
        for r in list(live.values()):
            num_new = min(rng.randint(1, 8), r.num_tokens - r.num_computed_tokens)
            if num_new <= 0 or rng.random() < 0.1:
                m.free(r)
                del live[r.request_id]
                continue
            if m.allocate_slots(r, num_new) is None:
                m.free(r)
                del live[r.request_id]
                continue
            r.num_computed_tokens += num_new
            # every token the next query keeps still has a block
            ids = m.get_block_ids(r.request_id)
            for j in range(r.num_computed_tokens):
                if m.policy.is_kept(j, r.num_computed_tokens):
                    assert ids[j // 4] >= 0
        held = sum(m.get_num_blocks(rid) for rid in live)
        assert m.num_free_blocks + len({b for rid in live for b in m.get_block_ids(rid) if b >= 0}) == 40
        assert held >= 0
    for r in live.values():
        m.free(r)
    assert m.num_free_blocks == 40


# ---- attention: RoPE positions as in the paper ---------------------------------------------------------

def test_sink_window_attention_equals_the_papers_rerotated_cache():
    """The paper caches keys before RoPE and rotates them by their *cache* position each step (sinks 0..S-1,
    window S..S+W-1, query last). brisk caches post-RoPE keys at original positions and rotates the query back
    by E for the sink columns; the outputs must agree."""
    torch.manual_seed(0)
    kvh, h, d, n = 2, 4, 16, 30
    sinks, window, bs = 3, 7, 4
    inv_freq = base_inv_freq(d, 10000.0)

    def rot(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [T, heads, d], pos [T]
        freqs = pos.float().unsqueeze(1) * inv_freq  # [T, d/2]
        return apply_rope(x, freqs.cos(), freqs.sin())

    q_raw = torch.randn(n, h, d)
    k_raw = torch.randn(n, kvh, d)
    v = torch.randn(n, kvh, d)
    pos = torch.arange(n)
    q, k = rot(q_raw, pos), rot(k_raw, pos)  # what the model computes: RoPE at original positions

    num_blocks = n // bs + 2
    cache = torch.zeros(2, num_blocks, bs, kvh, d)
    table = list(range(num_blocks))
    write_kv(cache, k, v, pos)  # slots = positions (identity table)

    def cos_sin(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # RoPE of e: [T] -> 2 x [T, d/2]
        freqs = e.float()[:, None] * inv_freq
        return freqs.cos(), freqs.sin()

    for t in [5, 10, 11, 20, 29]:  # queries before and after eviction starts (t >= S + W)
        meta = AttentionMetadata.for_sequences([1], [t + 1], [table], bs, positions=torch.tensor([t]),
                                               sliding_window=window, num_sink_tokens=sinks, evicting=True,
                                               cos_sin=cos_sin)
        assert meta.slot_mapping.tolist() == [t]
        out = paged_attention(q[t:t + 1], k[t:t + 1], v[t:t + 1], cache, meta, d**-0.5)
        # the paper: kept tokens in order, pre-RoPE keys rotated by cache position 0..L-1, query at L-1
        kept = [j for j in range(t + 1) if j < sinks or j > t - window]
        cache_pos = torch.arange(len(kept))
        kk = rot(k_raw[kept], cache_pos).repeat_interleave(h // kvh, dim=1)  # [L, h, d]
        qq = rot(q_raw[t:t + 1], cache_pos[-1:])  # [1, h, d]
        probs = (torch.einsum("qhd,khd->hqk", qq, kk) * d**-0.5).softmax(-1)
        ref = torch.einsum("hqk,khd->qhd", probs, v[kept].repeat_interleave(h // kvh, dim=1))
        assert torch.allclose(out, ref, atol=1e-5), t


@pytest.mark.parametrize("chunk", [1, 5])
def test_chunked_stream_equals_token_by_token(chunk):
    """The mask is per row, so a chunk of queries sees exactly what each would see alone."""
    loaded = tiny_loaded()
    ids = list(torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist())
    policy = StreamingPolicy(budget=12, sink_tokens=2)
    one, _ = stream_nll(loaded, ids, policy, chunk=1, block_size=4)
    many, held = stream_nll(loaded, ids, policy, chunk=chunk, block_size=4)
    assert torch.allclose(one, many, atol=1e-4)
    assert held <= 1 + (10 + chunk) // 4 + 2


def test_stream_modes_on_a_tiny_model():
    """A budget covering the whole stream keeps everything: streaming == window == full; smaller budgets
    evict and differ; the oracle with a budget >= the stream is the full forward."""
    loaded = tiny_loaded()
    ids = list(torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(2)).tolist())
    full, _ = stream_nll(loaded, ids, KVPolicy(), chunk=7, block_size=4)
    big, _ = stream_nll(loaded, ids, StreamingPolicy(budget=64, sink_tokens=4), chunk=7, block_size=4)
    assert torch.allclose(full, big, atol=1e-4)
    small, _ = stream_nll(loaded, ids, StreamingPolicy(budget=8, sink_tokens=2), chunk=7, block_size=4)
    assert not torch.allclose(full[10:], small[10:], atol=1e-3)
    assert torch.allclose(full[:7], small[:7], atol=1e-4)  # before the first eviction nothing differs


    assert torch.allclose(oracle_nll(loaded, ids, budget=64, stride=5), full, atol=1e-4)
    # stride 1 is the exact oracle: token t is predicted from exactly the `budget` tokens before it (here 8)
    exact = oracle_nll(loaded, ids, budget=8, stride=1)

    t = 20
    logits = sequence_logits(loaded, torch.tensor(ids[t - 8:t]))
    ref = -torch.log_softmax(logits[-1], -1)[ids[t]]
    assert torch.allclose(exact[t - 1], ref, atol=1e-4)


def test_long_perplexity_pools_consecutive_streams():
    """--streams N scores N consecutive streams of max_tokens each (it once truncated the text to one)."""
    from brisk.eval.longppl import long_perplexity

    class CharIds:  # the tiny model has no tokenizer: ids straight from the characters
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [3 + ord(ch) % 290 for ch in text]

    loaded = tiny_loaded()
    loaded.tokenizer = CharIds()  # type: ignore[assignment]
    text = "the quick brown fox jumps over the lazy dog; " * 4
    one = long_perplexity(loaded, text, "full", max_tokens=40, chunk=8, block_size=4, progress=False)
    two = long_perplexity(loaded, text, "full", max_tokens=40, chunk=8, block_size=4, progress=False,
                          num_streams=2)
    assert (one.num_tokens, two.num_tokens) == (39, 78)
    second = long_perplexity(loaded, text[40:], "full", max_tokens=40, chunk=8, block_size=4, progress=False)
    assert abs(two.nll - (one.nll + second.nll) / 2) < 1e-5


def test_bench_kv_capacity_counts_through_the_manager():
    from brisk.bench.kv import KVSetting, max_concurrent

    assert max_concurrent(10, KVSetting("auto", "full", block_size=4), seq_len=8, chunk=3) == 5
    assert max_concurrent(10, KVSetting("auto", "full", block_size=4), seq_len=40) == 1
    # streaming, 2 sinks + a window of 4, token by token: a finished 40-token request holds the sink block and
    # block 9 (tokens 36..39): 2 blocks. While running it needs up to 3 (the window straddles two blocks, plus
    # the sink block), so in 12 blocks 5 finish and the 6th (2 left) does not fit
    assert max_concurrent(12, KVSetting("auto", "streaming", budget=6, sink_tokens=2, block_size=4),
                          seq_len=40, chunk=1) == 5
    # h2o, budget 6: compacted to 5 entries before each token, so 6 entries in 2 blocks of 4 at most: 6 requests
    assert max_concurrent(12, KVSetting("auto", "h2o", budget=6, block_size=4), seq_len=40, chunk=1) == 6


# ---- H2O ---------------------------------------------------------------------------------------------------

def test_h2o_keeps_recent_plus_heavy_hitters():
    scores = [5.0, 0.1, 3.0, 0.2, 3.0, 9.0, 0.0, 0.0]
    # keep 5: the 2 newest (6, 7) + the 3 heaviest older ones: 5 (9.0), 0 (5.0), then 2 and 4 tie at 3.0 -> 2
    assert h2o_keep(scores, recent=2, keep=5) == [0, 2, 5, 6, 7]
    assert h2o_keep(scores, recent=2, keep=8) == list(range(8))  # nothing to evict
    assert h2o_keep(scores, recent=3, keep=3) == [5, 6, 7]  # all budget to recent tokens
    with pytest.raises(ValueError):
        H2OPolicy(budget=4, recent=4)


def test_h2o_stream_on_a_tiny_model():
    loaded = tiny_loaded()
    ids = list(torch.randint(3, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist())
    full, _ = stream_nll(loaded, ids, KVPolicy(), chunk=7, block_size=4)
    roomy, _ = h2o_stream_nll(loaded, ids, H2OPolicy(budget=40, recent=20), chunk=3, block_size=4)
    assert torch.allclose(full, roomy, atol=1e-4)  # a budget above the stream evicts nothing
    tight, held = h2o_stream_nll(loaded, ids, H2OPolicy(budget=10, recent=5), chunk=2, block_size=4)
    assert torch.allclose(full[:8], tight[:8], atol=1e-4)  # no query has yet lost a token
    assert not torch.allclose(full[12:], tight[12:], atol=1e-3)
    assert held <= 3  # 10 tokens in blocks of 4


def test_attention_scores_hold_one_unit_of_mass_per_head_and_query():
    loaded = tiny_loaded()
    c = loaded.config
    n = 9
    caches = [torch.zeros(2, 4, 4, c.num_key_value_heads, c.head_dim) for _ in range(c.num_hidden_layers)]
    scores = torch.zeros(n)
    meta = AttentionMetadata.for_sequences([n], [n], [list(range(4))], 4, evicting=True,
                                           stats=AttentionStats(key_mass=[scores]))
    with torch.inference_mode():
        loaded.model(torch.arange(3, 3 + n), torch.arange(n), meta, caches)
    assert torch.allclose(scores.sum(), torch.tensor(float(c.num_hidden_layers * c.num_attention_heads * n)))
    assert scores[0] > scores[-1]  # causal: the first key is seen by every query, the last by one


def test_h2o_settings():
    assert make_policy("h2o", 10) == H2OPolicy(10, 5) and H2OPolicy(10, 5).keep == 9
    assert make_policy("h2o", 10, recent=3).recent == 3
    with pytest.raises(ValueError, match="must exceed the recent window"):
        H2OPolicy(budget=5, recent=5)
    with pytest.raises(ValueError, match="positive recent window"):
        H2OPolicy(budget=5, recent=0)
    with pytest.raises(ValueError, match="h2o-recent"):
        CacheConfig(kv_policy="h2o", kv_budget=4, h2o_recent=6)
    with pytest.raises(ValueError, match="kv_cache_dtype auto with h2o"):
        CacheConfig(kv_policy="h2o", kv_budget=64, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="no meaning"):
        CacheConfig(kv_policy="streaming", kv_budget=64, h2o_recent=8)
    with pytest.raises(ValueError, match="speculative decoding does not support kv_policy h2o"):
        EngineConfig(cache=CacheConfig(kv_policy="h2o", kv_budget=64), spec=SpecConfig("ngram"))
    assert CacheConfig(kv_policy="h2o", kv_budget=64).h2o_recent == 32


def test_h2o_compaction_keeps_exactly_the_chosen_entries_in_private_blocks():
    # blocks of 4, keep = 5: a 10-token prompt fills blocks 0, 1 (both registered in the prefix cache) and half of 2
    m = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, policy=H2OPolicy(budget=6, recent=2))
    r = make_request("r", 10)
    assert m.allocate_slots(r, 10) == []
    r.num_computed_tokens = 10
    b0, b1, b2 = m.get_block_ids("r")
    hashes = [m.block_pool.blocks[b].block_hash for b in (b0, b1)]
    assert None not in hashes and m.block_pool.blocks[b2].block_hash is None
    kept = h2o_keep([5.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0], recent=2, keep=5)
    assert kept == [0, 3, 7, 8, 9]  # heavy hitters 0, 3, 7 + the 2 newest
    m.schedule_compaction(r, kept)
    r.all_token_ids.append(7)
    assert m.allocate_slots(r, 1) == []  # compacts, then the 11th token's slot: entry 5, in the second block
    # destinations: b0 and b1 are cached, so b2 (private, past the kept range) and one fresh block replace them
    new0, new1 = m.get_block_ids("r")
    assert new0 == b2 and new1 not in (b0, b1, b2)
    src, dst = m.take_kv_moves()
    slot = lambda b, i: b * 4 + i  # noqa: E731
    # entry j of the kept list goes to entry j: 0, 1, 2, 3 in b2 (entry 8 moves within b2), 4 in the fresh block
    assert list(zip(src, dst, strict=True)) == [
        (slot(b0, 0), slot(b2, 0)), (slot(b0, 3), slot(b2, 1)), (slot(b1, 3), slot(b2, 2)),
        (slot(b2, 0), slot(b2, 3)), (slot(b2, 1), slot(new1, 0))]
    assert m.take_kv_moves() == ([], [])
    assert m.get_num_cache_entries(r) == 5
    # b0, b1 were only dereferenced: free, still cached under their hashes, contents never written
    assert [m.block_pool.get_cached_block(h).block_id for h in hashes] == [b0, b1]
    assert all(m.block_pool.blocks[b].ref_cnt == 0 for b in (b0, b1))
    r.num_computed_tokens = 11
    for t in range(12, 20):  # a compacted table registers nothing more in the prefix cache
        r.all_token_ids.append(t)
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    assert all(m.block_pool.blocks[b].block_hash is None for b in m.get_block_ids("r"))
    m.free(r)
    assert m.num_free_blocks == 8


def test_h2o_compaction_never_writes_a_shared_block():
    m = KVCacheManager(num_blocks=12, block_size=4, enable_caching=False, policy=H2OPolicy(budget=6, recent=2))
    parent, child = make_request("p", 9), make_request("c", 9)
    assert m.allocate_slots(parent, 9) == []
    parent.num_computed_tokens = child.num_computed_tokens = 9
    m.fork(parent, child)  # n > 1: both tables hold the same 3 blocks
    shared = m.get_block_ids("p")
    m.schedule_compaction(child, [0, 1, 2, 7, 8])
    assert m.allocate_slots(child, 0) == []
    assert m.get_block_ids("p") == shared  # the parent's table and blocks are untouched
    assert not set(m.get_block_ids("c")) & set(shared)
    _, dst = m.take_kv_moves()
    assert not {d // 4 for d in dst} & set(shared)
    assert [m.block_pool.blocks[b].ref_cnt for b in shared] == [1, 1, 1]
    m.free(parent)
    m.free(child)
    assert m.num_free_blocks == 12


def test_h2o_randomized_compactions_never_write_shared_blocks_nor_leak():
    rng = random.Random(1)
    policy = H2OPolicy(budget=7, recent=3)
    m = KVCacheManager(num_blocks=40, block_size=4, enable_caching=True, policy=policy)
    prefix = list(range(500, 512))  # 3 shared blocks: prefix hits give tables with ref_cnt > 1 and cached blocks
    live: dict[str, Request] = {}
    for step in range(300):
        if len(live) < 4 and rng.random() < 0.3:
            tail = [rng.randint(0, 99) for _ in range(rng.randint(1, 9))]
            r = Request(f"r{step}", prefix[:rng.randint(0, 12)] + tail, sampling_params=None)
            hits, num_hit = m.get_computed_blocks(r)
            if m.allocate_slots(r, 0, hits, num_hit) is not None:  # admission: take the hits, compute later
                r.num_computed_tokens = num_hit
                live[r.request_id] = r
        for r in list(live.values()):
            if rng.random() < 0.05:  # finished, aborted or preempted
                m.free(r)
                del live[r.request_id]
                continue
            if r.num_computed_tokens == r.num_tokens:
                r.all_token_ids.append(rng.randint(0, 99))  # a decoded token
            num_new = min(r.num_tokens - r.num_computed_tokens, rng.randint(1, 5))
            if m.allocate_slots(r, num_new) is None:
                continue
            src, dst = m.take_kv_moves()
            others = {b for o in live.values() if o is not r for b in m.get_block_ids(o.request_id)}
            for d in dst:
                block = m.block_pool.blocks[d // 4]
                assert block.ref_cnt == 1 and block.block_hash is None and block.block_id not in others
            assert len(src) == len(dst)
            r.num_computed_tokens += num_new
            entries = m.get_num_cache_entries(r)
            assert entries <= policy.keep + 5 + 12  # kept + one chunk (+ a first prefix hit)
            if entries > policy.keep:  # what the runner would send back: any `keep` entries, the newest included
                older = rng.sample(range(entries - policy.recent), policy.keep - policy.recent)
                m.schedule_compaction(r, sorted(older) + list(range(entries - policy.recent, entries)))
    for r in live.values():
        m.free(r)
    assert m.num_free_blocks == 40


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "int4"])
def test_sink_window_kernel_matches_the_reference_with_evicted_blocks(kind, monkeypatch):
    """StreamingLLM on the C++ kernel (paged_attention_general with sinks): several sequences, decodes and a chunk,
    blocks behind every window evicted (-1 in the tables, never read), each row's back-rotated query on the sink
    keys; the same outputs as the PyTorch reference over the same cache."""
    from brisk.kvcache.quant import make_kv_caches
    from brisk.ops import kernels

    if kernels.get_op("paged_attention_general") is None:
        pytest.fail("the C++ kernels did not build")
    g = torch.Generator().manual_seed(4)
    kvh, h, d, bs, sinks, window = 2, 6, 32, 4, 3, 9
    inv_freq = base_inv_freq(d, 10000.0)

    def cos_sin(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = e.float()[:, None] * inv_freq
        return freqs.cos(), freqs.sin()

    query_lens, contexts = [1, 1, 1, 6], [40, 12, 3, 31]
    num_blocks = sum((c + bs - 1) // bs for c in contexts) + 2
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    cache = make_kv_caches("auto" if kind in ("float32", "bfloat16") else kind, 1, num_blocks, bs, kvh, d, dtype,
                           num_residual_blocks=3)[0]
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables, positions = [], []
    for q_len, ctx in zip(query_lens, contexts, strict=True):
        n = (ctx + bs - 1) // bs
        blocks, pool = pool[:n], pool[n:]
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(ctx)])
        k, v = torch.randn(2, ctx, kvh, d, generator=g).to(dtype)
        write_kv(cache, k, v, slots)
        lo = max(0, ctx - q_len + 1 - window)  # the first row's window start: blocks wholly before it (and after
        for j in range(n):  # the sinks) are evicted
            if (j + 1) * bs <= lo and j * bs >= sinks:
                blocks[j] = -1
        tables.append(blocks)
        positions += range(ctx - q_len, ctx)
    meta = AttentionMetadata.for_sequences(query_lens, contexts, tables, bs, positions=torch.tensor(positions),
                                           sliding_window=window, num_sink_tokens=sinks, evicting=True,
                                           cos_sin=cos_sin)
    assert bool((meta.block_tables < 0).any())
    q = torch.randn(sum(query_lens), h, d, generator=g).to(dtype)
    new = q[:, :kvh]
    import brisk.ops.attention as attention

    reference = attention._sink_window_attention
    calls = []
    monkeypatch.setattr(attention, "_sink_window_attention", lambda *a: calls.append(1) or reference(*a))
    got = paged_attention(q, new, new, cache, meta, d**-0.5)
    assert not calls  # the kernel ran
    want = paged_attention(q, new, new, cache, meta, d**-0.5, use_kernels=False)
    assert calls
    tol = 1e-5 if dtype == torch.float32 and kind != "int4" else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
