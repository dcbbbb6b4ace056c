"""Tokenizers from GGUF metadata: byte-level BPE ("gpt2") and SentencePiece-style BPE ("llama").

The result matches what transformers builds when it loads the same GGUF file (tested against it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from brisk.model.gguf_dequant import GGUFError
from brisk.model.tokenizer import Tokenizer


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the other 68
    bytes (control characters, space, ...) take the characters U+0100.. in byte order."""
    table = {b: chr(b) for b in (*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100))}
    spare = (chr(0x100 + i) for i in range(256))
    return {b: table[b] if b in table else next(spare) for b in range(256)}


# `tokenizer.ggml.pre` -> split regex, for the pre-tokenizers of the architectures brisk runs. Anything else
# (e.g. "smollm", "gpt2", "default") gets GPT-2's ByteLevel regex, which is what transformers builds too.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def _byte_level_bpe(md: dict[str, Any]) -> tokenizers.Tokenizer:
    alphabet = _byte_alphabet()
    chars = set(alphabet.values())
    # Tokens are stored already spelled in the byte alphabet; one that is not (a raw string) is re-spelled. (One
    # test over all the characters first: Llama-3's 128 k tokens one at a time took ~0.1 s of every load.)
    tokens = md["tokenizer.ggml.tokens"]
    if set("".join(tokens)) <= chars:
        vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    else:
        vocab = {t if set(t) <= chars else "".join(alphabet[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="",
                                          fuse_unk=False))
    split = _PRE_SPLITS.get(md.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return _add_special_tokens(tok, md)


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two vocabulary pieces,
    ranked by the merged token's score (higher first), ties by longer left piece, then longer right piece,
    then the pieces' ids (the order transformers derives for GGUF files without merges)."""
    ids = {t: i for i, t in enumerate(tokens)}
    candidates = []
    for token, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                candidates.append((-score, -len(left), -len(right), ids[left], ids[right], left, right))
    return [(c[5], c[6]) for c in sorted(candidates)]


def _sentencepiece_bpe(md: dict[str, Any]) -> tokenizers.Tokenizer:
    tokens = md["tokenizer.ggml.tokens"]
    if "tokenizer.ggml.merges" in md:
        merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    elif "tokenizer.ggml.scores" in md:
        merges = _sentencepiece_merges(tokens, md["tokenizer.ggml.scores"])
    else:
        raise GGUFError("a 'llama' (SentencePiece) tokenizer needs tokenizer.ggml.scores or .merges")
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    prefix = md.get("tokenizer.ggml.add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return _add_special_tokens(tok, md)


def _add_special_tokens(tok: tokenizers.Tokenizer, md: dict[str, Any]) -> tokenizers.Tokenizer:
    """Control tokens (and the named BOS/EOS/UNK/PAD) become special added tokens, user-defined ones plain added
    tokens, so that text like "<|im_start|>" is matched whole instead of being cut into pieces.

    Only tokens the model vocabulary holds under their own spelling are added: adding any other string would
    give it a new id past the vocabulary. (A byte-level "control" token spelled outside the byte alphabet is
    a llama.cpp mislabel; transformers skips those too.)"""
    tokens, types = md["tokenizer.ggml.tokens"], md.get("tokenizer.ggml.token_type") or []
    named = {md[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "unknown", "padding")
             if f"tokenizer.ggml.{k}_token_id" in md}
    special = {i for i, t in enumerate(types) if t == _CONTROL} | named
    user = {i for i, t in enumerate(types) if t == _USER_DEFINED} - special
    own = [i for i in range(len(tokens)) if (i in special or i in user) and tok.token_to_id(tokens[i]) == i]
    tok.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True) for i in own if i in special])
    tok.add_tokens([AddedToken(tokens[i], normalized=False, special=False) for i in own if i in user])
    return tok


_TOKENIZER_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def tokenizer_from_gguf_metadata(md: dict[str, Any], source: str | Path) -> Tokenizer:
    """Build brisk's Tokenizer from a GGUF file's `tokenizer.*` metadata (`source` names the file in errors)."""
    kind = md.get("tokenizer.ggml.model")
    if kind not in _TOKENIZER_BUILDERS or "tokenizer.ggml.tokens" not in md:
        raise GGUFError(f"{source}: tokenizer.ggml.model {kind!r} is not supported; brisk builds tokenizers "
                        f"of types {', '.join(_TOKENIZER_BUILDERS)} (with tokenizer.ggml.tokens)")
    try:
        hf = _TOKENIZER_BUILDERS[kind](md)
    except GGUFError as e:
        raise GGUFError(f"{source}: {e}") from None
    eos = [md[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in md]
    chat_template = md.get("tokenizer.chat_template")
    if md.get("general.architecture") == "gemma3":
        from brisk.model.gemma import gemma_gguf_tokenizer_defaults

        chat_template, end_of_turn = gemma_gguf_tokenizer_defaults(md)
        eos += end_of_turn
    return Tokenizer(
        hf,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos,
        # llama.cpp adds BOS for SentencePiece vocabularies unless the file says otherwise
        add_bos_token=md.get("tokenizer.ggml.add_bos_token", kind == "llama"),
        chat_template=chat_template,
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
    )


