"""The figures the benchmarks print, computed from hand-made timings."""

from __future__ import annotations

import json

import pytest

from carpool.bench.stats import (RequestResult, format_summary, parse_slo, peak_concurrency,
                                 summarize)


def _result(start, chunks, end, num_out=None, num_prompt=10, success=True):
    return RequestResult(start_time=start, num_prompt_tokens=num_prompt, success=success,
                         num_output_tokens=len(chunks) if num_out is None else num_out,
                         chunk_times=list(chunks), end_time=end)


def test_per_request_latencies():
    r = _result(1.0, [1.5, 1.7, 2.0], 2.0)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2el == pytest.approx(1.0)
    assert r.itls == pytest.approx([0.2, 0.3])
    assert r.tpot == pytest.approx(0.25)  # (1.0 - 0.5) / (3 - 1)
    assert _result(0.0, [0.1], 0.1).tpot is None


def test_summary_totals_and_distributions():
    results = [_result(0.0, [0.1, 0.2], 0.2), _result(0.0, [0.3, 0.5, 0.7], 0.7),
               _result(0.0, [], 0.1, success=False)]
    s = summarize(results, duration_s=2.0)
    assert (s.num_completed, s.num_failed) == (2, 1)
    assert s.total_input_tokens == 20 and s.total_output_tokens == 5
    assert s.output_throughput == pytest.approx(2.5)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.ttft.mean_ms == pytest.approx(200.0)
    assert s.ttft.median_ms == pytest.approx(200.0)
    assert s.itl.mean_ms == pytest.approx(500 / 3)
    assert s.e2el.p99_ms == pytest.approx(200 + 0.99 * 500)
    assert s.goodput is None


def test_goodput_counts_requests_within_every_slo():
    fast = _result(0.0, [0.05, 0.06], 0.06)
    slow_first = _result(0.0, [0.9, 0.91], 0.91)
    slow_tokens = _result(0.0, [0.05, 0.5], 0.5)
    s = summarize([fast, slow_first, slow_tokens], 1.0, parse_slo("ttft=100,tpot=50"))
    assert s.goodput == pytest.approx(1.0)


def test_peak_concurrency_sweeps_starts_and_ends():
    rs = [_result(0, [1], 1), _result(0.5, [2], 2), _result(1.0, [3], 3), _result(2.5, [3], 3)]
    assert peak_concurrency(rs) == 2  # the end at t=1 frees its place before the start at t=1


@pytest.mark.parametrize("text", ["ttft", "foo=1", "ttft=abc", "ttft=-5", ""])
def test_bad_slo_names_the_problem(text):
    with pytest.raises(ValueError, match="--slo"):
        parse_slo(text)


def test_printed_block_and_json():
    s = summarize([_result(0.0, [0.1, 0.2], 0.2)], 1.0, {"ttft": 150.0})
    text = format_summary(s)
    assert "Successful requests:" in text and "P99/P50 E2EL:" in text
    assert "Request goodput (req/s):" in text
    d = json.loads(json.dumps(s.to_dict()))
    assert d["e2el"]["p99_over_p50"] == pytest.approx(1.0)
    assert d["peak_concurrency"] == 1
