"""Tokenizer, chat template and incremental (streaming) detokenization.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend that transformers' fast tokenizers use) and adds
what generation needs on top: BOS handling the way transformers does it, the set of EOS ids, and the model's
Jinja chat template rendered in the same sandbox transformers uses, so the prompt text (and hence the prompt
ids) is byte-for-byte what the model was trained on.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas for streaming. Decoding one token
at a time is wrong in two ways: a multi-byte UTF-8 character can be split over several byte-level tokens
(decoding the first alone gives U+FFFD), and SentencePiece decoders strip the leading space of the first
token of whatever they decode. Both are solved by decoding a small window with a few tokens of left context
(the prefix_offset/read_offset scheme of vLLM's `detokenize_incrementally`) and holding text back while it
ends in U+FFFD.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
import tokenizers.processors
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Text <-> ids for one model, plus its chat template.

    `add_bos_token` says whether `encode(..., add_special_tokens=True)` starts with BOS. The backend's
    post-processor may already add it (Llama-3 style `TemplateProcessing`); then it is not added twice.
    """

    def __init__(
        self,
        hf_tokenizer: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        add_bos_token: bool,
        chat_template: str | None,
        pad_token_id: int | None = None,
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        # Padding and truncation are the engine's business; a tokenizer.json that enables them would
        # silently change prompt ids.
        hf_tokenizer.no_padding()
        hf_tokenizer.no_truncation()
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(int(i) for i in eos_token_ids))  # dedupe, keep order
        self.pad_token_id = pad_token_id
        self.add_bos_token = bool(add_bos_token) and bos_token_id is not None
        self.chat_template = chat_template or None
        # Does the backend's post-processor itself put BOS in front? Probe once with a one-letter text.
        with_special = hf_tokenizer.encode("a", add_special_tokens=True).ids
        without = hf_tokenizer.encode("a", add_special_tokens=False).ids
        self._post_processor_adds_bos = (
            bos_token_id is not None and len(with_special) > len(without) and with_special[0] == bos_token_id
        )
        special = {i for i, tok in hf_tokenizer.get_added_tokens_decoder().items() if tok.special}
        special.update(i for i in (bos_token_id, pad_token_id, *self.eos_token_ids) if i is not None)
        self._special_ids = frozenset(special)

    # ---------------------------------------------------------------- construction from a folder
    @classmethod
    def from_hf_folder(cls, path: str | Path, generation_config: dict | None = None) -> Tokenizer:
        """Load `tokenizer.json` + `tokenizer_config.json` (+ chat template files) from a model folder.

        `generation_config` (the parsed `generation_config.json`, read from the folder when None) adds its
        `eos_token_id`s after the tokenizer's own EOS. Raises FileNotFoundError when tokenizer.json is
        missing and ValueError when a file is malformed.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file} not found; brisk needs a fast-tokenizer tokenizer.json (save one with "
                "transformers: AutoTokenizer.from_pretrained(folder).save_pretrained(folder))"
            )
        try:
            hf = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise ValueError(f"{tok_file} could not be parsed as a tokenizer: {e}") from e
        # Older folders name the special tokens in special_tokens_map.json; tokenizer_config.json wins.
        cfg = _read_json(path / "special_tokens_map.json") or {}
        cfg.update(_read_json(path / "tokenizer_config.json") or {})
        if generation_config is None:
            generation_config = _read_json(path / "generation_config.json") or {}

        names = {k: _token_content(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        # transformers registers named special tokens that tokenizer.json lacks; do the same so ids agree.
        missing = [t for t in names.values() if t is not None and hf.token_to_id(t) is None]
        if missing:
            hf.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in missing])
        bos_id = hf.token_to_id(names["bos_token"]) if names["bos_token"] else None
        pad_id = hf.token_to_id(names["pad_token"]) if names["pad_token"] else None
        eos_ids = [hf.token_to_id(names["eos_token"])] if names["eos_token"] else []
        gen_eos = generation_config.get("eos_token_id")
        eos_ids += [gen_eos] if isinstance(gen_eos, int) else [i for i in (gen_eos or []) if isinstance(i, int)]

        # BOS comes from tokenizer.json's post-processor: transformers (v5) ignores tokenizer_config's
        # add_bos_token/add_eos_token whenever a tokenizer.json exists, and the two agree in published folders.
        probe = hf.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and probe[:1] == [bos_id]

        return cls(
            hf,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            add_bos_token=add_bos,
            chat_template=_find_chat_template(path, cfg),
            pad_token_id=pad_id,
        )

    def save(self, folder: str | Path, generation_config: Mapping[str, Any] | None = None) -> None:
        """Write tokenizer.json, tokenizer_config.json and generation_config.json so that `from_hf_folder`
        (and transformers) read back the same ids, special tokens, EOS set and chat template.

        `generation_config` (the source model's, LoadedModel.generation_config) is written on into
        generation_config.json, so a checkpoint keeps the model's recommended sampling values; its BOS/EOS
        ids give way to this tokenizer's.

        BOS that this wrapper adds by flag (GGUF vocabularies) is written as a post-processor, because folders
        state "add BOS" through tokenizer.json's post-processor, not through a config field.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        hf = tokenizers.Tokenizer.from_str(self.hf_tokenizer.to_str())
        if self.add_bos_token and not self._post_processor_adds_bos:
            bos = self.bos_token
            hf.post_processor = tokenizers.processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_token_id)])
        elif not self.add_bos_token and self._post_processor_adds_bos:
            hf.post_processor = None
        hf.save(str(folder / "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "bos_token": self.bos_token, "eos_token": self.eos_token,
                                  "pad_token": self.pad_token, "add_bos_token": self.add_bos_token}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        generation = {**(generation_config or {}), "bos_token_id": self.bos_token_id,
                      "eos_token_id": self.eos_token_ids}
        (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    # ---------------------------------------------------------------- basic properties
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (the model may pad beyond it)."""
        return self.hf_tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def _token_str(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.hf_tokenizer.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self._token_str(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self._token_str(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return self._token_str(self.pad_token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self.hf_tokenizer.token_to_id(token)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.hf_tokenizer.id_to_token(i) for i in ids]

    # ---------------------------------------------------------------- encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self.add_bos_token and not self._post_processor_adds_bos:
                ids = [self.bos_token_id, *ids]
            elif not self.add_bos_token and self._post_processor_adds_bos and ids[:1] == [self.bos_token_id]:
                ids = ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------- chat
    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` to prompt text with the model's template, as transformers' apply_chat_template.

        Extra keyword arguments become template variables (e.g. `enable_thinking=False`).
        """
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template, so chat messages cannot be formatted; "
                "use plain generate with a text prompt instead"
            )
        messages = _validate_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of JSON-schema dicts")
        template = _compile_chat_template(self.chat_template)
        context = {
            name: value
            for name, value in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("pad_token", self.pad_token),
            )
            if value is not None
        }
        context.update(kwargs)  # caller's variables win over the special-token strings, as in transformers
        context.setdefault("documents", None)  # a variable every template may test (retrieval templates render it)
        try:
            return template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **context,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the model's chat template rejected these messages: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Prompt ids for a conversation. The template writes BOS itself when the model wants one, so the text
        is encoded without special tokens (transformers' apply_chat_template(tokenize=True) does the same)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


# -------------------------------------------------------------------- streaming detokenization
class IncrementalDetokenizer:
    """Turns generated ids into text deltas, one `add` per engine step.

    Window over the ids (prompt tail + generated)::

        | ... already emitted ... | context | new (not yet emitted) |
                                  ^         ^                       ^
                         prefix_offset  read_offset             len(ids)

    Each step decodes ids[prefix_offset:read_offset] (`prefix_text`) and ids[prefix_offset:]; the delta is
    what the second has beyond the first. The left context makes SentencePiece decoders keep the space in
    front of the first new word, and lets a byte-level token that continues a character decode correctly.
    While the decoded window ends in U+FFFD a multi-byte character is probably incomplete, so the step emits
    nothing and the window keeps growing; it is emitted once the character completes.
    """

    # Context tokens taken from the prompt, as vLLM does: enough for any SentencePiece/byte-level joint.
    _NUM_CONTEXT_TOKENS = 5
    # A long hold only happens on invalid bytes (a degenerate model) or when every chunk of a multi-token
    # add ends mid-character; past this many held tokens the stable part is emitted (see _emit_stable_part)
    # so the window, and the cost of each step, stays bounded.
    _MAX_HELD_TOKENS = 16

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids or [])[-self._NUM_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # decode of ids[prefix_offset:read_offset], cached per window
        self.text = ""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append generated ids; return the text they finalize (possibly empty)."""
        self._ids.extend(token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """End of stream: emit whatever is held back, even an incomplete character."""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(self._prefix_text):
            return ""  # nothing printable yet (e.g. only skipped special tokens)
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            if len(self._ids) - self._read_offset <= self._MAX_HELD_TOKENS:
                return ""  # probably a character still incomplete: wait for its next byte
            return self._emit_stable_part(new_text)
        return self._advance(new_text, len(self._ids))

    def _advance(self, window_text: str, end: int) -> str:
        """Emit window_text (the decode of ids[prefix_offset:end]) beyond prefix_text; ids up to `end` become
        the next window's context. Old ids are kept: slicing costs O(window) only."""
        delta = window_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, end
        self._prefix_text = None
        self.text += delta
        return delta

    def _emit_stable_part(self, new_text: str) -> str:
        """Emit the longest held prefix whose text the whole window's text extends, ending at least 3 tokens
        before the end. An unfinished character is at most 3 bytes, each token at least one byte, so such a
        prefix ends at a character boundary or at bytes already known to be invalid: later tokens cannot
        change its text. Only the last few candidates are tried, keeping the cost of a step bounded."""
        end = len(self._ids)
        for k in range(end - 3, max(self._read_offset, end - 12), -1):
            text = self._decode(self._prefix_offset, k)
            if len(text) > len(self._prefix_text) and new_text.startswith(text):
                return self._advance(text, k)
        return ""


# -------------------------------------------------------------------- chat-template helpers
class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in transformers;
    for inference it renders its body unchanged. Without it such templates would not even compile."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` for templates, refusing underscore attributes so a template cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat template may not set namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes (<, >, &, '), which would change the prompt; transformers overrides it
    # with plain json.dumps and so must we.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers uses (templates come from the hub: untrusted
    code, hence the immutable sandbox). trim_blocks/lstrip_blocks change whitespace, so they must match."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"the model's chat template does not compile: {e}") from e


def _validate_messages(messages: Any) -> list[dict]:
    """Check the OpenAI-style message list; return copies without None values (as transformers drops them:
    many templates render a literal 'None' for `content=None` but handle a missing key)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role' (system, user, assistant or tool)")
        content = m.get("content")
        # An assistant turn that only calls tools may carry no content.
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise ValueError(
                f"messages[{i}] ({m['role']}) needs a string 'content', got {type(content).__name__}"
            )
        out.append({k: v for k, v in m.items() if v is not None})
    return out


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as serialized AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _find_chat_template(path: Path, tokenizer_config: dict) -> str | None:
    """chat_template.jinja wins over chat_template.json, which wins over tokenizer_config.json (the order in
    which transformers has moved the template out of the config over the years)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = (_read_json(path / "chat_template.json") or {}).get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = by_name.get("default") or next(iter(by_name.values()), None)
    return template if isinstance(template, str) and template else None
