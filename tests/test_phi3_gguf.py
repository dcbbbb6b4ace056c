"""Phi-3 from GGUF (llama.cpp's `phi3`): fused attn_qkv / ffn_up and LongRoPE factor tensors, against transformers."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_utils import tiny_gpt2_tokenizer_metadata, write_gguf
from hf_utils import make_tiny_hf_model
from safetensors.torch import load_file
from test_moe import prefill_logits

from brisk import LLM, SamplingParams
from brisk.model.gguf import GGUFError
from brisk.model.loader import load_model

ORIGINAL = 48  # the tiny model's original context: longrope switches to the long factors past it
_NAMES = {"input_layernorm.weight": "attn_norm.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
          "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def write_phi3_gguf(path: Path, folder: Path, ref: torch.nn.Module, qtype: GGMLQuantizationType | None = None,
                    drop: str | None = None, **metadata: object) -> Path:
    """The HF Phi-3 folder as llama.cpp's converter writes it: fused tensors kept, no Q/K permutation, the longrope
    factors as rope_factors_{long,short} tensors, the attention factor computed from the context ratio."""
    c = ref.config
    out: dict[str, np.ndarray] = {}
    for name, w in load_file(folder / "model.safetensors").items():
        if name in _GLOBAL:
            out[_GLOBAL[name]] = w.float().numpy()
        else:
            _, _, layer, rest = name.split(".", 3)
            out[f"blk.{layer}.{_NAMES[rest]}"] = w.float().numpy()
    rp = c.rope_parameters
    a = "phi3"
    md = {f"{a}.block_count": c.num_hidden_layers, f"{a}.context_length": c.max_position_embeddings,
          f"{a}.embedding_length": c.hidden_size, f"{a}.feed_forward_length": c.intermediate_size,
          f"{a}.attention.head_count": c.num_attention_heads, f"{a}.attention.head_count_kv": c.num_key_value_heads,
          f"{a}.rope.dimension_count": c.hidden_size // c.num_attention_heads,
          f"{a}.rope.freq_base": float(rp["rope_theta"]),
          f"{a}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
          f"{a}.vocab_size": c.vocab_size} | tiny_gpt2_tokenizer_metadata()
    if rp.get("rope_type") == "longrope":
        scale = c.max_position_embeddings / ORIGINAL
        md[f"{a}.rope.scaling.original_context_length"] = ORIGINAL
        md[f"{a}.rope.scaling.attn_factor"] = math.sqrt(1 + math.log(scale) / math.log(ORIGINAL))
        out["rope_factors_long.weight"] = np.array(rp["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rp["short_factor"], dtype=np.float32)
    out.pop(drop or "", None)
    md |= {f"{a}.{k.replace('__', '.')}": v for k, v in metadata.items()}
    qtypes = {n: qtype for n, t in out.items() if qtype is not None and t.ndim == 2}
    return write_gguf(path, a, md, out, GGMLQuantizationType.F32, qtypes)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    folder = tmp_path_factory.mktemp("phi3")
    g = torch.Generator().manual_seed(3)
    half = 64 // 4 // 2  # head_dim / 2
    scaling = {"rope_type": "longrope", "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
               "long_factor": (1 + 4 * torch.rand(half, generator=g)).tolist()}
    ref = make_tiny_hf_model(folder, "phi3", rope_scaling=scaling, max_position_embeddings=256,
                             original_max_position_embeddings=ORIGINAL, vocab_size=384, seed=7)
    return folder, ref


@pytest.mark.parametrize("num_tokens", [40, 56])  # within and beyond the original context
def test_logits_match_transformers(phi3: tuple[Path, torch.nn.Module], tmp_path: Path, num_tokens: int) -> None:
    folder, ref = phi3
    loaded = load_model(write_phi3_gguf(tmp_path / "phi3.gguf", folder, ref), max_model_len=128)
    c = loaded.config
    assert (c.architecture, c.rope_scaling["rope_type"], c.rope_scaling["original_max_position_embeddings"]) == (
        "phi3", "longrope", ORIGINAL)
    ids = torch.randint(3, 384, (num_tokens,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    n = num_tokens
    kv = [torch.zeros(2, 4, 16, c.num_key_value_heads, c.head_dim) for _ in range(c.num_hidden_layers)]
    from brisk.ops.attention import AttentionMetadata

    meta = AttentionMetadata.for_sequences([n], [n], [[0, 1, 2, 3]], 16)
    with torch.inference_mode():
        got = loaded.model(ids, torch.arange(n), meta, kv, context_lens=torch.full((n,), n))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers_across_the_original_context(phi3: tuple[Path, torch.nn.Module],
                                                                 tmp_path: Path) -> None:
    folder, ref = phi3
    path = write_phi3_gguf(tmp_path / "phi3.gguf", folder, ref)
    ids = torch.randint(3, 384, (40,), generator=torch.Generator().manual_seed(2))
    llm = LLM(str(path), max_model_len=128, kv_cache_memory="4MiB")
    out = llm.generate([ids.tolist()], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    with torch.no_grad():
        hf_ids = ref.generate(ids[None], max_new_tokens=32, min_new_tokens=32, do_sample=False)[0, 40:]
    assert out.outputs[0].token_ids == hf_ids.tolist()  # 40 + 32 tokens: crosses the original 48


def test_q8_0_runs_quantized_with_the_split_rows(phi3: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    """Row ranges of a quantized fused tensor are whole rows of blocks: repacked q/k/v equal dequantized ones."""
    from brisk.ops.layers import QuantLinear

    folder, ref = phi3
    path = write_phi3_gguf(tmp_path / "phi3-q8.gguf", folder, ref, GGMLQuantizationType.Q8_0)
    native, floats = load_model(path, keep_quantized=True), load_model(path)
    attn = native.model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj if attn.qkv_proj is not None else attn.q_proj, QuantLinear)
    ids = torch.randint(3, 384, (24,), generator=torch.Generator().manual_seed(4))
    want, got = prefill_logits(floats, ids), prefill_logits(native, ids)
    torch.testing.assert_close(got, want, atol=2e-2 * float(want.abs().max()), rtol=0)
    with torch.no_grad():  # and both near transformers' float model (Q8_0 rounding only)
        hf = ref(ids[None]).logits[0]
    assert float(10 * torch.log10(hf.pow(2).mean() / (want - hf).pow(2).mean())) > 20


def test_plain_rope_phi3_and_bad_files(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    ref = make_tiny_hf_model(folder, "phi3", vocab_size=384, seed=8)
    loaded = load_model(write_phi3_gguf(tmp_path / "plain.gguf", folder, ref))
    assert loaded.config.rope_scaling is None
    ids = torch.randint(3, 384, (20,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(loaded, ids), want, atol=1e-4, rtol=1e-4)
    # a missing tensor, and a fused tensor whose rows disagree with the metadata, are named
    bad = write_phi3_gguf(tmp_path / "bad.gguf", folder, ref, drop="blk.1.ffn_down.weight")
    with pytest.raises(GGUFError, match="blk.1.ffn_down.weight"):
        load_model(bad)
    bad = write_phi3_gguf(tmp_path / "bad-kv.gguf", folder, ref, attention__head_count_kv=1)
    with pytest.raises(GGUFError, match=r"'blk.0.attn_qkv.weight' has 128 rows, expected 64 \+ 16 \+ 16"):
        load_model(bad)
