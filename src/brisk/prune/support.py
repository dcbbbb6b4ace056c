"""Which models each pruning method handles, declared per method and checked before any calibration work.

`brisk prune` asks this table, never a list of its own (as `brisk quantize` asks quant/support.py):

    method      dense (llama mistral qwen2 qwen3 phi3 gemma3)   MoE (mixtral qwen2_moe qwen3_moe)
    magnitude   every decoder linear, N:M too                   + every expert's and the shared expert's linears
    wanda       every decoder linear, N:M too                   + experts: ||X_j|| over the tokens routed to each
    sparsegpt   every decoder linear, N:M too, --bits too       + experts: a Hessian per expert from its tokens
    structured  head groups, MLP channels, layers               refused (experts have widths of their own)

The router (`mlp.gate`) and qwen2_moe's shared-expert gate are never pruned: they are not linears of the decoder's
matmuls but the routing itself, and a few zeroed logits would send tokens to other experts. An expert that no
calibration token reached has no statistics: wanda and sparsegpt prune it by magnitude and the checkpoint records
how many there were (`experts_by_magnitude`).
"""

from __future__ import annotations

from dataclasses import dataclass

from brisk.model.config import MOE_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig
from brisk.prune.masks import PruneConfigError

DENSE_ARCHITECTURES = tuple(a for a in SUPPORTED_ARCHITECTURES if a not in MOE_ARCHITECTURES)


@dataclass(frozen=True)
class PruneSupport:
    """What one method handles: `architectures` (brisk's names), whether it takes an N:M pattern, and why the
    other architectures are out (said when one is refused)."""

    method: str
    architectures: tuple[str, ...]
    nm: bool = True  # takes --pattern N:M
    limit: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.architectures) - set(SUPPORTED_ARCHITECTURES)
        assert not unknown, f"{self.method}: unknown architectures {sorted(unknown)}"

    def handles(self, architecture: str) -> bool:
        return architecture in self.architectures

    def refusal(self, config: ModelConfig) -> str | None:
        """None if the method handles `config`'s model, else the message saying why not and what does."""
        arch = config.architecture
        if arch in self.architectures:
            return None
        others = [m for m, s in SUPPORT.items() if m != self.method and s.handles(arch)]
        why = f"--method {self.method} does not handle architecture {arch}" + (f": {self.limit}" if self.limit
                                                                               else "")
        return why + (f"; use --method {' or '.join(others)}" if others else "")


SUPPORT: dict[str, PruneSupport] = {
    "magnitude": PruneSupport("magnitude", SUPPORTED_ARCHITECTURES),
    "wanda": PruneSupport("wanda", SUPPORTED_ARCHITECTURES),
    "sparsegpt": PruneSupport("sparsegpt", SUPPORTED_ARCHITECTURES),
    "structured": PruneSupport(
        "structured", DENSE_ARCHITECTURES, nm=False,
        limit="structured pruning removes the same MLP channels from one dense MLP per layer; a mixture-of-experts "
              "layer has routed experts (and a router) whose widths it does not cut"),
}


def prune_support(method: str) -> PruneSupport:
    """The declared support of `method`."""
    if method not in SUPPORT:
        raise PruneConfigError(f"unknown pruning method {method!r}; expected one of {', '.join(SUPPORT)}")
    return SUPPORT[method]


def check_prune_supports(method: str, config: ModelConfig) -> None:
    """Raise PruneConfigError with the reason (and the methods that would do) unless `method` handles the model."""
    message = prune_support(method).refusal(config)
    if message is not None:
        raise PruneConfigError(message)
