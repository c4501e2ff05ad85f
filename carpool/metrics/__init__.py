"""Prometheus metrics under vLLM's names (prefix `carpool:`), and the periodic log line:
`server` holds the engine-wide series, `features` those of optional features, `families`
the registry the replicas of a data-parallel server share."""

from carpool.metrics.families import MetricFamilies
from carpool.metrics.server import FinishedRequestStats, ServerMetrics, buckets_1_2_5

__all__ = ["FinishedRequestStats", "MetricFamilies", "ServerMetrics", "buckets_1_2_5"]
