"""Grammar compilation and per-request matcher state, on llguidance.

Why llguidance: it installs as one self-contained wheel (no torch, no triton, unlike xgrammar, whose wheel pulls
triton), computes a token mask on the CPU in ~0.1 ms for JSON schemas on a 49k vocabulary, reads the model's own
tokenizer.json (so GGUF vocabularies, converted to a `tokenizers.Tokenizer` at load, work too), and offers what the
engine needs: a bitmask per sequence, rollback, forced ("fast-forward") tokens and grammar validation that names
unsupported schema keywords instead of silently ignoring them.

    GrammarCompiler (one per engine)             StructuredState (one per sequence, lives on the Request)
      LLTokenizer of the model's vocabulary        a copy of the compiled matcher, advanced token by token
      key -> compiled matcher (LRU cache)  ---->   fill_bitmask() / accept() / rollback() / forced tokens
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from brisk.structured.params import StructuredOutputError, StructuredOutputsParams

# JSON as json.dumps writes it: the separators' spaces fixed, no other whitespace. A fixed layout makes keys and
# punctuation forced bytes (the jump-forward source) and keeps small models from wandering into whitespace loops.
_JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_ANY_OBJECT = {"type": "object"}

# The longest run of digits the mask lets a sequence write where the grammar itself does not stop it. An integer a
# schema leaves unbounded (and the fraction or exponent of any number) is a digit run of any length to the grammar,
# and a small model can go on emitting digits until max_tokens, so the answer never closes. Past MAX_DIGIT_RUN
# digits in a row the mask forbids every token that would lengthen the run, which leaves the grammar's way out
# (`,`, `}`, `.`, `"`...): the value stays valid, the answer ends. Where the grammar allows nothing but more digits
# (a regex or pattern that asks for a longer run, an integer minimum of more than 40 digits) the cap is not applied.
# 40 digits is past any integer a program reads back (int64 has 19, a double's mantissa 17 significant).
MAX_DIGIT_RUN = 40


def _llguidance():  # noqa: ANN202 - the module
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputError("structured outputs need the llguidance package: pip install llguidance",
                                    param="structured_outputs") from None
    return llguidance


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for a constraint; compile errors are found by GrammarCompiler."""
    llg = _llguidance()
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = _ANY_OBJECT if kind == "json_object" else params.json
        if schema is True:
            schema = {}
        opts = _JSON_COMPACT if params.disable_any_whitespace else _JSON_DEFAULTS
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=opts)
        except ValueError as e:
            raise StructuredOutputError(f"invalid JSON schema: {e}", param="json") from None
    if kind == "regex":  # as LLMatcher.grammar_from_regex writes it, with ASCII classes
        return json.dumps({"grammars": [{"name": "regex", "json_schema": None,
                                         "lark_grammar": f"start: /{ascii_regex(params.regex)}/"}],
                           "max_tokens": None})
    if kind == "choice":
        return llg.grammar_from("choice", params.choice)
    from llguidance.gbnf_to_lark import any_to_lark  # optional: llguidance (_llguidance above says how to get it)

    try:
        lark = any_to_lark(params.grammar)  # Lark as it is, or GBNF converted to Lark
    except Exception as e:  # noqa: BLE001 - the converter raises whatever its parser met
        raise StructuredOutputError(f"the grammar does not compile: {e}", param="grammar") from None
    return llg.LLMatcher.grammar_from_lark(ascii_lark(lark))


# ---------------------------------------------------------------------------------------------- ASCII classes
# Rust's regex crate (llguidance's) reads \d, \w and \s as Unicode classes: `\d{4}` admits U+1FBF8 and every other
# script's digits, `\w` any letter, `\s` U+3000. What a user of a regex constraint means (and what JSON-schema
# `pattern`s already get) is ASCII: brisk rewrites the six escapes, outside and inside [...], before compiling.
ASCII_CLASSES = "dws"  # llguidance's regex_to_lark: \d -> [0-9], \w -> [0-9a-zA-Z_], \s -> [ \t\n\r\f\v]


def ascii_regex(pattern: str) -> str:
    """`pattern` with \\d, \\w, \\s, \\D, \\W, \\S as their ASCII classes (escaped backslashes and other escapes kept),
    its `/` escaped: ready to stand between the slashes of a Lark regex terminal."""
    return _llguidance().regex_to_lark(pattern, ASCII_CLASSES)


def ascii_lark(grammar: str) -> str:
    """A Lark grammar with the classes of every `/regex/` terminal made ASCII (strings and comments untouched)."""
    if not any(f"\\{c}" in grammar for c in "dwsDWS"):
        return grammar
    out, i, n = [], 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == '"':  # a string literal: up to its unescaped closing quote
            j = i + 1
            while j < n and grammar[j] != '"':
                j += 2 if grammar[j] == "\\" else 1
            out.append(grammar[i:j + 1])
            i = j + 1
        elif grammar.startswith("//", i) or c == "#":  # a comment, to the end of the line
            j = grammar.find("\n", i)
            j = n if j < 0 else j
            out.append(grammar[i:j])
            i = j
        elif c == "/":  # a regex terminal: up to its unescaped closing slash
            j = i + 1
            while j < n and grammar[j] not in "/\n":
                j += 2 if grammar[j] == "\\" else 1
            if j >= n or grammar[j] != "/":  # not a terminal after all: leave the rest to the grammar compiler
                out.append(grammar[i:])
                break
            out.append(f"/{ascii_regex(grammar[i + 1:j])}/")
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


class GrammarCompiler:
    """Compiles constraints once per (kind, text) for one vocabulary and hands out fresh matchers."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 max_cached: int = 256) -> None:
        llg = _llguidance()
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.ll_tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=self.eos_token_ids or None)
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()  # the server validates on the event loop and compiles on the engine thread
        self.num_compiled = 0
        self.compile_seconds = 0.0
        self._digits: _DigitTables | None = None

    def digit_tables(self) -> _DigitTables:
        """Per-token digit counts of this vocabulary, for the MAX_DIGIT_RUN cap (built on first use)."""
        with self._lock:
            if self._digits is None:
                self._digits = _DigitTables(self.ll_tokenizer, self.vocab_size)
            return self._digits

    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled (unadvanced) llguidance matcher for `params`; StructuredOutputError if it cannot be
        enforced. Cached: a second request with the same constraint costs a dict lookup."""
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        llg = _llguidance()
        t0 = time.perf_counter()
        grammar = grammar_text(params)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise StructuredOutputError(_error_message(params.kind, messages[0]), param=params.kind)
        matcher = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(_error_message(params.kind, matcher.get_error()), param=params.kind)
        self.compile_seconds += time.perf_counter() - t0
        self.num_compiled += 1
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return matcher

    def new_state(self, params: StructuredOutputsParams) -> StructuredState:
        return StructuredState(self.compile(params).deep_copy(), self)  # type: ignore[attr-defined]

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()


def _error_message(kind: str, detail: str) -> str:
    what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice list",
            "grammar": "grammar"}[kind]
    # llguidance's messages run over several lines (the regex, a caret under the error, the reason): one line
    lines = [" ".join(line.split()) for line in detail.strip().splitlines()]
    detail = "; ".join(line for line in lines if line and set(line) - {"^", " "})[:400] or "unknown error"
    if "Unimplemented keys" in detail or "not supported" in detail:
        return f"the {what} uses a feature the grammar engine cannot enforce: {detail}"
    return f"the {what} does not compile: {detail}"


class _DigitTables:
    """What each token does to a run of digits: `full[t]` its length when every byte is an ASCII digit (else -1),
    `trailing[t]` the digits it ends with, `leading[t]` those it starts with; `forbid(k)` the bitmask of tokens that
    start with more than k digits (they would lengthen a run that has k digits left before the cap)."""

    def __init__(self, ll_tokenizer: object, vocab_size: int) -> None:
        full, trailing, leading = [-1] * vocab_size, [0] * vocab_size, np.zeros(vocab_size, dtype=np.int16)
        for t in range(vocab_size):
            b = ll_tokenizer.decode_bytes([t])  # type: ignore[attr-defined]
            if not b or b[0] == 0xFF:  # empty, or a special token (llguidance marks those with a 0xFF byte)
                continue
            lead = len(b) - len(b.lstrip(b"0123456789"))
            leading[t] = lead
            trailing[t] = len(b) - len(b.rstrip(b"0123456789"))
            if lead == len(b):
                full[t] = lead
        self.full, self.trailing, self.leading = full, trailing, leading
        self.max_leading = int(leading.max()) if vocab_size else 0
        self.num_words = (vocab_size + 31) // 32
        self._forbid: dict[int, np.ndarray] = {}

    def run_length(self, tokens: Sequence[int]) -> int:
        """The digits at the end of the text of `tokens` (counted up to just past MAX_DIGIT_RUN)."""
        run = 0
        for t in reversed(tokens):
            n = self.full[t] if 0 <= t < len(self.full) else -1
            if n < 0:
                return run + (self.trailing[t] if 0 <= t < len(self.trailing) else 0)
            run += n
            if run > MAX_DIGIT_RUN:
                break
        return run

    def forbid(self, k: int) -> np.ndarray:
        mask = self._forbid.get(k)
        if mask is None:
            bits = np.zeros(self.num_words * 32, dtype=bool)
            bits[:len(self.leading)] = self.leading > k
            mask = np.packbits(bits, bitorder="little").view(np.int32)  # [W], bit t % 32 of word t // 32
            self._forbid[k] = mask
        return mask


class StructuredState:
    """One sequence's position in its grammar. Invariant: the matcher has consumed exactly the request's output
    tokens (`num_tokens == len(output_token_ids)`), so its mask is the set of tokens allowed next. Brisk's
    preemption recomputes KV but keeps the output tokens, so the state stays valid; `sync` repairs it whenever
    the output was changed behind its back (rolling back to the common prefix, then consuming the rest)."""

    def __init__(self, matcher: object, compiler: GrammarCompiler) -> None:
        self.matcher = matcher
        self.compiler = compiler
        self.tokens: list[int] = []  # what the matcher has consumed, for sync and rollback
        self.jump_forward = "off"  # this request's jump-forward mode (structured/runner.py), set by the engine
        self._mask: np.ndarray | None = None  # the bitmask of the current position, once computed

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def fill_bitmask(self, bitmask_row: np.ndarray) -> None:
        """Write the allowed-next-token bitmask into a C-contiguous int32 row (bit t % 32 of word t // 32)."""
        if self._mask is not None:
            bitmask_row[:] = self._mask
            return
        self.matcher.unsafe_compute_mask_ptr(bitmask_row.ctypes.data, bitmask_row.nbytes)  # type: ignore[attr-defined]
        self._cap_digit_run(bitmask_row)

    def _cap_digit_run(self, bitmask_row: np.ndarray) -> None:
        """Forbid the tokens that would take a run of digits past MAX_DIGIT_RUN, if the grammar leaves any other."""
        digits = self.compiler.digit_tables()
        run = digits.run_length(self.tokens)
        if run + digits.max_leading <= MAX_DIGIT_RUN:
            return
        capped = bitmask_row & ~digits.forbid(max(0, MAX_DIGIT_RUN - run))
        if capped.any():
            bitmask_row[:] = capped

    def allowed(self) -> np.ndarray:
        """Bool [vocab_size]: the tokens allowed next (tests and the jump-forward check; the sampler uses bitmasks)."""
        row = np.empty((self.compiler.vocab_size + 31) // 32, dtype=np.int32)
        self.fill_bitmask(row)
        self._mask = row  # the sampler's fill for this position reuses it
        return unpack_bitmask(row[None], self.compiler.vocab_size)[0]

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Consume tokens; False (and nothing consumed) if the grammar forbids them."""
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            return True
        self._mask = None
        eos = token_ids[-1] in self.compiler.eos_token_ids  # try_consume_tokens refuses EOS; consume_token takes it
        body = token_ids[:-1] if eos else token_ids
        n = self.matcher.try_consume_tokens(body) if body else 0  # type: ignore[attr-defined]
        if n != len(body) or (eos and not self.is_accepting):
            if n:
                self.matcher.rollback(n)  # type: ignore[attr-defined]
            return False
        if eos:
            assert self.matcher.consume_token(token_ids[-1]), self.matcher.get_error()  # type: ignore[attr-defined]
        self.tokens.extend(token_ids)
        return True

    def validate(self, token_ids: Sequence[int]) -> int:
        """How many of token_ids the grammar would accept from here, consuming none."""
        return int(self.matcher.validate_tokens([int(t) for t in token_ids]))  # type: ignore[attr-defined]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        self._mask = None
        assert num_tokens <= len(self.tokens), f"rollback of {num_tokens} tokens past the start ({len(self.tokens)})"
        ok = self.matcher.rollback(num_tokens)  # type: ignore[attr-defined]
        assert ok, f"the grammar matcher could not roll back {num_tokens} tokens: {self.matcher.get_error()}"
        del self.tokens[len(self.tokens) - num_tokens:]

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the consumed tokens equal the request's outputs."""
        if len(self.tokens) == len(output_token_ids) and (not self.tokens or self.tokens[-1] == output_token_ids[-1]):
            return
        common = 0
        for a, b in zip(self.tokens, output_token_ids, strict=False):
            if a != b:
                break
            common += 1
        self.rollback(len(self.tokens) - common)
        rest = list(output_token_ids[common:])
        assert self.accept(rest), f"the outputs left the grammar: {rest[:8]}"

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return bool(self.matcher.is_stopped())  # type: ignore[attr-defined]

    @property
    def is_accepting(self) -> bool:
        return bool(self.matcher.is_accepting())  # type: ignore[attr-defined]

    def forced_tokens(self) -> list[int]:
        """llguidance's fast-forward tokens: the tokenization of the bytes the grammar forces next, cut before any
        token whose split could depend on what follows."""
        return [int(t) for t in self.matcher.compute_ff_tokens()]  # type: ignore[attr-defined]

    def forced_bytes(self) -> bytes:
        return bytes(self.matcher.compute_ff_bytes())  # type: ignore[attr-defined]


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """int32 [B, W] bitmask -> bool [B, vocab_size] (little-endian words: byte 0 holds tokens 0..7)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


def schema_of(params: StructuredOutputsParams) -> dict | None:
    """The JSON schema a constraint stands for (None for regex / choice / grammar), for validating outputs."""
    if params.kind == "json_object":
        return _ANY_OBJECT
    if params.kind == "json":
        return params.json if isinstance(params.json, dict) else {}
    return None


def dumps_schema(schema: dict) -> str:
    return json.dumps(schema, sort_keys=True)
