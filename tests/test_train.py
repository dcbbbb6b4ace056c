"""The trainer on tiny random models: training forward vs the paged forward, schedule, determinism, resume."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from hf_utils import TRAINING_TEXT, make_tiny_hf_model
from test_gemma import make_tiny_gemma3
from test_moe import make_tiny_moe

from brisk.data import calibration_text_path
from brisk.eval.ppl import sequence_logits
from brisk.model.loader import load_model
from brisk.train.checkpoint import TrainCheckpointError
from brisk.train.data import TextWindows, TrainDataError
from brisk.train.distill import make_lm_loss
from brisk.train.forward import causal_lm_forward
from brisk.train.trainer import TrainConfig, lr_at, train

TEXT = calibration_text_path().read_text(encoding="utf-8")[:20000]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_hf_model(path, num_kv_heads=2, tie_word_embeddings=True)
    return path


def _config(**kw) -> TrainConfig:
    base = dict(max_steps=4, batch_size=2, lr=3e-3, warmup_steps=1, eval_windows=1, eval_window=64,
                checkpoint_every=0, progress=False)
    return TrainConfig(**{**base, **kw})


def _run(tiny, out, config, resume=False, loss_fn=None):
    loaded = load_model(tiny, fuse=False)
    data = TextWindows.from_text(TEXT, loaded.tokenizer, seq_len=32, seed=config.seed, source="emma")
    result = train(loaded, loss_fn or make_lm_loss(), data, config, out, method={"method": "finetune"},
                   eval_text=TEXT[:5000], eval_source="emma-head", resume=resume)
    return loaded, result


@pytest.mark.parametrize("arch,window", [("llama", None), ("mistral", 5)])
def test_training_forward_matches_paged_forward(tmp_path, arch, window):
    make_tiny_hf_model(tmp_path, arch=arch, sliding_window=window)
    loaded = load_model(tmp_path, fuse=False)
    ids = torch.randint(0, loaded.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = causal_lm_forward(loaded.model, ids).logits  # [2, 12, V]
    for b in range(2):
        torch.testing.assert_close(logits[b], sequence_logits(loaded, ids[b]), atol=1e-4, rtol=1e-4)


def _phi3_longrope(path, original: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(3)
    half = 64 // 4 // 2  # head_dim / 2 of the tiny model
    scaling = {"rope_type": "longrope", "short_factor": (1 + torch.rand(half, generator=g)).tolist(),
               "long_factor": (1 + 4 * torch.rand(half, generator=g)).tolist()}
    return make_tiny_hf_model(path, "phi3", rope_scaling=scaling, max_position_embeddings=256,
                              original_max_position_embeddings=original, seed=4)


# every architecture beyond llama / mistral, as transformers builds it (each with its features set to non-defaults:
# qwen2's biases, qwen3's q/k norms, gemma3's (1 + w) norms, 8-token window, two RoPE tables and soft-cap, MoE
# routers drawn wide so routing is decided by clear margins)
NEW_ARCHS = {
    "qwen2": lambda path: make_tiny_hf_model(path, "qwen2", seed=1),
    "qwen3": lambda path: make_tiny_hf_model(path, "qwen3", seed=1),
    # long-RoPE: 12-token windows within phi3's original context of 48 (short factors), and beyond one of 8 (long)
    "phi3-short": lambda path: _phi3_longrope(path, 48),
    "phi3-long": lambda path: _phi3_longrope(path, 8),
    "gemma3": lambda path: make_tiny_gemma3(path, seed=1),
    "mixtral": lambda path: make_tiny_moe(path, "mixtral", seed=1),
    "qwen2_moe": lambda path: make_tiny_moe(path, "qwen2_moe", seed=1),
    "qwen3_moe": lambda path: make_tiny_moe(path, "qwen3_moe", seed=1),
}


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_training_forward_matches_paged_forward_and_transformers(tmp_path, arch):
    ref = NEW_ARCHS[arch](tmp_path)
    loaded = load_model(tmp_path, fuse=False)
    assert loaded.config.architecture == arch.split("-")[0]
    ids = torch.randint(3, loaded.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = causal_lm_forward(loaded.model, ids).logits  # [2, 12, V]
    with torch.no_grad():
        want = ref(ids).logits  # [2, 12, V]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    for b in range(2):
        torch.testing.assert_close(logits[b], sequence_logits(loaded, ids[b]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "phi3-long", "gemma3", "qwen2_moe", "qwen3_moe"])
def test_few_steps_reduce_the_loss_on_each_architecture(tmp_path, arch):
    """A few seeded steps lower held-out perplexity (through the engine's forward), every trained weight (the
    experts and routers of a MoE model included) moves, and the saved folder serves the trained model."""
    NEW_ARCHS[arch](tmp_path / "float")
    loaded = load_model(tmp_path / "float", fuse=False)
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    data = TextWindows.from_text(TRAINING_TEXT, loaded.tokenizer, seq_len=24, seed=0, source="emma")
    result = train(loaded, make_lm_loss(), data, _config(max_steps=6, eval_window=48), tmp_path / "out",
                   method={"method": "finetune"}, eval_text=TRAINING_TEXT, eval_source="emma")
    assert result.record["eval_ppl_after"] < 0.97 * result.record["eval_ppl_before"]
    still = [n for n, p in loaded.model.named_parameters() if torch.equal(p, before[n])]
    assert not still, f"not trained: {still[:4]}"
    reloaded = load_model(tmp_path / "out")
    ids = torch.arange(3, 23)
    torch.testing.assert_close(sequence_logits(reloaded, ids), sequence_logits(loaded, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2_moe"])
def test_activation_checkpointing_and_bf16_on_each_layer_kind(tmp_path, arch):
    """Recomputed layers give the same gradients (a MoE layer routes the same tokens again in the backward), and
    bfloat16 autocast gives a loss near float32's with gradients pointing the same way."""
    NEW_ARCHS[arch](tmp_path)
    loaded = load_model(tmp_path, fuse=False)
    loaded.model.requires_grad_(True)
    ids = torch.randint(3, loaded.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    layer = loaded.model.model.layers[0]
    weight = layer.mlp.experts[0].down_proj.weight if arch == "qwen2_moe" else layer.mlp.down_proj.weight
    runs = []
    for ckpt, bf16 in ((False, False), (True, False), (False, True)):
        loaded.model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = make_lm_loss(ckpt)(loaded.model, ids)[0]
        loss.backward()
        runs.append((float(loss.detach()), weight.grad.clone()))
    (loss, grad), (loss_ckpt, grad_ckpt), (loss_bf16, grad_bf16) = runs
    assert grad.abs().sum() > 0
    assert loss_ckpt == loss
    torch.testing.assert_close(grad_ckpt, grad)
    assert abs(loss_bf16 - loss) < 0.02 * loss
    assert F.cosine_similarity(grad_bf16.flatten(), grad.flatten(), dim=0) > 0.95


def test_softcapped_head_loss_matches_autograd():
    """head_loss's fused gradient through gemma3's logit soft-cap against autograd over the plain expression."""
    from brisk.train.losses import head_loss, next_token_ce

    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False)
    with torch.no_grad():
        head.weight.copy_(3 * torch.randn(40, 16, generator=g))  # logits well into the cap's curved part
    hidden = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    ids = torch.randint(0, 40, (2, 9), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    loss, _, _ = head_loss(head, hidden.reshape(-1, 16), labels.reshape(-1), softcap=5.0)
    loss.backward()
    got = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None
    want = next_token_ce(torch.tanh(head(hidden) / 5.0) * 5.0, ids)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(got, (hidden.grad, head.weight.grad))


def test_activation_checkpointing_gives_the_same_gradients(tiny):
    loaded = load_model(tiny, fuse=False)
    loaded.model.requires_grad_(True)
    ids = torch.randint(0, loaded.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for ckpt in (False, True):
        loaded.model.zero_grad(set_to_none=True)
        make_lm_loss(ckpt)(loaded.model, ids)[0].backward()
        grads.append(loaded.model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1])


def test_lr_schedule_warmup_then_cosine_to_floor():
    c = TrainConfig(max_steps=11, lr=1.0, warmup_steps=2, min_lr_ratio=0.1)
    assert [lr_at(s, c) for s in range(2)] == [0.5, 1.0]
    assert lr_at(2, c) == pytest.approx(1.0)
    assert lr_at(10, c) == pytest.approx(0.1)
    assert lr_at(6, c) == pytest.approx(0.55)  # halfway through the cosine: the mean of lr and the floor


def test_windows_are_seeded_and_cover_the_text_each_epoch(tiny):
    tok = load_model(tiny, fuse=False).tokenizer
    data = TextWindows.from_text(TEXT, tok, seq_len=32, seed=3)
    n = data.num_windows
    epoch = data.batch(0, n)
    assert sorted(map(tuple, epoch.tolist())) == sorted(map(tuple, data.windows.tolist()))
    assert torch.equal(data.batch(5, 3), epoch[5:8])
    assert torch.equal(TextWindows.from_text(TEXT, tok, 32, seed=3).batch(n, 4), data.batch(n, 4))
    assert not torch.equal(TextWindows.from_text(TEXT, tok, 32, seed=4).batch(0, n), epoch)


def test_few_steps_reduce_the_loss_deterministically(tiny, tmp_path):
    loaded_a, a = _run(tiny, tmp_path / "a", _config(max_steps=6))
    loaded_b, b = _run(tiny, tmp_path / "b", _config(max_steps=6))
    # held-out perplexity (the same windows before and after) is the stable measure; step losses are of other batches
    assert a.record["eval_ppl_after"] < 0.97 * a.record["eval_ppl_before"]
    for (name, pa), pb in zip(loaded_a.model.state_dict().items(), loaded_b.model.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    # the output folder is an ordinary checkpoint with the training record
    reloaded = load_model(tmp_path / "a")
    ids = torch.arange(20)
    torch.testing.assert_close(sequence_logits(reloaded, ids), sequence_logits(loaded_a, ids), atol=1e-5, rtol=1e-5)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["training"]["steps"] == 6 and config["training"]["tokens"] == 6 * 2 * 32
    assert len((tmp_path / "a" / "train_log.jsonl").read_text().splitlines()) == 6 + 2  # steps + 2 evaluations


def test_interrupt_then_resume_equals_uninterrupted(tiny, tmp_path):
    config = _config(max_steps=5, grad_accum=2)
    loaded_full, full = _run(tiny, tmp_path / "full", config)

    calls = {"n": 0}
    lm = make_lm_loss()

    def interrupting(model, ids):  # Ctrl-C during the 3rd step's first micro-batch
        calls["n"] += 1
        if calls["n"] == 5:
            os.kill(os.getpid(), signal.SIGINT)
        return lm(model, ids)

    _, part = _run(tiny, tmp_path / "part", config, loss_fn=interrupting)
    assert part.interrupted and part.steps == 3
    assert load_model(tmp_path / "part").config.num_hidden_layers == 2  # a usable checkpoint folder
    loaded_resumed, resumed = _run(tiny, tmp_path / "part", config, resume=True)
    assert resumed.steps == 5 and not resumed.interrupted
    resumed_state = loaded_resumed.model.state_dict()
    for (name, pa), pb in zip(loaded_full.model.state_dict().items(), resumed_state.values(), strict=True):
        assert torch.equal(pa, pb), name
    strip = [{k: v for k, v in h.items() if k != "seconds"} for h in full.history]
    assert strip == [{k: v for k, v in h.items() if k != "seconds"} for h in resumed.history]


def test_resume_errors(tiny, tmp_path):
    with pytest.raises(TrainCheckpointError, match="no training checkpoint"):
        _run(tiny, tmp_path / "none", _config(), resume=True)
    _run(tiny, tmp_path / "run", _config(max_steps=2))
    with pytest.raises(TrainCheckpointError, match="other settings"):
        _run(tiny, tmp_path / "run", _config(max_steps=2, lr=1e-3), resume=True)
    (tmp_path / "run" / "last" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(TrainCheckpointError, match="corrupt"):
        _run(tiny, tmp_path / "run", _config(max_steps=2), resume=True)


def test_text_shorter_than_one_window(tiny):
    tok = load_model(tiny, fuse=False).tokenizer
    with pytest.raises(TrainDataError, match="fewer than one window"):
        TextWindows.from_text("Emma Woodhouse.", tok, seq_len=64, seed=0)


def test_bad_settings():
    with pytest.raises(ValueError, match="max_steps"):
        TrainConfig(max_steps=0)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        TrainConfig(max_steps=1, min_lr_ratio=2.0)


@pytest.mark.parametrize("keep", [True, False])
def test_keep_sparsity_keeps_a_pruned_students_zeros(tiny, tmp_path, keep):
    loaded = load_model(tiny, fuse=False)
    pruned = {}
    with torch.no_grad():
        for name, p in loaded.model.model.layers.named_parameters():
            if p.dim() == 2:
                mask = torch.rand(p.shape, generator=torch.Generator().manual_seed(len(name))) < 0.5
                p.masked_fill_(mask, 0.0)
                pruned[name] = mask
    data = TextWindows.from_text(TEXT, loaded.tokenizer, seq_len=32, seed=0, source="emma")
    result = train(loaded, make_lm_loss(), data, _config(keep_sparsity=keep), tmp_path / "out",
                   method={"method": "finetune"}, eval_text=TEXT[:5000], eval_source="emma-head")
    params = dict(loaded.model.model.layers.named_parameters())
    refilled = sum(int((params[n][m] != 0).sum()) for n, m in pruned.items())
    if keep:
        assert refilled == 0 and result.record["kept_zeros"] == sum(int(m.sum()) for m in pruned.values())
        assert result.record["eval_ppl_after"] < result.record["eval_ppl_before"]  # the kept weights still learn
    else:
        assert refilled > 0.9 * sum(int(m.sum()) for m in pruned.values())  # AdamW fills the zeros in
