"""The data-parallel router's choices, the outstanding-work ledger, and merging the replicas'
stats and metrics: plain objects, no processes (the live server is in
tests/server/test_data_parallel_serve.py)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from carpool.engine.dp_client import merge_results, merge_stats
from carpool.engine.dp_routing import (
    PREFIX_KEY_MAX_TOKENS,
    OutstandingWork,
    ReplicaRouter,
    request_cost,
)
from carpool.engine.output_stream import GenerationRequest
from carpool.metrics import MetricFamilies, ServerMetrics
from carpool.outputs import EngineStats, StepOutput
from carpool.sampling_params import SamplingParams


def request(rid: str, prompt: list[int], max_tokens: int | None = 8,
            salt: str | None = None) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), salt)


def test_cost_is_prompt_plus_max_tokens_or_what_max_model_len_leaves():
    assert request_cost(request("a", [1] * 10, 5), 256) == 15
    assert request_cost(request("a", [1] * 10, None), 256) == 256


def test_outstanding_work_counts_until_finished_and_ignores_unknown_ids():
    work = OutstandingWork()
    work.add([request("a", [1] * 10, 5), request("b", [1] * 3, 2)], 256)
    assert (work.num_tokens, work.num_requests) == (20, 2) and work.holds("a")
    work.finish(["a", "nobody"])
    assert (work.num_tokens, work.num_requests) == (5, 1) and not work.holds("a")
    work.finish(["b", "b"])
    assert (work.num_tokens, work.num_requests) == (0, 0)


def test_least_loaded_wins_and_ties_alternate():
    router = ReplicaRouter(3, block_size=4)
    assert router.choose([30, 10, 20], [request("a", [1])]) == 1
    # idle: 0, 1, 2, 0 in turn (after the last chosen)
    assert [router.choose([0, 0, 0], [request(str(i), [i])]) for i in range(4)] == [2, 0, 1, 2]


def test_a_shared_prefix_goes_home_while_loads_are_close():
    router = ReplicaRouter(2, block_size=4)
    shared = list(range(100, 112))  # three whole blocks
    first = request("a", shared + [1, 2])
    assert router.choose([0, 0], [first]) == 0
    # replica 0 is behind by less than the prompt (14 tokens): the cached prefix wins
    assert router.choose([10, 0], [request("b", shared + [3, 4])]) == 0
    # behind by more than the prompt could save: the least loaded wins, and becomes home
    assert router.choose([100, 0], [request("c", shared + [5, 6])]) == 1
    assert router.choose([5, 0], [request("d", shared + [7, 8])]) == 1
    # another salt is another cache: no affinity
    assert router.choose([0, 10], [request("e", shared + [1, 2], salt="s")]) == 0


def test_prefix_key_is_whole_blocks_of_salt_and_prompt_never_the_last_token():
    router = ReplicaRouter(2, block_size=4)
    assert router.prefix_key(request("a", [1, 2, 3, 4])) is None  # no whole block before last
    assert router.prefix_key(request("a", [1, 2, 3, 4, 5])) == (None, (1, 2, 3, 4))
    long = list(range(1000))
    assert len(router.prefix_key(request("a", long, salt="x"))[1]) == PREFIX_KEY_MAX_TOKENS


def test_a_router_needs_a_replica():
    with pytest.raises(ValueError, match="num_replicas"):
        ReplicaRouter(0, block_size=16)


def stats(**overrides) -> EngineStats:
    fields = dict(num_steps=1, num_generated_tokens=2, num_prompt_tokens=3,
                  last_step_num_tokens=4, last_step_num_prefill_tokens=1,
                  last_step_num_decode_tokens=3, num_preemptions=0, prefix_cache_queries=5,
                  prefix_cache_hits=1, num_free_blocks=6, num_total_blocks=8, num_running=1,
                  num_waiting=2, kv_cache_usage=0.25)
    return EngineStats(**{**fields, **overrides})


def test_merged_stats_sum_counts_and_pool_the_cache():
    merged = merge_stats([stats(), stats(num_free_blocks=8, num_running=0, kv_cache_usage=0.0)])
    assert (merged.num_steps, merged.num_running, merged.num_waiting) == (2, 1, 4)
    assert (merged.num_free_blocks, merged.num_total_blocks) == (14, 16)
    assert merged.kv_cache_usage == pytest.approx(2 / 16)


def test_merged_utility_results():
    assert merge_results([3, 4]) == 7
    ok = {**stats().as_dict(), "integrity": "ok"}
    bad = {**stats().as_dict(), "integrity": "violated: x"}
    merged = merge_results([ok, bad])
    assert merged["integrity"] == "engine 1: violated: x"
    assert merged["num_total_blocks"] == 16 and merged["engines"] == [ok, bad]
    assert merge_results([ok, ok])["integrity"] == "ok"


def test_replicas_share_one_registry_under_their_engine_label():
    families = MetricFamilies()
    replicas = [ServerMetrics("m", log_stats=False, engine=str(i), families=families)
                for i in range(2)]
    out = StepOutput("r", [7], "", num_prompt_tokens=3, num_output_tokens=1,
                     finish_reason="length")
    replicas[1].record_step([out], stats(), now=1.0)
    replicas[0].update_gauges(stats(num_running=5))
    replicas[1].record_request_params(2)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(replicas[0].render().decode())
               for s in family.samples}
    assert samples[("carpool:num_requests_running", (("engine", "0"), ("model_name", "m")))] == 5
    assert samples[("carpool:generation_tokens_total",
                    (("engine", "1"), ("model_name", "m")))] == 1
    assert samples[("carpool:generation_tokens_total",
                    (("engine", "0"), ("model_name", "m")))] == 0
    assert samples[("carpool:request_success_total", (("engine", "1"),
                                                      ("finished_reason", "length"),
                                                      ("model_name", "m")))] == 1
    # the front end's series has no engine
    assert samples[("carpool:request_params_n_count", (("model_name", "m"),))] == 1


def test_one_engine_has_no_engine_label():
    text = ServerMetrics("m").render().decode()
    assert 'engine="' not in text and "carpool:num_requests_running{model_name=" in text


def test_a_replica_takes_its_share_of_the_threads_on_cpu():
    import dataclasses

    import torch

    from carpool.config import EngineConfig
    from carpool.engine.runner_setup import place_replica

    one = EngineConfig(device="cpu")
    assert place_replica(one) is one
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        replica = dataclasses.replace(one, data_parallel_size=2, data_parallel_rank=1)
        assert place_replica(replica).device == "cpu"
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("num_cards, tp, cards", [(4, 2, [0, 2]), (2, 1, [0, 1]),
                                                   (2, 2, [0, 0])])
def test_replicas_take_consecutive_cards_for_their_ranks_on_cuda(monkeypatch, num_cards, tp,
                                                                  cards):
    """Replica r of T ranks starts at card r*T and its ranks count from there; with too few
    cards they wrap (and share, with a warning). Only torch.cuda's queries are stubbed."""
    import dataclasses

    import torch

    from carpool.config import EngineConfig
    from carpool.engine.runner_setup import place_replica
    from carpool.utils.device import device_for_rank

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: num_cards)
    saved = torch.get_num_threads()
    try:
        devices = [place_replica(dataclasses.replace(
            EngineConfig(device="cuda"), data_parallel_size=2, data_parallel_rank=r,
            tensor_parallel_size=tp)).device for r in range(2)]
    finally:
        torch.set_num_threads(saved)
    assert devices == [f"cuda:{c}" for c in cards]
    ranks = [device_for_rank(torch.device(d), t).index for d in devices for t in range(tp)]
    if 2 * tp <= num_cards:
        assert sorted(ranks) == list(range(2 * tp))  # every process on its own card


@pytest.mark.parametrize("fields, name", [({"data_parallel_size": 0}, "data_parallel_size"),
                                          ({"data_parallel_rank": 2, "data_parallel_size": 2},
                                           "data_parallel_rank")])
def test_replica_fields_are_checked(fields, name):
    from carpool.config import EngineConfig

    with pytest.raises(ValueError, match=name):
        EngineConfig(**fields)
