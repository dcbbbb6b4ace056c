"""Token trees, Medusa heads and the EAGLE head: tree attention equals each root-to-leaf path decoded alone (paged,
over a shared prefix block); greedy output with Medusa and EAGLE identical to plain decoding, alone, batched and
under preemption; no KV block leaked after rejected branches; the heads' training losses fall."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk import LLM, SamplingParams
from brisk.data import calibration_text_path
from brisk.engine.token_tree import (
    accept_tree_greedy,
    accepted_moves,
    path_to,
    static_tree,
    tree_depths,
    tree_mask,
    tree_parents,
)
from brisk.kvcache.quant import make_kv_caches
from brisk.model.loader import load_model
from brisk.ops.metadata import AttentionMetadata
from brisk.spec.eagle import (
    draft_vocabulary,
    eagle_accuracy,
    eagle_loss,
    eagle_windows,
    fit_eagle,
    head_for,
    save_eagle,
)
from brisk.spec.head_train import to_draft_ids
from brisk.spec.medusa import (
    MedusaHeads,
    SelfDistillData,
    collect_self_distill,
    evaluation_prompts,
    fit_heads,
    head_losses,
    load_heads,
    rank_accuracy,
    save_heads,
    training_prompts,
)

VOCAB = 384
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tree")
    make_tiny_hf_model(path, "llama", num_kv_heads=2, seed=7, vocab_size=VOCAB, num_hidden_layers=3)
    return str(path)


def make_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 30, 3, 41, 12)]


@pytest.fixture(scope="module")
def plain(model_dir):
    llm = LLM(model_dir, max_model_len=256)
    return [o.outputs[0].token_ids for o in llm.generate(make_prompts(), GREEDY)]


@pytest.fixture(scope="module")
def heads_dir(model_dir, tmp_path_factory):
    """Heads fitted to the tiny model's own greedy answers to the test prompts (so many drafts are accepted)."""
    loaded = load_model(model_dir)
    data = collect_self_distill(loaded, make_prompts(), 32, 3, log=lambda m: None)
    weight = loaded.model.lm_head.weight.detach().float()
    heads = MedusaHeads(3, data.hidden.shape[1])
    torch.manual_seed(0)
    fit_heads(heads, weight, data, steps=100, batch_size=64, lr=3e-3)
    out = tmp_path_factory.mktemp("medusa")
    save_heads(heads, out, {"accuracy": rank_accuracy(heads, weight, data.hidden, data.labels)})
    return str(out)


@pytest.fixture(scope="module")
def eagle_dir(model_dir, tmp_path_factory):
    """An EAGLE head fitted to the tiny model's own greedy answers to the test prompts."""
    loaded = load_model(model_dir)
    data = collect_self_distill(loaded, make_prompts(), 32, 1, log=lambda m: None)
    torch.manual_seed(0)
    head = head_for(loaded.model.config)
    fit_eagle(head, loaded.model.model.embed_tokens, loaded.model.lm_head.weight.detach().float(), data, steps=120,
              window=16, batch_size=8, lr=3e-3)
    out = tmp_path_factory.mktemp("eagle")
    save_eagle(head, draft_vocabulary(data, VOCAB, 256), out, {})
    return str(out)


# ---------------------------------------------------------------------------------------------- tree structure


def test_tree_helpers():
    parents = [-1, -1, 0, 0, 2, 1]
    assert tree_depths(parents) == [1, 1, 2, 2, 3, 2]
    assert path_to(parents, 4) == [0, 2, 4] and path_to(parents, -1) == []
    m = tree_mask(parents, num_real=2)
    assert m[0].tolist() == [True, False] + [False] * 6
    assert m[2 + 4].tolist() == [True, True, True, False, True, False, True, False]  # root, 0, 2, itself
    tokens = [10, 11, 12, 13, 14, 15]
    # argmax at root=10 -> node 0; at node 0 = 12 -> node 2; at node 2 = 99 -> no child: emit 99
    argmax = [10, 12, 0, 99, 0, 0, 0]
    path, emitted = accept_tree_greedy(tokens, parents, argmax)
    assert path == [0, 2] and emitted == [10, 12, 99]
    assert accepted_moves([1, 5]) == [(2, 1), (6, 2)]
    assert accepted_moves([0, 2]) == [(3, 2)]


def test_static_tree_best_first_and_prefix_closed():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    paths = static_tree(acc, 10)
    assert paths[0] == (0,) and paths[1] == (0, 0)
    assert len(paths) == 10 and len(set(paths)) == 10
    probs = []
    for p in paths:
        assert len(p) == 1 or p[:-1] in paths[:paths.index(p)]  # parent first
        prob = 1.0
        for k, c in enumerate(p):
            prob *= acc[k][c]
        probs.append(prob)
    assert probs == sorted(probs, reverse=True)
    parents = tree_parents(paths)
    assert all(p < i for i, p in enumerate(parents))


# ---------------------------------------------------------------------------------------------- tree attention


@pytest.mark.parametrize("kv_dtype", ["auto", "bfloat16"])
def test_tree_attention_equals_each_path_alone(model_dir, kv_dtype):
    loaded = load_model(model_dir)
    model, c = loaded.model, loaded.model.config
    bs = 16
    caches = make_kv_caches(kv_dtype, c.num_hidden_layers, 24, bs, c.num_key_value_heads, c.head_dim,
                            loaded.dtype)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, VOCAB, (21,), generator=g).tolist()
    root = 77
    parents = [-1, -1, -1, 0, 0, 1, 3, 3, 6, 2]
    drafts = torch.randint(3, VOCAB, (len(parents),), generator=g).tolist()

    def run(ids: list[int], positions: list[int], cache_len: int, blocks: list[int], mask=None) -> torch.Tensor:
        meta = AttentionMetadata.for_sequences([len(ids)], [cache_len + len(ids)], [blocks], bs,
                                               positions=torch.tensor(positions),
                                               tree_masks=None if mask is None else [(0, mask)])
        with torch.inference_mode():
            return model(torch.tensor(ids), torch.tensor(positions), meta, caches).float()

    tree_blocks = [5, 2, 7]  # paged and out of order
    run(prompt, list(range(len(prompt))), 0, tree_blocks)
    n = len(prompt)
    depths = tree_depths(parents)
    tree_logits = run([root] + drafts, [n] + [n + d for d in depths], n, tree_blocks, tree_mask(parents))
    for node in range(-1, len(parents)):
        path = [drafts[i] for i in path_to(parents, node)]
        # the path alone, reusing the prompt's first (full) block as a prefix-cache hit would, its own blocks after
        ids = prompt[bs:] + [root] + path
        want = run(ids, list(range(bs, bs + len(ids))), bs, [5, 11 + node + 1, 20])[-1]
        got = tree_logits[node + 1]
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
        assert int(got.argmax()) == int(want.argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_kernel_equals_the_reference(ops, dtype):  # ops: fails the test where the kernels did not build
    """paged_tree_attention (each tree row: the sequence's cache + its ancestors + itself) against the prefill
    kernel followed by tree_attention_reference, in one batch with a decode, a plain chunk and two trees (one of
    64 rows: bit 63 of the row masks); a tree of more than 64 rows takes the reference path."""
    from brisk.ops.attention import paged_attention, tree_attention_reference

    g = torch.Generator().manual_seed(0)
    bs, kvh, h, d, nb = 16, 3, 9, 64, 64
    cache = torch.randn(2, nb, bs, kvh, d, generator=g).to(dtype)
    small = [-1, -1, 0, 0, 1, 2, 2, 4, -1, 8, 9, 5]
    wide = [-1] + [i - 1 if i % 3 else -1 for i in range(1, 63)]  # 63 drafts + the root = 64 rows
    qlens = [1, 1 + len(small), 5, 1 + len(wide)]
    ctxs = [40, 100 + qlens[1], 70, 33 + qlens[3]]
    perm, blocks = torch.randperm(nb, generator=g).tolist(), []
    for c in ctxs:
        blocks.append(perm[:(c + bs - 1) // bs])
        perm = perm[len(blocks[-1]):]
    masks = [(1, tree_mask(small)), (3, tree_mask(wide))]
    meta = AttentionMetadata.for_sequences(qlens, ctxs, blocks, bs, tree_masks=masks)
    plain = AttentionMetadata.for_sequences(qlens, ctxs, blocks, bs)
    q = torch.randn(sum(qlens), h, d, generator=g).to(dtype)
    kv = torch.zeros(sum(qlens), kvh, d)  # this step's k / v: already in the cache, unused by the kernels
    got = paged_attention(q, kv, kv, cache, meta, 0.125)
    want = paged_attention(q, kv, kv, cache, plain, 0.125)
    causal = want.clone()
    tree_attention_reference(want, q, cache, meta, 0.125)
    assert not torch.allclose(want.float(), causal.float(), atol=0.1)  # the masks do change the tree rows
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # summation order; bfloat16 outputs round to 8 bits
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    big = [-1] + list(range(64))  # 65 drafts: no 64-bit row masks, the reference path
    meta = AttentionMetadata.for_sequences([66], [80], [perm[:5]], bs, tree_masks=[(0, tree_mask(big))])
    assert meta.tree_row_bits() is None


# ---------------------------------------------------------------------------------------------- engine


def medusa_llm(model_dir: str, heads_dir: str, size: int = 8, method: str = "medusa", adaptive: bool = False,
               **kwargs) -> LLM:
    """An LLM drafting trees of `size` nodes; whole trees unless `adaptive` (the tiny model's heads are weak, and
    the sizer would rightly drop most of their trees, leaving little for the verification tests to check)."""
    config = {"method": method, "model": heads_dir, "num_speculative_tokens": size, "disable_by_batch_size": None,
              "adaptive": adaptive}
    kwargs.setdefault("max_model_len", 256)
    return LLM(model_dir, speculative_config=config, **kwargs)


def assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv_manager.block_pool.get_num_free_blocks() == engine.num_blocks
    assert not engine.scheduler.requests and not engine.groups


def test_medusa_greedy_batched_equals_plain(model_dir, heads_dir, plain):
    llm = medusa_llm(model_dir, heads_dir)
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens > 0  # trees with accepted branches, their K/V moved into place
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and rejected branches, dropped
    assert_no_leak(llm)


def tree_steps_on(monkeypatch, path: str) -> list[int]:
    """The rows of every tree step DecodePlan.<path> ("run": the Python loop, "run_cpp": the C++ loop) runs."""
    from brisk.engine.decode_plan import DecodePlan

    rows: list[int] = []
    real = getattr(DecodePlan, path)

    def counted(self, x, cos, sin, meta, kv):
        if meta.tree_masks:
            rows.append(x.shape[0])
        return real(self, x, cos, sin, meta, kv)

    monkeypatch.setattr(DecodePlan, path, counted)
    return rows


def test_tree_steps_run_on_the_decode_plan(ops, model_dir, heads_dir, plain, monkeypatch):
    """Verification steps with trees take the plan's Python loop (paged_tree_attention), not the module path, and
    greedy output stays plain decoding's."""
    tree_rows = tree_steps_on(monkeypatch, "run")
    llm = medusa_llm(model_dir, heads_dir, size=12)
    outs = llm.generate(make_prompts()[:3], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain[:3]
    assert tree_rows and max(tree_rows) > 8  # trees of up to 13 rows per request, batched
    assert_no_leak(llm)


def test_small_tree_steps_run_in_the_cpp_loop(ops, model_dir, heads_dir, plain, monkeypatch):
    """A tree step of up to 8 rows takes the C++ layer loop (decode_layers with tree masks), with the numbers of
    the plan's Python loop bit for bit, and greedy output stays plain decoding's."""
    from brisk.engine.decode_plan import DecodePlan

    loaded = load_model(model_dir)
    model, c = loaded.model, loaded.model.config
    plan = DecodePlan.build(model)
    assert plan is not None and plan.decode_layers is not None
    bs, parents = 16, [-1, -1, 0, 0, 2, 1]  # 6 drafts + the root: 7 rows, with a decode row of another sequence
    prompt = torch.randint(3, VOCAB, (19,), generator=torch.Generator().manual_seed(4)).tolist()
    depths = tree_depths(parents)
    ids = torch.tensor([11] + [50, 60, 70, 80, 90, 100, 110])
    positions = torch.tensor([9] + [19] + [19 + d for d in depths])
    meta = AttentionMetadata.for_sequences([1, 7], [10, 26], [[3], [0, 1]], bs, positions=positions,
                                           tree_masks=[(1, tree_mask(parents))])
    outs = []
    for runner in (plan.run, plan.run_cpp):
        caches = make_kv_caches("auto", c.num_hidden_layers, 8, bs, c.num_key_value_heads, c.head_dim, loaded.dtype)
        for blocks, n in (([3], 9), ([0, 1], 19)):  # each sequence's earlier tokens, in the cache
            pre = AttentionMetadata.for_sequences([n], [n], [blocks], bs, positions=torch.arange(n))
            with torch.inference_mode():
                model(torch.tensor(prompt[:n]), torch.arange(n), pre, caches)
        with torch.inference_mode():
            x, cos, sin = model.prologue(ids, positions, meta, None)
            assert plan.cpp_applies(x, meta, caches)
            outs.append((runner(x.clone(), cos, sin, meta, caches)[0], torch.stack([kv.clone() for kv in caches])))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])

    tree_rows = tree_steps_on(monkeypatch, "run_cpp")
    llm = medusa_llm(model_dir, heads_dir, size=7)
    for p, want in zip(make_prompts()[:2], plain[:2], strict=True):
        assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == want
    assert tree_rows and max(tree_rows) == 8
    assert_no_leak(llm)


def test_medusa_greedy_alone_and_under_preemption(model_dir, heads_dir, plain):
    prompts = make_prompts()
    llm = medusa_llm(model_dir, heads_dir, size=12)
    for p, want in zip(prompts[:3], plain[:3], strict=True):
        assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == want
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    tight = medusa_llm(model_dir, heads_dir, num_kv_blocks=10, max_model_len=128,
                       max_num_batched_tokens=64)
    outs = tight.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert tight.engine.scheduler.num_preemptions > 0
    assert_no_leak(tight)


def test_medusa_sampling_verifies_trees(model_dir, heads_dir, monkeypatch):
    """Sampled requests draft the same static tree, verified by exact multi-draft sampling (engine/token_tree.py
    accept_tree_sampling; its distribution is tested in tests/test_spec_verify.py)."""
    import brisk.engine.token_tree as tree

    sampled_trees = []
    real = tree.verify_tree

    def spy(logits, requests, drafts, parents):
        sampled_trees.extend(len(d) for r, d in zip(requests, drafts, strict=True)
                             if r.sampling_params.temperature > 0)
        return real(logits, requests, drafts, parents)

    monkeypatch.setattr(tree, "verify_tree", spy)
    llm = medusa_llm(model_dir, heads_dir)
    params = SamplingParams(temperature=0.8, max_tokens=16, seed=3, ignore_eos=True)
    out = llm.generate(make_prompts()[:2], params)
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)
    assert max(sampled_trees) > 1  # trees of several nodes, not chains
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert_no_leak(llm)


def test_medusa_refuses_what_trees_do_not_cover(model_dir, heads_dir, tmp_path):
    with pytest.raises(ValueError, match="token trees"):
        medusa_llm(model_dir, heads_dir, kv_cache_dtype="int8")
    with pytest.raises(FileNotFoundError, match="train-medusa"):
        medusa_llm(model_dir, str(tmp_path))


# ---------------------------------------------------------------------------------------------- training


def test_head_training_loss_falls(model_dir, tmp_path):
    loaded = load_model(model_dir)
    data = collect_self_distill(loaded, make_prompts()[:3], 16, 2, log=lambda m: None)
    assert data.hidden.shape[0] == data.labels.shape[0] >= 3 * 15
    weight = loaded.model.lm_head.weight.detach().float()
    heads = MedusaHeads(2, data.hidden.shape[1])
    before = head_losses(heads, weight, data.hidden, data.labels).mean().item()
    history = fit_heads(heads, weight, data, steps=40, batch_size=32, lr=3e-3, seed=1)
    after = head_losses(heads, weight, data.hidden, data.labels).mean().item()
    assert after < 0.8 * before and history[-1] < history[0]
    save_heads(heads, tmp_path, {"accuracy": [[0.5], [0.2]]})
    loaded_heads, info, vocab = load_heads(tmp_path, data.hidden.shape[1])
    assert vocab is None
    torch.testing.assert_close(loaded_heads.weight, heads.weight)
    assert info["accuracy"] == [[0.5], [0.2]]


@pytest.mark.parametrize("batched", [False, True])
def test_eagle_greedy_equals_plain(model_dir, eagle_dir, plain, batched):
    llm = medusa_llm(model_dir, eagle_dir, size=10, method="eagle")
    prompts = make_prompts()
    if batched:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    else:
        got = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts[:3]]
    assert got == plain[:len(got)]
    stats = llm.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_no_leak(llm)
    assert llm.engine.step() == [] and not llm.engine.speculator.proposer.live_ids()


def test_eagle_attends_to_its_training_window(model_dir, eagle_dir, plain, tmp_path, monkeypatch):
    """A head trained on windows of W rows attends to at most W - 1 earlier pairs (eagle.json's training window);
    output stays plain decoding's."""
    import json
    import shutil

    from brisk.spec.eagle import CONFIG_FILE, EagleProposer

    folder = tmp_path / "eagle"
    shutil.copytree(eagle_dir, folder)
    info = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps({**info, "training": {"window": 6}}))
    seen = []
    real = EagleProposer._feed

    def feed(self, req):
        out = real(self, req)
        if req.request_id in self.states:
            seen.append(self.states[req.request_id].k.shape[2])
        return out

    monkeypatch.setattr(EagleProposer, "_feed", feed)
    llm = medusa_llm(model_dir, str(folder), size=10, method="eagle")
    assert llm.engine.speculator.proposer.context == 5
    got = [o.outputs[0].token_ids for o in llm.generate(make_prompts()[:3], GREEDY)]
    assert got == plain[:3] and max(seen) == 5
    assert_no_leak(llm)


def test_eagle_under_preemption_and_sampling(model_dir, eagle_dir, plain):
    tight = medusa_llm(model_dir, eagle_dir, method="eagle", num_kv_blocks=10, max_model_len=128,
                       max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in tight.generate(make_prompts(), GREEDY)] == plain
    assert tight.engine.scheduler.num_preemptions > 0
    assert_no_leak(tight)
    out = tight.generate(make_prompts()[:2], SamplingParams(temperature=0.8, max_tokens=12, seed=1, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 12 for o in out)
    assert_no_leak(tight)


def test_eagle_training_loss_falls(model_dir):
    loaded = load_model(model_dir)
    data = collect_self_distill(loaded, make_prompts()[:3], 24, 1, log=lambda m: None)
    win = eagle_windows(data, 8)
    feats, toks = win.features(), win.tokens
    assert feats.shape[1] == toks.shape[1] == 9
    # the windows gather the answers' own rows, whether those are views of data.hidden (as collected) or not
    each = [(h[s:s + 9], t[s:s + 9]) for h, t in data.sequences for s in range(0, h.shape[0] - 8, 4)]
    assert torch.equal(feats, torch.stack([h for h, _ in each])) and toks.tolist() == [t for _, t in each]
    apart = SelfDistillData(data.hidden.clone(), data.labels, data.num_prompts, 0.0,
                            [(h.clone(), t) for h, t in data.sequences])
    assert torch.equal(eagle_windows(apart, 8).features(), feats)
    torch.manual_seed(0)
    head = head_for(loaded.model.config)
    embed, weight = loaded.model.model.embed_tokens, loaded.model.lm_head.weight.detach().float()
    before = eagle_loss(head, embed, weight, feats, toks)[0].item()
    fit_eagle(head, embed, weight, data, steps=40, window=8, batch_size=8, lr=3e-3, seed=1)
    after = eagle_loss(head, embed, weight, feats, toks)[0].item()
    assert after < 0.8 * before


def test_eagle_held_out_split_and_chain_accuracy(model_dir):
    """Training on some answers only, the chain accuracy (measured as the proposer drafts) is a falling sequence of
    fractions and beats the untrained head on answers the head fitted."""
    loaded = load_model(model_dir)
    data = collect_self_distill(loaded, make_prompts()[:4], 24, 1, log=lambda m: None)
    embed, weight = loaded.model.model.embed_tokens, loaded.model.lm_head.weight.detach().float()
    vocab = draft_vocabulary(data, VOCAB, 200)
    torch.manual_seed(0)
    head = head_for(loaded.model.config)
    untrained = eagle_accuracy(head, embed, weight, data, [0, 1, 2], 8, vocab, depth=3)
    fit_eagle(head, embed, weight, data, steps=60, window=8, batch_size=8, lr=3e-3, seed=1, answers=[0, 1, 2],
              draft_vocab=vocab)
    trained = eagle_accuracy(head, embed, weight, data, [0, 1, 2], 8, vocab, depth=3)
    assert len(trained) == 3 and all(1 >= a >= b >= 0 for a, b in zip(trained, trained[1:], strict=False))
    assert trained[0] > untrained[0]
    held = eagle_accuracy(head, embed, weight, data, [3], 8, vocab, depth=3)
    assert 0 <= held[0] <= 1
    with pytest.raises(ValueError, match="window"):
        eagle_windows(data, 64, [3])


def test_train_commands_share_their_data(model_dir, tmp_path):
    """`brisk spec train-medusa` then `train-eagle` on one --data file: the second reads the first's answers
    (written prompts included) instead of generating again, and each writes what --speculative loads."""
    import json

    from click.testing import CliRunner

    from brisk.cli import main

    data = tmp_path / "sd.pt"
    common = ["--prompts", "4", "--written-prompts", "2", "--max-tokens", "40", "--steps", "3", "--batch-size", "4",
              "--draft-vocab", "128", "--data", str(data), "--threads", "1", "--data-dtype", "bfloat16"]
    runner = CliRunner()
    first = runner.invoke(main, ["spec", "train-medusa", model_dir, str(tmp_path / "medusa"), *common, "--heads", "2"])
    assert first.exit_code == 0, first.output
    assert "generating in bfloat16 on a second copy" in first.output and data.is_file()
    second = runner.invoke(main, ["spec", "train-eagle", model_dir, str(tmp_path / "eagle"), *common, "--window", "8"])
    assert second.exit_code == 0, second.output
    assert "self-distillation data from" in second.output and "generating" not in second.output
    info = json.loads((tmp_path / "eagle" / "eagle.json").read_text())
    assert info["data"]["prompts"] == 4 and 0 <= info["data"]["written_prompts"] <= 2
    assert info["training"]["window"] == 8 and info["data"]["dtype"] == "bfloat16"
    medusa_llm(model_dir, str(tmp_path / "medusa"))  # both load
    medusa_llm(model_dir, str(tmp_path / "eagle"), method="eagle")
    bad = runner.invoke(main, ["spec", "train-eagle", model_dir, str(tmp_path / "x"), "--written-prompts", "-1"])
    assert bad.exit_code != 0 and "--written-prompts" in bad.output


def test_data_dtype_follows_the_cpu(model_dir, monkeypatch):
    """auto: bfloat16 data where the CPU reports native bfloat16 arithmetic and the target is in float32."""
    import brisk.ops.linear as linear
    from brisk.spec.medusa import data_dtype

    loaded = load_model(model_dir)
    monkeypatch.setattr(linear, "native_bf16_gemm", lambda: True)  # the CPU reports avx512_bf16 or amx_bf16
    assert data_dtype(loaded) == torch.bfloat16
    assert data_dtype(loaded, "float32") == torch.float32
    monkeypatch.setattr(linear, "native_bf16_gemm", lambda: False)  # an AVX2-only CPU
    assert data_dtype(loaded) == torch.float32 and data_dtype(loaded, "bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="data dtype"):
        data_dtype(loaded, "float16")


def test_topic_words_and_model_written_prompts(model_dir):
    from brisk.spec.medusa import model_written_prompts, topic_words

    text = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition, seemed to unite"
    words = topic_words(text, 4)
    assert len(words) == 4 and all(w.islower() and w.isalpha() and len(w) >= 6 for w in words)
    assert "Woodhouse" not in words and topic_words(text, 20)[:2] == topic_words(text, 20)[5:7]  # 5 words, cycled
    with pytest.raises(ValueError, match="6\\+ letters"):
        topic_words("Tiny text.", 3)
    # the tiny random model writes noise: whatever survives the filter is a new question or quote of 4-60 words
    loaded = load_model(model_dir)
    got = model_written_prompts(loaded, text * 3, 5, log=lambda m: None)
    assert len(got) <= 5 and len({c[0]["content"] for c in got}) == len(got)
    assert all(4 <= len(c[0]["content"].split()) <= 60 and c[0]["role"] == "user" for c in got)


def test_draft_ids_and_training_prompts():
    vocab = torch.tensor([2, 5, 9])
    assert to_draft_ids(torch.tensor([[5, 3, -1], [9, 2, 0]]), vocab, 10).tolist() == [[1, -2, -1], [2, 0, -2]]
    text = "Intro words here. " + " ".join(f"Sentence number {i} of the text is long enough to use here." for i in
                                            range(200))
    banned = "Sentence number 100 of the text is long enough to use here."
    prompts = [c[0]["content"] for c in training_prompts(text, 40, exclude=[f"Continue: \"{banned}\""])]
    assert len(prompts) == 40 and len(set(prompts)) == 40
    many = [c[0]["content"] for c in training_prompts(text, 600)]  # more prompts than sentences: other templates
    assert len(set(many)) == 600
    assert not any("number 100 " in p for p in prompts)
    with pytest.raises(ValueError, match="training prompts"):
        training_prompts("Too short. Really.", 5)
    chat = evaluation_prompts()
    assert "Explain to a child why the sky is blue." in chat
    real = [c[0]["content"] for c in training_prompts(Path(calibration_text_path()).read_text(encoding="utf-8"), 64,
                                                      chat)]
    assert not any(e[:60] in p for p in real for e in chat if e.startswith("Continue this story"))


# ---------------------------------------------------------------------------------------------- adaptive trees


def line_costs(fixed: float, per_row: float, split: int | None = None):  # noqa: ANN201 - a StepCostModel that has
    from brisk.spec.adaptive import StepCostModel  # measured a straight line (up to `split` rows)

    costs = StepCostModel(split=split)
    for rows in (1, 2, 4, 6, 8, 1, 3, 5):
        costs.observe_step(rows, fixed + per_row * rows)
    return costs


def test_tree_sizer_keeps_the_nodes_that_pay():
    from brisk.spec.adaptive import TreeSizer

    sizer = TreeSizer()
    costs = line_costs(0.02, 0.002)  # one more row costs a tenth of a one-row step
    for r in ("a", "b"):
        sizer.update(r, 4, 2, 2.0)  # measured once, calibrated at 1
    # a node pays where its probability exceeds about (rows so far) x 0.1 x (tokens per row): the rich tree keeps
    # its first nodes, the poor one none, and each kept set is a prefix
    counts = sizer.sizes(["a", "b"], [[0.9, 0.8, 0.5, 0.3, 0.05], [0.08, 0.05]], costs, 2)
    assert counts[1] == 0 and 2 <= counts[0] <= 4
    assert sizer.sizes(["a"], [[0.01, 0.01]], costs, 1) == [0]  # plain decoding beats a hopeless tree
    assert sizer.sizes(["new"], [[0.01, 0.01]], costs, 1) == [1]  # a first tree verifies at least one node
    assert sizer.sizes(["new"], [[0.9, 0.5, 0.01]], costs, 1) == [2]  # ... and the rest at face value
    assert sizer.draft_size("new", 16) == 16 and sizer.draft_size("a", 16) == 2 + 8  # room to grow: 2 x 4 + 2
    costs.split = 8  # (a model with a line of its own past 8 rows): exploring trees stay within 8 rows
    assert sizer.sizes(["new"], [[0.5] * 16], costs, 1) == [7]
    assert sizer.sizes(["new", "new2"], [[0.5] * 16, [0.5] * 16], costs, 6) == [1, 1]
    assert sizer.sizes(["new", "a"], [[0.5] * 16, [0.5] * 16], costs, 2)[0] == 6  # (a: measured, not capped)
    sizer.update("a", 8, 8, 2.0)  # the estimates were 4x too low: calibration raises them
    assert sizer.calibration("a") > 1.5
    assert sizer.sizes(["a"], [[0.06, 0.06, 0.03]], costs, 1)[0] > sizer.sizes(["b"], [[0.06, 0.06, 0.03]], costs, 1)[0]


def test_tree_sizer_stops_drafting_and_probes():
    from brisk.spec.adaptive import TreeSizer

    sizer = TreeSizer(probe_every=4, max_probe_every=8)
    costs = line_costs(0.02, 0.002)
    assert sizer.wants("r", costs, 1, 0.001)  # nothing measured: draft
    for _ in range(3):
        sizer.update("r", 6, 0, 1.5)  # trees of 6 rows, nothing accepted
    pattern = [sizer.wants("r", costs, 1, 0.001) for _ in range(12)]
    assert pattern == [False] * 3 + [True] + [False] * 7 + [True]  # probes after 4, then 8 steps
    assert sizer.exploring("r")  # a probe's tree is sized at face value
    for _ in range(6):
        sizer.update("r", 6, 4, 1.5)  # the text turned predictable: drafting pays again
    assert sizer.wants("r", costs, 1, 0.001) and not sizer.exploring("r")
    # ... unless whole tree steps measured slower per token than plain ones: then it pauses, and probes
    assert [sizer.wants("r", costs, 1, 0.001, losing=True) for _ in range(4)] == [False] * 3 + [True]
    sizer.forget({"r"})
    assert not sizer.live_ids()
    for _ in range(3):
        sizer.update("s", 2, 0, 1.0)
    # drafting dearer than any tree could save (a second a tree): no probe at all, until it could pay again
    assert not any(sizer.wants("s", costs, 1, 1.0) for _ in range(70))
    assert [sizer.wants("s", costs, 1, 0.001) for _ in range(4)] == [False] * 3 + [True]
    # a first tree too waits while even one node, surely accepted, costs more than it saves: 8 requests decoding,
    # and steps past 8 rows measured at twice the 8-row step (the float32 CPU target's small-row kernels' edge)
    split = line_costs(0.02, 0.002, split=8)
    assert sizer.wants("new", split, 8, 0.001)  # steps past 8 rows not timed yet: their cost is not known
    for rows in (9, 16, 24):
        split.observe_step(rows, 0.08 + 0.0002 * rows)
    assert split.step_seconds(9) > 2 * split.step_seconds(8)
    assert not sizer.wants("new", split, 8, 0.001) and "new" not in sizer.live_ids()
    assert sizer.wants("new", split, 2, 0.001)  # fewer requests: the tree fits the small-row kernels again
    # several requests want trees at 6 decoding: room for 2 first nodes within 8 rows, so the 2 that accepted most
    # per tree step draft (a new one counts 1 accepted), not all of them for nodes the sizer would then drop
    sizer.update("good", 4, 3, 2.0)
    sizer.update("poor", 4, 0, 2.0)
    assert sizer.choose(["poor", "new", "good"], split, 6) == ["good", "new"]
    assert sizer.choose(["poor", "new", "good"], split, 2) == ["poor", "new", "good"]  # room for all
    assert sizer.choose(["poor", "new", "good"], line_costs(0.02, 0.002, split=8), 6) == ["poor", "new", "good"]


def test_adaptive_trees_keep_greedy_output(model_dir, heads_dir, plain, monkeypatch):
    from brisk.spec.speculator import Speculator

    timed = []  # the tree steps' timings each time requests leave (which clears them)
    forget = Speculator._forget
    monkeypatch.setattr(Speculator, "_forget", lambda self, ids: (timed.append(dict(self.whole_steps[True])),
                                                                  forget(self, ids))[1])
    llm = medusa_llm(model_dir, heads_dir, adaptive=True)
    outs = llm.generate(make_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain
    spec = llm.engine.speculator
    assert spec.stats.num_draft_tokens > 0  # first trees and probes are verified
    assert_no_leak(llm)
    assert not spec.trees.live_ids()
    # whole decode steps were timed per batch size, with trees and without; where tree steps measure slower per
    # token than plain ones, trees pause there
    assert any(timed) and all(s > 0 and n > 0 for t in timed for s, n in t.values())
    assert not spec.whole_steps[True]  # timed anew for the next requests
    spec.whole_steps[True][99], spec.whole_steps[False][99] = (0.2, 10.0), (0.1, 10.0)  # (seconds, tokens)
    assert spec.tree_losing(99)
    spec.whole_steps[True][99] = (0.2, 40.0)
    assert not spec.tree_losing(99) and not spec.tree_losing(98)  # (nothing measured at 98 requests)
