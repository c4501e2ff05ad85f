"""A streaming load generator for any OpenAI-compatible server.

Requests are sent on a schedule (Poisson arrivals at `request_rate`, all at
once for `inf`, or the workload's own arrival times), at most
`max_concurrency` in flight, each as a streamed `/v1/completions` call
(backend `openai`) or `/v1/chat/completions` call with the prompt as one user
message (backend `openai-chat`). Every SSE chunk that carries text is
timestamped on arrival, which is what TTFT and ITL are made of (a chat stream's
role-only chunk is no token); the token count comes from the final usage chunk
when the server sends one (`stream_options.include_usage`), else from the chunks.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from carpool.bench.stats import RequestResult
from carpool.bench.workloads import BenchRequest

# vLLM's backend names -> the endpoint each streams from by default.
BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class ServeConfig:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: str | None = None  # None: the first model the server lists
    request_rate: float = math.inf  # requests per second (Poisson); inf: all at once
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False  # a vLLM extension: generate exactly max_tokens
    temperature: float | None = None  # None: not sent, the server's default (as vLLM's)
    api_key: str | None = None
    timeout_s: float = 600.0
    backend: str = "openai"  # one of BACKENDS
    endpoint: str | None = None  # None: the backend's

    @property
    def url(self) -> str:
        return self.base_url + (self.endpoint or BACKENDS[self.backend])

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {tuple(BACKENDS)}, got {self.backend!r}")


def arrival_offsets(requests: list[BenchRequest], request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent.

    The workload's own arrival times win when it has them; otherwise gaps are
    exponential with mean 1 / request_rate (a Poisson process), or all 0 for inf.
    """
    if any(r.arrival_time is not None for r in requests):
        return [r.arrival_time or 0.0 for r in requests]
    if math.isinf(request_rate):
        return [0.0] * len(requests)
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in requests:
        offsets.append(now)
        now += rng.expovariate(request_rate)
    return offsets


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the server lists; ValueError saying why when it cannot be asked."""
    try:
        response = await client.get(f"{base_url}/v1/models")
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {base_url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        raise ValueError(f"{base_url}/v1/models answered HTTP {response.status_code}: "
                         f"{response.text[:300]}")
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def run_load(requests: list[BenchRequest], config: ServeConfig,
                   show_progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every request on its schedule; returns per-request results and the wall duration."""
    if any(r.prompt is None for r in requests):
        raise ValueError("every request needs its text prompt to be sent over HTTP")
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=config.timeout_s,
                                 limits=limits) as client:
        model = config.model or await resolve_model(client, config.base_url)
        gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        progress = tqdm(total=len(requests), disable=not show_progress, desc="requests")
        offsets = arrival_offsets(requests, config.request_rate, config.seed)
        start = time.perf_counter()

        async def one(request: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            if gate is None:
                result = await send_completion(client, config, model, request)
            else:
                async with gate:
                    result = await send_completion(client, config, model, request)
            progress.update(1)
            return result

        results = await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets)))
        duration = time.perf_counter() - start
        progress.close()
    return list(results), duration


async def send_completion(client: httpx.AsyncClient, config: ServeConfig, model: str,
                          request: BenchRequest) -> RequestResult:
    """One streamed completion, timestamped chunk by chunk; errors become a failed result."""
    body = {"model": model, "max_tokens": request.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if config.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if config.temperature is not None:
        body["temperature"] = config.temperature
    if config.ignore_eos:
        body["ignore_eos"] = True
    result = RequestResult(start_time=time.perf_counter(),
                           num_prompt_tokens=len(request.prompt_token_ids))
    num_chunk_tokens = 0
    usage = None
    try:
        async with client.stream("POST", config.url, json=body) as response:
            if response.status_code != 200:
                result.success = False
                body_text = (await response.aread()).decode()[:500]
                result.error = f"HTTP {response.status_code}: {body_text}"
                result.end_time = time.perf_counter()
                return result
            async for line in response.aiter_lines():
                now = time.perf_counter()
                chunk = _parse_sse(line)
                if chunk is None:
                    continue
                if "error" in chunk:
                    result.success, result.error = False, f"stream error: {chunk['error']}"
                    break
                usage = chunk.get("usage") or usage
                choices = chunk.get("choices") or []
                if choices and _chunk_text(choices[0]):
                    result.chunk_times.append(now)
                    num_chunk_tokens += 1
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.success = False
        result.error = f"{type(exc).__name__}: {exc}"
    result.end_time = time.perf_counter()
    if result.success:
        result.num_output_tokens = usage["completion_tokens"] if usage else num_chunk_tokens
        if usage and usage.get("prompt_tokens"):
            result.num_prompt_tokens = usage["prompt_tokens"]
        if not result.chunk_times:
            result.success, result.error = False, "the stream carried no text"
    return result


def _chunk_text(choice: dict) -> str | None:
    """The text a streamed choice carries: a completion's `text`, a chat delta's `content`."""
    return choice.get("text") or (choice.get("delta") or {}).get("content")


def _parse_sse(line: str) -> dict | None:
    """The JSON payload of one `data:` line; None for blank lines, comments and [DONE]."""
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if not payload or payload == "[DONE]":
        return None
    return json.loads(payload)
