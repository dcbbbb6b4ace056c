"""The C++ paged-attention kernels against a plain oracle, and the pure-PyTorch fallback that replaces them.

The oracle walks each sequence's block table position by position (independent of brisk's slot arithmetic),
gathers K/V, and runs a float64 masked softmax. Block tables are shuffled, non-contiguous slices of the pool,
with garbage in the padding columns, so reading a wrong block or a padding column shows up as a wrong number.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.ops import kernels
from brisk.ops.attention import AttentionMetadata, paged_attention, write_kv

BLOCK = 16
DTYPES = [torch.float32, torch.bfloat16]
HEADS = [(4, 4), (4, 2), (9, 3), (4, 1)]  # (query heads, kv heads): MHA, GQA, GQA as SmolLM2, MQA
CONTEXTS = [1, 15, 16, 17, 300]


@pytest.fixture(scope="session")
def ops():
    """Build (or load the cached build of) the extension once per test session, whatever the environment says."""
    with kernels.override(enabled=True):
        found = kernels.get_ops()
    if found is None:
        pytest.fail("the C++ kernels did not build; see the warning logged by brisk.ops.kernels")
    return found


def oracle(q, kv_cache, query_start_loc, block_tables, context_lens, scale, window=0):
    """float64 attention of each sequence's query rows against its cached context, read position by position."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // kv_cache.shape[3]
    for b in range(len(context_lens)):
        ctx, r0, r1 = int(context_lens[b]), int(query_start_loc[b]), int(query_start_loc[b + 1])
        positions = torch.arange(ctx)
        blocks = block_tables[b].long()[positions // BLOCK]  # the block holding each position
        k = kv_cache[0, blocks, positions % BLOCK].double()  # [ctx, kvh, d]
        v = kv_cache[1, blocks, positions % BLOCK].double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [ctx, h, d]
        scores = torch.einsum("qhd,khd->hqk", q[r0:r1].double(), k) * scale
        pos = torch.arange(ctx - (r1 - r0), ctx)[:, None]  # absolute position of each query row
        key = torch.arange(ctx)[None]
        visible = (key <= pos) & ((key > pos - window) if window else True)
        out[r0:r1] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    return out


def random_problem(query_lens, context_lens, num_heads, num_kv_heads, dtype, head_dim=64, seed=0):
    """q [T, h, d], a cache with more blocks than needed, shuffled block tables with garbage padding."""
    g = torch.Generator().manual_seed(seed)
    needed = [(c + BLOCK - 1) // BLOCK for c in context_lens]
    num_blocks = sum(needed) + 7
    kv_cache = torch.randn(2, num_blocks, BLOCK, num_kv_heads, head_dim, generator=g).to(dtype)
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(context_lens), max(needed) + 2), 10**6, dtype=torch.int32)  # padding: never read
    for b, n in enumerate(needed):
        tables[b, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        pool = pool[n:]
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int64)
    q = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=g).to(dtype)
    return q, kv_cache, qsl, tables, torch.tensor(context_lens, dtype=torch.int32)


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def assert_matches(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    else:
        # Inputs are the same bfloat16 values for both; the kernel accumulates in float32 and rounds once on
        # output, so it must land within one bfloat16 ulp (relative 2^-8 .. 2^-7) of the correctly rounded result.
        torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=1e-6, rtol=2**-7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("repeat", [1, 4], ids=["split-heads", "all-heads"])  # few or many work items
def test_decode_matches_oracle(ops, dtype, heads, window, repeat):
    contexts = CONTEXTS * repeat
    q, kv_cache, qsl, tables, lens = random_problem([1] * len(contexts), contexts, *heads, dtype)
    out = torch.full_like(q, float("nan"))
    ops.paged_decode_attention(out, q, kv_cache, tables, lens, 0.125, window)
    assert_matches(out, oracle(q, kv_cache, qsl, tables, lens, 0.125, window), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(9, 3), (4, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("window", [0, 100, 300])
@pytest.mark.parametrize("contexts", [[97], [700], [130, 5], [1000, 64]], ids=str)
def test_split_k_decode_matches_oracle(ops, dtype, heads, window, contexts):
    """Few long decodes (batch 1-2): each kv head's keys are cut into parts walked by different threads and
    merged afterwards (flash-decoding); parts of whole 32-key chunks, windows cutting into the first part."""
    assert torch.get_num_threads() > 1  # the split needs threads to split for
    q, kv_cache, qsl, tables, lens = random_problem([1] * len(contexts), contexts, *heads, dtype, seed=len(contexts))
    out = torch.full_like(q, float("nan"))
    ops.paged_decode_attention(out, q, kv_cache, tables, lens, 0.125, window)
    assert_matches(out, oracle(q, kv_cache, qsl, tables, lens, 0.125, window), dtype)
    one = torch.full_like(q, float("nan"))  # one thread: no split at all; the same result up to rounding
    with torch_threads(1):
        ops.paged_decode_attention(one, q, kv_cache, tables, lens, 0.125, window)
    torch.testing.assert_close(out.float(), one.float(), atol=1e-5 if dtype == torch.float32 else 1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (9, 3)], ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("q_tile", [1, 5, 16])
def test_prefill_matches_oracle(ops, dtype, heads, window, q_tile):
    # chunked prefill with prior context, a fresh prompt, verification-sized chunks, a decode in the mix
    query_lens = [2, 17, 40, 1, 16, 33]
    contexts = [2 + 300, 17 + 16, 40, 15, 16 + 1, 33 + 5]
    q, kv_cache, qsl, tables, lens = random_problem(query_lens, contexts, *heads, dtype, seed=1)
    out = torch.full_like(q, float("nan"))
    ops.paged_prefill_attention(out, q, kv_cache, qsl, tables, lens, 0.125, window, q_tile)
    assert_matches(out, oracle(q, kv_cache, qsl, tables, lens, 0.125, window), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [8, 40, 80, 128])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (5, 1)], ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_head_dims_and_group_sizes(ops, dtype, head_dim, heads):
    """The AVX-512 build takes head_dim % 16 == 0 in 512-bit steps (80: a 64-column pass, then 16; 128: two
    passes) and three query rows of a GQA group at a time (groups of 3, 4 and 5: threes, then a pair or one);
    8 and 40 keep the 256-bit code. Decode (split-K and not) and prefill against the oracle."""
    for query_lens, contexts in [([1], [300]), ([1] * 4, [37, 130, 5, 64]), ([3, 17], [3 + 50, 17])]:
        q, kv_cache, qsl, tables, lens = random_problem(query_lens, contexts, *heads, dtype, head_dim=head_dim,
                                                        seed=head_dim)
        out = torch.full_like(q, float("nan"))
        if all(n == 1 for n in query_lens):
            ops.paged_decode_attention(out, q, kv_cache, tables, lens, 0.125, 0)
        else:
            ops.paged_prefill_attention(out, q, kv_cache, qsl, tables, lens, 0.125, 0, 16)
        assert_matches(out, oracle(q, kv_cache, qsl, tables, lens, 0.125, 0), dtype)


def test_strided_q_and_out_views(ops):
    """q may be a view into a fused qkv projection, out a slice of a bigger buffer: only d must be contiguous."""
    q, kv_cache, qsl, tables, lens = random_problem([1] * 5, CONTEXTS, 4, 2, torch.float32, seed=2)
    qkv = torch.randn(5, 4 + 2 + 2, 64)
    qkv[:, :4] = q
    big = torch.zeros(7, 4, 64)
    ops.paged_decode_attention(big[1:6], qkv[:, :4], kv_cache, tables, lens, 0.125, 0)
    torch.testing.assert_close(big[1:6], oracle(q, kv_cache, qsl, tables, lens, 0.125).float(), atol=1e-5,
                               rtol=1e-5)
    assert big[0].abs().sum() == 0 and big[6].abs().sum() == 0


def test_bfloat16_queries_on_float32_cache(ops):
    q, kv_cache, qsl, tables, lens = random_problem([1] * 5, CONTEXTS, 4, 2, torch.float32, seed=3)
    q = q.bfloat16()
    out = torch.empty_like(q)
    ops.paged_decode_attention(out, q, kv_cache, tables, lens, 0.125, 0)
    assert_matches(out, oracle(q, kv_cache, qsl, tables, lens, 0.125), torch.bfloat16)


def test_layout_errors_are_clear(ops):
    q, kv_cache, qsl, tables, lens = random_problem([1] * 5, CONTEXTS, 4, 2, torch.float32)
    out = torch.empty_like(q)
    bad = tables.clone()
    bad[4, 3] = kv_cache.shape[1]  # a block past the end of the pool, inside sequence 4's context
    with pytest.raises(RuntimeError, match=r"block_tables\[3\] = .* outside the cache"):
        ops.paged_decode_attention(out, q, kv_cache, bad, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="block_tables must be a contiguous int32"):
        ops.paged_decode_attention(out, q, kv_cache, tables.long(), lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="head_dim = kv_cache.size"):
        ops.paged_decode_attention(out[..., :32], q[..., :32], kv_cache, tables, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="kv_cache must be a contiguous"):
        ops.paged_decode_attention(out, q, kv_cache[:, :, :8], tables, lens, 0.125, 0)
    with pytest.raises(RuntimeError, match="query_len .* <= context_len"):
        ops.paged_prefill_attention(out, q, kv_cache, torch.tensor([0, 1, 2, 3, 4, 5]), tables,
                                    torch.tensor([1, 15, 16, 17, 0], dtype=torch.int32), 0.125, 0, 16)


def runner_metadata(query_lens, contexts, q, kv_cache, qsl, tables, lens, window):
    """Metadata as the runner builds it: decodes first; every row's own K/V already written to the cache."""
    slots = []
    for b, (q_len, ctx) in enumerate(zip(query_lens, contexts, strict=True)):
        slots += [int(tables[b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(ctx - q_len, ctx)]
    return AttentionMetadata(slot_mapping=torch.tensor(slots), num_decodes=sum(n == 1 for n in query_lens),
                             query_start_loc=qsl, block_tables=tables, context_lens=lens,
                             sliding_window=window or None)


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("disable", ["argument", "env"])
def test_paged_attention_kernel_and_fallback_agree(kernel_settings, ops, window, disable):
    """The layer-facing entry point, on a mixed decode + chunked-prefill batch, through both paths."""
    query_lens, contexts = [1, 1, 1, 5, 40], [300, 1, 17, 5 + 16, 40]
    q, kv_cache, qsl, tables, lens = random_problem(query_lens, contexts, 4, 2, torch.float32, seed=4)
    meta = runner_metadata(query_lens, contexts, q, kv_cache, qsl, tables, lens, window)
    k_new = kv_cache[0].reshape(-1, 2, 64)[meta.slot_mapping]  # [T, kvh, d]: this step's keys, as written
    v_new = kv_cache[1].reshape(-1, 2, 64)[meta.slot_mapping]
    write_kv(kv_cache, k_new, v_new, meta.slot_mapping)  # a no-op rewrite: exercises the runner's order
    want = oracle(q, kv_cache, qsl, tables, lens, 0.125, window).float()

    fast = paged_attention(q, k_new, v_new, kv_cache, meta, 0.125)
    assert meta._reference is None  # the kernel path builds no gather indices
    torch.testing.assert_close(fast, want, atol=1e-5, rtol=1e-5)

    if disable == "env":
        kernel_settings(enabled=False)
        assert kernels.get_ops() is None
        slow = paged_attention(q, k_new, v_new, kv_cache, meta, 0.125)
    else:
        slow = paged_attention(q, k_new, v_new, kv_cache, meta, 0.125, use_kernels=False)
    ref = meta._reference
    assert ref is not None and ref.decode_context_slots.shape == (3, 300)  # built once, kept for later layers
    assert paged_attention(q, k_new, v_new, kv_cache, meta, 0.125, use_kernels=False) is not None
    assert meta._reference is ref
    torch.testing.assert_close(slow, want, atol=1e-5, rtol=1e-5)


def test_failed_build_falls_back_with_one_warning(kernel_settings, monkeypatch, tmp_path, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this kernel does not compile\n")
    monkeypatch.setattr(kernels, "_SOURCES", [broken])
    monkeypatch.setitem(kernels._state, "tried", False)
    monkeypatch.setitem(kernels._state, "ops", None)
    kernel_settings(enabled=True, cache_dir=tmp_path / "ext")
    with caplog.at_level(logging.WARNING, logger="brisk.ops.kernels"):
        assert kernels.get_ops() is None
        assert kernels.get_op("paged_decode_attention") is None  # no second attempt, no second warning
    warnings = [r for r in caplog.records if r.name == "brisk.ops.kernels"]
    assert len(warnings) == 1 and "C++ kernels broken.cpp unavailable" in warnings[0].getMessage()

    # attention still works, on the reference path
    query_lens, contexts = [1, 1, 3], [17, 1, 20]
    q, kv_cache, qsl, tables, lens = random_problem(query_lens, contexts, 4, 2, torch.float32, seed=5)
    meta = runner_metadata(query_lens, contexts, q, kv_cache, qsl, tables, lens, 0)
    k_new = kv_cache[0].reshape(-1, 2, 64)[meta.slot_mapping]
    v_new = kv_cache[1].reshape(-1, 2, 64)[meta.slot_mapping]
    got = paged_attention(q, k_new, v_new, kv_cache, meta, 0.125)
    torch.testing.assert_close(got, oracle(q, kv_cache, qsl, tables, lens, 0.125).float(), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mistral")
    make_tiny_hf_model(path, "mistral", num_kv_heads=2, seed=3, sliding_window=24)
    return str(path)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_engine_greedy_tokens_same_with_and_without_kernels(kernel_settings, ops, mistral_dir, kv_cache_dtype):
    """Whole engine, sliding window, prefix-cache hits and 16-token chunks interleaved with decodes; a quantized
    cache is read in place by the kernel and dequantized by the reference path, the same values either way."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 384, (40,), generator=g).tolist()
    prompts = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 7, 50)]
    prompts += [shared + torch.randint(3, 384, (n,), generator=g).tolist() for n in (2, 21)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run() -> list[list[int]]:
        llm = LLM(mistral_dir, max_model_len=256, max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    with_kernels = run()
    kernel_settings(enabled=False)
    assert with_kernels == run()
