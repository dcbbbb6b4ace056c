"""What a request asks its output to match, with vLLM's names: `StructuredOutputsParams` (current) and
`GuidedDecodingParams` (vLLM's older name for the same fields).

Exactly one of json / regex / choice / grammar / json_object is set. `key()` names the constraint for the
compiled-grammar cache, so two requests with the same schema share one compilation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputError(ValueError):
    """A constraint that cannot be enforced: a bad schema, a regex or grammar that does not compile, a schema
    feature the grammar engine does not implement. `param` names the request field it came from."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's `SamplingParams(structured_outputs=StructuredOutputsParams(...))`).

    json: a JSON schema (dict, or its JSON text); regex: a regular expression (Rust regex syntax, anchored at both
    ends; \\d, \\w, \\s and their negations are the ASCII classes, as in JSON-schema patterns); choice: a list of
    strings, the output is exactly one of them; grammar: a Lark grammar (its /regex/ terminals read as `regex`) or a
    GBNF (llama.cpp) grammar; json_object: any JSON object (OpenAI's response_format {"type": "json_object"}).
    disable_any_whitespace: JSON without the separators' spaces (`{"a":1,"b":2}` instead of `{"a": 1, "b": 2}`).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputError(
                "structured outputs need exactly one of json, regex, choice, grammar or json_object, got "
                + (", ".join(given) if given else "none"), param="structured_outputs")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}", param="json") from None
        if self.json is not None and not isinstance(self.json, dict | bool):
            raise StructuredOutputError(f"a JSON schema must be an object, got {type(self.json).__name__}",
                                        param="json")
        if self.choice is not None:
            if (not isinstance(self.choice, list) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise StructuredOutputError("choice must be a non-empty list of non-empty strings", param="choice")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise StructuredOutputError(f"{name} must be a non-empty string", param=name)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """A hashable name of the constraint: (kind, canonical text, compact whitespace)."""
        value: Any = getattr(self, self.kind)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace

    @classmethod
    def from_dict(cls, d: dict[str, Any], param: str = "structured_outputs") -> StructuredOutputsParams:
        """vLLM's `structured_outputs` request field: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}."""
        if not isinstance(d, dict):
            raise StructuredOutputError(f"{param} must be an object", param=param)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - _IGNORED)
        if unknown:
            raise StructuredOutputError(f"{param} has unknown field(s) {unknown}; use one of {', '.join(KINDS)}",
                                        param=f"{param}.{unknown[0]}")
        return cls(**{k: v for k, v in d.items() if k in known})


# vLLM fields that choose a backend or tune it; brisk has one backend, so they change nothing here
_IGNORED = {"backend", "disable_fallback", "disable_additional_properties", "whitespace_pattern", "structural_tag",
            "whitespace_flexible"}


class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name (`SamplingParams(guided_decoding=GuidedDecodingParams(json=...))`); the same fields."""
