"""In-process benchmarks: the same requests through each scheduler variant, step by step.

The engine is driven directly (`LLMEngine.step()` in a loop) rather than through
`LLM.generate`, so every request's output deltas are timestamped as they come
(TTFT, ITL, E2E) and every step's prefill / decode token counts are kept for
the plots. Requests with an arrival time are added once the clock reaches it,
so long prompts can land in the middle of running decodes.

Variants, compared one after another on identical requests:
  static           request-level batching, the baseline
  continuous       continuous batching, prompts prefilled whole
  chunked          continuous batching with chunked prefill (one partial prefill at a time)
  chunked-partial  chunked prefill with several partial prefills, at most one long
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from carpool.bench.stats import RequestResult
from carpool.bench.workloads import BenchRequest

VARIANTS: dict[str, dict] = {
    "static": dict(scheduler="static", enable_chunked_prefill=False),
    "continuous": dict(scheduler="continuous", enable_chunked_prefill=False),
    "chunked": dict(scheduler="continuous", enable_chunked_prefill=True,
                    max_num_partial_prefills=1, max_long_partial_prefills=1),
    "chunked-partial": dict(scheduler="continuous", enable_chunked_prefill=True,
                            max_num_partial_prefills=4, max_long_partial_prefills=1),
}
DEFAULT_COMPARE = ("static", "continuous", "chunked")


@dataclass(frozen=True)
class StepRecord:
    start: float  # engine clock (time.monotonic)
    end: float
    num_prefill_tokens: int
    num_decode_tokens: int


@dataclass
class OfflineRun:
    """One variant's run: per-request results (workload order) and per-step records."""

    variant: str
    results: list[RequestResult]
    steps: list[StepRecord]
    duration_s: float
    # Engine-clock time each request was first scheduled (from its finishing output's metrics).
    first_scheduled: list[float | None] = field(default_factory=list)


def engine_kwargs(variant: str, common: dict, max_model_len: int) -> dict:
    """`LLM(...)` keyword arguments for `variant` on top of the shared settings.

    Without chunked prefill a prompt must fit one step whole, so the step budget
    is raised to `max_model_len` there, as vLLM does.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    kwargs = {**common, "max_model_len": max_model_len}
    for key, value in VARIANTS[variant].items():
        if key in ("max_num_partial_prefills", "max_long_partial_prefills") and key in common:
            continue  # an explicit setting wins over the variant's default
        kwargs[key] = value
    if not kwargs["enable_chunked_prefill"]:
        kwargs["max_num_batched_tokens"] = max(kwargs.get("max_num_batched_tokens") or 0, max_model_len)
        for key in ("max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold"):
            kwargs.pop(key, None)
    if kwargs.get("max_long_partial_prefills", 1) > kwargs.get("max_num_partial_prefills", 1):
        kwargs["max_long_partial_prefills"] = kwargs["max_num_partial_prefills"]
    return kwargs


def build_engine(model: str, kwargs: dict):
    """A fresh engine for one variant, warmed up by one short request."""
    from carpool.llm import LLM
    from carpool.sampling_params import SamplingParams

    llm = LLM(model=model, **kwargs)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2, temperature=0.0),
                 use_tqdm=False)
    return llm.engine


def drive(engine, requests: list[BenchRequest], variant: str) -> OfflineRun:
    """Run `requests` to completion on `engine`, timestamping every output delta."""
    from carpool.sampling_params import SamplingParams

    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time or 0.0)
    results: dict[int, RequestResult] = {}
    first_scheduled: dict[int, float | None] = {}
    steps: list[StepRecord] = []
    start = time.monotonic()
    next_index = 0
    while next_index < len(order) or engine.has_unfinished_requests():
        now = time.monotonic()
        while next_index < len(order) and start + (requests[order[next_index]].arrival_time or 0.0) <= now:
            i = order[next_index]
            params = SamplingParams(max_tokens=requests[i].max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(_request_id(i), list(requests[i].prompt_token_ids), params)
            results[i] = RequestResult(start_time=now, num_prompt_tokens=len(requests[i].prompt_token_ids))
            next_index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + (requests[order[next_index]].arrival_time or 0.0) - time.monotonic()))
            continue
        step_start = time.monotonic()
        outputs = engine.step()
        step_end = time.monotonic()
        stats = engine.stats()
        steps.append(StepRecord(step_start, step_end, stats["last_step_num_prefill_tokens"],
                                stats["last_step_num_decode_tokens"]))
        for out in outputs:
            _record(results, out, step_end, first_scheduled)
    duration = time.monotonic() - start
    ordered = [results[i] for i in range(len(requests))]
    return OfflineRun(variant, ordered, steps, duration,
                      [first_scheduled.get(i) for i in range(len(requests))])


def _request_id(index: int) -> str:
    return f"bench-{index}"


def _record(results: dict[int, RequestResult], out, now: float,
            first_scheduled: dict[int, float | None]) -> None:
    index = int(out.request_id.removeprefix("bench-"))
    result = results[index]
    if out.new_token_ids:
        result.chunk_times.append(now)
    result.num_output_tokens = out.num_output_tokens
    if out.finished:
        result.end_time = now
        if out.finish_reason in ("abort", "error"):
            result.success, result.error = False, out.error or out.finish_reason
        metrics = out.request_metrics or {}
        first_scheduled[index] = metrics.get("first_scheduled_time")


def run_variant(model: str, requests: list[BenchRequest], variant: str, common: dict,
                max_model_len: int) -> OfflineRun:
    engine = build_engine(model, engine_kwargs(variant, common, max_model_len))
    return drive(engine, requests, variant)
