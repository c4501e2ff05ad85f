"""carpool: an LLM inference server built around continuous batching."""

__version__ = "0.1.0"

from carpool.sampling_params import SamplingParams  # noqa: E402

__all__ = ["SamplingParams", "__version__"]
