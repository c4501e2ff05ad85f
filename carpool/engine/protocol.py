"""What the async layer needs from the engine it drives: `LLMEngine` is one, test fakes another.

The loop thread reads these once the engine is loaded (to build `EngineInfo`)
and then only calls the methods, between steps, on that one thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from carpool.outputs import EngineStats, StepOutput
from carpool.sampling_params import SamplingParams


class EngineCore(Protocol):
    served_model_name: str
    max_model_len: int
    tokenizer: Any
    sampling_defaults: dict

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def kv_cache_info(self) -> dict: ...

    def add_request(self, request_id: str, prompt: str | list[int],
                    sampling_params: SamplingParams,
                    arrival_time: float | None = None,
                    cache_salt: str | None = None) -> int: ...

    def abort_request(self, request_ids: str | Iterable[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[StepOutput]: ...

    def stats(self) -> EngineStats: ...

    def reset_prefix_cache(self) -> int: ...
