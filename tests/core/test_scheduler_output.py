"""ScheduledRequest's own __init__ (it fills __dict__ for speed) keeps a frozen dataclass's
behaviour: positional or keyword construction, defaults, equality, replace, no assignment."""

from __future__ import annotations

import dataclasses

import pytest

from carpool.core.scheduler_output import ScheduledRequest
from carpool.sampling_params import SamplingParams


def test_scheduled_request_builds_compares_and_stays_frozen():
    params = SamplingParams()
    by_position = ScheduledRequest("r", [5, 6], 3, [0, 1], True, params)
    by_name = ScheduledRequest(request_id="r", token_ids=[5, 6], num_computed_tokens=3,
                               block_ids=[0, 1], sample=True, sampling_params=params)
    assert by_position == by_name
    assert (by_position.prompt_token_ids, by_position.output_token_ids) == ((), ())
    assert by_position.num_new_tokens == 2
    assert [f.name for f in dataclasses.fields(ScheduledRequest)] == list(vars(by_position))
    replaced = dataclasses.replace(by_position, sample=False, output_token_ids=[9])
    assert (replaced.sample, replaced.output_token_ids, replaced.token_ids) == (False, [9], [5, 6])
    with pytest.raises(dataclasses.FrozenInstanceError):
        by_position.sample = False
    with pytest.raises(TypeError):
        ScheduledRequest("r", [5], 0, [0], True)  # sampling_params is required
