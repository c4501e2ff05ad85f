"""carpool: an LLM inference server built around continuous batching."""

__version__ = "0.1.0"

from carpool.lora_request import LoRARequest
from carpool.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str):
    # `LLM` is imported on first use, so `carpool simulate` and the CLI stay light.
    if name == "LLM":
        from carpool.llm import LLM
        return LLM
    raise AttributeError(f"module 'carpool' has no attribute {name!r}")
