"""Bytes a decode step reads from memory, and what that makes of a measured tokens/s.

Batch-1 decoding is memory-bandwidth bound: every generated token streams all the weights it uses plus the
KV cache of its context through the cores once. So

    achieved GB/s = bytes read per decode token x decode tokens/s

and dividing by the machine's measured read bandwidth (`brisk bench membw`) says how close a tokens/s
figure is to the limit. What one token reads:

    every linear layer and norm                  whole matrices
    the embedding table                          one row (a lookup)
    lm_head                                      the whole [vocab, hidden] matrix
    KV cache                                     2 (K and V) x layers x kv_heads x head_dim x dtype bytes
                                                 x context length

Tied embeddings change what is stored, not what is read: the lm_head still reads the full matrix and the
lookup still reads one row, so the figure is the same for a tied and an untied model of equal shape.
"""

from __future__ import annotations

from torch import nn

from brisk.model.config import ModelConfig


def config_weight_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Weight bytes one batch-1 decode step reads, from the config alone (all weights in one dtype)."""
    embedding = config.vocab_size * config.hidden_size
    stored = config.num_params  # counts the [vocab, hidden] matrix once if tied, twice if not
    without_tables = stored - embedding * (1 if config.tie_word_embeddings else 2)
    return (without_tables + embedding + config.hidden_size) * dtype_bytes  # + lm_head + one embedding row


def weight_bytes_per_token(model: nn.Module) -> int:
    """Weight bytes one batch-1 decode step reads, from the module's actual tensors.

    Unlike `config_weight_bytes_per_token` this sees what is really in memory (a bf16 model, a quantized
    layer's packed weights and scales), so benchmarks use it. A mixture-of-experts layer counts top-k of its
    routed experts (their mean size): the active-parameter bound. Tensors shared by several modules (tied
    embeddings) count once; an embedding table that nothing else uses counts as one row.
    """
    owners: dict[int, list[str]] = {}  # storage address -> names of the tensors living there
    sizes: dict[int, int] = {}
    state = model.state_dict(keep_vars=True)
    for name, t in state.items():
        key = t.data_ptr()
        owners.setdefault(key, []).append(name)
        sizes[key] = t.numel() * t.element_size()
    embedding_weights = {f"{prefix}.weight" if prefix else "weight": m.weight
                         for prefix, m in model.named_modules() if isinstance(m, nn.Embedding)}
    total = sum(sizes.values())
    for module in model.modules():  # a quantized table (quant.layers.QuantEmbedding) is only ever looked up
        if hasattr(module, "table_tensors") and hasattr(module, "row_bytes"):
            total += module.row_bytes - sum(t.numel() * t.element_size() for t in module.table_tensors())
        if getattr(module, "quant_activations", None) == "int8" and hasattr(module, "rounded_tables"):
            # SqueezeLLM with int8 activations reads its uint8 tables (ops/layers.py LutLinear), not the float ones
            lut = module.lut_weight.lut
            total += module.rounded_tables().qlut.numel() - lut.numel() * lut.element_size()
    for name, w in embedding_weights.items():
        key = w.data_ptr()
        row_bytes = w.shape[1] * w.element_size()
        only_lookup = all(n in embedding_weights for n in owners.get(key, [name]))
        # an untied table: only one row is read instead of the whole table; a tied one is read whole by
        # lm_head and its row is read once more by the lookup
        total += row_bytes - (sizes[key] if only_lookup else 0)
    from brisk.model.moe import expert_bytes, moe_blocks

    for block in moe_blocks(model):  # MoE: top-k routed experts a token, not all of them (the active roofline)
        sizes_e = expert_bytes(block)[block.layer_idx]
        total -= sum(sizes_e) - block.top_k * sum(sizes_e) / len(sizes_e)
    return int(total)


def kv_bytes_read(config: ModelConfig, kv_dtype_bytes: int, context_len: int) -> int:
    """KV cache bytes attention reads for one new token that attends to `context_len` positions."""
    return config.kv_bytes_per_token(kv_dtype_bytes) * context_len


def mean_decode_context(input_len: int, output_len: int) -> float:
    """Mean number of positions attended to per decode step of a batch-1 request.

    Prefill yields token 1; decode step j = 1 .. output_len-1 feeds token j at position input_len + j - 1
    and attends to input_len + j positions, so the mean is input_len + output_len / 2.
    """
    if output_len < 2:
        return float(input_len)
    return input_len + output_len / 2


def decode_bytes_per_token(weight_bytes: int, config: ModelConfig, kv_dtype_bytes: int,
                           context_len: float) -> float:
    """Bytes read from memory to produce one token at batch 1: the weights plus the context's KV."""
    return weight_bytes + config.kv_bytes_per_token(kv_dtype_bytes) * context_len


def achieved_gbps(bytes_per_token: float, tokens_per_s: float) -> float:
    return bytes_per_token * tokens_per_s / 1e9
