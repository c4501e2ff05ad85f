"""Prometheus metrics under vLLM's names (prefix `carpool:`), and the periodic log line.

Gauges are set from the stats snapshot the engine loop publishes after every
step; counters and histograms are recorded on the loop thread from each step's
outputs. Each `ServerMetrics` has its own registry, so several servers can live
in one process (tests) without clashing.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from carpool.outputs import EngineStats, StepOutput

logger = logging.getLogger("carpool.metrics")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_PREEMPTION_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)


class ServerMetrics:
    """The server's metrics for one served model; see the module docstring."""

    def __init__(self, model_name: str, log_interval_s: float = 5.0) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"model_name": model_name}
        self._log_interval_s = log_interval_s
        gauge = self._make(Gauge)
        counter = self._make(Counter)
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests waiting to be scheduled.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc",
                                    "Fraction of KV cache blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted (KV blocks freed).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (first admissions).")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Of those, tokens found cached (not re-lookups after preemption).")
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached",
            "Prompt tokens of started requests served from the prefix cache.")
        self.request_success = Counter(
            "carpool:request_success", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        histogram = self._make(Histogram)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.",
                              buckets=_LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=_LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                             buckets=_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    buckets=_LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per step.",
                                          buckets=_TOKEN_BUCKETS)
        self.request_preemptions = histogram("request_num_preemptions",
                                             "Times each finished request was preempted.",
                                             buckets=_PREEMPTION_BUCKETS)
        self._last_token_time: dict[str, float] = {}
        self._num_preemptions_seen = 0
        self._num_steps_seen = 0
        self._totals = {"prompt": 0, "generation": 0}
        self._prefix_cache_queries_seen = 0
        self._prefix_cache_hits_seen = 0
        self._prefix_cache_logged = (0, 0)  # (queries, hits) at the last log line
        self._last_log: tuple[float, int, int] | None = None

    def _make(self, kind):
        def make(name: str, documentation: str, **kwargs):
            metric = kind(f"carpool:{name}", documentation, ["model_name"],
                          registry=self.registry, **kwargs)
            return metric.labels(**self._labels)
        return make

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def update_gauges(self, stats: EngineStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)

    def record_step(self, outputs: list[StepOutput], stats: EngineStats, now: float) -> None:
        """Counters and histograms for one engine step (loop thread), then maybe the log line."""
        num_steps = stats.num_steps
        if num_steps > self._num_steps_seen:  # the model ran (not only abort notices)
            self.iteration_tokens.observe(stats.last_step_num_tokens)
        self._num_steps_seen = num_steps
        self._num_preemptions_seen = _advance(self.num_preemptions, self._num_preemptions_seen,
                                              stats.num_preemptions)
        self._prefix_cache_queries_seen = _advance(
            self.prefix_cache_queries, self._prefix_cache_queries_seen, stats.prefix_cache_queries)
        self._prefix_cache_hits_seen = _advance(
            self.prefix_cache_hits, self._prefix_cache_hits_seen, stats.prefix_cache_hits)
        num_prompt_tokens = num_generation_tokens = num_cached_tokens = 0
        for out in outputs:
            if out.new_token_ids:
                previous = self._last_token_time.get(out.request_id)
                if previous is None:  # its first token: the prompt has been processed
                    num_prompt_tokens += out.num_prompt_tokens
                    num_cached_tokens += out.num_cached_tokens
                else:
                    self.itl.observe(now - previous)
                self._last_token_time[out.request_id] = now
                num_generation_tokens += len(out.new_token_ids)
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
                self._record_finished(out)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generation_tokens)
        self.prompt_tokens_cached.inc(num_cached_tokens)
        self._totals["prompt"] += num_prompt_tokens
        self._totals["generation"] += num_generation_tokens
        self._maybe_log(stats, now)

    def _record_finished(self, out: StepOutput) -> None:
        self.request_success.labels(finished_reason=out.finish_reason, **self._labels).inc()
        m = out.request_metrics
        if m is None:
            return
        for histogram, end in ((self.ttft, m.first_token_time), (self.e2e, m.finished_time),
                               (self.queue_time, m.first_scheduled_time)):
            if end is not None:
                histogram.observe(max(0.0, end - m.arrival_time))
        self.request_preemptions.observe(m.num_preemptions)

    def _maybe_log(self, stats: EngineStats, now: float) -> None:
        window = self._last_log
        if window is None or now - window[0] > 2 * self._log_interval_s:
            # first step, or first after an idle spell: start a fresh window
            self._last_log = (now, self._totals["prompt"], self._totals["generation"])
            return
        since, prompt_seen, generation_seen = window
        elapsed = now - since
        if elapsed < self._log_interval_s:
            return
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        num_queries = queries - self._prefix_cache_logged[0]
        hit_rate = (hits - self._prefix_cache_logged[1]) / num_queries if num_queries else 0.0
        self._prefix_cache_logged = (queries, hits)
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Preemptions: %d, "
            "Prefix cache hit rate: %.1f%%",
            (self._totals["prompt"] - prompt_seen) / elapsed,
            (self._totals["generation"] - generation_seen) / elapsed,
            stats.num_running, stats.num_waiting, 100.0 * stats.kv_cache_usage,
            stats.num_preemptions, 100.0 * hit_rate)
        self._last_log = (now, self._totals["prompt"], self._totals["generation"])


def _advance(counter, seen: int, total: int) -> int:
    """Add to `counter` what the engine's running `total` gained since `seen`; the new seen."""
    if total > seen:
        counter.inc(total - seen)
    return total
