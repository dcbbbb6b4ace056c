"""\\d, \\w and \\s mean their ASCII classes in every regex a constraint takes (regex, and a grammar's /regex/
terminals), as in JSON-schema patterns: llguidance's Rust regex would read them as Unicode classes, and a small
model then writes U+1FBF8 for a digit. The rewrite (structured/backend.py), the masks it gives on the default
model's vocabulary against Python's re.ASCII, and sampled generations that stay ASCII."""

from __future__ import annotations

import json
import re

import pytest

from brisk import SamplingParams, StructuredOutputsParams
from brisk.structured.backend import ascii_lark, ascii_regex, grammar_text

pytest.importorskip("llguidance")

D, W, S = "[0-9]", "[0-9a-zA-Z_]", r"[ \t\n\r\f\v]"


@pytest.mark.parametrize("pattern, want", [
    (r"\d{4}-\d{2}-\d{2}", f"{D}{{4}}-{D}{{2}}-{D}{{2}}"),
    (r"\w+\s\S\W\D", f"{W}+{S}[^{S[1:-1]}][^{W[1:-1]}][^0-9]"),
    (r"[\d.]+", f"[{D}.]+"),  # inside a class: a nested class, the union
    (r"[^\d\s]", f"[^{D}{S}]"),
    (r"\\d\\\d", rf"\\d\\{D}"),  # an escaped backslash then 'd' is no class
    (r"\p{L}\x41\n\.", r"\p{L}\x41\n\."),  # other escapes stay
    ("a/b", r"a\/b"),  # ready for Lark's /.../
])
def test_the_rewrite(pattern, want):
    assert ascii_regex(pattern) == want


def test_lark_terminals_are_rewritten_and_strings_and_comments_are_not():
    grammar = 'start: "\\\\d" x /\\d+/ y  // a \\d comment\nx: /[\\w-]\\/\\s/i\ny: "a/b" /\\S/\n'
    got = ascii_lark(grammar)
    assert got == (f'start: "\\\\d" x /{D}+/ y  // a \\d comment\nx: /[{W}-]\\/{S}/i\n'
                   f'y: "a/b" /[^{S[1:-1]}]/\n')
    assert ascii_lark('start: "a" /[0-9]+/') == 'start: "a" /[0-9]+/'  # nothing to rewrite: untouched


def test_every_spelling_compiles_to_ascii_classes():
    regex = json.loads(grammar_text(StructuredOutputsParams(regex=r"\d+")))["grammars"][0]["lark_grammar"]
    assert regex == "start: /[0-9]+/"
    assert "/[0-9]+/" in grammar_text(StructuredOutputsParams(grammar=r"start: /\d+/"))
    gbnf = grammar_text(StructuredOutputsParams(grammar='root ::= [0-9]+ "x"'))  # GBNF still converts
    assert "start" in gbnf and "[0-9]" in gbnf


# ---------------------------------------------------------------------------------------------- the default model
@pytest.fixture(scope="module")
def token_texts(default_llm) -> dict[int, str]:
    """Every ordinary token of the default vocabulary whose bytes are whole UTF-8 text."""
    compiler = default_llm.engine.grammar_compiler()
    out = {}
    for t in range(compiler.vocab_size):
        b = compiler.ll_tokenizer.decode_bytes([t])
        if not b or compiler.ll_tokenizer.is_special_token(t):
            continue
        try:
            out[t] = b.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return out


@pytest.mark.parametrize("cls", [r"\d", r"\w", r"\s", r"\D", r"\W", r"\S", r"[^\W_]"])
def test_masks_follow_python_ascii_semantics(default_llm, token_texts, cls):
    """The first-token mask of `cls+` allows exactly the whole-character tokens that re.ASCII's `cls+` matches."""
    state = default_llm.engine.grammar_compiler().new_state(StructuredOutputsParams(regex=f"{cls}+"))
    allowed = state.allowed()
    py = re.compile(f"{cls}+", re.ASCII)
    wrong = [(t, s) for t, s in token_texts.items() if bool(allowed[t]) != bool(py.fullmatch(s))]
    assert not wrong, wrong[:10]


@pytest.mark.parametrize("pattern", [
    r"\d{4}-\d{2}-\d{2}",  # the date that came out as U+1FBF8 digits
    r"[A-Z]\w{7}",
    r"x\s{2,4}y",
    r"[^\W_]{8}",  # a negated class of a negated class: ASCII letters and digits
])
def test_sampled_generations_stay_ascii(default_llm, pattern):
    params = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, max_tokens=24, n=4, seed=7,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    outs = default_llm.generate("Write something in a script other than Latin:", params)[0].outputs
    for c in outs:
        assert c.finish_reason == "stop", c
        assert c.text.isascii() and re.fullmatch(pattern, c.text, re.ASCII), c.text
