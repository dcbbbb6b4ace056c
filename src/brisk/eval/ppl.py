"""Perplexity of a model on a text, through brisk's own paged forward path.

Protocol (the GPTQ / SparseGPT / AWQ one, with the window length stated instead of tied to the model):

1. The whole text is tokenized once, with no special tokens: no BOS in front, nothing appended, so the
   score is of the text alone and does not depend on whether a tokenizer adds BOS.
2. The ids are cut into consecutive, non-overlapping windows of `window` tokens (default 1024). The
   trailing partial window is dropped, so every window has the same length and a figure does not depend
   on how the text happens to end (GPTQ does the same: `numel // seqlen` windows). A text shorter than one
   window is an error.
3. Only the first `max_windows` windows are scored (default 32, about 33k tokens; None = all), so a
   quick figure and a full figure are both well defined.
4. Each window is scored on its own from an empty context: its first token sits at position 0 and is
   only conditioned on, so a window predicts `window - 1` tokens. Nothing is carried between windows.
5. With a quantized KV cache (`kv_cache_dtype` int8/int4) the window's keys and values are quantized as they
   are written and every query attends to the dequantized cache, its own window's tokens included (as in
   serving, where a prompt's KV is read back by every later token). `block_size` (default 16) matters only
   for int4, whose key groups are one block.
6. Per token, NLL = -log_softmax(logits)[next token], computed in float32 (the logits are cast to float32
   whatever the model dtype). The result is the mean NLL over all predicted tokens of all windows, and
   ppl = exp(mean NLL).

Figures measured with different windows, texts or tokenizers cannot be compared with each other.
`tokens_per_second` counts every token run through the model (num_windows x window), not only the
predicted ones.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from brisk.console import progress_bar
from brisk.kvcache.quant import make_kv_caches
from brisk.model.loader import LoadedModel
from brisk.ops.attention import AttentionMetadata, KVCache

_BLOCK_SIZE = 16  # KV block size of the private cache; any size works, the cache is used for one call


@dataclass
class PerplexityResult:
    ppl: float
    nll: float  # mean negative log-likelihood per predicted token, in nats
    num_tokens: int  # predicted tokens: num_windows * (window - 1)
    num_windows: int
    window: int
    seconds: float  # scoring time (tokenizing included, model loading not)
    tokens_per_second: float  # num_windows * window / seconds: tokens through the model per second

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def sequence_logits(loaded: LoadedModel, ids: torch.Tensor, kv_cache_dtype: str = "auto",
                    block_size: int = _BLOCK_SIZE) -> torch.Tensor:
    """All-position logits [T, V] float32 of one sequence (ids [T]) run as a single prefill from position 0.

    The sequence goes through the same paged path the engine uses, with a private KV cache sized for it,
    so nothing is shared with (or left behind in) an engine's cache.
    """
    c = loaded.config
    device = loaded.model.model.norm.weight.device  # the embedding may be a quantized table (no .weight)
    ids = ids.to(device)
    n = ids.shape[0]
    num_blocks = (n + block_size - 1) // block_size
    kv: list[KVCache]
    # per layer [2, num_blocks, block_size, num_kv_heads, head_dim] (auto, bfloat16), or quantized on write:
    # attention reads the dequantized rows, the prompt's own included
    kv = make_kv_caches(kv_cache_dtype, c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads,
                        c.head_dim, loaded.dtype, device)
    positions = torch.arange(n, device=device)
    meta = AttentionMetadata.for_sequences([n], [n], [list(range(num_blocks))], block_size,
                                           sliding_window=c.sliding_window, device=device)
    # dynamic NTK RoPE rescales by the sequence length; pass it per token, as the engine's runner does
    dynamic = loaded.model.rope is not None and loaded.model.rope.length_dependent
    context_lens = torch.full((n,), n, device=device) if dynamic else None
    with torch.inference_mode():
        return loaded.model(ids, positions, meta, kv, context_lens).float()


def window_nll(loaded: LoadedModel, ids: torch.Tensor, kv_cache_dtype: str = "auto",
               block_size: int = _BLOCK_SIZE) -> float:
    """Summed NLL (nats) of ids[1:] given their prefixes, for one window ids [T] scored from position 0."""
    logits = sequence_logits(loaded, ids, kv_cache_dtype, block_size)  # [T, V]
    logprobs = F.log_softmax(logits[:-1], dim=-1)  # [T - 1, V]: row t predicts token t + 1
    targets = ids[1:].to(logprobs.device)
    return float(-logprobs.gather(1, targets[:, None]).sum())  # gather: [T - 1, 1]


def split_windows(ids: list[int], window: int, max_windows: int | None) -> list[list[int]]:
    """Consecutive full windows of `window` ids (the partial tail dropped), at most `max_windows` of them."""
    num_windows = len(ids) // window
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    return [ids[i * window:(i + 1) * window] for i in range(num_windows)]


def perplexity(loaded: LoadedModel, text: str, window: int = 1024, max_windows: int | None = 32,
               progress: bool = True, kv_cache_dtype: str = "auto", block_size: int = _BLOCK_SIZE,
               token_ids: list[int] | None = None) -> PerplexityResult:
    """Perplexity of `loaded` on `text` under the protocol in this module's docstring. `token_ids`: `text` already
    encoded by this model's tokenizer (step 1), for callers that score many models of one tokenizer."""
    max_pos = loaded.config.max_position_embeddings
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens (one to condition on, one to predict), "
                         f"got {window}")
    if window > max_pos:
        raise ValueError(f"window {window} is longer than the model's max_position_embeddings ({max_pos}); "
                         f"pass a window of at most {max_pos} tokens")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be at least 1 (or None for all windows), got {max_windows}")

    start = time.perf_counter()
    ids = loaded.tokenizer.encode(text, add_special_tokens=False) if token_ids is None else token_ids
    windows = split_windows(ids, window, max_windows)
    if not windows:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}; "
                         "pass a longer text or a smaller window")

    total_nll = 0.0
    with progress_bar(f"perplexity ({window}-token windows)", len(windows), enabled=progress) as advance:
        for w in windows:
            total_nll += window_nll(loaded, torch.tensor(w, dtype=torch.long), kv_cache_dtype, block_size)
            advance(1)
    seconds = time.perf_counter() - start
    num_tokens = len(windows) * (window - 1)
    nll = total_nll / num_tokens
    return PerplexityResult(ppl=math.exp(nll), nll=nll, num_tokens=num_tokens, num_windows=len(windows),
                            window=window, seconds=seconds,
                            tokens_per_second=len(windows) * window / seconds)
