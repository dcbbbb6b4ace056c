"""Evaluation: perplexity on a text (`ppl`) and the size of a checkpoint by tensor kind (`size`)."""

from brisk.eval.ppl import PerplexityResult, perplexity, sequence_logits
from brisk.eval.size import SizeReport, model_size

__all__ = ["PerplexityResult", "SizeReport", "model_size", "perplexity", "sequence_logits"]
