"""Per-request sampling settings, with vLLM's names and semantics so OpenAI/vLLM clients map onto them 1:1."""

from __future__ import annotations

import copy
import enum
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from brisk.structured.params import StructuredOutputsParams

# Below this temperature sampling is argmax (vLLM's _SAMPLING_EPS): dividing logits by ~0 would only
# overflow, and the limit of softmax(logits / t) as t -> 0 is the argmax anyway.
SAMPLING_EPS = 1e-5

# Largest number of top logprobs a request may ask for per token (vLLM's default max_logprobs, and
# OpenAI's limit for `top_logprobs`).
MAX_LOGPROBS = 20


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2  # random, drawn from the request's own generator so the output is reproducible


@dataclass
class SamplingParams:
    """How to pick each output token of one request and when to stop.

    Disabled values: top_k 0 (or -1), top_p 1.0, min_p 0.0, penalties 0.0 (presence/frequency) and 1.0
    (repetition). `max_tokens=None` means "until EOS or the model's context length".
    `logprobs=k` returns the top-k logprobs of each output token plus the sampled token's (0 = only the
    sampled token's); they are the model's raw log-softmax, before penalties and temperature.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # constrain the output (structured/): a JSON schema, regex, choice list or grammar; guided_decoding is vLLM's
    # older name of the same field
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its older name), not both.")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None:
            from brisk.structured.params import StructuredOutputsParams

            if isinstance(self.structured_outputs, dict):
                self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
            elif not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}.")
        # Normalize first so validation and every consumer see one shape per field.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0  # vLLM accepts both; keep one spelling of "disabled"
        self._verify_args()
        if self.temperature < SAMPLING_EPS:
            # Greedy ignores the truncation settings; resetting them (as vLLM does) lets the sampler
            # skip top-k/top-p/min-p for batches whose only users of them would be greedy rows.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def _verify_args(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        _check_number("temperature", self.temperature)
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled), or at least 1, got {self.top_k}.")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                             f"got {self.min_tokens}.")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must be a string or a list of strings, got an element {s!r}.")
            if not s:
                raise ValueError("stop cannot contain an empty string.")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if t < 0:
                raise ValueError(f"stop_token_ids must be non-negative token ids, got {t}.")

    @classmethod
    def greedy(cls, max_tokens: int | None = 16, **kwargs) -> SamplingParams:
        """Argmax decoding; the usual setting for tests and benchmarks."""
        return cls(temperature=0.0, max_tokens=max_tokens, **kwargs)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """The user's stop token ids. EOS is per model and lives on the Request: see `stop_token_ids_with`."""
        return frozenset(self.stop_token_ids)

    def stop_token_ids_with(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Every token id that ends this request: its stop ids, plus the model's EOS ids unless ignore_eos."""
        if self.ignore_eos:
            return self.all_stop_token_ids
        return self.all_stop_token_ids | frozenset(eos_token_ids)

    def clone(self) -> SamplingParams:
        """A deep copy, so the engine may adjust a request's params without touching the caller's."""
        return copy.deepcopy(self)


def _check_int(name: str, value: object) -> None:
    # bool is an int subclass; `top_k=True` is a caller bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}.")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
