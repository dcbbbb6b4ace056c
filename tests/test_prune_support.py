"""`brisk prune` per architecture: each method's declared support decides (prune/support.py); every accepted
combination prunes tiny random qwen3 / phi3 / gemma3 / MoE checkpoints to the asked sparsity or shapes, and the
folder reloads (fused, through the sparse kernels) computing what the pruned model in memory computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from gguf_utils import tiny_arch_config
from hf_utils import TRAINING_TEXT, make_tiny_hf_model
from safetensors import safe_open
from test_gemma import LAYER_TYPES, make_tiny_gemma3
from test_moe import make_tiny_moe, prefill_logits

from brisk.cli import main
from brisk.eval.sparsity import sparsity_report
from brisk.model.config import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from brisk.model.loader import load_model
from brisk.model.moe import SparseMoeBlock
from brisk.prune import structured as st
from brisk.prune.masks import NMPattern, PruneConfigError, nm_conforms, sparsity_of, unstructured_mask
from brisk.prune.run import prune_and_save
from brisk.prune.support import check_prune_supports
from brisk.quant.calib import CalibConfig, load_calibration_ids

METHODS = ("magnitude", "wanda", "sparsegpt", "structured")
DENSE = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "smollm3")
# what each method is expected to take (written out here, not derived from the declarations)
ACCEPTS = {"magnitude": set(SUPPORTED_ARCHITECTURES), "wanda": set(SUPPORTED_ARCHITECTURES),
           "sparsegpt": set(SUPPORTED_ARCHITECTURES), "structured": set(DENSE)}
ARCHS = ("qwen3", "phi3", "gemma3", "smollm3", "mixtral", "qwen2_moe", "qwen3_moe")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_each_method_accepts_what_it_declares(method: str, arch: str) -> None:
    config = tiny_arch_config(arch)
    if arch in ACCEPTS[method]:
        check_prune_supports(method, config)
        return
    with pytest.raises(PruneConfigError) as e:
        check_prune_supports(method, config)
    message = str(e.value)
    assert f"--method {method}" in message and arch in message and "mixture-of-experts" in message
    assert message.endswith("use --method magnitude or wanda or sparsegpt")  # what to do instead


def test_unknown_method_is_named() -> None:
    with pytest.raises(PruneConfigError, match="unknown pruning method 'obc'"):
        check_prune_supports("obc", tiny_arch_config("llama"))


# ---------------------------------------------------------------------------------------------- the models

@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random HF folder per architecture (qwen3 / phi3 with 3 layers, so one can be dropped)."""
    root = tmp_path_factory.mktemp("prune-archs")
    out = {}
    for arch in ARCHS:
        path = root / arch
        if arch == "gemma3":
            make_tiny_gemma3(path, seed=2)
        elif arch in MOE_ARCHITECTURES:
            make_tiny_moe(path, arch, seed=2, num_experts=4)
        else:
            make_tiny_hf_model(path, arch, seed=2, num_hidden_layers=3)
        out[arch] = path
    return out


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (4, 32), generator=torch.Generator().manual_seed(seed))  # [N, L]


def _prompt(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (24,), generator=torch.Generator().manual_seed(5))  # [T]


def _expected_linears(config) -> int:  # noqa: ANN001 - ModelConfig
    per_layer = []
    for i in range(config.num_hidden_layers):
        mlp = 3 * config.num_experts if config.is_moe_layer(i) else 3
        per_layer.append(4 + mlp + (3 if config.shared_expert_intermediate_size else 0))
    return sum(per_layer)


# every method on a dense and a MoE model, every architecture twice with the CLI runs below
UNSTRUCTURED = [("qwen3", "wanda-2:4"), ("phi3", "sparsegpt"), ("gemma3", "sparsegpt-2:4"), ("mixtral", "magnitude"),
                ("qwen2_moe", "wanda"), ("qwen3_moe", "sparsegpt-2:4")]


@pytest.mark.parametrize("arch,name", UNSTRUCTURED, ids=[f"{a}-{m}" for a, m in UNSTRUCTURED])
def test_unstructured_prunes_every_linear_and_reloads(models: dict[str, Path], tmp_path: Path, arch: str,
                                                      name: str) -> None:
    method, _, pattern = name.partition("-")
    loaded = load_model(models[arch], fuse=False)
    config = loaded.config
    routers = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if ".mlp.gate." in n
               or "shared_expert_gate" in n}
    ids = None if method == "magnitude" else _ids(config.vocab_size)
    nm = NMPattern(2, 4) if pattern else None
    prune_and_save(loaded, tmp_path / "out", method, 0.5, pattern=nm, ids=ids, progress=False)

    record = json.loads((tmp_path / "out" / "config.json").read_text())["sparsity_config"]
    assert len(record["modules"]) == _expected_linears(config)  # experts and shared expert included
    for name_ in record["modules"]:
        w = loaded.model.get_submodule(name_).weight
        assert sparsity_of(w) == pytest.approx(0.5, abs=2e-3), name_
        if nm is not None:
            assert nm_conforms(w, 2, 4), name_
    if config.is_moe:
        assert any(".experts." in n for n in record["modules"])
        assert routers and all(torch.equal(p, loaded.model.get_parameter(n)) for n, p in routers.items())
        if method != "magnitude":
            assert record["experts_by_magnitude"] == []  # 128 tokens reach all 4 experts of these models
    report = sparsity_report(str(tmp_path / "out"))  # brisk eval sparsity: experts counted too
    assert sorted(m.name for m in report.modules) == sorted(record["modules"])
    assert report.linear_sparsity == pytest.approx(record["measured_sparsity"], abs=1e-6)
    reloaded = load_model(tmp_path / "out")  # no flags: fused, sparse kernels where >= 30% zeros
    assert reloaded.config.architecture == arch
    prompt = _prompt(config.vocab_size)
    torch.testing.assert_close(prefill_logits(reloaded, prompt), prefill_logits(loaded, prompt), atol=2e-4,
                               rtol=2e-4)


def test_sparsegpt_with_bits_quantizes_the_experts(models: dict[str, Path], tmp_path: Path) -> None:
    """Joint pruning + 8-bit quantization on a MoE model: the quantized folder (embedding and head at 8 bits too)
    stays close to the pruned float model in memory. Measured 31 dB here (mixtral 26, dense qwen3 36: the 8-bit
    embedding and head flip a few near-tied routing choices); a wrong expert layout lands near 0 dB."""
    loaded = load_model(models["qwen2_moe"], fuse=False)
    ids = _ids(loaded.config.vocab_size)
    prune_and_save(loaded, tmp_path / "out", "sparsegpt", 0.5, bits=8, group_size=16, ids=ids, progress=False)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "model.layers.1.mlp.experts.3.down_proj" in saved["quantization_config"]["modules"]
    prompt = _prompt(loaded.config.vocab_size)
    want, got = prefill_logits(loaded, prompt), prefill_logits(load_model(tmp_path / "out"), prompt)
    sqnr = float(10 * torch.log10(want.pow(2).mean() / (got - want).pow(2).mean()))
    assert sqnr > 15.0, f"logits SQNR {sqnr:.1f} dB"


def test_widths_are_checked_before_calibration(models: dict[str, Path], tmp_path: Path) -> None:
    loaded = load_model(models["qwen2_moe"], fuse=False)
    ids = torch.zeros(1, 4, dtype=torch.long)  # never used: the refusal comes first
    with pytest.raises(PruneConfigError, match=r"--group-size for model.layers.0.mlp.shared_expert.down_proj: group "
                                               r"size 32 does not divide the input dimension 48"):
        prune_and_save(loaded, tmp_path / "out", "sparsegpt", 0.5, bits=4, group_size=32, ids=ids, progress=False)
    with pytest.raises(PruneConfigError, match="--pattern 2:32 needs every input dimension to be a multiple of 32; "
                                               "model.layers.0.mlp.shared_expert.down_proj has 48"):
        prune_and_save(loaded, tmp_path / "out", "wanda", 0.5, pattern=NMPattern(2, 32), ids=ids, progress=False)
    assert not (tmp_path / "out").exists()


def test_phi3_checkpoint_is_fused_and_transformers_reads_it(models: dict[str, Path], tmp_path: Path) -> None:
    import transformers

    loaded = load_model(models["phi3"], fuse=False)
    prune_and_save(loaded, tmp_path / "out", "magnitude", 0.5, progress=False)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", pad_token_id=0).float().eval()
    prompt = _prompt(loaded.config.vocab_size)
    with torch.no_grad():
        want = ref(prompt[None]).logits[0]
    torch.testing.assert_close(prefill_logits(loaded, prompt), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_experts_no_token_reaches_are_pruned_by_magnitude(models: dict[str, Path], tmp_path: Path,
                                                          method: str) -> None:
    """Layer 0 routes each token to one expert and its router is set so that only experts 0 and 1 can win:
    experts 2 and 3 get no calibration rows."""
    loaded = load_model(models["mixtral"], fuse=False)
    block = loaded.model.model.layers[0]
    assert isinstance(block.mlp, SparseMoeBlock)
    with torch.no_grad():
        # the router's input is channel 0 alone (norm weight): experts 0 / 1 score +-10 x_0, experts 2 / 3 zero
        block.post_attention_layernorm.weight.zero_()
        block.post_attention_layernorm.weight[0] = 1.0
        block.mlp.gate.weight.zero_()
        block.mlp.gate.weight[:2, 0] = torch.tensor([10.0, -10.0])
    block.mlp.top_k = 1
    before = {j: {p: getattr(block.mlp.experts[j], p).weight.detach().clone() for p in ("gate_proj", "down_proj")}
              for j in (2, 3)}
    prune_and_save(loaded, tmp_path / "out", method, 0.5, ids=_ids(loaded.config.vocab_size), progress=False)
    record = json.loads((tmp_path / "out" / "config.json").read_text())["sparsity_config"]
    assert record["experts_by_magnitude"] == [f"model.layers.0.mlp.experts.{j}" for j in (2, 3)]
    for j, weights in before.items():
        for proj, w in weights.items():
            # wanda: |W| per output row; sparsegpt with H = I: |W| over the (single, < 128 columns) block
            mask = unstructured_mask(w.abs(), 0.5, per_row=method == "wanda")
            got = getattr(block.mlp.experts[j], proj).weight
            torch.testing.assert_close(got, w.masked_fill(mask, 0.0), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- structured

@pytest.mark.parametrize("arch", ["qwen3", "phi3", "gemma3", "smollm3"])
def test_structured_shapes_and_reload(models: dict[str, Path], tmp_path: Path, arch: str) -> None:
    loaded = load_model(models[arch], fuse=False)
    config = loaded.config
    ids = _ids(config.vocab_size)
    plan = st.plan_structured(config, 0.5, num_groups=1, num_layers=1)
    removals = st.choose_removals(st.structured_scores(loaded.model, ids, progress=False), plan)
    prune_and_save(loaded, tmp_path / "out", "structured", 0.5, drop_head_groups=1, drop_layers=1, ids=ids,
                   progress=False)
    record = json.loads((tmp_path / "out" / "config.json").read_text())["sparsity_config"]
    assert record["removed"]["layers"] == removals.layers and len(removals.layers) == 1

    small = load_model(tmp_path / "out")
    c = small.config
    assert c.architecture == arch and c.num_hidden_layers == config.num_hidden_layers - 1
    assert (c.num_key_value_heads, c.num_attention_heads) == (1, 2)
    assert c.intermediate_size == config.intermediate_size - plan.num_channels_removed == 64
    assert record["num_parameters_after"] == c.num_params
    kept = [i for i in range(config.num_hidden_layers) if i not in removals.layers]
    if arch == "gemma3":  # every kept layer keeps its own sliding / global attention
        assert c.layer_types == [LAYER_TYPES[i] for i in kept]
        assert [layer.self_attn.sliding_window for layer in small.model.model.layers] == [
            config.layer_window(i) for i in kept]
    if arch == "smollm3":  # every kept layer keeps its RoPE or its lack of it
        assert c.no_rope_layers == [config.no_rope_layers[i] for i in kept]
    for layer in small.model.model.layers:
        if c.qk_norm:  # per-head norms keep head_dim
            assert layer.self_attn.q_norm.weight.shape == layer.self_attn.k_norm.weight.shape == (c.head_dim,)
    st.mask_removals(loaded.model, config, removals)  # the full-size model computing what the small one does
    prompt = _prompt(config.vocab_size)
    torch.testing.assert_close(prefill_logits(small, prompt), prefill_logits(loaded, prompt), atol=2e-4, rtol=2e-4)


# ---------------------------------------------------------------------------------------------- the CLI

@pytest.fixture(scope="module")
def calib_text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(TRAINING_TEXT * 3)
    return path


CALIB = ["--num-samples", "4", "--seq-len", "32"]
CLI_RUNS = [("gemma3", "wanda", ["--pattern", "2:4"]), ("qwen2_moe", "sparsegpt", []), ("phi3", "magnitude", [])]


@pytest.mark.parametrize("arch,method,flags", CLI_RUNS, ids=[f"{r[0]}-{r[1]}" for r in CLI_RUNS])
def test_generate_on_the_folder_matches_the_pruned_model(models: dict[str, Path], calib_text: Path, tmp_path: Path,
                                                         arch: str, method: str, flags: list[str]) -> None:
    """`brisk prune`, then `brisk generate --model OUT` (no other model flag): its greedy text is the in-memory
    pruned model's (the same run, in process, decoding greedily by full prefills)."""
    out = tmp_path / "out"
    calib = [] if method == "magnitude" else ["--calib-text", str(calib_text), *CALIB]
    result = CliRunner().invoke(main, ["prune", str(models[arch]), str(out), "--method", method, *flags, *calib])
    assert result.exit_code == 0, result.output

    loaded = load_model(models[arch], fuse=False)
    ids = None if method == "magnitude" else load_calibration_ids(
        loaded.tokenizer, CalibConfig(str(calib_text), num_samples=4, seq_len=32))
    nm = NMPattern(2, 4) if flags else None
    prune_and_save(loaded, tmp_path / "again", method, 0.5, pattern=nm, ids=ids, progress=False)
    tokens = loaded.tokenizer.encode("Emma Woodhouse")
    answer: list[int] = []
    while len(answer) < 8 and (not answer or answer[-1] not in loaded.config.eos_token_id):
        answer.append(int(prefill_logits(loaded, torch.tensor(tokens + answer))[-1].argmax()))
    want = loaded.tokenizer.decode(answer)

    result = CliRunner().invoke(main, ["generate", "--model", str(out), "--temperature", "0", "--max-tokens", "8",
                                       "--no-stream", "Emma Woodhouse"])
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip("\n") == want


def test_refusal_comes_before_calibration(models: dict[str, Path], calib_text: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import brisk.quant.calib

    def no_calibration(*_args: object, **_kw: object) -> None:
        raise AssertionError("calibration started before the refusal")

    monkeypatch.setattr(brisk.quant.calib, "load_calibration_ids", no_calibration)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["prune", str(models["qwen3_moe"]), str(out), "--method", "structured",
                                       "--calib-text", str(calib_text), *CALIB])
    assert result.exit_code != 0
    assert "--method structured" in result.output and "qwen3_moe" in result.output
    assert "use --method magnitude or wanda or sparsegpt" in result.output
    assert not (out / "config.json").exists()
