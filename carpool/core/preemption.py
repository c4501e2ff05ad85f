"""Who gives up its KV blocks when a running request needs one and none is free.

A policy picks one victim from the running requests (in admission order,
oldest first). The request asking for the block is itself a candidate: when
the policy names it, it preempts itself. The victim is recomputed later from
its prompt and the outputs it already produced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from carpool.core.request import Request

VictimPolicy = Callable[[Sequence[Request]], Request]


def newest(running: Sequence[Request]) -> Request:
    """The most recently admitted request: it has waited least and usually done least."""
    return running[-1]


def least_work(running: Sequence[Request]) -> Request:
    """The request with the fewest computed tokens (the cheapest to recompute); ties: newest."""
    best_index = len(running) - 1
    for index in range(len(running) - 2, -1, -1):
        if running[index].num_computed_tokens < running[best_index].num_computed_tokens:
            best_index = index
    return running[best_index]


VICTIM_POLICIES: dict[str, VictimPolicy] = {"newest": newest, "least_work": least_work}


def get_victim_policy(name: str) -> VictimPolicy:
    try:
        return VICTIM_POLICIES[name]
    except KeyError:
        raise ValueError(f"preemption_policy must be one of {tuple(VICTIM_POLICIES)}, "
                         f"got {name!r}") from None
