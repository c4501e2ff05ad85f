"""A registry's metric families, shared by the replicas that record into it, and the step
that turns the engine's running totals into counter increments."""

from __future__ import annotations

from prometheus_client import CollectorRegistry


class MetricFamilies:
    """One registry's metric families, created on first use and shared by the `ServerMetrics`
    of every replica that records into it (each under its own `engine` label)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._families: dict[str, object] = {}

    def get(self, kind, name: str, documentation: str, labelnames: list[str], **kwargs):
        """The family `name`, made now if this registry has none yet."""
        family = self._families.get(name)
        if family is None:
            family = kind(name, documentation, labelnames, registry=self.registry, **kwargs)
            self._families[name] = family
        return family


def advance(counter, seen: int, total: int) -> int:
    """Add to `counter` what the engine's running `total` gained since `seen`; the new seen."""
    if total > seen:
        counter.inc(total - seen)
    return total
