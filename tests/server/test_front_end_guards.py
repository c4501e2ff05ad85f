"""The front end's guards of issue 64 on their own: the tokenizer's two bounded,
cancellable lanes; the engine-stall clock; the logprob-work cap; the connection cap's
reserve and the accept-error log. Their live behaviour: tests/reliability/
test_front_end_hardening.py."""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace

import pytest

from carpool.engine.commands import EngineSnapshot
from carpool.sampling_params import SamplingParams
from carpool.server.admission import Admission
from carpool.server.errors import APIError
from carpool.server.http_protocol import DEFAULT_BACKLOG, connection_cap, quiet_accept_errors
from carpool.server.liveness import stall_message, stalled_for
from carpool.server.logprobs import check_logprob_work
from carpool.server.prompts import TokenizerWorker
from tests.server.test_units import engine_stats


async def _blocked_job(worker_run, release: threading.Event, started: threading.Event):
    def job() -> str:
        started.set()
        release.wait(10)
        return "tokenize"
    return await worker_run(job)


def test_generation_prompts_do_not_wait_behind_tokenize_jobs():
    """A /tokenize job that holds its thread does not hold up a generation request's
    prompt: they have a thread each."""
    async def run() -> None:
        worker = TokenizerWorker()
        release, started = threading.Event(), threading.Event()
        tokenize = asyncio.ensure_future(_blocked_job(worker.run_tokenize, release, started))
        await asyncio.to_thread(started.wait, 10)
        assert await asyncio.wait_for(worker.run(lambda: "prompt"), 10) == "prompt"
        assert not tokenize.done()
        release.set()
        assert await tokenize == "tokenize"
        worker.shutdown()
    asyncio.run(run())


def test_a_full_lane_is_a_503_and_a_cancelled_wait_drops_its_job():
    async def run() -> None:
        worker = TokenizerWorker(max_jobs=2)
        release, started = threading.Event(), threading.Event()
        running = asyncio.ensure_future(_blocked_job(worker.run_tokenize, release, started))
        await asyncio.to_thread(started.wait, 10)
        ran = []
        queued = asyncio.ensure_future(worker.run_tokenize(lambda: ran.append("queued")))
        await asyncio.sleep(0)
        with pytest.raises(APIError) as refused:
            await worker.run_tokenize(lambda: ran.append("refused"))
        assert refused.value.status_code == 503 and refused.value.headers["Retry-After"]
        assert "--max-tokenizer-queue" in refused.value.message
        queued.cancel()  # its client left while it waited
        await asyncio.sleep(0)
        release.set()
        await running
        assert await worker.run_tokenize(lambda: "after") == "after"  # a slot is free again
        assert ran == []  # neither the cancelled nor the refused job ever ran
        worker.shutdown()
    asyncio.run(run())


def _engine(num_running=0, num_waiting=0, num_paused=0, time=100.0, taken=0):
    snapshot = EngineSnapshot(engine_stats(num_running=num_running, num_waiting=num_waiting,
                                           num_paused=num_paused), time, taken)
    return SimpleNamespace(snapshot=lambda: snapshot)


def test_stalled_counts_only_while_the_engine_has_work():
    admission = Admission()
    assert stalled_for(_engine(time=100.0), admission, now=500.0) == 0.0  # idle: never
    assert stalled_for(_engine(num_running=1, time=100.0), admission, now=130.0) == 30.0
    assert stalled_for(_engine(num_running=2, num_paused=2), admission, now=500.0) == 0.0
    assert stall_message(_engine(num_running=1, time=0.0), admission, 0) is None  # off


def test_a_send_to_an_idle_engine_counts_from_the_send():
    """An engine idle for an hour is not stalled the moment a request arrives; it is once
    the request has gone untaken for the timeout."""
    admission = Admission()
    admission.num_sent = 3
    admission._sends.append((3, 1000.0))
    engine = _engine(time=10.0, taken=2)  # idle since 10, has not taken the send at 1000
    assert stalled_for(engine, admission, now=1005.0) == 5.0
    assert stalled_for(_engine(time=1001.0, taken=3), admission, now=1005.0) == 0.0  # taken


def test_logprob_work_over_the_cap_is_a_value_error_naming_logprobs():
    params = SamplingParams(max_tokens=100, logprobs=20, prompt_logprobs=20, n=2)
    work = 2 * (3 * (50 * 21 + 100 * 21))  # n x prompts x (prompt + generated entries)
    check_logprob_work(params, [50, 50, 50], 512, work)
    with pytest.raises(ValueError, match=r"^logprobs: .* --max-logprob-work"):
        check_logprob_work(params, [50, 50, 50], 512, work - 1)
    check_logprob_work(SamplingParams(max_tokens=100), [10**6], 512, 1)  # none asked for


def test_the_connection_cap_keeps_an_accept_burst_of_descriptors():
    assert connection_cap(4096, 4096) <= 4096 - DEFAULT_BACKLOG
    assert connection_cap(100, 65536) == 100
    assert connection_cap(4096, 100) == 1


def test_accept_errors_are_logged_once_per_interval(caplog):
    loop = asyncio.new_event_loop()
    others = []
    loop.set_exception_handler(lambda _, context: others.append(context["message"]))
    try:
        quiet_accept_errors(loop)
        with caplog.at_level(logging.WARNING, logger="carpool.server"):
            for _ in range(5000):
                loop.call_exception_handler({
                    "message": "socket.accept() out of system resource",
                    "exception": OSError(24, "Too many open files")})
            loop.call_exception_handler({"message": "something else"})
    finally:
        loop.close()
    ours = [r for r in caplog.records if r.name == "carpool.server"]
    assert len(ours) == 1 and "could not be accepted" in ours[0].getMessage()
    assert others == ["something else"]  # the handler before it still gets the rest


def test_a_whole_reply_rendered_choice_by_choice_is_the_same_json():
    """Each choice is serialized in its own call (json's encoder holds the GIL for a whole
    call), then spliced into the envelope: the bytes parse to the same object."""
    import json

    from carpool.server.generation import ChunkedJSONResponse

    content = {"id": "cmpl-1", "choices": [
        {"index": i, "text": '"choices":[] \u00e9\U0001f600', "logprobs": None}
        for i in range(3)], "usage": {"prompt_tokens": 1}}
    body = ChunkedJSONResponse(content).body
    assert json.loads(body) == content
    assert ChunkedJSONResponse({"choices": [1]}).body == b'{"choices":[1]}'
