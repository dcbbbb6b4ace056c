"""vLLM's /tokenize and /detokenize on `brisk serve`, and the chat request fields that shape the prompt: a text
prompt or chat messages (rendered as /v1/chat/completions renders them) to token ids and back, bad input refused
with a 400 naming the field.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from test_serve import MODEL, model_dir, server  # noqa: F401 - the tiny random model and its server

from brisk.model.tokenizer import Tokenizer

TEXT = "Emma Woodhouse, handsome, clever, and rich"
ASK = [{"role": "user", "content": "Who is Emma?"}]


def post(server, path: str, body: dict) -> httpx.Response:  # noqa: ANN001, F811
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def ok(resp: httpx.Response) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def refused(resp: httpx.Response, param: str) -> str:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_tokenize_detokenize_round_trip(server, model_dir):  # noqa: F811
    tok = Tokenizer.from_hf_folder(model_dir)
    plain = ok(post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}))
    assert plain["tokens"] == tok.encode(TEXT, add_special_tokens=False)
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == 256
    assert ok(post(server, "/detokenize", {"tokens": plain["tokens"]})) == {"prompt": TEXT}
    default = ok(post(server, "/tokenize", {"prompt": TEXT, "model": MODEL, "return_token_strs": True}))
    assert default["tokens"] == tok.encode(TEXT)  # special tokens by default, as vLLM
    assert "".join(default["token_strs"]).endswith(TEXT) and len(default["token_strs"]) == default["count"]
    assert ok(post(server, "/detokenize", {"tokens": []})) == {"prompt": ""}


def test_tokenize_messages_is_the_chat_prompt(server, model_dir):  # noqa: F811
    tok = Tokenizer.from_hf_folder(model_dir)
    got = ok(post(server, "/tokenize", {"messages": ASK}))
    assert got["tokens"] == tok.encode_chat(ASK) and got["token_strs"] is None
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    resp = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert resp.usage.prompt_tokens == got["count"]
    bare = ok(post(server, "/tokenize", {"messages": ASK, "add_generation_prompt": False}))
    assert bare["tokens"] == tok.encode_chat(ASK, add_generation_prompt=False)
    # continue_final_message: the last message is left open for the model to go on
    prefill = [*ASK, {"role": "assistant", "content": "Emma is"}]
    open_ = ok(post(server, "/tokenize", {"messages": prefill, "continue_final_message": True,
                                          "add_generation_prompt": False}))
    text = ok(post(server, "/detokenize", {"tokens": open_["tokens"]}))["prompt"]
    assert text.endswith("<|im_start|>assistant\nEmma is")
    resp = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=1,
                                          extra_body={"continue_final_message": True})
    assert resp.usage.prompt_tokens == open_["count"]


def test_chat_template_kwargs_reach_the_template(server):  # noqa: F811
    # the tiny model's ChatML template reads no variable of its own (tests/test_serve_reasoning.py has one that does)
    plain = ok(post(server, "/tokenize", {"messages": ASK}))
    given = ok(post(server, "/tokenize", {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}))
    assert given == plain  # a variable the template does not read changes nothing
    message = refused(post(server, "/tokenize", {"messages": ASK, "chat_template_kwargs": {"tools": []}}),
                      "chat_template_kwargs.tools")
    assert "own field" in message


def test_truncate_prompt_tokens(server):  # noqa: F811
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    full = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1)
    cut = client.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    assert full.usage.prompt_tokens > 3 and cut.usage.prompt_tokens == 3
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": TEXT, "messages": ASK}, "messages"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": TEXT, "model": "other"}, "model"),
    ("/tokenize", {"messages": ASK, "continue_final_message": True, "add_generation_prompt": True},
     "add_generation_prompt"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens.1"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):  # noqa: F811
    refused(post(server, path, body), param)


@pytest.mark.parametrize("field,value", [("use_beam_search", True), ("prompt_logprobs", 1), ("bad_words", ["x"]),
                                         ("priority", 3), ("chat_template", "{{ x }}"), ("echo", True),
                                         ("thinking_token_budget", 10), ("allowed_token_ids", [1])])
def test_vllm_fields_brisk_does_not_do_are_refused_by_name(server, field, value):  # noqa: F811
    message = refused(post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 1, field: value}), field)
    assert "not supported" in message


def test_harmless_vllm_fields_are_accepted(server):  # noqa: F811
    body = {"messages": ASK, "max_tokens": 1, "spaces_between_special_tokens": False, "length_penalty": 1.5,
            "request_id": "mine", "use_beam_search": False, "priority": 0, "bad_words": [], "add_special_tokens": True,
            "documents": [{"title": "Emma", "text": "A novel"}], "reasoning_effort": "low",
            "chat_template_kwargs": {"enable_thinking": False}, "include_reasoning": False}
    assert ok(post(server, "/v1/chat/completions", body))["choices"][0]["finish_reason"] == "length"


def test_openapi_describes_tokenize(server):  # noqa: F811
    spec = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    for path, request, response in [("/tokenize", "TokenizeRequest", "TokenizeResponse"),
                                    ("/detokenize", "DetokenizeRequest", "DetokenizeResponse")]:
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(request)
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(response)
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"chat_template_kwargs", "continue_final_message", "truncate_prompt_tokens",
            "include_reasoning"} <= set(chat)
