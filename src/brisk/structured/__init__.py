"""Structured outputs: constrain generation to a JSON schema, a regex, a list of choices or a grammar.

params.py holds what a request asks for (vLLM's StructuredOutputsParams), backend.py compiles it once per
constraint with llguidance and keeps each sequence's matcher, runner.py is what the model runner calls each step
(mask the logits, advance the matchers, jump forward over forced tokens).
"""

from brisk.structured.params import GuidedDecodingParams, StructuredOutputError, StructuredOutputsParams

__all__ = ["GuidedDecodingParams", "StructuredOutputError", "StructuredOutputsParams"]
