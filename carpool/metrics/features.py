"""The metrics of optional features, each recorded only when its feature is on:
speculative decoding's acceptance counters and LoRA's per-adapter gauges."""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge

from carpool.metrics.families import MetricFamilies, advance
from carpool.outputs import EngineStats


class SpecDecodeMetrics:
    """vLLM's spec_decode_* counters (carpool: prefix), fed from `EngineStats`' running totals,
    and the acceptance figures of the periodic log line since the last one."""

    def __init__(self, counter, families: MetricFamilies, labels: dict) -> None:
        self._labels = labels
        self.num_drafts = counter("spec_decode_num_drafts", "Draft proposals verified.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted.")
        self.per_pos = families.get(Counter, "carpool:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted, by position in the draft (0: first).",
                                    [*labels, "position"])
        self._seen = (0, 0, 0)  # drafts, draft tokens, accepted tokens
        self._seen_per_pos: list[int] = []
        self._logged = (0, 0, 0)

    def record(self, stats: EngineStats) -> None:
        totals = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                  stats.spec_decode_num_accepted_tokens)
        self._seen = tuple(advance(counter, seen, total) for counter, seen, total in zip(
            (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens), self._seen,
            totals))
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        seen = self._seen_per_pos
        seen.extend([0] * (len(per_pos) - len(seen)))
        for position, total in enumerate(per_pos):
            if total > seen[position]:
                self.per_pos.labels(**self._labels, position=str(position)).inc(
                    total - seen[position])
                seen[position] = total

    def log_part(self, stats: EngineStats) -> str:
        """", Draft acceptance rate: ..., Mean acceptance length: ..." over the drafts since
        the last call ("" when none)."""
        drafts, draft_tokens, accepted = (
            now - then for now, then in zip((stats.spec_decode_num_drafts,
                                             stats.spec_decode_num_draft_tokens,
                                             stats.spec_decode_num_accepted_tokens), self._logged))
        self._logged = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                        stats.spec_decode_num_accepted_tokens)
        if not drafts:
            return ""
        # vLLM's mean acceptance length: tokens a verify step emits, its own token included
        return (f", Draft acceptance rate: {100.0 * accepted / draft_tokens:.1f}%, "
                f"Mean acceptance length: {1 + accepted / drafts:.2f}")
class LoraMetrics:
    """LoRA adapters (with enable_lora): vLLM's `lora_requests_info` (labels: the running
    and waiting adapters' names, comma-separated, and max_lora; value: when it was set),
    requests per adapter, and adapter loads and evictions."""

    def __init__(self, families: MetricFamilies, labels: dict) -> None:
        self._labels = labels
        self._info = families.get(
            Gauge, "carpool:lora_requests_info", "Running and waiting LoRA adapters (labels; "
            "value: when set).", [*labels, "running_lora_adapters", "waiting_lora_adapters",
                                  "max_lora"])
        self._running = families.get(Gauge, "carpool:lora_num_requests_running",
                                     "Running requests per LoRA adapter.", [*labels, "lora_name"])
        self._waiting = families.get(Gauge, "carpool:lora_num_requests_waiting",
                                     "Waiting requests per LoRA adapter.", [*labels, "lora_name"])
        self._loads = families.get(Counter, "carpool:lora_adapter_loads",
                                   "LoRA adapters read from disk.", list(labels)).labels(**labels)
        self._evictions = families.get(Counter, "carpool:lora_adapter_evictions",
                                       "LoRA adapters dropped from memory (LRU or unloaded).",
                                       list(labels)).labels(**labels)
        self._info_labels: dict | None = None
        self._named: set[str] = set()
        self._seen = (0, 0)

    def update(self, stats: EngineStats) -> None:
        labels = {**self._labels, "running_lora_adapters": ",".join(sorted(stats.lora_running)),
                  "waiting_lora_adapters": ",".join(sorted(stats.lora_waiting)),
                  "max_lora": str(stats.max_lora)}
        if labels != self._info_labels:  # one series at a time, not one per combination
            if self._info_labels is not None:
                self._info.remove(*self._info_labels.values())
            self._info_labels = labels
        self._info.labels(**labels).set(time.time())
        names = set(stats.lora_running) | set(stats.lora_waiting) | self._named
        for name in names:
            self._running.labels(**self._labels, lora_name=name).set(
                stats.lora_running.get(name, 0))
            self._waiting.labels(**self._labels, lora_name=name).set(
                stats.lora_waiting.get(name, 0))
        self._named = names
        self._seen = (advance(self._loads, self._seen[0], stats.lora_loads),
                      advance(self._evictions, self._seen[1], stats.lora_evictions))
