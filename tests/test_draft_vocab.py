"""Draft vocabularies: a draft model computing logits for its most frequent tokens only (spec/vocab.py) keeps the
greedy output identical to plain decoding; `brisk distill --generations --draft-vocab` writes what it needs and
`brisk quantize` carries it over."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from hf_utils import make_tiny_hf_model
from safetensors.torch import save_file
from test_distill import write_texts

from brisk import LLM, SamplingParams
from brisk.cli import main
from brisk.model.loader import load_model
from brisk.spec.vocab import (
    VOCAB_FILE,
    DraftVocabError,
    head_matrix,
    int8_rows,
    load_vocab,
    most_frequent,
    restrict_head,
    save_vocab,
    token_counts,
)

VOCAB = 384
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9] * 3, [100, 200, 300], list(range(40, 80))]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-vocab")
    make_tiny_hf_model(root / "target", "llama", num_kv_heads=2, seed=7, vocab_size=VOCAB, num_hidden_layers=3)
    return root


def test_most_frequent_ranks_by_count_then_id_and_keeps_always():
    counts = token_counts([torch.tensor([3, 3, 3, 1, 1, 7]), torch.tensor([[7, 9]])], 10)
    assert counts.tolist() == [0, 2, 0, 3, 0, 0, 0, 2, 0, 1]
    assert most_frequent(counts, 3).tolist() == [1, 3, 7]  # 3 (x3), then 1 and 7 (x2 each, by id)
    assert most_frequent(counts, 2, always=[2]).tolist() == [2, 3]  # the size is kept
    assert most_frequent(counts, 5).tolist() == [0, 1, 3, 7, 9]  # an unseen token by id fills the last place
    with pytest.raises(DraftVocabError):
        most_frequent(counts, 0)


@pytest.mark.parametrize("activations", ["int8", "float"])
def test_int8_rows_is_the_rounded_layer(activations):
    """int8_rows: the weight rounded to int8 per row (scale = row absmax / 127, in float16), with its bias, on the
    engine's kernels; int8 activations add their own rounding (per 32 columns)."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 96, generator=g), torch.randn(48, generator=g)
    x = torch.randn(3, 5, 96, generator=g)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).half().float()
    want = x @ ((w / scale).round().clamp(-128, 127) * scale).t() + b
    with torch.inference_mode():
        got = int8_rows(w, activations, bias=b)(x)
    assert got.shape == (3, 5, 48)
    tol = (0.01 if activations == "float" else 0.05) * float(want.abs().mean())  # (float: the kernels' bf16 paths)
    torch.testing.assert_close(got, want, atol=tol, rtol=0.02)


def test_restricted_head_gives_those_columns(dirs, tmp_path):
    """Float head: the same rows; 8-bit head: the rows' codes re-round to themselves (the same logits)."""
    runner = CliRunner().invoke(main, ["quantize", "--method", "rtn", "--bits", "4", "--group-size", "32",
                                       str(dirs / "target"), str(tmp_path / "q")])
    assert runner.exit_code == 0, runner.output
    vocab = torch.tensor([0, 2, 5, 77, 300, VOCAB - 1, *range(100, 126)])  # 32 rows: tiled as the whole head
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for path in (dirs / "target", tmp_path / "q"):
        model = load_model(path).model
        full = model.lm_head(x)
        kind = type(model.lm_head)
        restrict_head(model, vocab)
        assert type(model.lm_head) is kind and model.lm_head.out_features == len(vocab)
        assert not model.config.tie_word_embeddings
        torch.testing.assert_close(model.lm_head(x), full[:, vocab], rtol=0, atol=1e-5)
        torch.testing.assert_close(head_matrix(model), model.lm_head(torch.eye(64)).t(), rtol=0, atol=1e-6)


def spec_llm(target: str, draft: str) -> LLM:
    return LLM(target, max_model_len=256, speculative_config={
        "num_speculative_tokens": 4, "adaptive": False, "method": "draft", "model": draft,
        "disable_by_batch_size": None})


def test_draft_with_a_vocabulary_keeps_greedy_output(dirs, tmp_path):
    plain = [o.outputs[0].token_ids for o in LLM(str(dirs / "target"), max_model_len=256).generate(PROMPTS, GREEDY)]
    draft = tmp_path / "draft"
    shutil.copytree(dirs / "target", draft)  # the target drafting for itself: accepted wherever it may propose
    for vocab, whole in ((torch.arange(VOCAB), True), (torch.arange(0, VOCAB, 2), False)):
        save_vocab(draft, vocab)
        llm = spec_llm(str(dirs / "target"), str(draft))
        proposer = llm.engine.speculator.proposer
        assert proposer.runner.model.lm_head.out_features == len(vocab)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == plain
        rate = llm.engine.speculator.stats.acceptance_rate
        assert rate == 1.0 if whole else 0 < rate < 1.0, rate  # half the vocabulary: its tokens only
        drafted = [t for o in outs for t in o.outputs[0].token_ids]
        assert any(t % 2 for t in drafted)  # the target still emits tokens the draft cannot propose
        # sampling runs through the same rows: q is zero outside the vocabulary
        sampled = llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=3))
        assert all(len(o.outputs[0].token_ids) == 16 for o in sampled)
        assert llm.engine.kv_manager.block_pool.get_num_free_blocks() == llm.engine.num_blocks
        assert proposer.kv.block_pool.get_num_free_blocks() == proposer.kv.block_pool.num_blocks


def test_bad_vocabulary_files_are_refused(tmp_path):
    assert load_vocab(tmp_path, VOCAB) is None
    (tmp_path / VOCAB_FILE).write_bytes(b"not safetensors")
    with pytest.raises(DraftVocabError, match="not a draft vocabulary"):
        load_vocab(tmp_path, VOCAB)
    for bad, what in ((torch.tensor([3, 1]), "sorted"), (torch.tensor([1, VOCAB]), "below"),
                      (torch.tensor([1.0, 2.0]), "int64")):
        save_file({"draft_vocab": bad}, str(tmp_path / VOCAB_FILE))
        with pytest.raises(DraftVocabError, match=what):
            load_vocab(tmp_path, VOCAB)


def test_distill_with_teacher_answers_writes_a_draft_vocabulary(tmp_path):
    make_tiny_hf_model(tmp_path / "teacher", num_hidden_layers=4, tie_word_embeddings=True)
    text, held = write_texts(tmp_path)
    out = tmp_path / "out"
    args = [str(tmp_path / "teacher"), "every:2", str(out), "--text", str(text), "--eval-text", str(held),
            "--steps", "2", "--batch-size", "2", "--seq-len", "32", "--eval-windows", "1", "--eval-window", "64",
            "--generations", "5", "--generation-tokens", "12", "--draft-vocab", "50"]
    result = CliRunner().invoke(main, ["distill", *args])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "teacher_generations.json").read_text())
    assert saved["key"]["prompts"] == 5 and len(saved["answers"]) == 5
    record = json.loads((out / "config.json").read_text())["training"]
    assert record["generations"] == 5 and record["draft_vocab"] == 50 and "teacher answers" in record["text"]
    teacher = load_model(tmp_path / "teacher")
    vocab = load_vocab(out, teacher.config.vocab_size)
    assert vocab is not None and len(vocab) == 50
    assert set(teacher.tokenizer.eos_token_ids) <= set(vocab.tolist())
    # a second run reads the answers back instead of generating them (the file is left as it was)
    stamp = (out / "teacher_generations.json").stat().st_mtime_ns
    again = CliRunner().invoke(main, ["distill", *args, "--force"])
    assert again.exit_code == 0, again.output
    assert (out / "teacher_generations.json").stat().st_mtime_ns == stamp
    # the quantized draft carries the vocabulary
    q = CliRunner().invoke(main, ["quantize", "--method", "rtn", "--bits", "4", "--group-size", "32", str(out),
                                  str(tmp_path / "q")])
    assert q.exit_code == 0, q.output
    assert torch.equal(load_vocab(tmp_path / "q", teacher.config.vocab_size), vocab)
