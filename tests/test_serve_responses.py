"""The Responses API (POST /v1/responses) through `brisk serve` and the official openai client.

A response is the chat completion of the same conversation (greedy: the same text), streamed or not; continuations
by previous_response_id render the stored conversation; text.format json_schema constrains the answer; a cut answer
is incomplete. Tool calls round-trip on the scripted tool-calling model of test_tool_calls_edge.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_tool_calls_edge import ASK, MODEL, SERVE_ARGS, TOOLS, make_scripted_tool_model

from brisk.serve.process import ServerProcess

pytest.importorskip("llguidance")

GREEDY = {"temperature": 0.0}
FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat tool definitions


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--max-model-len", "512", "--kv-cache-memory", "48MiB"], startup_timeout_s=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def chat_text(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, str]:
    c = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages,
                                       max_completion_tokens=max_tokens, **GREEDY).choices[0]
    return c.message.content or "", c.finish_reason


def test_string_input_is_the_chat_completion_of_one_user_message(client):
    resp = client.responses.create(input="Name a colour.", max_output_tokens=12, **GREEDY)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.created_at > 0
    text, finish = chat_text(client, [{"role": "user", "content": "Name a colour."}], 12)
    assert resp.output_text == text and text
    assert resp.status == ("incomplete" if finish == "length" else "completed")
    assert [o.type for o in resp.output] == ["message"] and resp.output[0].content[0].type == "output_text"
    assert resp.usage.output_tokens <= 12 and resp.usage.input_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


def test_items_and_instructions_render_as_the_chat(client):
    items = [{"role": "developer", "content": "Answer in one word."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Capital of France?"}]}]
    resp = client.responses.create(input=items, instructions="You are terse.", max_output_tokens=8,
                                   metadata={"k": "v"}, **GREEDY)
    text, _ = chat_text(client, [{"role": "system", "content": "You are terse."},
                                 {"role": "system", "content": "Answer in one word."},
                                 {"role": "user", "content": "Capital of France?"}], 8)
    assert resp.output_text == text and resp.instructions == "You are terse." and resp.metadata == {"k": "v"}


def test_previous_response_id_continues_the_stored_conversation(client, server):
    first = client.responses.create(input="My name is Ada.", max_output_tokens=6, **GREEDY)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, max_output_tokens=6,
                                     **GREEDY)
    text, _ = chat_text(client, [{"role": "user", "content": "My name is Ada."},
                                 {"role": "assistant", "content": first.output_text},
                                 {"role": "user", "content": "What is my name?"}], 6)
    assert second.output_text == text and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    unstored = client.responses.create(input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="Hi", previous_response_id=unstored.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    client.responses.delete(first.id)
    assert httpx.get(f"{server.base_url}/responses/{first.id}", timeout=10).status_code == 404


def test_json_schema_text_format_gives_valid_json(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    resp = client.responses.create(input="Pick a colour and a digit, as JSON.", max_output_tokens=40,
                                   text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert resp.status == "completed"
    value = json.loads(resp.output_text)
    assert value["colour"] in ("red", "green", "blue") and 0 <= value["count"] <= 9


def test_max_output_tokens_makes_it_incomplete(client):
    resp = client.responses.create(input="Tell me a long story about a dragon.", max_output_tokens=3, **GREEDY)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[-1].status == "incomplete"


def test_stream_events_in_order_and_deltas_join_to_the_text(client):
    # the default model's greedy answer ends by itself in 15 tokens: room enough to reach response.completed
    kw = {"model": client.models.list().data[0].id, "input": "Name three fruits.", "max_output_tokens": 48, **GREEDY}
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == client.responses.create(**kw).output_text
    cut = list(client.responses.create(input="Count to fifty.", max_output_tokens=2, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"


def test_bad_requests_are_400s_naming_the_field(server):
    url = f"{server.base_url}/responses"
    for body, param in [({"input": []}, "input"), ({}, "input"), ({"input": "x", "temperature": 3}, "temperature"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
                        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
                        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
                         "input.0.arguments"),
                        ({"input": [{"role": "user", "content": "x"}, {"type": "image"}]}, "input.1"),
                        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
                         "text.format.schema"),
                        ({"input": "x", "max_output_tokens": 5000}, "max_output_tokens"),
                        ({"input": "x", "background": True}, "background")]:
        resp = httpx.post(url, json=body, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (body, resp.text)


# ---------------------------------------------------------------------------------------------- tool calls
@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tool-caller")
    make_scripted_tool_model(path)
    with ServerProcess(["--model", str(path), *SERVE_ARGS], startup_timeout_s=90) as proc:
        yield openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=60)


def test_function_calls_round_trip(scripted):
    resp = scripted.responses.create(input=ASK[0]["content"], tools=FUNCTIONS)
    assert [o.type for o in resp.output] == ["message", "function_call", "function_call"]
    assert resp.output_text == "Let me check." and resp.status == "completed"
    calls = [o for o in resp.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo", "days": 2}),
                                                                  ("get_time", {"zone": "CET"})]
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls]
    again = scripted.responses.create(previous_response_id=resp.id, input=results, tools=FUNCTIONS)
    assert again.status == "completed"
    # the same turn sent whole: the earlier output items go back as input
    whole = [{"role": "user", "content": ASK[0]["content"]}, *[o.model_dump(exclude_none=True) for o in resp.output],
             *results]
    assert scripted.responses.create(input=whole, tools=FUNCTIONS).status == "completed"
    with scripted.responses.stream(model=MODEL, input=ASK[0]["content"], tools=FUNCTIONS) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert streamed == [(c.name, c.arguments) for c in calls] and final.output_text == "Let me check."
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == [
        "message", "function_call", "function_call"]
    named = scripted.responses.create(input=ASK[0]["content"], tools=FUNCTIONS, max_output_tokens=40,
                                      tool_choice={"type": "function", "name": "get_time"})
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_time"]
