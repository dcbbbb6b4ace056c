"""Which models each quantization method handles: a capability every method module declares (`SUPPORT`).

`brisk quantize` asks the method, never a list of its own: a method states the architectures whose decoder layers
it can process and whether it handles the routed experts of a mixture-of-experts layer. Every other combination is
refused before any work starts, with the reason and the methods that do handle the model.

    rtn          every architecture, MoE experts included (each expert's weights are rounded on their own)
    gptq         every dense architecture the calibration driver runs (it hooks the layers' linears)
    llm-int8     the same: outlier columns are found from the linears' inputs, nothing is folded
    awq          dense architectures with Llama-style RMSNorm: its scales are folded into the norm weights
    smoothquant  the same folds as awq
    qat          every architecture (the training forward, train/forward.py, runs them all), MoE experts
                 included: each expert's linears are trained through their own fake-quant
    squeezellm   every dense architecture: its sensitivities are gradients of the LM loss through that forward

The calibrated methods refuse MoE experts: each expert would need the statistics of the tokens routed to it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from brisk.model.config import (
    MOE_ARCHITECTURES,
    NORM_PLUS_ONE_ARCHITECTURES,
    SANDWICH_NORM_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
)

DENSE_ARCHITECTURES = tuple(a for a in SUPPORTED_ARCHITECTURES if a not in MOE_ARCHITECTURES)
# dense architectures whose norms are RMSNorm with a plain weight (x / rms * w) before attention and MLP: where AWQ /
# SmoothQuant fold scales
PLAIN_NORM_ARCHITECTURES = tuple(a for a in DENSE_ARCHITECTURES
                                 if a not in NORM_PLUS_ONE_ARCHITECTURES + SANDWICH_NORM_ARCHITECTURES)

# --method name -> the module that declares its SUPPORT
_METHOD_MODULES = {"rtn": "brisk.quant.rtn", "gptq": "brisk.quant.gptq", "awq": "brisk.quant.awq",
                   "qat": "brisk.quant.qat", "smoothquant": "brisk.quant.smoothquant",
                   "llm-int8": "brisk.quant.llm_int8", "squeezellm": "brisk.quant.squeezellm"}


@dataclass(frozen=True)
class MethodSupport:
    """What one method handles: `architectures` (brisk's names) and whether MoE experts are among them."""

    method: str
    architectures: tuple[str, ...]
    moe_experts: bool = False  # True: the routed experts of MoE layers are quantized too
    limit: str = ""  # why the other architectures are out, said when one is refused

    def __post_init__(self) -> None:
        unknown = set(self.architectures) - set(SUPPORTED_ARCHITECTURES)
        assert not unknown, f"{self.method}: unknown architectures {sorted(unknown)}"
        has_moe = any(a in MOE_ARCHITECTURES for a in self.architectures)
        assert has_moe == self.moe_experts, f"{self.method}: MoE architectures listed iff moe_experts"

    def refusal(self, config: ModelConfig) -> str | None:
        """None if the method handles `config`'s model, else the message saying why not and what does."""
        arch = config.architecture
        if arch in self.architectures:
            return None
        others = [m for m in _METHOD_MODULES if m != self.method and method_support(m).handles(arch)]
        if arch in MOE_ARCHITECTURES:
            why = (f"--method {self.method} does not quantize the routed experts of a mixture-of-experts model "
                   f"({arch}): a calibrated method would need each expert's statistics from the tokens routed to it")
        else:
            why = f"--method {self.method} does not handle architecture {arch}" + (f": {self.limit}" if self.limit
                                                                                   else "")
        return why + (f"; use --method {' or '.join(others)}" if others else "")

    def handles(self, architecture: str) -> bool:
        return architecture in self.architectures


def method_support(method: str) -> MethodSupport:
    """The SUPPORT that `method`'s module declares."""
    if method not in _METHOD_MODULES:
        raise ValueError(f"unknown quantization method {method!r}; expected one of {', '.join(_METHOD_MODULES)}")
    support = importlib.import_module(_METHOD_MODULES[method]).SUPPORT
    assert isinstance(support, MethodSupport) and support.method == method, f"{method}: bad SUPPORT declaration"
    return support


def check_method_supports(method: str, config: ModelConfig) -> None:
    """Raise ValueError with the reason (and the methods that would do) unless `method` handles the model."""
    message = method_support(method).refusal(config)
    if message is not None:
        raise ValueError(message)
