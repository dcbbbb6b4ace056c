"""Structured outputs and tool calling through `brisk serve`, with the official openai client.

Every constrained answer must parse and validate; a streamed answer must reassemble to the non-streamed one
(greedy); the Hermes tool-call parser is checked on model-shaped text, its streaming form on every chunking.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import openai
import pytest
from test_serve import MODEL, model_dir  # noqa: F401 - the tiny model, shared with test_serve

from brisk.model.tokenizer import Tokenizer
from brisk.serve import tools
from brisk.serve.process import ServerProcess

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time of a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next three days?"}]


@pytest.fixture(scope="module")
def server(model_dir):  # noqa: F811
    # a long context: the tools' system prompt alone is a few hundred tokens of the tiny model's vocabulary
    proc = ServerProcess(["--model", model_dir, "--served-model-name", MODEL, "--max-model-len", "2048",
                          "--kv-cache-memory", "16MiB", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                         startup_timeout_s=90)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:  # noqa: F811
    return Tokenizer.from_hf_folder(model_dir)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, **kw):  # noqa: ANN201
    kw.setdefault("messages", ASK)
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=MODEL, **kw)


def reassemble(stream) -> tuple[str, list[tuple[str, str]], str]:  # noqa: ANN001
    """A streamed chat answer as (content, [(name, arguments)], finish_reason), the deltas joined as clients do."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                call["id"] = call["id"] or tc.id
                call["name"] += (tc.function.name or "") if tc.function else ""
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    assert all(c["id"] for c in calls.values())
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


def answer(resp) -> tuple[str, list[tuple[str, str]], str]:  # noqa: ANN001
    msg = resp.choices[0].message
    return (msg.content or "", [(c.function.name, c.function.arguments) for c in msg.tool_calls or []],
            resp.choices[0].finish_reason)


# ---------------------------------------------------------------------------------------------- structured outputs
def test_json_schema_response_format_parses_validates_and_streams_the_same(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    resp = chat(client, response_format=rf)
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)
    streamed = reassemble(chat(client, response_format=rf, stream=True))
    assert streamed == answer(resp)
    # the same schema through vLLM's names, on /v1/completions
    for extra in ({"structured_outputs": {"json": SCHEMA}}, {"guided_json": json.dumps(SCHEMA)},
                  {"response_format": rf}):
        out = client.completions.create(model=MODEL, prompt="Emma Woodhouse", max_tokens=120, temperature=0,
                                        extra_body=extra).choices[0]
        assert out.finish_reason == "stop", extra
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_regex_choice_grammar_and_json_object(client):
    regex = r"[a-z]{3}-\d{2,4}"
    out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=16, temperature=1.0, seed=4, n=3,
                                    extra_body={"structured_outputs": {"regex": regex}})
    assert all(re.fullmatch(regex, c.text) for c in out.choices), [c.text for c in out.choices]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Code:", max_tokens=16, temperature=0, stream=True, extra_body={"guided_regex": regex})
        if c.choices)
    assert re.fullmatch(regex, streamed), streamed
    resp = chat(client, n=4, temperature=1.0, seed=1, extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert all(c.message.content in ("yes", "no", "maybe") for c in resp.choices)
    resp = chat(client, extra_body={"guided_grammar": 'root ::= "(" [0-9]+ " + " [0-9]+ ")"'}, max_tokens=40)
    assert re.fullmatch(r"\(\d+ \+ \d+\)", resp.choices[0].message.content), resp.choices[0].message.content
    resp = chat(client, response_format={"type": "json_object"}, max_tokens=6)  # cut short: reported as length
    assert resp.choices[0].message.content.startswith("{") and resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "does not compile"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "cannot enforce"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar", "grammar"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one output constraint"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}], "tool_choice": "required"}, "tools.0.function.parameters", "does not compile"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name", "not among the tools"),
])
def test_bad_constraints_are_400s_naming_the_field(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body=extra, max_tokens=4)
    assert e.value.status_code == 400
    error = e.value.body
    assert error["param"] == param and words in error["message"], error


# ---------------------------------------------------------------------------------------------- tools
def _check_call(name: str, arguments: str) -> None:
    spec = next(t["function"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), spec["parameters"])


def test_named_tool_choice_calls_that_function_and_streams_the_same(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = chat(client, tools=TOOLS, tool_choice=choice)
    content, calls, finish = answer(resp)
    assert content == "" and finish == "stop" and [n for n, _ in calls] == ["get_weather"]
    _check_call(*calls[0])
    assert resp.choices[0].message.tool_calls[0].id.startswith("chatcmpl-tool-")
    assert reassemble(chat(client, tools=TOOLS, tool_choice=choice, stream=True)) == answer(resp)


def test_required_tool_choice_always_parses_and_streams_the_same(client):
    for messages in (ASK, [{"role": "user", "content": "What time is it in Tokyo?"}]):
        resp = chat(client, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=200)
        content, calls, finish = answer(resp)
        assert finish == "tool_calls" and calls and content == ""
        for call in calls:
            _check_call(*call)
        assert reassemble(chat(client, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=200,
                               stream=True)) == answer(resp)
    one = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=2, n=3)
    for c in one.choices:
        assert len(c.message.tool_calls) == 1 and c.finish_reason == "tool_calls"
        _check_call(c.message.tool_calls[0].function.name, c.message.tool_calls[0].function.arguments)


def test_auto_renders_the_tools_and_streams_the_same(client, tok):
    """The tiny model may or may not call: whatever it answers, streamed equals non-streamed, and the prompt is
    the conversation with the tools' Hermes system prompt (its template has no tools support)."""
    resp = chat(client, tools=TOOLS, max_tokens=60)
    content, calls, finish = answer(resp)
    assert finish == "tool_calls" if calls else finish in ("stop", "length")
    assert reassemble(chat(client, tools=TOOLS, max_tokens=60, stream=True)) == (content, calls, finish)
    assert not tools.template_supports_tools(tok.chat_template)
    system = {"role": "system", "content": tools.hermes_system_prompt(TOOLS)}
    assert resp.usage.prompt_tokens == len(tok.encode_chat([system, *ASK]))
    none = chat(client, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert none.usage.prompt_tokens == len(tok.encode_chat(ASK)) and not none.choices[0].message.tool_calls


def test_tool_results_go_back_into_the_conversation(client, tok):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sun"}'}]
    resp = chat(client, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=4)
    said = tools.render_call("get_weather", '{"city": "Paris", "days": 3}')
    rendered = [*ASK, {"role": "assistant", "content": said},
                {"role": "user", "content": '<tool_response>\n{"forecast": "sun"}\n</tool_response>'}]
    assert resp.usage.prompt_tokens == len(tok.encode_chat(rendered))
    assert "<tool_call>" in tok.apply_chat_template(rendered)


# ---------------------------------------------------------------------------------------------- the Hermes parser
MODEL_TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}',  # stopped before the closing tag
    'No tools needed: 2 < 3 and <tool is not a tag.',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call> then text',  # broken JSON
    'Sure <tool_call>{"name": "get_time", "parameters": {"zone": "EST"}}</tool_call>',
]


def test_hermes_parser_on_model_shaped_text():
    content, calls = tools.parse_hermes(MODEL_TEXTS[0])
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    content, calls = tools.parse_hermes(MODEL_TEXTS[1])
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2
    assert [c.arguments for c in tools.parse_hermes(MODEL_TEXTS[2])[1]] == ['{"zone": "UTC"}']
    assert tools.parse_hermes(MODEL_TEXTS[3]) == (MODEL_TEXTS[3], [])
    assert tools.parse_hermes(MODEL_TEXTS[4]) == (MODEL_TEXTS[4], [])
    assert [c.arguments for c in tools.parse_hermes(MODEL_TEXTS[5])[1]] == ['{"zone": "EST"}']
    assert [c.name for c in tools.parse_required('[{"name": "get_time", "parameters": {"zone": "CET"}}]')] == [
        "get_time"]
    assert tools.parse_required('[{"name": "get_time", "parameters": {"zo') == []


@pytest.mark.parametrize("text", MODEL_TEXTS)
def test_hermes_streaming_reassembles_to_the_parsed_text_on_any_chunking(text):
    want_content, want_calls = tools.parse_hermes(text)
    rng = random.Random(len(text))
    for _ in range(20):
        streamer = tools.HermesStreamer()
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        content, calls = "", []
        for end in [*cuts, len(text)]:
            delta, new = streamer.update(text[:end], end == len(text))
            content += delta
            calls += new
        assert content == (want_content or "")
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]
