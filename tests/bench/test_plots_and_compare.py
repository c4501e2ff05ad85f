"""Slot lanes, the comparison table and the engine settings of each variant."""

from __future__ import annotations

import pytest

from carpool.bench.compare import format_comparison, ratio_spreads
from carpool.bench.offline import OfflineRun, StepRecord, engine_kwargs
from carpool.bench.plots import save_comparison_plot, slot_spans
from carpool.bench.stats import RequestResult, summarize


def _run(spans: list[tuple[int, int]], num_steps: int, variant: str = "v") -> OfflineRun:
    """A run whose request i is first scheduled in step spans[i][0] and ends in step spans[i][1]."""
    steps = [StepRecord(float(k), k + 0.5, 4 if k == 0 else 0, 2) for k in range(num_steps)]
    results = [RequestResult(start_time=0.0, num_prompt_tokens=4, num_output_tokens=last - first + 1,
                             chunk_times=[k + 0.5 for k in range(first, last + 1)], end_time=last + 0.5)
               for first, last in spans]
    return OfflineRun(variant, results, steps, num_steps * 0.5, list(spans))


def test_static_batch_leaves_lanes_idle_until_the_batch_ends():
    # batch 1: requests 0,1 (steps 0-1 and 0-5); batch 2 starts at step 6 on both lanes
    spans = slot_spans(_run([(0, 1), (0, 5), (6, 8), (6, 7)], 9))
    by_request = {s.request_index: s for s in spans}
    assert {s.lane for s in spans} == {0, 1}
    assert by_request[0].lane != by_request[1].lane
    assert (by_request[2].first_step, by_request[2].last_step) == (6, 8)


def test_continuous_reuses_a_lane_the_step_after_it_frees():
    spans = slot_spans(_run([(0, 1), (0, 5), (2, 4)], 6))
    by_request = {s.request_index: s for s in spans}
    assert by_request[2].lane == by_request[0].lane
    assert max(s.lane for s in spans) == 1


def test_plot_is_written(tmp_path):
    path = tmp_path / "p.png"
    save_comparison_plot(str(path), [_run([(0, 1), (0, 5)], 6, "static"), _run([(0, 1), (2, 3)], 4, "c")])
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_ratios_are_taken_within_a_round():
    def summary(rate):
        r = RequestResult(0.0, 1, num_output_tokens=int(rate), chunk_times=[0.5, 1.0], end_time=1.0)
        return summarize([r], 1.0)

    rounds = [{"static": summary(10), "continuous": summary(20)},
              {"static": summary(5), "continuous": summary(15)}]
    spread = ratio_spreads(rounds, "static")["continuous"]["out tok/s"]
    assert (spread.low, spread.median, spread.high) == (2.0, 2.5, 3.0)
    text = format_comparison(rounds, "static")
    assert "continuous" in text and "x2.50 [2.00-3.00]" in text


def test_variant_settings():
    common = {"max_num_seqs": 8, "max_num_batched_tokens": 128}
    unchunked = engine_kwargs("continuous", common, max_model_len=512)
    # without chunked prefill the engine's default budget (>= max_model_len) applies
    assert "max_num_batched_tokens" not in unchunked and not unchunked["enable_chunked_prefill"]
    chunked = engine_kwargs("chunked", common, max_model_len=512)
    assert chunked["max_num_batched_tokens"] == 128 and chunked["enable_chunked_prefill"]
    assert engine_kwargs("static", common, 512)["scheduler"] == "static"
    explicit = engine_kwargs("chunked-partial", {**common, "max_num_partial_prefills": 2}, 512)
    assert explicit["max_num_partial_prefills"] == 2
    with pytest.raises(ValueError, match="variant"):
        engine_kwargs("fast", common, 512)


def test_cpu_clock_skips_idle_waits_instead_of_sleeping():
    import time

    from carpool.bench.offline import BenchClock

    clock = BenchClock("cpu")
    before_wall, before = time.monotonic(), clock.now()
    clock.wait_until(before + 5.0)
    assert clock.now() >= before + 5.0
    assert time.monotonic() - before_wall < 1.0
    with pytest.raises(ValueError, match="clock"):
        BenchClock("sundial")
