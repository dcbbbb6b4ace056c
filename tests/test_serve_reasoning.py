"""Reasoning models through `brisk serve --reasoning-parser` and the official openai client: a tiny model built here
to answer every chat with `<think>...</think>` then its answer. The reasoning goes to message.reasoning_content (and
.reasoning), never to content, streamed or not; max_tokens cutting the reasoning leaves content null; the template's
`enable_thinking` (chat_template_kwargs) turns it off; output constraints refuse to constrain the reasoning.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import openai
import pytest
from hf_utils import add_script_tokens, make_tiny_hf_model, wire_bigram_chain

from brisk.model.tokenizer import Tokenizer as BriskTokenizer
from brisk.serve.process import ServerProcess
from brisk.serve.reasoning import ReasoningParser, ReasoningStreamer

MODEL = "tiny-thinker"
# ChatML, with Qwen3's switch: enable_thinking false closes an empty reasoning in the prompt. open_think (a variable
# of this test's own) opens it there instead, as DeepSeek-R1's and QwQ's templates do.
TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}"
    "{% elif open_think is defined and open_think %}{{ '<think>' }}{% endif %}{% endif %}"
)
# What the scripted model writes, one added token each, then EOS
SCRIPT = ["<think>", "\nThe user says hi.", " Greet back.\n", "</think>\n\n", "Hello", "! How can I help?"]
REASONING, ANSWER = "\nThe user says hi. Greet back.\n", "Hello! How can I help?"
AFTER = "\n\n" + ANSWER  # the content after </think>, as vLLM's parsers leave it (the newlines are the model's)
ASK = [{"role": "user", "content": "Hi"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
SERVE_ARGS = ["--served-model-name", MODEL, "--max-model-len", "512", "--kv-cache-memory", "8MiB",
              "--enable-auto-tool-choice"]


def make_thinking_model(path: Path) -> None:
    """A tiny llama that answers every chat with SCRIPT, as tests/test_tool_calls_edge.py builds its tool caller:
    a bigram model (zero o_proj / down_proj, one-hot embeddings, lm_head mapping each token to its successor). The
    prompt's last token starts the chain: `assistant\\n` (thinking), `<think>` (opened by the template) or
    `</think>\\n\\n` (closed by it: the answer comes straight away)."""
    make_tiny_hf_model(path, "llama", seed=0, chat_template=TEMPLATE)
    ids = add_script_tokens(path, SCRIPT)
    brisk_tok = BriskTokenizer.from_hf_folder(path)
    last = brisk_tok.encode_chat(ASK)[-1]
    assert brisk_tok.encode_chat(ASK, open_think=True)[-1] == ids[0]
    assert brisk_tok.encode_chat(ASK, enable_thinking=False)[-1] == ids[3]
    wire_bigram_chain(path, [last, *ids, brisk_tok.eos_token_id], len(SCRIPT))


@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-thinker")
    make_thinking_model(path)
    return str(path)


@pytest.fixture(scope="module")
def qwen3(thinker_dir):
    with ServerProcess(["--model", thinker_dir, *SERVE_ARGS, "--reasoning-parser", "qwen3"],
                       startup_timeout_s=90) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(qwen3):
    return openai.OpenAI(base_url=qwen3.base_url, api_key="unused", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, **kw):  # noqa: ANN201 - a ChatCompletion or a stream of chunks
    extra = {**kw.pop("extra_body", {}), **{k: kw.pop(k) for k in ("chat_template_kwargs", "include_reasoning")
                                             if k in kw}}
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), temperature=0,
                                          extra_body=extra or None, **kw)


def answer(resp) -> tuple[str | None, str | None, str]:  # noqa: ANN001
    """(reasoning, content, finish_reason) of a non-streamed answer; both reasoning fields agree."""
    c = resp.choices[0]
    reasoning = getattr(c.message, "reasoning_content", None)
    assert getattr(c.message, "reasoning", None) == reasoning
    return reasoning, c.message.content, c.finish_reason


def reassemble(stream) -> tuple[str | None, str | None, str]:  # noqa: ANN001
    """A streamed answer as the non-streamed one reads; no delta mixes reasoning and tags into content."""
    reasoning, content, finish = "", "", None
    for chunk in stream:
        for c in chunk.choices:
            r = getattr(c.delta, "reasoning_content", None)
            assert getattr(c.delta, "reasoning", None) == r
            reasoning += r or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert "<think>" not in content and "</think>" not in content
    return reasoning or None, content or None, finish


def test_the_model_writes_its_script(thinker_dir):
    from brisk import LLM, SamplingParams

    llm = LLM(thinker_dir, max_model_len=512, kv_cache_memory="8MiB")
    out = llm.chat(ASK, SamplingParams(temperature=1.0, max_tokens=20))[0].outputs[0]
    assert out.text == "".join(SCRIPT) and out.finish_reason == "stop"


def test_reasoning_is_split_from_the_answer_streamed_and_not(client):
    got = answer(chat(client))
    assert got == (REASONING, AFTER, "stop")
    assert reassemble(chat(client, stream=True)) == got


def test_max_tokens_inside_the_reasoning_leaves_no_answer(client):
    for max_tokens, reasoning in [(2, "\nThe user says hi."), (1, None)]:
        got = answer(chat(client, max_tokens=max_tokens))
        assert got == (reasoning, None, "length")
        assert reassemble(chat(client, max_tokens=max_tokens, stream=True)) == got


def test_enable_thinking_false_changes_the_prompt_and_leaves_no_reasoning(client, qwen3):
    def tokenize(**kw) -> list[int]:
        resp = httpx.post(f"{qwen3.url}/tokenize", json={"messages": ASK, **kw}, timeout=30)
        assert resp.status_code == 200, resp.text
        return resp.json()["tokens"]

    thinking, off = tokenize(), tokenize(**NO_THINKING)
    assert off[:len(thinking)] == thinking and len(off) > len(thinking)
    text = httpx.post(f"{qwen3.url}/detokenize", json={"tokens": off}, timeout=30).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    got = answer(chat(client, **NO_THINKING))
    assert got == (None, ANSWER, "stop")
    assert reassemble(chat(client, stream=True, **NO_THINKING)) == got
    resp = chat(client, **NO_THINKING)
    assert "reasoning_content" not in resp.choices[0].message.model_dump(exclude_unset=True)


def test_reasoning_opened_by_the_template(client):
    # the prompt ends with <think>: the model writes only its end, and the text up to it is still the reasoning
    kwargs = {"chat_template_kwargs": {"open_think": True}}
    got = answer(chat(client, **kwargs))
    assert got == (REASONING, AFTER, "stop")
    assert reassemble(chat(client, stream=True, **kwargs)) == got


def test_include_reasoning_false_drops_it(client):
    assert answer(chat(client, include_reasoning=False)) == (None, AFTER, "stop")
    assert reassemble(chat(client, include_reasoning=False, stream=True)) == (None, AFTER, "stop")


def test_tool_choice_auto_reads_the_answer_after_the_reasoning(client):
    tools = [{"type": "function", "function": {"name": "wave", "parameters": {"type": "object", "properties": {}}}}]
    resp = chat(client, tools=tools)
    assert answer(resp) == (REASONING, AFTER, "stop") and not resp.choices[0].message.tool_calls
    assert reassemble(chat(client, tools=tools, stream=True)) == (REASONING, AFTER, "stop")


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_object"}),
    ("guided_regex", "[a-z]+"),
    ("tool_choice", "required"),
])
def test_constraints_are_refused_while_the_model_reasons(client, field, value):
    pytest.importorskip("llguidance")
    body = {field: value}
    if field == "tool_choice":
        body["tools"] = [{"type": "function", "function": {"name": "wave", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, extra_body=body, max_tokens=4)
    error = err.value.body
    assert error["param"] == field and "reasoning" in error["message"] and "--reasoning-parser" in error["message"]
    assert "enable_thinking" in error["message"]
    # with thinking off there is no reasoning to constrain: the constraint applies from the first token
    resp = chat(client, extra_body={**body, **NO_THINKING}, max_tokens=4)
    assert resp.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_unknown_reasoning_parser_is_a_usage_error(thinker_dir):
    from click.testing import CliRunner

    from brisk.cli import main

    result = CliRunner().invoke(main, ["serve", "--model", thinker_dir, "--reasoning-parser", "nope"])
    assert result.exit_code == 2 and "--reasoning-parser" in result.output


# ---------------------------------------------------------------------------------------------- the parsers
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_parser_split(name):
    p = ReasoningParser(name)
    assert p.split("<think>\nabc</think>\n\nHi") == ("\nabc", "\n\nHi")
    assert p.split("abc</think>Hi") == ("abc", "Hi")  # <think> was in the prompt
    assert p.split("<think>abc") == ("abc", None)  # cut by max_tokens
    assert p.split("abc</think>") == ("abc", None)
    assert p.split("") == (None, None)
    assert p.active(None, "<|im_start|>assistant\n<think>")
    assert not p.active(None, "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the prompt closed it
    assert p.active({"enable_thinking": False}, "x") is (name == "deepseek_r1")


def test_streamed_reasoning_joins_to_the_split():
    rng = random.Random(0)
    p = ReasoningParser("deepseek_r1")
    for text in ["<think>\nab</think>\n\nHello", "ab</think>x", "\n<think>ab<c</th", "plain", "<th", "a</think>",
                 "<think>x</think></think>y", "</think>"]:
        for _ in range(20):
            ends = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(4, len(text) + 1)))) + [len(text)]
            streamer, reasoning, content = ReasoningStreamer(p), "", None
            for end in ends:
                delta, content = streamer.update(text[:end], end == len(text))
                reasoning += delta
            assert (reasoning or None, content or None) == p.split(text), (text, ends)
