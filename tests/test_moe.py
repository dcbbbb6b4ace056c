"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) against HF transformers on tiny random checkpoints,
and the grouped expert dispatch against a per-token reference loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_utils import SPECIAL_TOKENS, write_tiny_tokenizer

from brisk import LLM, SamplingParams
from brisk.model.config import ModelConfig, UnsupportedModelError
from brisk.model.loader import load_model
from brisk.model.moe import SparseMoeBlock, grouped_experts, record_expert_loads, route
from brisk.ops.attention import AttentionMetadata

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
VOCAB = 384


def make_tiny_moe(path: Path, arch: str, seed: int = 0, num_experts: int = 8, top_k: int = 2,
                  num_hidden_layers: int = 2, **overrides: object) -> torch.nn.Module:
    """A tiny random MoE checkpoint folder as transformers saves it (hub names); returns the float32 HF model.

    Router weights are drawn wide (std 1) so routing is decided by clear margins, not by float noise."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    eos_id, pad_id = SPECIAL_TOKENS.index("<|im_end|>"), SPECIAL_TOKENS.index("<|endoftext|>")
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=num_hidden_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                  tie_word_embeddings=False, eos_token_id=eos_id, pad_token_id=pad_id, num_experts_per_tok=top_k)
    if arch == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=num_experts, **overrides)
        cls = transformers.MixtralForCausalLM
    elif arch == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common, **({"num_experts": num_experts, "moe_intermediate_size": 32,
                                                           "shared_expert_intermediate_size": 48} | overrides))
        cls = transformers.Qwen2MoeForCausalLM
    else:
        # norm_topk_prob as Qwen3-30B-A3B has it (and llama.cpp's qwen3moe assumes); qwen2_moe keeps it off
        config = transformers.Qwen3MoeConfig(**common, num_experts=num_experts, moe_intermediate_size=32,
                                             head_dim=16, norm_topk_prob=True, **overrides)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight") and ".experts" not in name:  # the router
                p.copy_(torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_id], "pad_token_id": pad_id}))
    write_tiny_tokenizer(path, VOCAB)
    return model


def prefill_logits(loaded, ids: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - LoadedModel
    c = loaded.config
    n = ids.shape[0]
    num_blocks = (n + 15) // 16
    kv = [torch.zeros(2, num_blocks, 16, c.num_key_value_heads, c.head_dim, dtype=loaded.dtype)
          for _ in range(c.num_hidden_layers)]
    meta = AttentionMetadata.for_sequences([n], [n], [list(range(num_blocks))], 16)
    with torch.inference_mode():
        return loaded.model(ids, torch.arange(n), meta, kv).float()


@pytest.fixture(scope="module", params=ARCHS)
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[str, Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_tiny_moe(path, request.param, seed=1)


def test_logits_match_transformers(moe_dir: tuple[str, Path, torch.nn.Module]) -> None:
    arch, path, ref = moe_dir
    loaded = load_model(path)
    assert loaded.config.architecture == arch and loaded.config.num_experts == 8
    assert isinstance(loaded.model.model.layers[0].mlp, SparseMoeBlock)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(loaded, ids), want, atol=1e-4, rtol=1e-4)


def test_greedy_generation_matches_transformers(moe_dir: tuple[str, Path, torch.nn.Module]) -> None:
    """Several prompts batched, prefill in chunks of 8 tokens (mixed prefill / decode steps), 32 greedy tokens."""
    _, path, ref = moe_dir
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (12, 19, 7)]
    llm = LLM(str(path), max_model_len=256, kv_cache_memory="4MiB", max_num_batched_tokens=8,
              enable_chunked_prefill=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
        assert out.outputs[0].token_ids == want[0, len(prompt):].tolist()


def _per_token_reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """The oracle: for each token, its top-k experts one at a time, as the MoE papers write the sum."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(block.gate.weight @ x[t], dim=-1, dtype=torch.float32)  # [E]
        w, e = torch.topk(probs, block.top_k)
        if block.normalize:
            w = w / w.sum()
        for wj, ej in zip(w.tolist(), e.tolist(), strict=True):
            out[t] += wj * block.experts[ej](x[t:t + 1])[0]
        if block.shared_expert is not None:
            out[t] += torch.sigmoid(block.shared_expert_gate.weight[0] @ x[t]) * block.shared_expert(x[t:t + 1])[0]
    return out


@pytest.mark.parametrize("num_tokens", [1, 3, 37])
def test_grouped_dispatch_equals_per_token_loop(moe_dir: tuple[str, Path, torch.nn.Module], num_tokens: int
                                                ) -> None:
    _, path, _ = moe_dir
    loaded = load_model(path)
    block = loaded.model.model.layers[1].mlp
    x = torch.randn(num_tokens, loaded.config.hidden_size, generator=torch.Generator().manual_seed(num_tokens))
    with torch.inference_mode(), record_expert_loads(loaded.model) as loads:
        got = block(x)
    torch.testing.assert_close(got, _per_token_reference(block, x), atol=1e-5, rtol=1e-5)
    ((layer, counts),) = loads.counts
    assert layer == 1 and sum(counts) == num_tokens * block.top_k and len(counts) == block.num_experts


def test_experts_without_tokens_are_not_called() -> None:
    calls: list[int] = []

    def expert(j: int):  # noqa: ANN202
        def run(x: torch.Tensor) -> torch.Tensor:
            calls.append(j)
            return x * (j + 1)
        return run

    x = torch.randn(4, 8)
    ids = torch.tensor([[2, 5], [5, 2], [2, 0], [5, 0]])
    w = torch.rand(4, 2)
    out = grouped_experts(x, w, ids, [expert(j) for j in range(8)])
    assert calls == [0, 2, 5]  # one call per expert that has rows, in id order; 1, 3, 4, 6, 7 cost nothing
    want = torch.stack([sum(w[t, j] * x[t] * (ids[t, j] + 1) for j in range(2)) for t in range(4)])
    torch.testing.assert_close(out, want)


def test_route_mixtral_is_softmax_over_topk_logits() -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    w, ids = route(logits, 2, normalize=True)
    top, top_ids = torch.topk(logits, 2)
    assert torch.equal(ids, top_ids)
    torch.testing.assert_close(w, torch.softmax(top, dim=-1))


def test_bad_configs_are_refused(tmp_path: Path) -> None:
    base = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}
    with pytest.raises(UnsupportedModelError, match=r"num_experts_per_tok \(9\) must be between 1 and num_experts "
                                                    r"\(8\)"):
        ModelConfig.from_hf_dict(base | {"num_local_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(UnsupportedModelError, match="num_experts must be positive"):
        ModelConfig.from_hf_dict(base | {"num_experts_per_tok": 2})


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from brisk.model.loader import CheckpointError

    make_tiny_moe(tmp_path, "mixtral", num_hidden_layers=1)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): model\.layers\.0\.mlp\.experts\.5\.up_proj"):
        load_model(tmp_path)


# --------------------------------------------------------------------------------------------------- GGUF

_GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def write_moe_gguf(path: Path, folder: Path, qtype=None, drop: str | None = None) -> Path:  # noqa: ANN001
    """The HF model as llama.cpp's converter writes it: experts stacked into ffn_{gate,up,down}_exps [E, ...],
    the router as ffn_gate_inp, qwen2moe's shared expert as ffn_*_shexp (its gate as [H]), Q/K permuted for the
    `llama` arch (Mixtral)."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf_utils import _GLOBAL_NAMES, _LAYER_NAMES, llama_cpp_permute, tiny_gpt2_tokenizer_metadata, write_gguf
    from safetensors.torch import load_file

    c = load_model(folder, fuse=False).config
    a = _GGUF_ARCH[c.architecture]
    state = {k: v.float().numpy() for k, v in load_file(folder / "model.safetensors").items()}
    for k in list(state):  # hub Mixtral names -> transformers 5's (the tensors are the same)
        if ".block_sparse_moe." in k:
            new = k.replace(".block_sparse_moe.", ".mlp.")
            for w, p in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                new = new.replace(f".{w}.", f".{p}.")
            state[new] = state.pop(k)
    out: dict[str, np.ndarray] = {}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}.mlp."
        for proj, g in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            out[f"blk.{i}.{g}.weight"] = np.stack([state.pop(f"{p}experts.{j}.{proj}.weight")
                                                   for j in range(c.num_experts)])
        out[f"blk.{i}.ffn_gate_inp.weight"] = state.pop(f"{p}gate.weight")
        if c.shared_expert_intermediate_size:
            out[f"blk.{i}.ffn_gate_inp_shexp.weight"] = state.pop(f"{p}shared_expert_gate.weight")[0]
            for proj, g in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                out[f"blk.{i}.ffn_{g}_shexp.weight"] = state.pop(f"{p}shared_expert.{proj}.weight")
    for name, w in state.items():
        if name in _GLOBAL_NAMES:
            out[_GLOBAL_NAMES[name]] = w
            continue
        _, _, layer, rest = name.split(".", 3)
        if a == "llama" and rest.startswith("self_attn.q_proj."):
            w = llama_cpp_permute(w, c.num_attention_heads)
        elif a == "llama" and rest.startswith("self_attn.k_proj."):
            w = llama_cpp_permute(w, c.num_key_value_heads)
        out[f"blk.{layer}.{_LAYER_NAMES[rest]}"] = w
    md = {f"{a}.block_count": c.num_hidden_layers, f"{a}.context_length": c.max_position_embeddings,
          f"{a}.embedding_length": c.hidden_size, f"{a}.feed_forward_length": c.intermediate_size,
          f"{a}.attention.head_count": c.num_attention_heads, f"{a}.attention.head_count_kv": c.num_key_value_heads,
          f"{a}.attention.key_length": c.head_dim, f"{a}.attention.value_length": c.head_dim,
          f"{a}.rope.freq_base": float(c.rope_theta), f"{a}.attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
          f"{a}.vocab_size": c.vocab_size, f"{a}.expert_count": c.num_experts,
          f"{a}.expert_used_count": c.num_experts_per_tok} | tiny_gpt2_tokenizer_metadata()
    if a == "llama":
        md[f"{a}.rope.dimension_count"] = c.head_dim
    else:
        md[f"{a}.expert_feed_forward_length"] = c.moe_intermediate_size
    if c.shared_expert_intermediate_size:
        md[f"{a}.expert_shared_feed_forward_length"] = c.shared_expert_intermediate_size
    out.pop(drop or "", None)
    qtypes = {n: qtype for n, t in out.items() if qtype is not None and t.ndim >= 2}
    return write_gguf(path, a, md, out, GGMLQuantizationType.F32, qtypes)


def test_gguf_loads_with_the_same_logits(moe_dir: tuple[str, Path, torch.nn.Module], tmp_path: Path) -> None:
    arch, path, _ = moe_dir
    hf = load_model(path)
    gguf_path = write_moe_gguf(tmp_path / "moe.gguf", path)
    loaded = load_model(gguf_path)
    c = loaded.config
    assert (c.architecture, c.num_experts, c.num_experts_per_tok) == (arch, 8, 2)
    assert (c.moe_intermediate_size, c.shared_expert_intermediate_size) == (
        hf.config.moe_intermediate_size, hf.config.shared_expert_intermediate_size)
    ids = torch.randint(3, 250, (24,), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(prefill_logits(loaded, ids), prefill_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_gguf_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    from brisk.model.gguf import GGUFError

    make_tiny_moe(tmp_path / "hf", "qwen2_moe", num_hidden_layers=1)
    bad = write_moe_gguf(tmp_path / "bad.gguf", tmp_path / "hf", drop="blk.0.ffn_up_exps.weight")
    with pytest.raises(GGUFError, match=r"missing tensor 'blk\.0\.ffn_up_exps\.weight' \(model\.layers\.0\.mlp\."
                                        r"experts\.\*\.up_proj\.weight\)"):
        load_model(bad)


# -------------------------------------------------------------------------------------------- quantization

def test_rtn_int8_quantized_experts_run_and_stay_close(moe_dir: tuple[str, Path, torch.nn.Module],
                                                       tmp_path: Path) -> None:
    from brisk.ops.layers import QuantLinear
    from brisk.quant.checkpoint import save_quantized
    from brisk.quant.config import LayerQuant
    from brisk.quant.rtn import plan_layers, rtn_quantize

    _, path, _ = moe_dir
    source = load_model(path, fuse=False)
    spec = LayerQuant(bits=8, group_size=-1, sym=True)
    plan = plan_layers(source.model, source.config.tie_word_embeddings, spec)
    assert "model.layers.0.mlp.experts.7.down_proj" in plan and "model.layers.0.mlp.gate" not in plan  # router: float
    tensors, qconfig = rtn_quantize(source, plan, spec, progress=False)
    save_quantized(tmp_path / "q", source.config, source.tokenizer, qconfig, tensors)
    quant = load_model(tmp_path / "q")
    expert = quant.model.model.layers[1].mlp.experts[3]
    assert isinstance(expert.gate_up_proj, QuantLinear) and isinstance(expert.down_proj, QuantLinear)
    ids = torch.randint(3, VOCAB, (32,), generator=torch.Generator().manual_seed(6))
    want, got = prefill_logits(load_model(path), ids), prefill_logits(quant, ids)
    # SQNR of the logits. Measured 22 dB at int8 on mixtral: the error sits on a few tokens (14x the median), where
    # the rounding flips a near-tied router choice; the floors leave ~4 dB of margin under what was measured, far
    # above what a wrong expert layout or unquantized-weight mixup gives (near 0 dB)
    sqnr = 10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean())
    assert sqnr > 18, f"logits SQNR {sqnr:.1f} dB"
    llm = LLM(str(tmp_path / "q"), max_model_len=128, kv_cache_memory="2MiB")
    out = llm.generate([ids[:8].tolist()], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8


def test_calibrated_methods_refuse_moe(moe_dir: tuple[str, Path, torch.nn.Module]) -> None:
    from brisk.quant.calib import CalibrationError, run_layerwise

    _, path, _ = moe_dir
    loaded = load_model(path, fuse=False)
    with pytest.raises(CalibrationError, match="use --method rtn"):
        run_layerwise(loaded.model, torch.zeros(1, 4, dtype=torch.long), lambda ctx: None, progress=False)


def test_lora_serving_refuses_moe_by_name(moe_dir: tuple[str, Path, torch.nn.Module]) -> None:
    arch, path, _ = moe_dir
    with pytest.raises(UnsupportedModelError, match=f"{arch} is a mixture-of-experts model.*--enable-lora"):
        LLM(str(path), enable_lora=True)


# ------------------------------------------------------------------------------------------ bytes read

def test_decode_reads_each_routed_expert_once(moe_dir: tuple[str, Path, torch.nn.Module]) -> None:
    """Batch-8 decode: the experts' bytes read (every expert call counted) equal the distinct routed experts'
    bytes (the target: at most 1.1x), and stay under the dense bound; the roofline counts top-k experts."""
    from brisk.bench.roofline import weight_bytes_per_token
    from brisk.model.moe import expert_bytes, expert_bytes_per_token

    arch, path, _ = moe_dir
    llm = LLM(str(path), max_model_len=128, kv_cache_memory="4MiB")
    model = llm.engine.loaded.model
    prompts = [torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    with record_expert_loads(model) as loads:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    got = expert_bytes_per_token(model, loads, max_tokens=8)  # decode steps (the 48-token prefill left out)
    assert got.num_forwards >= 5
    assert got.read <= 1.1 * got.routed and got.read == got.routed
    assert got.routed < got.dense  # with 8 tokens over 8 experts (top 2) some experts sit idle in some layers
    sizes = expert_bytes(model)
    per_expert = sum(sum(b) / len(b) for b in sizes.values())  # one mean expert of every MoE layer
    assert got.active == pytest.approx(2 * per_expert)
    all_experts = sum(sum(b) for b in sizes.values())
    # the roofline: every non-expert weight plus top-k experts a layer (the embedding table counts as one row)
    dense_total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    table = model.model.embed_tokens.weight
    active_total = dense_total - all_experts + 2 * per_expert
    assert active_total - table.numel() * table.element_size() < weight_bytes_per_token(model) <= active_total
    batch1 = expert_bytes_per_token(model, loads, max_tokens=1)
    assert batch1.num_forwards == 0  # (no batch-1 forward in this run)
