"""brisk: an LLM inference engine in which every acceleration technique is a setting."""

from brisk import parallel, spec
from brisk.engine.outputs import CompletionOutput, RequestOutput
from brisk.engine.sampling_params import SamplingParams
from brisk.lora.request import LoRARequest
from brisk.structured.params import GuidedDecodingParams, StructuredOutputsParams

# parallel and speculative engines: their runners and speculators, installed where the engine looks them up
parallel.install()
spec.install()

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams",
           "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name: str):  # noqa: ANN202 - lazy import keeps `import brisk` light
    if name == "LLM":
        from brisk.engine.llm import LLM

        return LLM
    raise AttributeError(name)
