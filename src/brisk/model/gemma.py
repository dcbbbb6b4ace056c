"""Gemma 3: what its checkpoints and GGUF files say, read into the one decoder of model/llama.py.

What differs from Llama is data in ModelConfig, which the decoder reads:

    RMSNorm            x * (1 + w) with w stored zero-centred, as HF stores it   norm_plus_one (GemmaRMSNorm)
    norms per layer    four, "sandwich": around attention and around the MLP     sandwich_norms (SANDWICH)
    q / k norms        per-head (1 + w) RMSNorm before RoPE                       qk_norm
    attention scale    query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5)       query_pre_attn_scalar
    local / global     layer_types: sliding layers see (p - window, p] with RoPE   layer_window, rope_tables
                       base rope_local_base_freq; full layers everything, with     (global, local), layer_rope
                       rope_theta + rope_scaling
    MLP                GeGLU: gelu_tanh(gate) * up                                hidden_act gelu_pytorch_tanh
    embeddings         scaled by sqrt(hidden_size), in the model dtype            LlamaForCausalLM.embed
    final logits       optional tanh soft-cap                                     final_logit_softcapping

One layer in the residual-stream form of model/llama.py (hidden = residual + x; `add` = residual += x):

    h = input_layernorm(add x)                  (layer 0: the embeddings are the stream)
    a = post_attention_layernorm(attn(h))
    h = pre_feedforward_layernorm(add a)
    x = post_feedforward_layernorm(mlp(h))      -> (x, residual); the next norm adds x

This module holds the config fields of Gemma3TextConfig and GGUF metadata, the GGUF tensor names and the chat
template fallback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from brisk.model.config import FULL, SLIDING, UnsupportedModelError

if TYPE_CHECKING:
    from brisk.model.config import ModelConfig

# ----------------------------------------------------------------------------------------- config

def gemma_config_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A Gemma3TextConfig dict's fields in the names ModelConfig.from_hf_dict reads (overrides of `d`).

    transformers 5 keeps RoPE per layer type (rope_parameters {"full_attention": {...}, "sliding_attention":
    {...}}); older files have rope_theta, rope_scaling and rope_local_base_freq. The layer pattern is layer_types,
    else every sliding_window_pattern-th layer global."""
    if d.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError("gemma3: attn_logit_softcapping is not supported (brisk's paged attention "
                                    "kernels have no score soft-cap)")
    n = d.get("num_hidden_layers", 0)
    out: dict[str, Any] = {"hidden_act": d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
                           "rms_norm_eps": d.get("rms_norm_eps", 1e-6), "head_dim": d.get("head_dim", 256),
                           "tie_word_embeddings": d.get("tie_word_embeddings", True),
                           "query_pre_attn_scalar": d.get("query_pre_attn_scalar", 256),
                           "sliding_window": d.get("sliding_window", 4096)}
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and (FULL in rp or SLIDING in rp):
        full, local = dict(rp.get(FULL) or {}), dict(rp.get(SLIDING) or {})
        out["rope_theta"] = full.pop("rope_theta", d.get("rope_theta", 1_000_000.0))
        out["rope_local_base_freq"] = local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))
        if local.get("rope_type", "default") != "default":
            raise UnsupportedModelError("gemma3: scaled RoPE on sliding layers is not supported")
        out["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
        out["rope_parameters"] = None  # read here; the generic reader must not see the nested form
    else:
        out["rope_theta"] = d.get("rope_theta", 1_000_000.0)
        out["rope_local_base_freq"] = d.get("rope_local_base_freq", 10_000.0)
    layer_types = d.get("layer_types")
    if layer_types is None:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    out["layer_types"] = list(layer_types)
    return out


def gemma_hf_dict(c: ModelConfig, arch_class: str) -> dict[str, Any]:
    """The Gemma3TextConfig dict (transformers 5 names) of a gemma3 ModelConfig."""
    full = {"rope_type": "default", **(c.rope_scaling or {}), "rope_theta": c.rope_theta}
    d: dict[str, Any] = {
        "architectures": [arch_class],
        "model_type": "gemma3_text",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_activation": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_parameters": {FULL: full, SLIDING: {"rope_type": "default",
                                                  "rope_theta": c.rope_local_base_freq or 10_000.0}},
        "query_pre_attn_scalar": c.query_pre_attn_scalar or c.head_dim,
        "sliding_window": c.sliding_window,
        "layer_types": list(c.layer_types or [SLIDING if c.sliding_window else FULL] * c.num_hidden_layers),
        "final_logit_softcapping": c.final_logit_softcapping,
        "attn_logit_softcapping": None,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id[0] if len(c.eos_token_id) == 1 else list(c.eos_token_id),
    }
    if c.torch_dtype:
        d["torch_dtype"] = c.torch_dtype
    return d


# ----------------------------------------------------------------------------------------- GGUF

# llama.cpp's gemma3 names inside blk.{i} that differ from the llama map (model/gguf.py _LAYER_TENSORS): its
# ffn_norm is the pre-feed-forward norm, and the two post-norms have names of their own
GGUF_LAYER_TENSORS = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# llama.cpp's converter stores every Gemma norm weight as 1 + w (its graph multiplies by the weight as is);
# the loader subtracts it again, back to HF's zero-centred w
GGUF_NORM_SHIFT = 1.0
# llama.cpp's gemma3 hyper-parameters that its files do not carry (src/llama-model.cpp): every 6th layer global,
# RoPE base 10000 on sliding layers, queries scaled by head_dim ** -0.5 (27B: by (hidden / heads) ** -0.5)
_GGUF_SWA_PATTERN = 6
_GGUF_LOCAL_ROPE_BASE = 10_000.0
_GGUF_27B_LAYERS = 62


def is_gguf_norm(name: str) -> bool:
    """Whether a GGUF tensor of gemma3 is a norm weight stored shifted by GGUF_NORM_SHIFT."""
    return name.endswith("norm.weight")


def gemma_gguf_config_fields(md: dict[str, Any], arch: str) -> dict[str, Any]:
    """The gemma3-only ModelConfig fields from GGUF metadata, with llama.cpp's defaults where keys are absent."""
    n = int(md[f"{arch}.block_count"])
    pattern = int(md.get(f"{arch}.attention.sliding_window_pattern", _GGUF_SWA_PATTERN))
    head_dim = int(md.get(f"{arch}.attention.key_length", 256))
    scalar = head_dim
    if n == _GGUF_27B_LAYERS:
        scalar = int(md[f"{arch}.embedding_length"]) // int(md[f"{arch}.attention.head_count"])
    return {"hidden_act": "gelu_pytorch_tanh",
            "sliding_window": int(md.get(f"{arch}.attention.sliding_window", 4096)),
            "layer_types": [SLIDING if (i + 1) % pattern else FULL for i in range(n)],
            "rope_local_base_freq": float(md.get(f"{arch}.rope.freq_base_swa", _GGUF_LOCAL_ROPE_BASE)),
            "query_pre_attn_scalar": scalar,
            "final_logit_softcapping": md.get(f"{arch}.final_logit_softcapping")}


# Gemma's turn format, for GGUF files that carry no tokenizer.chat_template (llama.cpp falls back to the same
# built-in format): system text goes in front of the first user turn, the assistant's role is "model".
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] | trim + '\\n\\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (ns.system if role == 'user' else '') + m['content'] | trim"
    " + '<end_of_turn>\\n' }}"
    "{%- if role == 'user' -%}{%- set ns.system = '' -%}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
END_OF_TURN = "<end_of_turn>"


def gemma_gguf_tokenizer_defaults(md: dict[str, Any]) -> tuple[str | None, list[int]]:
    """(chat template, extra end-of-sequence ids) for a gemma3 GGUF: the file's template, else Gemma's format;
    and <end_of_turn>, which ends every chat answer but is not the file's eos_token_id."""
    tokens = md.get("tokenizer.ggml.tokens") or []
    eot = [i for i, t in enumerate(tokens[:1024]) if t == END_OF_TURN]  # a low id (106 in Gemma 3's vocabulary)
    return md.get("tokenizer.chat_template") or GEMMA_CHAT_TEMPLATE, eot
