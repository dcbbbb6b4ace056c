"""Tokenizer, chat templates and streaming detokenization, each against transformers as the oracle.

Three tokenizer families: the tiny byte-level BPE with ChatML (GPT-2 / Qwen2 / SmolLM2 style), a
Llama-2-style SentencePiece BPE (byte fallback, leading-space stripping, BOS from the post-processor,
raise_exception in its template), and, marked slow, the real SmolLM2 tokenizer from the default GGUF file.
"""

from __future__ import annotations

import json
import random
from datetime import datetime
from pathlib import Path

import pytest
import tokenizers
from hf_utils import (
    CHATML_TEMPLATE,
    LLAMA2_TEMPLATE,
    write_sentencepiece_style_tokenizer,
    write_tiny_tokenizer,
)
from transformers import AutoTokenizer

from brisk.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home",
    "Café naïve résumé — Ærø, Øre, ß, Ω ≈ ∑ ∞",
    "日本語のテキストと中文字符，还有한국어.",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 astronaut 🧑‍🚀 flag 🇫🇷!",
    "  leading spaces, trailing spaces  ",
    "tabs\tand\n\nnewlines\r\n end",
    "specials inline <|im_start|>user\nhi<|im_end|> and <s> </s> text",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "  Blue.  "},
        {"role": "user", "content": "And grass? 🌱 日本"},
    ],
    [{"role": "user", "content": "Say <|im_end|> literally"}, {"role": "assistant", "content": "<|im_end|>"}],
]

# Exercises what transformers' environment adds to plain jinja: loop controls, namespace, its tojson
# (no HTML escaping, non-ASCII kept), raise_exception, and trim_blocks / lstrip_blocks whitespace.
LOOP_TEMPLATE = """\
{% set ns = namespace(system='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
    {% endif %}
{% endfor %}
{% if tools %}
<tools>{{ tools | tojson }}</tools>
{% endif %}
{% if ns.system %}SYSTEM: {{ ns.system | trim }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% if message['content'] == 'STOP' %}{% break %}{% endif %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('role ' + message['role'] + ' is not allowed here') }}
    {% endif %}
[{{ message['role'] | upper }}] {{ message['content'] | trim }}
{% endfor %}
{% if add_generation_prompt %}[ASSISTANT]{% endif %}"""

TOOLS = [{
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Find <tags> & 'quotes' — ünïcødé",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}]


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chatml")
    write_tiny_tokenizer(path, 384)
    return path


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spm")
    write_sentencepiece_style_tokenizer(path, 512)
    return path


@pytest.fixture(scope="module", params=["chatml", "spm"])
def pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, object]:
    """(brisk Tokenizer, transformers tokenizer) loaded from the same folder."""
    path = request.getfixturevalue(f"{request.param}_dir")
    return Tokenizer.from_hf_folder(path), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def smollm2_pair(tmp_path_factory: pytest.TempPathFactory, default_gguf_path: Path) -> tuple[Tokenizer, object]:
    """The real SmolLM2 tokenizer: transformers converts it from the GGUF once (~20 s) and saves an HF
    tokenizer folder, which brisk then loads like any other."""
    path = tmp_path_factory.mktemp("smollm2")
    AutoTokenizer.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name).save_pretrained(path)
    return Tokenizer.from_hf_folder(path), AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------------------------------- encode/decode
def _check_encode_decode(tok: Tokenizer, ref: object) -> None:
    for text in TEXTS:
        for add_special in (True, False):
            ids = tok.encode(text, add_special_tokens=add_special)
            assert ids == ref.encode(text, add_special_tokens=add_special), (text, add_special)
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)


def test_encode_decode_match_transformers(pair: tuple[Tokenizer, object]) -> None:
    _check_encode_decode(*pair)


def test_special_token_ids(chatml_dir: Path, spm_dir: Path) -> None:
    chatml = Tokenizer.from_hf_folder(chatml_dir)
    assert (chatml.bos_token_id, chatml.eos_token_ids, chatml.pad_token_id) == (None, [2], 0)
    assert not chatml.add_bos_token and chatml.encode("hi")[0] != 0
    assert chatml.vocab_size == 384
    assert chatml.is_special(1) and chatml.is_special(2) and not chatml.is_special(100)
    assert chatml.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]
    assert chatml.token_to_id("<|im_end|>") == 2

    spm = Tokenizer.from_hf_folder(spm_dir)
    assert (spm.bos_token_id, spm.eos_token_ids, spm.add_bos_token) == (1, [2], True)
    assert not spm.is_special(3 + 0x41)  # a byte-fallback token is ordinary text


def test_bos_added_exactly_once(spm_dir: Path) -> None:
    """The constructor contract the GGUF loader relies on: add_bos_token is obeyed whether or not the backend
    post-processor already adds BOS."""
    raw = (spm_dir / "tokenizer.json").read_text()
    body = Tokenizer.from_hf_folder(spm_dir).encode("Emma was clever", add_special_tokens=False)
    assert body[0] != 1

    with_pp = tokenizers.Tokenizer.from_str(raw)  # post-processor prepends <s>
    without_pp = tokenizers.Tokenizer.from_str(raw)
    without_pp.post_processor = None
    for backend in (with_pp, without_pp):
        for add_bos, expected in ((True, [1, *body]), (False, body)):
            tok = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], add_bos_token=add_bos, chat_template=None)
            assert tok.encode("Emma was clever") == expected
            assert tok.encode("Emma was clever", add_special_tokens=False) == body


def test_generation_config_eos_merged_after_tokenizer_eos(chatml_dir: Path) -> None:
    tok = Tokenizer.from_hf_folder(chatml_dir, generation_config={"eos_token_id": [0, 2, 5]})
    assert tok.eos_token_ids == [2, 0, 5]
    assert tok.is_special(5)  # a stop id is never shown as text


def test_chat_template_file_precedence(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path, 384, chat_template="config {{ messages[0]['content'] }}")
    msgs = [{"role": "user", "content": "x"}]
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template(msgs) == "config x"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "json {{ messages[0]['content'] }}"}))
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template(msgs) == "json x"
    (tmp_path / "chat_template.jinja").write_text("jinja {{ messages[0]['content'] }}")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template(msgs) == "jinja x"


# ---------------------------------------------------------------------------------------------- chat templates
def _check_chat(tok: Tokenizer, ref: object, conversations: list[list[dict]], **kwargs: object) -> None:
    for messages in conversations:
        for add_gen in (True, False):
            text = tok.apply_chat_template(messages, add_generation_prompt=add_gen, **kwargs)
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_gen, **kwargs)
            assert text == expected, messages
            ids = ref.apply_chat_template(messages, add_generation_prompt=add_gen, return_dict=False, **kwargs)
            assert tok.encode_chat(messages, add_generation_prompt=add_gen, **kwargs) == ids


def test_chatml_template_matches_transformers(chatml_dir: Path) -> None:
    tok, ref = Tokenizer.from_hf_folder(chatml_dir), AutoTokenizer.from_pretrained(chatml_dir)
    assert tok.chat_template == CHATML_TEMPLATE
    _check_chat(tok, ref, CONVERSATIONS)
    assert tok.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_llama2_template_matches_transformers(spm_dir: Path) -> None:
    tok, ref = Tokenizer.from_hf_folder(spm_dir), AutoTokenizer.from_pretrained(spm_dir)
    alternating = [c for c in CONVERSATIONS if c[-1]["role"] == "user" or len(c) == 2]
    _check_chat(tok, ref, alternating)
    # bos_token / eos_token strings come from the tokenizer's ids
    assert tok.apply_chat_template(CONVERSATIONS[0]).startswith("<s>[INST] What")


def test_template_errors_surface_as_value_error(spm_dir: Path) -> None:
    tok = Tokenizer.from_hf_folder(spm_dir)
    assert tok.chat_template == LLAMA2_TEMPLATE
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="roles must alternate user/assistant"):
        tok.apply_chat_template(two_users)


def test_loop_control_template_matches_transformers(chatml_dir: Path) -> None:
    ref = AutoTokenizer.from_pretrained(chatml_dir)
    ref.chat_template = LOOP_TEMPLATE
    tok = Tokenizer(
        tokenizers.Tokenizer.from_file(str(chatml_dir / "tokenizer.json")),
        bos_token_id=None, eos_token_ids=[2], add_bos_token=False, chat_template=LOOP_TEMPLATE, pad_token_id=0,
    )
    stop = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "STOP"},
            {"role": "user", "content": "never shown"}]
    _check_chat(tok, ref, [*CONVERSATIONS, stop])
    _check_chat(tok, ref, CONVERSATIONS[:2], tools=TOOLS)
    rendered = tok.apply_chat_template(CONVERSATIONS[1], tools=TOOLS)
    assert "<tags> & 'quotes' — ünïcødé" in rendered  # tojson neither HTML-escapes nor ASCII-escapes
    assert "never shown" not in tok.apply_chat_template(stop)
    with pytest.raises(ValueError, match="role tool is not allowed here"):
        tok.apply_chat_template([{"role": "tool", "content": "42"}])


def test_template_variables_and_strftime(chatml_dir: Path) -> None:
    template = "{{ strftime_now('%Y') }};{{ eos_token }};{{ enable_thinking }};{{ messages | length }}"
    ref = AutoTokenizer.from_pretrained(chatml_dir)
    tok = Tokenizer(tokenizers.Tokenizer.from_file(str(chatml_dir / "tokenizer.json")), bos_token_id=None,
                    eos_token_ids=[2], add_bos_token=False, chat_template=template)
    msgs = CONVERSATIONS[1]
    text = tok.apply_chat_template(msgs, enable_thinking=False)
    assert text == ref.apply_chat_template(msgs, tokenize=False, chat_template=template, enable_thinking=False)
    assert text.split(";")[1:] == ["<|im_end|>", "False", "2"]
    assert int(text.split(";")[0]) in (datetime.now().year, datetime.now().year - 1)


def test_generation_tag_renders_its_body(chatml_dir: Path) -> None:
    """Training-mask templates wrap assistant turns in {% generation %}; inference renders them as text."""
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>"
                "{% endgeneration %}{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}")
    ref = AutoTokenizer.from_pretrained(chatml_dir)
    tok = Tokenizer(tokenizers.Tokenizer.from_file(str(chatml_dir / "tokenizer.json")), bos_token_id=None,
                    eos_token_ids=[2], add_bos_token=False, chat_template=template)
    msgs = CONVERSATIONS[2]
    text = tok.apply_chat_template(msgs)
    assert text == ref.apply_chat_template(msgs, tokenize=False, chat_template=template, add_generation_prompt=True)
    assert "<a>  Blue.  </a>" in text


def test_no_chat_template_is_a_clear_error(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path, 384, chat_template=None)
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template.*plain generate"):
        tok.apply_chat_template(CONVERSATIONS[0])


@pytest.mark.parametrize("messages, fragment", [
    ("hello", "non-empty list"),
    ([], "non-empty list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"content": "hi"}], r"messages\[0\] needs a string 'role'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\] \(user\) needs a string"),
    ([{"role": "user"}], "needs a string 'content'"),
])
def test_bad_messages_rejected(chatml_dir: Path, messages: object, fragment: str) -> None:
    tok = Tokenizer.from_hf_folder(chatml_dir)
    with pytest.raises(ValueError, match=fragment):
        tok.apply_chat_template(messages)


def test_template_that_does_not_compile(chatml_dir: Path) -> None:
    tok = Tokenizer(tokenizers.Tokenizer.from_file(str(chatml_dir / "tokenizer.json")), bos_token_id=None,
                    eos_token_ids=[2], add_bos_token=False, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="does not compile"):
        tok.apply_chat_template(CONVERSATIONS[0])


def test_template_sandbox_blocks_internals(chatml_dir: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    tok = Tokenizer(tokenizers.Tokenizer.from_file(str(chatml_dir / "tokenizer.json")), bos_token_id=None,
                    eos_token_ids=[2], add_bos_token=False, chat_template=template)
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template(CONVERSATIONS[0])


# ---------------------------------------------------------------------------------------------- streaming
def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None, rng: random.Random | None = None,
            skip_special_tokens: bool = True) -> tuple[list[str], str]:
    """Feed ids in chunks of 1 (or random 1..4 with rng); return (deltas incl. flush, expected text).
    Expected: the full decode of prompt + generated, minus the decode of the prompt alone."""
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        deltas.append(det.add(ids[i:i + n]))
        i += n
    deltas.append(det.flush())
    prompt = prompt or []
    full = tok.decode(prompt + ids, skip_special_tokens=skip_special_tokens)
    head = tok.decode(prompt, skip_special_tokens=skip_special_tokens)
    assert full.startswith(head)
    assert det.text == "".join(deltas)
    return deltas, full[len(head):]


@pytest.mark.parametrize("family", ["chatml", "spm"])
def test_stream_unicode_text(family: str, request: pytest.FixtureRequest) -> None:
    tok = Tokenizer.from_hf_folder(request.getfixturevalue(f"{family}_dir"))
    rng = random.Random(0)
    prompts = [None, tok.encode("Hello there, friend"), tok.encode("x")]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        for prompt in prompts:
            for chunked in (None, rng):
                deltas, expected = _stream(tok, ids, prompt, chunked)
                assert "".join(deltas) == expected, (text, prompt)
                assert not any("\ufffd" in d for d in deltas), deltas  # never half a character


def test_stream_keeps_sentencepiece_spaces(spm_dir: Path) -> None:
    """Decoding a token alone drops its leading space under SentencePiece; with left context it must not."""
    tok = Tokenizer.from_hf_folder(spm_dir)
    prompt = tok.encode("Emma was")
    ids = tok.encode("Emma was very clever indeed", add_special_tokens=False)[len(prompt) - 1:]
    assert tok.decode(ids[:1]) == "very"  # alone: the space is stripped
    deltas, expected = _stream(tok, ids, prompt)
    assert "".join(deltas) == expected == " very clever indeed"


def test_stream_random_byte_level_tokens(chatml_dir: Path) -> None:
    """Random ids of a byte-level BPE are mostly single bytes, so invalid and split UTF-8 is everywhere.
    Byte-level decoding is lossy UTF-8 over all bytes, whose text up to a complete character never changes
    when bytes are appended, so the concatenated deltas must equal the full decode exactly."""
    tok = Tokenizer.from_hf_folder(chatml_dir)
    rng = random.Random(1234)
    for trial in range(60):
        ids = [rng.randrange(tok.vocab_size) for _ in range(150)]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(8)] if trial % 2 else None
        skip = trial % 3 != 0
        deltas, expected = _stream(tok, ids, prompt, rng if trial % 4 == 1 else None, skip_special_tokens=skip)
        assert "".join(deltas) == expected, trial


def test_stream_random_sentencepiece_pieces(spm_dir: Path) -> None:
    """Random streams of whole pieces and byte-fallback spellings of random characters. (Arbitrary byte
    tokens are not a valid oracle here: ByteFallback decodes a run of byte tokens jointly, so appending an
    invalid byte turns an already valid '=' into U+FFFD in the full decode; no streaming decoder can emit
    '=' early and match that. Real SentencePiece output spells only whole characters in bytes.)"""
    tok = Tokenizer.from_hf_folder(spm_dir)
    pieces = [i for i in range(tok.vocab_size) if i > 258]
    chars = "éü中文日本🙂👍🏽🧑‍🚀Ω∑"
    rng = random.Random(7)
    for trial in range(40):
        ids: list[int] = []
        while len(ids) < 120:
            if rng.random() < 0.25:
                ids += [3 + b for b in rng.choice(chars).encode("utf-8")]  # <0xNN> ids
            else:
                ids.append(rng.choice(pieces))
        prompt = tok.encode("Hello there") if trial % 2 else None
        deltas, expected = _stream(tok, ids, prompt, rng if trial % 3 == 0 else None)
        assert "".join(deltas) == expected, trial
        assert not any("\ufffd" in d for d in deltas)


def test_stream_long_invalid_run_is_emitted_not_held_forever(chatml_dir: Path) -> None:
    """A degenerate model emitting invalid bytes: the text must still stream (the window is bounded) and
    stay equal to the full decode, including a character that completes right after the garbage."""
    tok = Tokenizer.from_hf_folder(chatml_dir)
    ff = tok.token_to_id("\u00ff")  # byte-level symbol of byte 0xFF, never valid UTF-8
    lead = tok.token_to_id("\u00e4")  # byte 0xE4, first byte of a 3-byte character
    ids = [ff] * 30 + [lead] * 25 + tok.encode("中 ok", add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    deltas = [det.add([i]) for i in ids[:40]]
    assert det.text.startswith("\ufffd" * 20)  # emitted while the garbage is still coming
    deltas += [det.add([i]) for i in ids[40:]] + [det.flush()]
    assert "".join(deltas) == tok.decode(ids)
    assert det.text.endswith("中 ok")


def test_flush_emits_held_partial_character(chatml_dir: Path) -> None:
    tok = Tokenizer.from_hf_folder(chatml_dir)
    ids = tok.encode("ok 🙂", add_special_tokens=False)
    partial = ids[:-1]  # the emoji's last byte(s) missing
    assert tok.decode(partial).endswith("\ufffd")
    det = IncrementalDetokenizer(tok)
    emitted = det.add(partial)
    assert emitted == "" and det.flush() == tok.decode(partial)
    assert det.text == tok.decode(partial)


def test_stream_skips_or_keeps_special_tokens(chatml_dir: Path) -> None:
    tok = Tokenizer.from_hf_folder(chatml_dir)
    ids = tok.encode("Hi there", add_special_tokens=False) + [2]  # ... <|im_end|>
    skipped = IncrementalDetokenizer(tok)
    assert skipped.add(ids[:-1]) == "Hi there" and skipped.add([2]) == "" and skipped.flush() == ""
    kept = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert kept.add(ids) == "Hi there<|im_end|>"


def test_stream_window_stays_small(chatml_dir: Path) -> None:
    """add() must cost O(window), not O(all tokens): record how many ids each decode call sees."""
    tok = Tokenizer.from_hf_folder(chatml_dir)
    seen: list[int] = []
    real_decode = tok.decode

    def recording_decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        seen.append(len(ids))
        return real_decode(ids, skip_special_tokens)

    tok.decode = recording_decode  # type: ignore[method-assign]
    ids = tok.encode("Emma Woodhouse, handsome, clever 🙂 日本 " * 60, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, prompt_token_ids=ids[:300])
    for i in ids:
        det.add([i])
    assert len(ids) > 1000
    assert max(seen) <= 12, max(seen)
    tok.decode = real_decode  # type: ignore[method-assign]
    assert det.text == tok.decode(ids[:300] + ids)[len(tok.decode(ids[:300])):]


# ---------------------------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_pair: tuple[Tokenizer, object]) -> None:
    tok, ref = smollm2_pair
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token) == (1, [2], False)
    assert tok.vocab_size == 49152
    _check_encode_decode(tok, ref)
    _check_chat(tok, ref, CONVERSATIONS)
    # SmolLM2's template injects its default system prompt when the conversation has none
    assert "You are a helpful AI assistant named SmolLM" in tok.apply_chat_template(CONVERSATIONS[0])


@pytest.mark.slow
def test_smollm2_streaming(smollm2_pair: tuple[Tokenizer, object]) -> None:
    tok, _ = smollm2_pair
    prompt = tok.encode_chat(CONVERSATIONS[2])
    for text in TEXTS:
        deltas, expected = _stream(tok, tok.encode(text, add_special_tokens=False), prompt)
        assert "".join(deltas) == expected and not any("\ufffd" in d for d in deltas)
    rng = random.Random(3)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(100)]
        deltas, expected = _stream(tok, ids, prompt, rng)
        assert "".join(deltas) == expected
