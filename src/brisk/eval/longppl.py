"""Perplexity over one long stream through the engine's paged KV cache under an eviction policy.

Protocol (`brisk eval ppl --long`):
1. The text is tokenized once with no special tokens; the first `max_tokens` ids form ONE stream (no windows).
2. Cache modes: the stream is fed in chunks of `chunk` tokens from position 0 to the end, through a
   KVCacheManager with the policy (the engine's own manager: blocks are allocated, evicted and freed exactly
   as when serving) and the engine's attention. Every token t >= 1 is predicted from the row of token t - 1.
   Positions are the original text positions (0 .. n-1); see ops/attention.py for how StreamingLLM keeps the
   sinks' relative positions within the cache. The chunk size changes nothing for streaming / window modes:
   the mask is token-exact per row (a test checks chunked == token by token); it only sets how many tokens
   one forward computes.
     full       keep everything (past the model's trained context this extrapolates RoPE)
     streaming  `sink_tokens` sinks + a window of `budget - sink_tokens` tokens (StreamingLLM)
     window     the same window without sinks (sink_tokens = 0), the contrast of the StreamingLLM paper
3. Oracle mode (sliding window with recomputation): token t is predicted by a fresh forward over the
   `budget` tokens before it, ids[t - budget : t] at positions 0 .. budget-1 (so the predicting row sees
   `budget` tokens, itself included, as under a cache of `budget` tokens). Recomputing a window per token
   costs budget x n token-forwards, so it is strided: windows of `budget` tokens end every `stride` tokens
   and each scores only its last `stride` targets, whose predicting rows see budget - stride + 1 .. budget
   tokens; the first window scores all of its targets. stride 1 is the exact oracle.
4. H2O mode: the stream in chunks through a private dense cache; after each chunk the cache is cut to
   budget - chunk entries (the budget/2 newest + heavy hitters by attention mass summed over layers, heads and
   queries) and compacted, so no query sees more than `budget` tokens (kvcache/policy.py H2OPolicy).
5. `num_streams` > 1 scores that many consecutive, independent streams of `max_tokens` (each from position 0)
   and pools their NLL: with max_tokens 1024 this is the windowed protocol of eval/ppl.py with a KV budget.
6. NLL in float32 per predicted token; ppl = exp(mean NLL) over tokens 1 .. n-1 (the same set in every
   mode). `segment_ppl` splits the stream into consecutive segments to show whether ppl stays flat.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from brisk.console import progress_bar
from brisk.engine.request import Request
from brisk.eval.ppl import sequence_logits
from brisk.kvcache.manager import KVCacheManager
from brisk.kvcache.policy import H2OPolicy, KVPolicy, StreamingPolicy, h2o_keep
from brisk.kvcache.quant import make_kv_caches
from brisk.model.loader import LoadedModel
from brisk.ops.attention import AttentionMetadata, AttentionStats, KVCache

LONG_MODES = ("full", "streaming", "window", "oracle", "h2o")


@dataclass
class LongPerplexityResult:
    mode: str
    ppl: float
    nll: float
    num_tokens: int  # predicted tokens (stream length - 1)
    budget: int | None
    sink_tokens: int
    chunk: int
    stride: int | None
    kv_cache_dtype: str
    max_blocks_held: int  # most KV blocks the stream held at once (cache modes)
    seconds: float
    segment: int
    segment_ppl: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [N, V], targets [N] -> NLL per row [N] (float32)."""
    return -F.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)  # gather: [N, 1]


def stream_nll(loaded: LoadedModel, ids: list[int], policy: KVPolicy, chunk: int = 64, block_size: int = 16,
               kv_cache_dtype: str = "auto", progress: bool = False) -> tuple[torch.Tensor, int]:
    """NLL [n - 1] of ids[1:] fed as one stream through a paged cache under `policy`; also the peak blocks held."""
    c = loaded.config
    model = loaded.model
    device = model.model.norm.weight.device
    n = len(ids)
    if model.rope is None or model.rope.cos_table.shape[0] < n:
        model.init_rope(max(n, c.max_position_embeddings), device)
    if isinstance(policy, StreamingPolicy):
        # sinks' blocks + the window + one chunk of new tokens + a partial block at each end of the window
        num_blocks = -(-policy.sink_tokens // block_size) + -(-(policy.window + chunk) // block_size) + 2
    else:
        num_blocks = -(-n // block_size)
    manager = KVCacheManager(num_blocks, block_size, enable_caching=False, policy=policy)
    caches: list[KVCache]
    caches = make_kv_caches(kv_cache_dtype, c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads,
                            c.head_dim, loaded.dtype, device, 4)
    request = Request("stream", ids, sampling_params=None)
    ids_t = torch.tensor(ids, dtype=torch.long)
    nll = torch.empty(n - 1)
    max_held = 0
    window = policy.window if isinstance(policy, StreamingPolicy) else None
    sinks = policy.sink_tokens if isinstance(policy, StreamingPolicy) else 0
    with progress_bar(f"stream ({policy.name}, {n} tokens)", n, enabled=progress) as advance:
        start = 0
        while start < n:
            num_new = min(chunk, n - start)
            copies = manager.allocate_slots(request, num_new)
            assert copies == [], f"the stream's pool of {num_blocks} blocks ran out at position {start}"
            max_held = max(max_held, manager.get_num_blocks("stream"))
            positions = torch.arange(start, start + num_new)
            meta = AttentionMetadata.for_sequences(
                [num_new], [start + num_new], [manager.get_block_ids("stream")], block_size, positions=positions,
                sliding_window=window, num_sink_tokens=sinks, evicting=policy.evicts, cos_sin=model.rope.cos_sin,
                device=device)
            with torch.inference_mode():
                logits = model(ids_t[start:start + num_new].to(device), positions.to(device), meta, caches)
            # row i predicts token start + i + 1; the stream's last token predicts nothing
            num_pred = min(num_new, n - 1 - start)
            nll[start:start + num_pred] = _token_nll(logits[:num_pred], ids_t[start + 1:start + 1 + num_pred])
            request.num_computed_tokens += num_new
            start += num_new
            advance(num_new)
    manager.free(request)
    assert manager.num_free_blocks == num_blocks, "blocks leaked"
    return nll, max_held


def h2o_stream_nll(loaded: LoadedModel, ids: list[int], policy: H2OPolicy, chunk: int = 16,
                   block_size: int = 16) -> tuple[torch.Tensor, int]:
    """NLL [n - 1] of ids[1:] under H2O (kvcache/policy.py): the stream in chunks; after each chunk the cache is
    cut to `budget - chunk` entries (recent + heavy hitters) and compacted, so no query ever sees more than
    `budget` tokens (itself included), the same bound StreamingLLM's mask gives. Chunk 1 is H2O's own
    one-token-at-a-time eviction (and the engine's rule, see H2OPolicy); larger chunks evict less often. Also
    returns the peak blocks held."""
    n = len(ids)
    ids_t = torch.tensor(ids, dtype=torch.long)
    nll = torch.empty(n - 1)
    max_held = 0
    for start, logits, held in h2o_stream_logits(loaded, ids, policy, chunk, block_size):
        num_pred = min(logits.shape[0], n - 1 - start)
        nll[start:start + num_pred] = _token_nll(logits[:num_pred], ids_t[start + 1:start + 1 + num_pred])
        max_held = max(max_held, held)
    return nll, max_held


def h2o_stream_logits(loaded: LoadedModel, ids: list[int], policy: H2OPolicy, chunk: int = 16,
                      block_size: int = 16) -> Iterator[tuple[int, torch.Tensor, int]]:
    """The H2O stream of `h2o_stream_nll`, chunk by chunk: (first position, logits [chunk, V], blocks held)."""
    c = loaded.config
    model = loaded.model
    device = model.model.norm.weight.device
    n = len(ids)
    if chunk >= policy.budget:
        raise ValueError(f"h2o chunk ({chunk}) must be smaller than the budget ({policy.budget})")
    if model.rope is None or model.rope.cos_table.shape[0] < n:
        model.init_rope(max(n, c.max_position_embeddings), device)
    num_blocks = -(-policy.budget // block_size) + 1
    caches = [torch.zeros(2, num_blocks, block_size, c.num_key_value_heads, c.head_dim, dtype=loaded.dtype,
                          device=device) for _ in range(c.num_hidden_layers)]
    table = list(range(num_blocks))  # private, dense: cache index = slot
    keep = policy.budget - chunk
    ids_t = torch.tensor(ids, dtype=torch.long)
    scores = torch.zeros(0)  # accumulated attention mass per cache entry, in cache order
    cache_len = 0
    for start in range(0, n, chunk):
        num_new = min(chunk, n - start)
        ctx = cache_len + num_new
        step_scores = torch.cat([scores, torch.zeros(num_new)])
        meta = AttentionMetadata.for_sequences([num_new], [ctx], [table], block_size, evicting=True,
                                               stats=AttentionStats(key_mass=[step_scores]), device=device)
        positions = torch.arange(start, start + num_new)  # original positions: RoPE as in the full model
        with torch.inference_mode():
            logits = model(ids_t[start:start + num_new].to(device), positions.to(device), meta, caches)
        yield start, logits, -(-ctx // block_size)
        scores, cache_len = step_scores, ctx
        if cache_len > keep:
            kept = torch.tensor(h2o_keep(scores, policy.recent, keep))
            for kv in caches:  # compaction: kept entries to cache indices 0 .. keep-1, in order
                flat = kv.view(2, -1, c.num_key_value_heads, c.head_dim)  # [2, slots, kvh, d]
                flat[:, :keep] = flat[:, kept]
            scores, cache_len = scores[kept], keep


def oracle_nll(loaded: LoadedModel, ids: list[int], budget: int, stride: int, kv_cache_dtype: str = "auto",
               progress: bool = False) -> torch.Tensor:
    """NLL [n - 1] of ids[1:], each token scored by a fresh forward over the `budget` tokens ending at it
    (strided, see the module docstring)."""
    n = len(ids)
    nll = torch.empty(n - 1)
    ids_t = torch.tensor(ids, dtype=torch.long)
    # windows ids[end - budget : end] (row r predicts token begin + r + 1, the last row token `end`); each scores
    # the targets (previous end, end], whose contexts then hold budget - stride + 1 .. budget tokens
    ends = list(range(min(budget, n - 1), n - 1, stride)) + [n - 1]
    with progress_bar(f"oracle (window {budget}, stride {stride})", len(ends), enabled=progress) as advance:
        last = 0  # targets 1 .. last are scored
        for end in ends:
            begin = max(0, end - budget)
            logits = sequence_logits(loaded, ids_t[begin:end], kv_cache_dtype)  # [end - begin, V]
            targets = torch.arange(last + 1, end + 1)
            nll[last:end] = _token_nll(logits[targets - 1 - begin], ids_t[targets])
            last = end
            advance(1)
    return nll


def long_perplexity(loaded: LoadedModel, text: str, mode: str, budget: int | None = 1024, sink_tokens: int = 4,
                    max_tokens: int | None = 16384, chunk: int = 64, stride: int = 128, segment: int = 2048,
                    kv_cache_dtype: str = "auto", block_size: int = 16, progress: bool = True,
                    num_streams: int = 1) -> LongPerplexityResult:
    """Perplexity of one long stream under `mode` (see the module docstring)."""
    if mode not in LONG_MODES:
        raise ValueError(f"mode must be one of {', '.join(LONG_MODES)}, got {mode!r}")
    if mode != "full" and (budget is None or budget < 2):
        raise ValueError(f"mode {mode!r} needs a KV budget of at least 2 tokens, got {budget}")
    if chunk < 1 or stride < 1 or segment < 1:
        raise ValueError("chunk, stride and segment must be positive")
    start = time.perf_counter()
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    if max_tokens is not None:
        ids = ids[:max_tokens * max(1, num_streams)]
    if len(ids) < 2:
        raise ValueError(f"the text has {len(ids)} tokens; a stream needs at least 2")
    if max_tokens is None:
        streams = [ids]
    else:
        streams = [ids[i * max_tokens:(i + 1) * max_tokens] for i in range(num_streams)]
        streams = [st for st in streams if len(st) == max_tokens] or [ids[:max_tokens]]
    parts = []
    max_held = 0
    for stream in streams:
        if mode == "oracle":
            assert budget is not None
            part = oracle_nll(loaded, stream, budget, stride, kv_cache_dtype, progress)
        elif mode == "h2o":
            assert budget is not None
            if kv_cache_dtype != "auto":
                raise ValueError("h2o mode runs with the float cache only")
            part, held = h2o_stream_nll(loaded, stream, H2OPolicy(budget, budget // 2), chunk, block_size)
            max_held = max(max_held, held)
        else:
            if mode == "full":
                policy: KVPolicy = KVPolicy()
            else:
                assert budget is not None
                policy = StreamingPolicy(budget, sink_tokens if mode == "streaming" else 0)
            part, held = stream_nll(loaded, stream, policy, chunk, block_size, kv_cache_dtype, progress)
            max_held = max(max_held, held)
        parts.append(part)
    nll = torch.cat(parts)
    seconds = time.perf_counter() - start
    mean = float(nll.mean())
    segments = [math.exp(float(nll[i:i + segment].mean())) for i in range(0, nll.shape[0], segment)]
    return LongPerplexityResult(
        mode=mode, ppl=math.exp(mean), nll=mean, num_tokens=int(nll.shape[0]), budget=budget,
        sink_tokens=sink_tokens if mode == "streaming" else 0, chunk=chunk,
        stride=stride if mode == "oracle" else None, kv_cache_dtype=kv_cache_dtype, max_blocks_held=max_held,
        seconds=seconds, segment=segment, segment_ppl=segments)
