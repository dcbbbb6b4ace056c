"""Tool calls at the edges, through `brisk serve` and the official openai client: a call cut by max_tokens is
reported the same way in every tool_choice mode, streamed or not (finish_reason "length", the cut call kept with
its arguments so far, never raw call syntax in content), and tool_choice "auto" end to end on a model that does
call: a tiny model built here to write Hermes <tool_call> blocks token by token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import openai
import pytest
from hf_utils import add_script_tokens, make_tiny_hf_model, wire_bigram_chain
from test_serve import MODEL, model_dir  # noqa: F401 - the tiny random model, shared with test_serve
from test_serve_structured import TOOLS

from brisk.model.tokenizer import Tokenizer as BriskTokenizer
from brisk.serve import tools
from brisk.serve.process import ServerProcess

pytest.importorskip("llguidance")

ASK = [{"role": "user", "content": "What will the weather be in Oslo for the next two days, and the time in CET?"}]
SERVE_ARGS = ["--served-model-name", MODEL, "--max-model-len", "2048", "--kv-cache-memory", "16MiB",
              "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]

# What the scripted model writes, one added token each, then EOS: content, a call in four pieces, a second call.
SCRIPT = ["Let me check.", "\n<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": ',
          '"Oslo", "days": 2}}', "\n</tool_call>",
          '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>']


def make_scripted_tool_model(path: Path, script: list[str] = SCRIPT) -> None:
    """A tiny llama that answers every chat with `script` (SCRIPT unless given): a bigram model. Its layers add
    nothing (o_proj and down_proj are zero), so the last hidden state is the token's embedding; the embeddings of
    the generation prompt's last token and of the script's tokens are orthogonal unit vectors, and lm_head maps each
    to its successor's logit (80 against 0), whatever the sampling settings."""
    make_tiny_hf_model(path, "llama", seed=0)
    script_ids = add_script_tokens(path, script)
    brisk_tok = BriskTokenizer.from_hf_folder(path)
    last = brisk_tok.encode_chat(ASK)[-1]  # the generation prompt's last token
    wire_bigram_chain(path, [last, *script_ids, brisk_tok.eos_token_id], len(script))


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-tool-caller")
    make_scripted_tool_model(path)
    return str(path)


@pytest.fixture(scope="module")
def scripted(scripted_dir):
    with ServerProcess(["--model", scripted_dir, *SERVE_ARGS], startup_timeout_s=90) as proc:
        yield openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def client(model_dir):  # noqa: F811
    with ServerProcess(["--model", model_dir, *SERVE_ARGS], startup_timeout_s=90) as proc:
        yield openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, **kw):  # noqa: ANN201 - a ChatCompletion or a stream of chunks
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), **kw)


def answer(resp) -> tuple[str | None, list[tuple[str, str]], str]:  # noqa: ANN001
    c = resp.choices[0]
    return c.message.content, [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []], \
        c.finish_reason


def reassemble(stream) -> tuple[str | None, list[tuple[str, str]], str]:  # noqa: ANN001
    """A streamed answer as the non-streamed one reads: content (None when nothing), calls, finish_reason."""
    content, calls, finish, ids = "", {}, None, set()
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                name, args = calls.get(t.index, ("", ""))
                calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
                if t.id:
                    ids.add((t.index, t.id))
            finish = c.finish_reason or finish
    assert len(ids) == len(calls), "every call has one id"
    return content or None, [calls[i] for i in sorted(calls)], finish


# ---------------------------------------------------------------------------------------------- auto, end to end
def test_the_scripted_model_writes_its_script(scripted_dir):
    from brisk import LLM, SamplingParams

    llm = LLM(scripted_dir, max_model_len=2048, kv_cache_memory="16MiB")
    out = llm.chat(ASK, SamplingParams(temperature=1.0, max_tokens=20))[0].outputs[0]
    assert out.text == "".join(SCRIPT) and out.finish_reason == "stop"


def test_auto_parses_the_calls_streamed_and_not(scripted):
    resp = chat(scripted, tools=TOOLS)
    content, calls, finish = answer(resp)
    assert content == "Let me check." and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo", "days": 2}),
                                                      ("get_time", {"zone": "CET"})]
    assert all(t.id.startswith("chatcmpl-tool-") and t.type == "function" for t in resp.choices[0].message.tool_calls)
    assert reassemble(chat(scripted, tools=TOOLS, stream=True)) == (content, calls, finish)
    # the conversation goes on with the results (a second turn renders the calls and the tool messages)
    said = resp.choices[0].message
    follow = [*ASK, {"role": "assistant", "content": said.content,
                     "tool_calls": [t.model_dump() for t in said.tool_calls]},
              *({"role": "tool", "tool_call_id": t.id, "content": "{}"} for t in said.tool_calls)]
    assert chat(scripted, messages=follow, tools=TOOLS, max_tokens=2).choices[0].finish_reason == "length"


@pytest.mark.parametrize("max_tokens, want_content, want_calls", [
    (1, "Let me check.", []),
    (2, "Let me check.", []),  # a block opened, nothing of the call written: no call, no tag in content
    (3, "Let me check.", [("get_weather", "")]),  # the name whole, no arguments yet
    (4, "Let me check.", [("get_weather", '{"city": ')]),  # cut inside the arguments: kept as written
    (5, "Let me check.", [("get_weather", '{"city": "Oslo", "days": 2}')]),  # whole, its block unclosed
    (6, "Let me check.", [("get_weather", '{"city": "Oslo", "days": 2}')]),
])
def test_auto_cut_by_max_tokens(scripted, max_tokens, want_content, want_calls):
    resp = chat(scripted, tools=TOOLS, max_tokens=max_tokens)
    assert answer(resp) == (want_content, want_calls, "length")
    assert reassemble(chat(scripted, tools=TOOLS, max_tokens=max_tokens, stream=True)) == answer(resp)


# ---------------------------------------------------------------------------------------------- required and named
def test_required_cut_by_max_tokens_keeps_the_calls_not_the_array(client):
    """The tiny model's greedy answer is one call written a character a token (`[{"name": "get_weather", ...`):
    cut anywhere, the answer holds no raw array, and the call appears once its name is whole, its arguments a
    prefix of the whole answer's."""
    whole = chat(client, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    (name, arguments), = answer(whole)[1]
    assert answer(whole)[2] == "tool_calls" and whole.usage.completion_tokens > 40
    seen = set()
    for max_tokens in (1, 8, 16, 24, 30, 40, whole.usage.completion_tokens - 3):
        resp = chat(client, tools=TOOLS, tool_choice="required", max_tokens=max_tokens, temperature=0)
        content, calls, finish = answer(resp)
        assert content is None and finish == "length", (max_tokens, resp)
        assert len(calls) <= 1 and all(n == name and arguments.startswith(a) for n, a in calls), (max_tokens, calls)
        seen.add("" if not calls else "name" if not calls[0][1] else "arguments")
        streamed = chat(client, tools=TOOLS, tool_choice="required", max_tokens=max_tokens, temperature=0,
                        stream=True)
        assert reassemble(streamed) == (content, calls, finish)
    assert seen == {"", "name", "arguments"}, seen


def test_named_cut_by_max_tokens_is_reported_the_same_way(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = chat(client, tools=TOOLS, tool_choice=choice, max_tokens=3, temperature=0)
    content, calls, finish = answer(resp)
    assert content is None and finish == "length" and [n for n, _ in calls] == ["get_weather"]
    assert reassemble(chat(client, tools=TOOLS, tool_choice=choice, max_tokens=3, temperature=0,
                           stream=True)) == (content, calls, finish)


# ---------------------------------------------------------------------------------------------- the parsers
def test_required_calls_of_cut_arrays():
    whole = '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "get_weather", "parameters": {}}]'
    calls, complete = tools.required_calls(whole)
    assert complete and [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "CET"}'),
                                                                    ("get_weather", "{}")]
    assert [(c.name, c.arguments) for c in tools.parse_required(whole)] == [(c.name, c.arguments) for c in calls]
    def at(piece: str) -> int:  # the end of the first `piece` in whole
        return whole.index(piece) + len(piece)

    for end, want in [(0, []), (1, []), (at('"get_t'), []), (at('"get_time"'), [("get_time", "")]),
                      (at('"param'), [("get_time", "")]), (at('{"zone": "C'), [("get_time", '{"zone": "C')]),
                      (at('"CET"}'), [("get_time", '{"zone": "CET"}')]), (at('}}'), [("get_time", '{"zone": "CET"}')]),
                      (at('}}, '), [("get_time", '{"zone": "CET"}')]),
                      (len(whole) - 1, [("get_time", '{"zone": "CET"}'), ("get_weather", "{}")])]:
        calls, complete = tools.required_calls(whole[:end])
        assert not complete and [(c.name, c.arguments) for c in calls] == want, whole[:end]


CUT_TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os',
    'Let me check.\n<tool_call>\n{"na',
    'Let me check.\n<tool_c',
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "get_weather"',
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> and then',
    "No call at all, cut",
]


def test_hermes_parser_on_cut_text():
    assert [(c.name, c.arguments) for c in tools.parse_hermes(CUT_TEXTS[0], cut=True)[1]] == [
        ("get_weather", '{"city": "Os')]
    assert tools.parse_hermes(CUT_TEXTS[1], cut=True) == ("Let me check.", [])
    assert tools.parse_hermes(CUT_TEXTS[2], cut=True) == ("Let me check.", [])
    content, calls = tools.parse_hermes(CUT_TEXTS[3], cut=True)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", "{}"), ("get_weather", "")]
    assert tools.parse_hermes(CUT_TEXTS[5], cut=True) == (CUT_TEXTS[5], [])
    assert tools.parse_hermes(CUT_TEXTS[1]) == (CUT_TEXTS[1], [])  # not cut (EOS): unparsable text stays content


@pytest.mark.parametrize("text", CUT_TEXTS)
def test_hermes_streaming_of_cut_text_reassembles_to_the_parsed_text(text):
    want_content, want_calls = tools.parse_hermes(text, cut=True)
    rng = random.Random(len(text))
    for _ in range(20):
        streamer = tools.HermesStreamer()
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        content, calls = "", []
        for end in [*cuts, len(text)]:
            delta, new = streamer.update(text[:end], end == len(text), cut=end == len(text))
            content += delta
            calls += new
        assert content == (want_content or "")
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]
