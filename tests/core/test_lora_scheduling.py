"""LoRA adapters in the scheduler: at most `max_loras` distinct adapters a step, the others
waiting without holding back base requests or aging; the adapter id separates prefix
blocks; every request finishes and no block is leaked."""

from __future__ import annotations

import pytest

from carpool.core.block_manager import BlockManager
from carpool.core.config import SchedulerConfig
from carpool.core.prefix_cache import hash_block_tokens
from carpool.core.request import Request
from carpool.core.scheduler import Scheduler
from carpool.lora_request import LoRARequest
from carpool.sampling_params import SamplingParams
from tests.core.stepping import FakeClock, step


def lora(i: int) -> LoRARequest:
    return LoRARequest(f"adapter{i}", i, f"/adapters/{i}")


def request(request_id: str, adapter: int | None, num_prompt_tokens=3, max_tokens=4,
            prompt=None) -> Request:
    return Request(request_id, list(prompt or range(100, 100 + num_prompt_tokens)),
                   SamplingParams(max_tokens=max_tokens),
                   lora_request=None if adapter is None else lora(adapter))


def scheduler(max_loras=2, num_blocks=64, **overrides) -> Scheduler:
    fields = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64, block_size=4,
                  max_loras=max_loras)
    fields.update(overrides)
    return Scheduler(SchedulerConfig(**fields), num_blocks=num_blocks, clock=FakeClock())


def adapters_of(output) -> set[int]:
    return {s.lora_request.lora_int_id for s in output.scheduled if s.lora_request is not None}


def test_at_most_max_loras_adapters_a_step_and_base_requests_pass_the_waiting_ones():
    s = scheduler(max_loras=2)
    order = [("a1", 1), ("a2", 2), ("a3", 3), ("base", None), ("b1", 1), ("a4", 4)]
    for rid, adapter in order:
        s.add_request(request(rid, adapter))
    first = step(s)
    # adapters 3 and 4 wait; base and adapter 1's second request are admitted past them
    assert [r.request_id for r in first.scheduled] == ["a1", "a2", "base", "b1"]
    assert adapters_of(first) == {1, 2}
    seen, finished = set(), 0
    while s.has_unfinished_requests():
        output = step(s)
        assert len(adapters_of(output)) <= 2
        seen |= adapters_of(output)
        finished += 1
        assert finished < 100
    assert seen == {1, 2, 3, 4}
    assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks


def test_waiting_on_an_adapter_is_not_a_skip():
    s = scheduler(max_loras=1, max_skips=0)  # a request skipped once would block the queue
    s.add_request(request("a1", 1, max_tokens=8))
    s.add_request(request("a2", 2))
    s.add_request(request("base", None))
    step(s)
    assert {r.request_id for r in step(s).scheduled} == {"a1", "base"}


def test_a_running_request_over_the_limit_waits_with_its_blocks():
    s = scheduler(max_loras=1, num_blocks=64)
    s.add_request(request("a1", 1, max_tokens=6))
    step(s)
    s.add_request(request("a2", 2, max_tokens=6))
    s.add_request(request("base", None, max_tokens=6))
    while s.has_unfinished_requests():
        assert len(adapters_of(step(s))) <= 1
    assert s.block_manager.num_free_blocks == s.block_manager.num_total_blocks


def test_max_loras_is_validated():
    with pytest.raises(ValueError, match="max_loras"):
        SchedulerConfig(max_loras=0)


def test_the_adapter_id_roots_the_hash_chain_and_separates_blocks():
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(None, [1, 2, 3, 4], lora_int_id=1) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], lora_int_id=1) != hash_block_tokens(
        None, [1, 2, 3, 4], lora_int_id=2)
    assert hash_block_tokens(None, [1, 2, 3, 4], "s", 1) != hash_block_tokens(None, [1, 2, 3, 4],
                                                                              "s")
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = request("a", 1, prompt=range(9))
    bm.allocate("a", 9)
    bm.cache_full_blocks(a, 9)
    assert bm.find_cached_blocks(request("b", 2, prompt=range(9))) == []
    assert bm.find_cached_blocks(request("c", None, prompt=range(9))) == []
    assert bm.find_cached_blocks(request("d", 1, prompt=range(9))) == [0, 1]


def test_requests_by_adapter_counts_running_and_waiting():
    s = scheduler(max_loras=1)
    for rid, adapter in (("a", 1), ("b", 1), ("c", 2), ("d", None)):
        s.add_request(request(rid, adapter))
    step(s)
    assert s.requests_by_adapter() == ({"adapter1": 2}, {"adapter2": 1})
