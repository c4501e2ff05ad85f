"""Test helpers: build requests and run scheduler steps the way the engine does."""

from __future__ import annotations

from carpool.core.request import Request
from carpool.sampling_params import SamplingParams


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int | None = 16,
                 **sampling) -> Request:
    prompt = [100 + i for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **sampling))


def step(scheduler, token_id: int = 7):
    """schedule() + update() with `token_id` sampled for everyone; checks block integrity."""
    output = scheduler.schedule()
    scheduler.update(output, {s.request_id: token_id for s in output.scheduled if s.sample})
    scheduler.block_manager.check_integrity()
    return output


def plan(output) -> list[tuple[str, int]]:
    return [(s.request_id, s.num_new_tokens) for s in output.scheduled]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now
