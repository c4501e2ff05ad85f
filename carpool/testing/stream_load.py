"""Streaming clients that may walk away, for the disconnect-storm test and the soak.

Each client follows a `ClientPlan`: it streams one greedy completion and
either reads it to the end or leaves — before the response headers arrive
(its task is cancelled), right after them (before the first token, which for
a long prompt is during its prefill), or after a number of chunks. Leaving
closes the connection mid-response, exactly as a browser tab or a killed
script does.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class ClientPlan:
    prompt: str
    max_tokens: int
    leave_after_chunks: int | None = None  # None: read to the end; 0: right after headers
    leave_before_headers_s: float | None = None  # cancel this long after sending

    @property
    def leaves(self) -> bool:
        return self.leave_after_chunks is not None or self.leave_before_headers_s is not None


@dataclass
class ClientResult:
    plan: ClientPlan
    status: int | None = None
    text: str = ""
    finish_reasons: list[str] = field(default_factory=list)
    chunk_gaps: list[float] = field(default_factory=list)  # seconds between chunks
    latency: float = 0.0  # send to last byte read
    left: bool = False  # the client closed before the stream ended
    error: str | None = None


def plan_clients(rng: random.Random, num_clients: int, prompts: list[str], max_tokens: int,
                 leave_fraction: float = 0.5,
                 leaver_max_tokens: int | None = None) -> list[ClientPlan]:
    """A random `leave_fraction` of the clients leave at random points (within their first
    `max_tokens` chunks); the rest read all `max_tokens`. Leavers ask for `leaver_max_tokens`
    (default `max_tokens`): more than they read keeps their requests generating when they
    leave, so the server has something to abort however fast it runs."""
    leaver_tokens = max_tokens if leaver_max_tokens is None else leaver_max_tokens
    plans = []
    for i in range(num_clients):
        prompt = prompts[i % len(prompts)]
        if rng.random() >= leave_fraction:
            plans.append(ClientPlan(prompt, max_tokens))
            continue
        where = rng.random()
        if where < 0.2:
            plans.append(ClientPlan(prompt, leaver_tokens,
                                    leave_before_headers_s=rng.uniform(0, 0.05)))
        elif where < 0.4:
            plans.append(ClientPlan(prompt, leaver_tokens, leave_after_chunks=0))
        else:
            plans.append(ClientPlan(prompt, leaver_tokens,
                                    leave_after_chunks=rng.randint(1, max_tokens)))
    return plans


def completion_body(model: str, plan: ClientPlan) -> dict:
    return {"model": model, "prompt": plan.prompt, "max_tokens": plan.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


async def run_client(http: httpx.AsyncClient, model: str, plan: ClientPlan) -> ClientResult:
    result = ClientResult(plan)
    started = time.monotonic()
    stream = _stream(http, model, plan, result)
    if plan.leave_before_headers_s is None:
        await stream
    else:
        try:
            await asyncio.wait_for(stream, plan.leave_before_headers_s)
        except TimeoutError:
            result.left = True
    result.latency = time.monotonic() - started
    return result


async def _stream(http: httpx.AsyncClient, model: str, plan: ClientPlan,
                  result: ClientResult) -> None:
    try:
        async with http.stream("POST", "/v1/completions", json=completion_body(model, plan)) as r:
            result.status = r.status_code
            if r.status_code != 200:
                result.error = (await r.aread()).decode(errors="replace")
                return
            if plan.leave_after_chunks == 0:
                result.left = True
                return
            await _read_events(r, plan, result)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"


async def _read_events(response: httpx.Response, plan: ClientPlan, result: ClientResult) -> None:
    num_chunks = 0
    last = time.monotonic()
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        now = time.monotonic()
        result.chunk_gaps.append(now - last)
        last = now
        event = json.loads(line[len("data: "):])
        if "error" in event:
            result.error = event["error"]["message"]
            continue
        choice = event["choices"][0]
        result.text += choice["text"]
        if choice["finish_reason"]:
            result.finish_reasons.append(choice["finish_reason"])
        num_chunks += 1
        if plan.leave_after_chunks is not None and num_chunks >= plan.leave_after_chunks:
            result.left = not result.finish_reasons
            return


def async_client(base_url: str, api_key: str | None, timeout: float = 300.0) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout, limits=limits)


def read_rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc/<pid>/status (Linux)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; ValueError on no values."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]
