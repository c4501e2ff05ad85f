"""Schemathesis against the server's own OpenAPI schema: no input makes it fail.

Positive and negative cases are generated from /openapi.json for both
generation routes and /tokenize, /detokenize, and sent to a live server over
loopback. Every response must be below 500, every rejection must carry
OpenAI's error body, and afterwards the server must be healthy with every KV
block free. `CARPOOL_FUZZ_CASES` sets the number of cases (default 200 for CI;
the recorded full run uses 1000).
"""

from __future__ import annotations

import pytest

import json
import os

import hypothesis
import schemathesis
from hypothesis import HealthCheck, Phase, strategies as st
from schemathesis import GenerationMode

from tests.reliability.live import AUTH, wait_idle_and_intact

pytestmark = pytest.mark.slow  # a live server (still run in CI)

FUZZED = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
          ("/tokenize", "POST"), ("/detokenize", "POST")]
ERROR_FIELDS = {"message", "type", "param", "code"}


def num_cases() -> int:
    return int(os.environ.get("CARPOOL_FUZZ_CASES", "200"))


def check_response(case, response) -> None:
    where = f"{case.method} {case.path} body={case.body!r:.300}"
    assert response.status_code < 500, f"{response.status_code} for {where}: {response.text[:500]}"
    if response.status_code >= 400:
        body = json.loads(response.text)
        assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, (where, body)
        assert body["error"]["message"], (where, body)


def fuzz_operation(operation, max_examples: int, seen: list) -> None:
    strategy = st.one_of(operation.as_strategy(generation_mode=GenerationMode.POSITIVE),
                         operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))

    @hypothesis.given(case=strategy)
    @hypothesis.settings(max_examples=max_examples, deadline=None, database=None,
                         derandomize=True, phases=[Phase.generate],
                         suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        response = case.call(headers=AUTH, timeout=60)
        seen.append(response.status_code)
        check_response(case, response)

    run()


def test_fuzzed_requests_never_fail_the_server(edge_server):
    schema = schemathesis.openapi.from_url(f"{edge_server.base_url}/openapi.json", headers=AUTH)
    total = num_cases()
    statuses: list[int] = []
    for path, method in FUZZED:
        fuzz_operation(schema[path][method], max(1, total // len(FUZZED)), statuses)
    summary = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(f"\nfuzz: {len(statuses)} cases over {len(FUZZED)} routes, statuses {summary}")
    assert len(statuses) >= 0.9 * total, summary
    assert any(s == 200 for s in statuses) and any(s == 400 for s in statuses), summary
    with edge_server.http() as http:
        assert http.get("/health").status_code == 200
    wait_idle_and_intact(edge_server)
