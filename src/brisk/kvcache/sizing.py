"""How many blocks the KV pool gets, and whether that is enough to run one request.

The pool is sized from a byte budget (`kv_cache_memory`), not a block count, so that the same budget holds more
tokens under a smaller KV dtype:

    num_blocks = (kv_cache_memory - int4 residual key buffers) // bytes of one block, over all layers

A pool that cannot hold one request is a configuration error, raised here before any tensor is allocated:
  * keep-everything: one sequence of max_model_len tokens must fit;
  * an evicting policy: a request holds at most what the policy keeps plus one step's new tokens (see
    `min_blocks_evicting`), so that must fit, whatever max_model_len is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from brisk.kvcache.policy import H2OPolicy, KVPolicy
from brisk.kvcache.quant import Int4KVCache, kv_bytes_per_token

if TYPE_CHECKING:  # kvcache/ does not depend on engine/ or model/ at run time: these are plain data
    from brisk.engine.config import CacheConfig
    from brisk.model.config import ModelConfig


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_bytes_per_block(cache: CacheConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one block of the pool: keys and values of `block_size` tokens in every layer."""
    mc = model_config
    dtype_bytes = torch.finfo(dtype).bits // 8
    return int(kv_bytes_per_token(cache.kv_cache_dtype, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                  cache.block_size, dtype_bytes) * cache.block_size)


def num_kv_blocks(cache: CacheConfig, model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Blocks of the pool: `cache.num_blocks` when given, else as many as `cache.kv_cache_bytes` holds (int4's
    float16 residual key buffers come out of the same budget). Can be 0; `check_kv_pool` says if it is too few."""
    if cache.num_blocks:
        return cache.num_blocks
    mc = model_config
    pool_bytes = cache.kv_cache_bytes
    if cache.kv_cache_dtype == "int4":
        pool_bytes -= cache.num_residual_blocks * mc.num_hidden_layers * Int4KVCache.residual_bytes_per_block(
            mc.num_key_value_heads, mc.head_dim, cache.block_size)
    return max(0, pool_bytes) // kv_bytes_per_block(cache, mc, dtype)


def min_blocks_evicting(policy: KVPolicy, block_size: int, max_num_batched_tokens: int) -> int:
    """The most blocks one request holds under an evicting policy."""
    if isinstance(policy, H2OPolicy):
        # its kept entries + one step's new tokens, and while it compacts, the fresh destination blocks besides
        # (kvcache/manager.py _compact)
        return _cdiv(policy.keep + max_num_batched_tokens, block_size) + _cdiv(policy.keep, block_size)
    # streaming: the sinks' blocks, the window, one step's new tokens, a partial block at each end of the window
    return (_cdiv(policy.sink_tokens, block_size)
            + _cdiv(policy.window + max_num_batched_tokens, block_size) + 2)


def check_policy_supports(policy: KVPolicy, kv_policy: str, sliding_window: int | None,
                          dynamic_rope: bool) -> None:
    """An evicting policy keeps keys rotated at their original positions and drops the old ones itself: a model
    with its own sliding window or with dynamic NTK RoPE (which re-rotates by length) cannot run under it."""
    if not policy.evicts:
        return
    if sliding_window is not None:
        raise ValueError(f"--kv-policy {kv_policy} cannot be combined with the model's own sliding "
                         f"window ({sliding_window}); use --kv-policy full")
    if dynamic_rope:
        raise ValueError(f"--kv-policy {kv_policy} needs a static RoPE (keys stay rotated at their "
                         "original positions); this model uses dynamic NTK scaling; use --kv-policy full")


def check_kv_pool(num_blocks: int, cache: CacheConfig, model_config: ModelConfig, dtype: torch.dtype,
                  policy: KVPolicy, max_num_batched_tokens: int, max_model_len: int) -> None:
    """ValueError, saying which setting to change, when `num_blocks` cannot hold one request."""
    bs = cache.block_size
    if policy.evicts:
        needed = min_blocks_evicting(policy, bs, max_num_batched_tokens)
        if num_blocks < needed:
            raise ValueError(f"the KV cache ({num_blocks} blocks of {bs} tokens) cannot hold "
                             f"one request under --kv-budget {cache.kv_budget} with "
                             f"{max_num_batched_tokens} tokens per step ({needed} blocks); raise "
                             "--kv-cache-memory or lower --kv-budget / --max-num-batched-tokens")
    elif num_blocks * bs < max_model_len:
        bytes_per_block = kv_bytes_per_block(cache, model_config, dtype)
        raise ValueError(
            f"the KV cache ({num_blocks} blocks of {bs} tokens) cannot hold one sequence of "
            f"max_model_len={max_model_len} tokens; raise --kv-cache-memory "
            f"(needs at least {max_model_len * bytes_per_block // bs / 2**20:.0f} MiB) "
            "or lower --max-model-len")
