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
  chunked-no-prefix-cache  `chunked` with prefix caching off (every variant but static has it on)
  chunked-ngram    `chunked` with n-gram speculative decoding (k = 4, lookup 2..5, the
                   default batch-size gate)
  chunked-draft    `chunked` with a draft model (`--draft-model`, k = 3, the default gate)
"""

from __future__ import annotations

import bisect
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
    "chunked-no-prefix-cache": dict(scheduler="continuous", enable_chunked_prefill=True,
                                    max_num_partial_prefills=1, max_long_partial_prefills=1,
                                    enable_prefix_caching=False),
    "chunked-ngram": dict(scheduler="continuous", enable_chunked_prefill=True,
                          max_num_partial_prefills=1, max_long_partial_prefills=1,
                          speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                              "prompt_lookup_min": 2, "prompt_lookup_max": 5}),
    "chunked-draft": dict(scheduler="continuous", enable_chunked_prefill=True,
                          max_num_partial_prefills=1, max_long_partial_prefills=1,
                          speculative_config={"method": "draft_model",
                                              "num_speculative_tokens": 3}),
}
DEFAULT_COMPARE = ("static", "continuous", "chunked")
CLOCKS = ("wall", "cpu")
MAX_IDLE_STEPS = 1000  # steps in a row that schedule nothing before a run is declared stuck


@dataclass(frozen=True)
class StepRecord:
    start: float  # bench clock
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
    # Per request: the step it was first scheduled in and the step it finished in (inclusive).
    request_steps: list[tuple[int, int]] = field(default_factory=list)
    clock: str = "wall"  # what the seconds are: wall time or CPU time


class BenchClock:
    """The seconds figures are made of: wall time, or this process's CPU time.

    On a machine shared with other jobs, wall time also counts the time the OS
    gave to others, which swamps a 30 ms step. CPU time counts the engine's own
    work only (meaningful when torch runs one thread, OMP_NUM_THREADS=1); idle
    waits for a request's arrival are skipped over instead of slept.
    """

    def __init__(self, kind: str = "wall") -> None:
        if kind not in CLOCKS:
            raise ValueError(f"clock must be one of {CLOCKS}, got {kind!r}")
        self.kind = kind
        self._read = time.monotonic if kind == "wall" else time.process_time
        self._num_skipped_s = 0.0

    def now(self) -> float:
        return self._read() + self._num_skipped_s

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay <= 0:
            return
        if self.kind == "wall":
            time.sleep(delay)
        else:
            self._num_skipped_s += delay


def engine_kwargs(variant: str, common: dict, max_model_len: int) -> dict:
    """`LLM(...)` keyword arguments for `variant` on top of the shared settings.

    Variants without chunked prefill drop the partial-prefill settings and the step
    budget: the engine's default budget then fits the longest prompt in one step.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    kwargs = {**common, "max_model_len": max_model_len}
    draft = kwargs.pop("draft_model", None)
    for key, value in VARIANTS[variant].items():
        if key in ("max_num_partial_prefills", "max_long_partial_prefills") and key in common:
            continue  # an explicit setting wins over the variant's default
        kwargs[key] = value
    spec = kwargs.get("speculative_config")
    if spec is not None and spec["method"] == "draft_model":
        if draft is None:
            raise ValueError(f"variant {variant!r} needs --draft-model (a folder sharing the "
                             "model's tokenizer)")
        kwargs["speculative_config"] = {**spec, "model": draft}
    if not kwargs["enable_chunked_prefill"]:
        for key in ("max_num_batched_tokens", "max_num_partial_prefills",
                    "max_long_partial_prefills", "long_prefill_token_threshold"):
            kwargs.pop(key, None)
    if kwargs.get("max_long_partial_prefills", 1) > kwargs.get("max_num_partial_prefills", 1):
        kwargs["max_long_partial_prefills"] = kwargs["max_num_partial_prefills"]
    return kwargs


def build_engine(model: str, kwargs: dict):
    """A fresh engine for one variant, warmed up by one short request."""
    from carpool.llm import LLM
    from carpool.sampling_params import SamplingParams

    llm = LLM(model=model, **kwargs)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=2,
                                                                      temperature=0.0),
                 use_tqdm=False)
    return llm.engine


def drive(engine, requests: list[BenchRequest], variant: str, clock: BenchClock | None = None,
          show_progress: bool = False) -> OfflineRun:
    """Run `requests` to completion on `engine`, timestamping every output delta."""
    from tqdm import tqdm

    clock = clock or BenchClock()
    progress = tqdm(total=len(requests), desc=variant, disable=not show_progress)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_time or 0.0)
    run = _RunRecorder(len(requests))
    start = clock.now()
    num_added = 0
    while num_added < len(order) or engine.has_unfinished_requests():
        while (num_added < len(order)
               and start + (requests[order[num_added]].arrival_time or 0.0) <= clock.now()):
            _add(engine, order[num_added], requests[order[num_added]], run, clock.now())
            num_added += 1
        if not engine.has_unfinished_requests():
            clock.wait_until(start + (requests[order[num_added]].arrival_time or 0.0))
            continue
        engine_start, step_start = time.monotonic(), clock.now()
        outputs = engine.step()
        stats = engine.stats()
        run.step(engine_start, StepRecord(step_start, clock.now(),
                                          stats.last_step_num_prefill_tokens,
                                          stats.last_step_num_decode_tokens))
        run.check_progress(stats.last_step_num_tokens)
        for out in outputs:
            run.output(out)
            progress.update(out.finished)
    progress.close()
    return run.finish(variant, clock.now() - start, clock.kind)


def _add(engine, index: int, request: BenchRequest, run: _RunRecorder, now: float) -> None:
    from carpool.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(f"bench-{index}", list(request.prompt_token_ids), params,
                       text_at_finish=True)  # as `LLM.generate` adds its requests
    run.results[index] = RequestResult(start_time=now,
                                       num_prompt_tokens=len(request.prompt_token_ids))


class _RunRecorder:
    """Collects one run: results by request index, steps, and which steps each request spanned."""

    def __init__(self, num_requests: int) -> None:
        self.results: dict[int, RequestResult] = {}
        self.steps: list[StepRecord] = []
        self._engine_starts: list[float] = []  # engine clock (time.monotonic), to place metrics
        self._first_scheduled: dict[int, float | None] = {}
        self._last_step: dict[int, int] = {}
        self._num_requests = num_requests
        self._num_idle_steps = 0

    def check_progress(self, num_step_tokens: int) -> None:
        """Raise rather than spin when the engine keeps scheduling nothing with requests left."""
        self._num_idle_steps = 0 if num_step_tokens else self._num_idle_steps + 1
        if self._num_idle_steps > MAX_IDLE_STEPS:
            raise RuntimeError(f"the engine scheduled nothing for {MAX_IDLE_STEPS} steps with "
                               f"{self._num_requests - len(self._last_step)} requests unfinished")

    def step(self, engine_start: float, record: StepRecord) -> None:
        self._engine_starts.append(engine_start)
        self.steps.append(record)

    def output(self, out) -> None:
        index = int(out.request_id.removeprefix("bench-"))
        result = self.results[index]
        now = self.steps[-1].end
        if out.new_token_ids:
            result.chunk_times.append(now)
        result.num_output_tokens = out.num_output_tokens
        if out.finished:
            result.end_time = now
            self._last_step[index] = len(self.steps) - 1
            if out.finish_reason in ("abort", "error"):
                result.success, result.error = False, out.error or out.finish_reason
            metrics = out.request_metrics
            self._first_scheduled[index] = metrics.first_scheduled_time if metrics else None

    def finish(self, variant: str, duration_s: float, clock: str) -> OfflineRun:
        request_steps = []
        for i in range(self._num_requests):
            last = self._last_step[i]
            began = self._first_scheduled.get(i)
            first = last if began is None else max(0, bisect.bisect_right(self._engine_starts,
                                                                          began) - 1)
            request_steps.append((min(first, last), last))
        return OfflineRun(variant, [self.results[i] for i in range(self._num_requests)], self.steps,
                          duration_s, request_steps, clock)


def run_variant(model: str | None, requests: list[BenchRequest], variant: str, common: dict,
                max_model_len: int, clock: str = "wall", show_progress: bool = False) -> OfflineRun:
    engine = build_engine(model, engine_kwargs(variant, common, max_model_len))
    return drive(engine, requests, variant, BenchClock(clock), show_progress)
