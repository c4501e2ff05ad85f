"""The messages between the front end and the engine-core process, as frozen dataclasses.

They cross a `multiprocessing` connection pickled whole, so a field added to
`StepOutput`, `SamplingParams` or `EngineStats` travels with no code here
(pickle over a pipe was measured against ZeroMQ + msgpack:
docs/lab/14-the-engine-in-its-own-process.md).
Front end -> engine: `SubmitRequests`, `AbortRequests`, `PauseRequests`, `UtilityCall`, `Stop`.
Engine -> front end: `EngineReady` once, then `Admitted`, `UtilityResult` and one
`StepBatch` per step (and after commands), or `EngineFailed` as its last word.
"""

from __future__ import annotations

from dataclasses import dataclass

from carpool.engine.commands import AbortRequests, EngineSnapshot, PauseRequests, Stop
from carpool.engine.output_stream import GenerationRequest
from carpool.outputs import StepOutput

__all__ = ["AbortRequests", "Admitted", "EngineFailed", "EngineReady", "PauseRequests",
           "StepBatch", "Stop", "SubmitRequests", "UtilityCall", "UtilityResult"]


@dataclass(frozen=True)
class SubmitRequests:
    """Admit these requests together (all or none); the engine answers `Admitted(batch_id)`.
    Prompts are token ids: the front end tokenizes."""

    batch_id: int
    requests: tuple[GenerationRequest, ...]
    arrival_time: float  # time.monotonic() in the front end (one clock per machine)


@dataclass(frozen=True)
class UtilityCall:
    """Run `engine.utility.UTILITIES[name]` between two steps; answered by `UtilityResult`."""

    call_id: int
    name: str
    args: tuple = ()  # after the engine, e.g. remove_lora's adapter id


@dataclass(frozen=True)
class EngineReady:
    """The model is loaded and the KV cache sized: what the front end may know of the engine."""

    model_path: str  # where the front end loads its own tokenizer from
    served_model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    kv_cache_info: dict
    sampling_defaults: dict
    snapshot: EngineSnapshot
    quantization: str | None = None  # the weights' format and types; None: float weights


@dataclass(frozen=True)
class Admitted:
    batch_id: int
    error: Exception | None  # the engine's refusal (a ValueError names the field), or None


@dataclass(frozen=True)
class UtilityResult:
    call_id: int
    result: object
    error: Exception | None


@dataclass(frozen=True)
class StepBatch:
    """One step's outputs (token-id deltas, finishes, request metrics) and the stats after it."""

    outputs: list[StepOutput]
    snapshot: EngineSnapshot
    time: float  # time.monotonic() when the step ended


@dataclass(frozen=True)
class EngineFailed:
    """The engine could not load or its step loop died; the process exits after sending this."""

    message: str
