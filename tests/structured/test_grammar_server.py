"""The issue's hostile grammars against a live `carpool serve` (hardening issue 64, items 1-2).

With the limits on (the defaults; alternatives at 10,000) each is a 400 naming the field,
the limit and its flag, and the server serves the next request. With the limits lifted, the
grammars reach llguidance: the rule chain that overflows its stack costs the checker
process only, and a check that takes seconds runs off the event loop (/health answers
meanwhile) until its time budget ends it.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from carpool.bench.local_server import LocalServer
from carpool.default_model_path import default_model_path
from tests.structured.conftest import FLAGS, MODEL
from tests.structured.test_grammar_limits import gbnf_alternation, rule_chain

pytestmark = pytest.mark.slow  # a live server (still run in CI)

CHAIN = {"model": MODEL, "prompt": "x", "max_tokens": 4,
         "structured_outputs": {"grammar": rule_chain(3000)}}
CHOICES = [f"choice number {i} of many" for i in range(100_000)]


def _error(response: httpx.Response, param: str, *words: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in (*words, param):
        assert word in error["message"], error["message"]
    for leak in ("panic", "backtrace", "/tmp/", ".rs:"):
        assert leak not in error["message"], error["message"]
    return error["message"]


def _serves(http: httpx.Client) -> None:
    """The server is up and generates, constrained, after what came before."""
    out = http.post("/v1/completions", json={
        "model": MODEL, "prompt": "x", "max_tokens": 4, "guided_choice": ["yes", "no"]})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] in ("yes", "no")


def test_over_limit_grammars_are_400s_naming_field_and_flag(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as http:
        _error(http.post("/v1/completions", json=CHAIN), "structured_outputs",
               "3002 rules", "--max-grammar-rules")
        _serves(http)
        _error(http.post("/v1/completions", json={
            "model": MODEL, "prompt": "x", "max_tokens": 4, "guided_choice": CHOICES}),
            "guided_choice", "100000 choices", "--max-grammar-alternatives")
        gbnf = gbnf_alternation(60_000)
        assert len(gbnf) > 640_000
        _error(http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "guided_grammar": gbnf}), "guided_grammar", "--max-grammar-bytes")
        schema = {"type": "object", "properties": {"a": {"enum": list(range(20_000))}}}
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        _error(http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "tools": tools, "tool_choice": "required"}), "tools", "--max-grammar-alternatives")
        _serves(http)


@pytest.fixture(scope="module")
def unbounded(tmp_path_factory):
    """(base url, pid) of a server whose limits let the issue's grammars reach llguidance."""
    log = tmp_path_factory.mktemp("unbounded-grammar-server") / "server.log"
    flags = [*FLAGS, "--max-grammar-rules", "1000000", "--max-grammar-bytes", "64MiB",
             "--max-grammar-alternatives", "1000000", "--grammar-check-timeout", "3"]
    server = LocalServer(default_model_path(), flags, log)
    with server as url:
        yield url, server.process.pid


def test_a_grammar_that_overflows_the_library_costs_its_request_only(unbounded):
    with httpx.Client(base_url=unbounded[0], timeout=120) as http:
        for _ in range(2):  # again: the answer is remembered
            _error(http.post("/v1/completions", json=CHAIN), "structured_outputs",
                   "crashed the grammar library")
        _serves(http)
        assert http.get("/health").status_code == 200


def test_a_slow_check_runs_off_the_event_loop_within_its_budget(unbounded):
    """100,000 choices take llguidance seconds to check: /health and a stream answer while
    it runs, and the check ends at --grammar-check-timeout with a 400."""
    answers = {}

    def send() -> None:
        with httpx.Client(base_url=unbounded[0], timeout=120) as http:
            answers["choices"] = http.post("/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 4, "guided_choice": CHOICES})

    sender = threading.Thread(target=send)
    with httpx.Client(base_url=unbounded[0], timeout=120) as http:
        sender.start()
        while not _checking(unbounded[1]):
            assert sender.is_alive(), answers["choices"].text
        assert http.get("/health").status_code == 200
        with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 8, "ignore_eos": True,
                "stream": True}) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert len(events) == 9 and events[-1] == "data: [DONE]"
        assert sender.is_alive()  # all of that while the check still ran
        sender.join(120)
    _error(answers["choices"], "guided_choice", "took more than 3 s",
           "--grammar-check-timeout")


def _checking(server_pid: int) -> bool:
    """Whether the server's grammar checker process is at work (its CPU time grows)."""
    def cpu_ticks() -> int:
        for pid in _descendants(server_pid):
            try:
                if b"check_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11])
            except OSError:
                pass
        return -1
    before = cpu_ticks()
    threading.Event().wait(0.2)
    return before >= 0 and cpu_ticks() > before


def _descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):  # each thread's own children
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return children + [g for c in children for g in _descendants(c)]
