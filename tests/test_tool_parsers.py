"""Every model family's tool-call parser (serve/tool_parsers.py): its own syntax parsed into calls, several calls,
nested and escaped arguments, content before the calls, malformed output left as content; streamed deltas that
reassemble to the parsed answer under any chunking; `--tool-call-parser auto` reading the chat template; and
llama3_json end to end through `brisk serve` and the official openai client.
"""

from __future__ import annotations

import json
import random

import openai
import pytest
from test_tool_calls_edge import ASK, MODEL, TOOLS, answer, make_scripted_tool_model, reassemble

from brisk.serve import tool_parsers as tp
from brisk.serve.process import ServerProcess

WEATHER = ("get_weather", {"city": "Oslo", "days": 2})
CLOCK = ("get_time", {"zone": "CET"})
NESTED = ("search", {"query": 'say "hi" \\ there', "filters": {"tags": ["a", "b"], "deep": {"x": None, "y": 1.5}},
                     "exact": True})
SEARCH_TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "filters": {"type": "object"}, "exact": {"type": "boolean"}}}}}
QWEN_TOOLS = [*TOOLS, SEARCH_TOOL]


def j(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def hermes(name: str, args: dict) -> str:
    return f"<tool_call>\n{j({'name': name, 'arguments': args})}\n</tool_call>"


def qwen(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else j(v)}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def py(name: str, args: dict) -> str:
    return f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"


# (parser, text, content, calls): what each family writes, as its docs and chat templates show it.
CASES: list[tuple[str, str, str | None, list[tuple[str, dict]]]] = [
    ("hermes", hermes(*WEATHER), None, [WEATHER]),
    ("hermes", f"Let me check.\n{hermes(*WEATHER)}\n{hermes(*CLOCK)}", "Let me check.", [WEATHER, CLOCK]),
    ("hermes", hermes(*NESTED), None, [NESTED]),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("llama3_json", f"<|python_tag|>{j({'name': 'get_weather', 'parameters': WEATHER[1]})}", None, [WEATHER]),
    ("llama3_json", f"{j({'name': 'get_weather', 'parameters': WEATHER[1]})}; "
                    f"{j({'name': 'get_time', 'parameters': CLOCK[1]})}", None, [WEATHER, CLOCK]),
    ("llama3_json", f"Sure.\n\n<|python_tag|>{j({'name': 'search', 'parameters': NESTED[1]})}", "Sure.", [NESTED]),
    ("llama3_json", 'Use {"name": 1} as the key.', 'Use {"name": 1} as the key.', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Os', '{"name": "get_weather", "parameters": '
                    '{"city": "Os', []),
    ("mistral", f"[TOOL_CALLS][{j({'name': 'get_weather', 'arguments': WEATHER[1]})}, "
                f"{j({'name': 'get_time', 'arguments': CLOCK[1]})}]", None, [WEATHER, CLOCK]),
    ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{j(WEATHER[1])}[TOOL_CALLS]get_time[ARGS]{j(CLOCK[1])}", None,
     [WEATHER, CLOCK]),
    ("mistral", f"I will search.[TOOL_CALLS]search[ARGS]{j(NESTED[1])}", "I will search.", [NESTED]),
    ("mistral", f"Checking. [TOOL_CALLS] [{j({'name': 'search', 'arguments': NESTED[1]})}]", "Checking.", [NESTED]),
    ("mistral", "[TOOL_CALLS] no calls here", "[TOOL_CALLS] no calls here", []),
    ("qwen3_coder", qwen(*WEATHER), None, [WEATHER]),
    ("qwen3_coder", f"Let me look both up.\n\n{qwen(*WEATHER)}\n{qwen(*CLOCK)}", "Let me look both up.",
     [WEATHER, CLOCK]),
    ("qwen3_coder", qwen(*NESTED), None, [NESTED]),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=zone>\n123\n</parameter>\n</function>\n</tool_call>",
     None, [("get_time", {"zone": "123"})]),  # a string parameter stays a string, whatever it reads as
    ("qwen3_coder", "<tool_call>\nno function\n</tool_call>", "<tool_call>\nno function\n</tool_call>", []),
    ("pythonic", f"[{py(*WEATHER)}, {py(*CLOCK)}]", None, [WEATHER, CLOCK]),
    ("pythonic", f"Let me search.\n[{py(*NESTED)}]", "Let me search.", [NESTED]),
    ("pythonic", '[get_weather(city=__import__("os").system("ls"))]',
     '[get_weather(city=__import__("os").system("ls"))]', []),  # not a literal: nothing is evaluated
    ("pythonic", '[get_weather("Oslo")] and [broken(', '[get_weather("Oslo")] and [broken(', []),
    ("phi4_mini", f"functools[{j({'name': 'get_weather', 'arguments': WEATHER[1]})}, "
                  f"{j({'name': 'get_time', 'arguments': CLOCK[1]})}]", None, [WEATHER, CLOCK]),
    ("phi4_mini", f"On it. functools[{j({'name': 'search', 'arguments': NESTED[1]})}]", "On it.", [NESTED]),
    ("phi4_mini", "functools[oops]", "functools[oops]", []),
    ("gemma", f"```tool_code\nprint({py(*WEATHER)})\n```", None, [WEATHER]),
    ("gemma", f"Checking both.\n```tool_code\n{py(*WEATHER)}\n{py(*CLOCK)}\n```", "Checking both.", [WEATHER, CLOCK]),
    ("gemma", f"[{py(*NESTED)}]", None, [NESTED]),
    ("gemma", j({"name": "get_weather", "parameters": WEATHER[1]}), None, [WEATHER]),
    ("gemma", "```tool_code\nimport os\n```", "```tool_code\nimport os\n```", []),
]


def calls_of(calls: list[tp.ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_each_family_parses_its_own_syntax(name, text, content, calls):
    got_content, got_calls = tp.get_parser(name, QWEN_TOOLS).parse(text)
    assert got_content == content
    assert calls_of(got_calls) == calls


def stream(parser: tp.ToolParser, text: str, rng: random.Random, cut: bool) -> tuple[str | None, list[tuple]]:
    streamer = parser.streamer()
    ends = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 16))))
    content, calls = "", []
    for end in [*ends, len(text)]:
        delta, new = streamer.update(text[:end], end == len(text), cut=cut and end == len(text))
        content += delta
        calls += new
    return content or None, [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("name", tp.PARSER_NAMES)
def test_streamed_deltas_reassemble_to_the_parsed_answer(name):
    """50 random chunkings of every text of the family (whole, and cut by max_tokens at a few places)."""
    parser = tp.get_parser(name, QWEN_TOOLS)
    texts = [(text, False) for n, text, _, _ in CASES if n == name]
    texts += [(text[:k * len(text) // 4], True) for text, _ in list(texts) for k in (1, 2, 3)]
    for text, cut in texts:
        if not text:
            continue
        want_content, want_calls = parser.parse(text, cut=cut)
        want = ((want_content or "") or None, [(c.name, c.arguments) for c in want_calls])
        for seed in range(50):
            assert stream(parser, text, random.Random(seed), cut) == want, (text, cut, seed)


@pytest.mark.parametrize("name, text, calls", [
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
                    '"parameters": {"zone": "C', [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "C')]),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "C', [("get_time", '{"zone": "C')]),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"zone": "C', [("get_time", '{"zone": "C')]),
    ("phi4_mini", 'functools[{"name": "get_time", "arguments": {"zo', [("get_time", '{"zo')]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=da",
     [("get_weather", '{"city": "Oslo"')]),
    ("pythonic", '[get_time(zone="CET"), get_weather(city="Os', [("get_time", '{"zone": "CET"}')]),
])
def test_a_call_cut_by_max_tokens_keeps_what_was_written(name, text, calls):
    content, got = tp.get_parser(name).parse(text, cut=True)
    assert content is None and [(c.name, c.arguments) for c in got] == calls
    assert tp.get_parser(name).parse(text)[1] != calls or name == "pythonic"  # not cut: only whole calls count


def test_a_marker_being_written_is_held_back():
    for name, tail in [("hermes", "<tool_"), ("llama3_json", "<|python"), ("llama3_json", '{"na'),
                       ("mistral", "[TOOL_C"), ("qwen3_coder", "<functi"), ("pythonic", "[get_wea"),
                       ("phi4_mini", "functoo"), ("gemma", "```tool")]:
        streamer = tp.get_parser(name).streamer()
        assert streamer.update("Let me check. " + tail, False) == ("Let me check.", [])
        assert tp.get_parser(name).parse("Let me check. " + tail, cut=True) == ("Let me check.", [])
        assert tp.get_parser(name).parse("Let me check. " + tail) == ("Let me check. " + tail, [])


# Snippets of the families' chat templates (as the model repositories ship them).
TEMPLATES = [
    ('{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
     '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
     '<args-json-object>}\\n</tool_call><|im_end|>\\n" }}', "hermes"),  # Qwen2.5, Hermes
    ('{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
     '\' }}{%- if builtin_tools is defined %}{{- "<|python_tag|>" + tool_call.name }}', "llama3_json"),  # Llama 3.1
    ('{{- \'Given the following functions, please respond with a JSON for a function call with its proper arguments '
     'that best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": '
     'dictionary of argument name and its value}.\' }}', "llama3_json"),  # Llama 3.2
    ('{%- elif message.tool_calls is defined %}{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}',
     "mistral"),
    ('{{- "[TOOL_CALLS]" + tool_call.function.name + "[ARGS]" + arguments }}', "mistral"),
    ('If you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n'
     '<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>', "qwen3_coder"),
    ("{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' }}",
     "phi4_mini"),
    ('you MUST put it in the format of [func_name1(params_name1=params_value1, params_name2=params_value2...), '
     'func_name2(params)]', "pythonic"),  # Llama 4, Llama 3.2 pythonic
    ("Wrap the call in ```tool_code``` and print its result.", "gemma"),
    ("{% for message in messages %}{{ message.content }}{% endfor %}", "hermes"),  # nothing tells: as before
    (None, "hermes"),
]


@pytest.mark.parametrize("template, name", TEMPLATES)
def test_auto_reads_the_chat_template(template, name):
    assert tp.resolve_parser("auto", template) == name
    assert tp.resolve_parser(None, template) == "hermes"
    assert tp.resolve_parser("mistral", template) == "mistral"


def test_unknown_parser_and_the_cli_choices():
    from brisk.cli import serve

    with pytest.raises(ValueError, match="llama3_json"):
        tp.resolve_parser("nope", None)
    option = next(p for p in serve.params if p.name == "tool_call_parser")
    assert set(option.type.choices) == {"auto", *tp.PARSER_NAMES}


def test_each_family_prompts_its_own_format():
    for name in tp.PARSER_NAMES:
        prompt = tp.get_parser(name).system_prompt(TOOLS)
        assert '"get_weather"' in prompt and tp.PARSERS[name].example in prompt


# ---------------------------------------------------------------------------------------------- end to end
LLAMA_SCRIPT = ["Let me check.", "\n\n<|python_tag|>", '{"name": "get_weather", ', '"parameters": {"city": ',
                '"Oslo", "days": 2}}', '; {"name": "get_time", "parameters": {"zone": "CET"}}']


@pytest.fixture(scope="module")
def llama_caller(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama3-json-caller")
    make_scripted_tool_model(path, LLAMA_SCRIPT)
    args = ["--model", str(path), "--served-model-name", MODEL, "--max-model-len", "2048", "--kv-cache-memory",
            "16MiB", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    with ServerProcess(args, startup_timeout_s=90) as proc:
        yield openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=60)


def test_llama3_json_end_to_end_streamed_and_not(llama_caller):
    resp = llama_caller.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    content, calls, finish = answer(resp)
    assert content == "Let me check." and finish == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls] == [WEATHER, CLOCK]
    streamed = reassemble(llama_caller.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True))
    assert streamed == (content, calls, finish)
    cut = llama_caller.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4)
    assert answer(cut) == (content, [("get_weather", '{"city": ')], "length")
