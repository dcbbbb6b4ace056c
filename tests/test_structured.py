"""Structured outputs in the batched engine: constrained rows masked, free rows untouched, every output inside its
grammar; speculative decoding and jump-forward keep plain constrained decoding's output; bad constraints refused
before anything is queued."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest
import torch
from hf_utils import make_tiny_hf_model

from brisk import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from brisk.structured.params import StructuredOutputError
from brisk.structured.runner import mask_logits

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPTS = ["Hello there", "Once upon a time", "The weather", "Emma Woodhouse, handsome,"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-structured")
    make_tiny_hf_model(path, "llama", seed=3)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, max_model_len=256, kv_cache_memory="8MiB", jump_forward="off")


@pytest.fixture(scope="module")
def greedy_json(llm) -> tuple[list[list[int]], int, list]:
    """Plain constrained greedy decoding of PROMPTS (jump-forward off): (token ids, engine steps, outputs), the
    oracle the jump-forward, preemption and speculative runs are compared with (their max_tokens cut it)."""
    steps_before = llm.engine.num_steps
    outs = llm.generate(PROMPTS, constrained(max_tokens=120))
    return [o.outputs[0].token_ids for o in outs], llm.engine.num_steps - steps_before, outs


def constrained(max_tokens: int = 48, **kw) -> SamplingParams:
    so = kw.pop("so", StructuredOutputsParams(json=SCHEMA))
    return SamplingParams(temperature=kw.pop("temperature", 0.0), max_tokens=max_tokens, structured_outputs=so, **kw)


def texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


def test_json_schema_outputs_parse_and_validate(greedy_json):
    for o in greedy_json[2]:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[a-z]{3}-\d{2,4}"
    out = llm.generate(PROMPTS, constrained(max_tokens=12, so=StructuredOutputsParams(regex=regex), temperature=0.9,
                                            seed=5))
    assert all(re.fullmatch(regex, t) for t in texts(out)), texts(out)
    out = llm.generate(PROMPTS[0], constrained(max_tokens=4, so=GuidedDecodingParams(choice=["yes", "no", "maybe"]),
                                              temperature=1.0, n=4))
    assert all(c.text in ("yes", "no", "maybe") for c in out[0].outputs)
    gbnf = 'root ::= "(" [0-9]+ " + " [0-9]+ ")"'
    out = llm.generate(PROMPTS[:2], constrained(so=StructuredOutputsParams(grammar=gbnf)))
    assert all(re.fullmatch(r"\(\d+ \+ \d+\)", t) for t in texts(out)), texts(out)
    out = llm.generate(PROMPTS[:2], constrained(max_tokens=8, so=StructuredOutputsParams(json_object=True)))
    assert all(t.startswith("{") for t in texts(out))


def test_truncated_object_finishes_with_length(llm):
    out = llm.generate(PROMPTS[0], constrained(max_tokens=5))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and out.text.startswith("{")


def _digit_loving_walk(state, max_steps: int = 400) -> str:
    """Drive a state as a model that always writes a digit other than 0 when the mask allows one (else the lowest
    allowed token): the model that runs an unbounded integer on forever."""
    tok, eos = state.compiler.ll_tokenizer, state.compiler.eos_token_ids
    for _ in range(max_steps):
        if state.is_stopped:
            break
        allowed = [int(t) for t in np.flatnonzero(state.allowed()) if int(t) not in eos]
        digits = [t for t in allowed if tok.decode_bytes([t]).isdigit() and not tok.decode_bytes([t]).startswith(b"0")]
        assert allowed, "the mask allows nothing"
        assert state.accept([(digits or allowed)[0]])
    return tok.decode_bytes(state.tokens).decode()


def test_unbounded_digit_runs_are_capped_and_stay_valid(llm):
    from brisk.structured.backend import MAX_DIGIT_RUN

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                               "k": {"type": "integer", "minimum": 0}},
              "required": ["n", "x", "k"], "additionalProperties": False}
    state = llm.engine.grammar_compiler().new_state(StructuredOutputsParams(json=schema))
    text = _digit_loving_walk(state)
    assert state.is_stopped, text
    value = json.loads(text)
    jsonschema.validate(value, schema)
    runs = [len(r) for r in re.findall(r"[0-9]+", text)]
    assert max(runs) == MAX_DIGIT_RUN and len(str(value["n"])) == MAX_DIGIT_RUN, text


def test_digit_cap_yields_where_the_grammar_needs_more_digits(llm):
    state = llm.engine.grammar_compiler().new_state(StructuredOutputsParams(regex="[0-9]{50}"))
    text = _digit_loving_walk(state)
    assert state.is_stopped and re.fullmatch("[0-9]{50}", text), text


def test_mixed_batch_equals_each_sequence_alone(llm):
    """Constrained and free greedy sequences in one batch: each equals its own run alone (free rows untouched)."""
    params = [constrained(max_tokens=24) if i % 2 == 0 else SamplingParams(temperature=0.0, max_tokens=24)
              for i in range(4)]
    batched = llm.generate(PROMPTS, params)
    for prompt, p, out in zip(PROMPTS, params, batched, strict=True):
        alone = llm.generate(prompt, p)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids


def test_mask_logits_touches_only_constrained_rows():
    class AllowEven:
        def fill_bitmask(self, row: np.ndarray) -> None:
            row[:] = np.int32(0x55555555)  # bits 0, 2, 4, ...: even token ids

    logits = torch.randn(3, 70)
    before = logits.clone()
    mask_logits(logits, [None, AllowEven(), None])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    assert torch.equal(logits[1, ::2], before[1, ::2]) and bool(torch.isinf(logits[1, 1::2]).all())


def test_every_emitted_prefix_is_accepted_by_a_fresh_matcher(llm):
    """Randomized: sampled constrained outputs, with random schemas' worth of settings; replaying every prefix
    through a fresh matcher accepts each token (the mask never let a forbidden token through)."""
    rng = random.Random(0)
    compiler = llm.engine.grammar_compiler()
    constraints = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"(ab|cd)+[0-9]{1,3}"),
                   StructuredOutputsParams(json={"type": "array", "items": {"type": "number"}, "maxItems": 3})]
    trials = [constraints[trial % len(constraints)] for trial in range(6)]
    params = [constrained(max_tokens=rng.randint(4, 40), so=so, temperature=rng.uniform(0.5, 1.5),
                          top_k=rng.choice([0, 20]), seed=rng.randint(0, 1000)) for so in trials]
    outs = llm.generate([rng.choice(PROMPTS) for _ in trials], params)  # one batch: the rows mask one another's
    for trial, (so, o) in enumerate(zip(trials, outs, strict=True)):
        out = o.outputs[0]
        state = compiler.new_state(so)
        for t in out.token_ids:
            if t in llm.engine.tokenizer.eos_token_ids:
                assert state.is_accepting
                break
            assert state.allowed()[t], (trial, out.token_ids)
            assert state.accept([t])


def test_jump_forward_auto_is_identical_and_on_stays_in_the_grammar(model_dir, greedy_json):
    plain, plain_steps, _ = greedy_json
    auto = LLM(model_dir, max_model_len=256, kv_cache_memory="8MiB", jump_forward="auto")
    assert [o.outputs[0].token_ids for o in auto.generate(PROMPTS, constrained(max_tokens=120))] == plain
    assert auto.engine.num_steps < plain_steps  # single-token continuations took no steps of their own
    on = LLM(model_dir, max_model_len=256, kv_cache_memory="8MiB", jump_forward="on")
    outs = on.generate(PROMPTS, constrained(max_tokens=120))
    assert on.engine.num_steps < plain_steps
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    capped = on.generate(PROMPTS[0], constrained(max_tokens=3))[0].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 3


def test_preemption_and_prefix_caching_keep_the_constrained_output(model_dir, greedy_json):
    want = [t[:40] for t in greedy_json[0]]
    small = LLM(model_dir, max_model_len=96, num_kv_blocks=24, block_size=4, jump_forward="on")
    got = small.generate(PROMPTS + PROMPTS, constrained(max_tokens=64))
    assert small.engine.scheduler.num_preemptions > 0
    for o in got:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    off = LLM(model_dir, max_model_len=96, num_kv_blocks=24, block_size=4, jump_forward="off")
    got = off.generate(PROMPTS + PROMPTS, constrained(max_tokens=40))
    assert off.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want + want


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_constrained_equals_constrained_alone(model_dir, greedy_json, method):
    want = [t[:24] for t in greedy_json[0]]
    config = {"method": method, "num_speculative_tokens": 3, "adaptive": False, "disable_by_batch_size": None}
    if method == "draft":
        config["model"] = model_dir  # the target drafting for itself: drafts are free text, many forbidden
    spec = LLM(model_dir, max_model_len=256, kv_cache_memory="8MiB", speculative_config=config, jump_forward="off")
    got = spec.generate(PROMPTS, constrained(max_tokens=24))
    assert [o.outputs[0].token_ids for o in got] == want
    assert spec.engine.speculator.stats.num_draft_tokens > 0
    regex = r"[a-z]{3}-\d{2,4}"  # short: every sampled output completes and is checked
    sampled = spec.generate(PROMPTS, constrained(max_tokens=16, temperature=1.0, seed=3,
                                                 so=StructuredOutputsParams(regex=regex)))
    assert all(o.outputs[0].finish_reason == "stop" and re.fullmatch(regex, o.outputs[0].text) for o in sampled)


@pytest.mark.parametrize("so, field, words", [
    (dict(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "json", "does not compile"),
    (dict(json={"type": "array", "uniqueItems": True}), "json", "cannot enforce"),
    (dict(json={"type": "string", "pattern": "(?=a)b"}), "json", "look-around"),
    (dict(json="{not json"), "json", "not valid JSON"),
    (dict(regex="a(b"), "regex", "unclosed group"),
    (dict(grammar="root ::= ("), "grammar", "grammar"),
    (dict(choice=[]), "choice", "non-empty"),
    (dict(json={"type": "object"}, regex="a"), "structured_outputs", "exactly one"),
])
def test_bad_constraints_are_refused_before_anything_is_queued(llm, so, field, words):
    with pytest.raises(StructuredOutputError, match=words) as e:
        llm.generate(PROMPTS[0], constrained(so=StructuredOutputsParams(**so)))
    assert e.value.param == field
    assert not llm.engine.groups and not llm.engine.scheduler.requests


def test_the_grammar_compiler_is_made_once_under_concurrent_first_use(llm):
    import threading

    engine, saved = llm.engine, llm.engine._grammar_compiler
    engine._grammar_compiler = None  # as a fresh engine: built on first use
    barrier, got = threading.Barrier(4), []

    def first_use() -> None:
        barrier.wait()
        got.append(engine.grammar_compiler())

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 4 and all(c is got[0] for c in got) and engine.grammar_compiler() is got[0]
    finally:
        engine._grammar_compiler = saved


def test_grammars_are_compiled_once(llm):
    compiler = llm.engine.grammar_compiler()
    schema = {"type": "object", "properties": {"unique_key_for_cache_test": {"type": "boolean"}}}
    before = compiler.num_compiled
    llm.generate(PROMPTS, constrained(max_tokens=4, so=StructuredOutputsParams(json=schema)))
    llm.generate(PROMPTS, constrained(max_tokens=4, so=StructuredOutputsParams(json=json.dumps(schema))))
    assert compiler.num_compiled == before + 1


def test_bench_structured_runs_every_arm_and_validates(model_dir, tmp_path):
    from click.testing import CliRunner

    from brisk.cli import main

    report = tmp_path / "structured.json"
    r = CliRunner().invoke(main, ["bench", "structured", "--model", model_dir, "--max-model-len", "256",
                                  "--kv-cache-memory", "8MiB", "--batch-sizes", "2", "--repeats", "1",
                                  "--max-tokens", "24", "--validate", "15", "--json", str(report)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "jf-auto output identical to mask: yes" in r.output and "grammar compile: cold" in r.output
    assert "free output identical to free-plain: yes" in r.output
    data = json.loads(report.read_text())
    assert set(data["batches"]["2"]["median"]) == {"free-plain", "free", "mask", "jf-auto", "jf-on"}
    v = data["validation"]
    assert v["requests"] == 15 and set(v["per_kind"]) == {"json", "regex", "choice", "tools"}
    for kind, row in v["per_kind"].items():  # every answer that was not cut validates
        assert row["valid"] == row["requests"] - row["cut_at_length"], (kind, row)
