"""Which data-parallel replica takes a new request, from what the front end itself knows.

Each replica's outstanding work is the tokens of the requests the front end sent it
and has not yet seen finish (`OutstandingWork`): per request its prompt plus its
`max_tokens` (what `max_model_len` leaves when unset), the worst case of its
queued and running tokens. No round trip to the engines is needed, and a burst of
requests is spread at once, before any replica has published a step.

`ReplicaRouter.choose` sends a request to the replica with the least outstanding
work; ties go to the next replica after the last one chosen, so an idle server
alternates. A request whose prompt starts with the same full blocks (and carries
the same `cache_salt`) as an earlier one prefers the replica that served that one,
where the prefix cache may still hold them, as long as that replica is behind the
least loaded by no more than the prompt's length: the prefill a cache hit saves.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from carpool.engine.output_stream import GenerationRequest

# A prompt's routing key covers at most this many of its leading tokens (whole blocks):
# enough to tell system prompts and few-shot headers apart, cheap to hash.
PREFIX_KEY_MAX_TOKENS = 256
# The router remembers the replica of this many recent prefixes (least recent forgotten).
MAX_REMEMBERED_PREFIXES = 4096


def request_cost(request: GenerationRequest, max_model_len: int) -> int:
    """The tokens a request may still cost its replica: prompt + max_tokens (unset: up to
    max_model_len)."""
    num_prompt_tokens = len(request.prompt)
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is None:
        return max(max_model_len, num_prompt_tokens)
    return num_prompt_tokens + max_tokens


class OutstandingWork:
    """The requests one replica holds and their cost; used from the event loop (`add`) and
    the replica's receiver thread (`finish`), hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._costs: dict[str, int] = {}
        self.num_tokens = 0

    def add(self, requests: Sequence[GenerationRequest], max_model_len: int) -> None:
        """Count these requests as the replica's until they finish."""
        with self._lock:
            for r in requests:
                cost = request_cost(r, max_model_len)
                self.num_tokens += cost - self._costs.get(r.request_id, 0)
                self._costs[r.request_id] = cost

    def finish(self, request_ids) -> None:
        """These requests are done (finished, aborted, refused); unknown ids are ignored."""
        with self._lock:
            for rid in request_ids:
                self.num_tokens -= self._costs.pop(rid, 0)

    def holds(self, request_id: str) -> bool:
        return request_id in self._costs

    @property
    def num_requests(self) -> int:
        return len(self._costs)


class ReplicaRouter:
    """Chooses a replica per `add`; event-loop side only. See the module docstring."""

    def __init__(self, num_replicas: int, block_size: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self._last = num_replicas - 1  # so the first tie goes to replica 0
        self._prefix_homes: OrderedDict[tuple, int] = OrderedDict()

    def choose(self, loads: Sequence[int], requests: Sequence[GenerationRequest]) -> int:
        """The replica for `requests` (sent together to one replica), given each replica's
        outstanding tokens; remembers it as the home of their prompt's prefix."""
        least = self._least_loaded(loads)
        key = self.prefix_key(requests[0]) if requests else None
        chosen = least
        if key is not None:
            home = self._prefix_homes.get(key)
            if home is not None and loads[home] - loads[least] <= len(requests[0].prompt):
                chosen = home
            self._prefix_homes[key] = chosen
            self._prefix_homes.move_to_end(key)
            if len(self._prefix_homes) > MAX_REMEMBERED_PREFIXES:
                self._prefix_homes.popitem(last=False)
        self._last = chosen
        return chosen

    def _least_loaded(self, loads: Sequence[int]) -> int:
        lowest = min(loads)
        for step in range(1, self.num_replicas + 1):
            index = (self._last + step) % self.num_replicas
            if loads[index] == lowest:
                return index
        raise AssertionError("unreachable: some replica has the lowest load")

    def prefix_key(self, request: GenerationRequest) -> tuple | None:
        """The salt and leading whole blocks of the prompt (at most PREFIX_KEY_MAX_TOKENS
        tokens, never its last token, which is always computed); None when the prompt has no
        whole block to share."""
        prompt = request.prompt
        num_blocks = min(len(prompt) - 1, PREFIX_KEY_MAX_TOKENS) // self.block_size
        if num_blocks < 1 or isinstance(prompt, str):
            return None
        return request.cache_salt, tuple(prompt[:num_blocks * self.block_size])
