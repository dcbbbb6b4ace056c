"""Speculative decoding: proposers draft, the target verifies in the engine's ordinary batched step."""

from __future__ import annotations

from typing import TYPE_CHECKING

from brisk.engine.config import SpecConfig
from brisk.engine.extensions import EXTENSIONS
from brisk.spec.speculator import Speculator

if TYPE_CHECKING:
    from brisk.engine.llm_engine import LLMEngine


def build_speculator(config: SpecConfig, engine: LLMEngine) -> Speculator:
    """The proposer that `config.method` names, wrapped for the engine."""
    if config.method == "ngram":
        from brisk.spec.ngram import NgramProposer

        proposer = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
    elif config.method == "medusa":
        from brisk.spec.medusa import build_medusa_proposer

        proposer = build_medusa_proposer(config.model, engine, config.num_speculative_tokens)
    elif config.method == "eagle":
        from brisk.spec.eagle import build_eagle_proposer

        proposer = build_eagle_proposer(config.model, engine, config.num_speculative_tokens)
    elif config.method == "lookahead":
        from brisk.spec.lookahead import LookaheadProposer

        proposer = LookaheadProposer(config.lookahead_ngram_size, config.lookahead_pool_size, engine.config.seed)
    else:
        from brisk.spec.draft_model import build_draft_proposer

        proposer = build_draft_proposer(config, engine)
    return Speculator(proposer, config.num_speculative_tokens, config.adaptive,
                      disable_by_batch_size=config.disable_by_batch_size)


def install() -> None:
    """Give the engine its speculator builder (engine/extensions.py)."""
    EXTENSIONS.speculator = build_speculator
