"""Workloads are seeded, have the shapes they promise, and text prompts match their ids."""

from __future__ import annotations

import json

import pytest

from carpool.bench.serve_client import _parse_sse, arrival_offsets
from carpool.bench.workloads import BenchRequest, WorkloadConfig, build_workload


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from carpool.engine.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir)


def test_same_seed_same_requests_other_seed_others(tokenizer):
    config = WorkloadConfig(name="random", num_prompts=8, seed=3)
    assert build_workload(config, tokenizer) == build_workload(config, tokenizer)
    other = build_workload(WorkloadConfig(name="random", num_prompts=8, seed=4), tokenizer)
    assert other != build_workload(config, tokenizer)


def test_random_lengths_stay_in_range_and_avoid_special_tokens(tokenizer):
    config = WorkloadConfig(name="random", num_prompts=20, input_len=40, output_len=10, range_ratio=0.5)
    special = set(tokenizer.all_special_ids)
    for r in build_workload(config, tokenizer):
        assert 20 <= len(r.prompt_token_ids) <= 60 and 5 <= r.max_tokens <= 15
        assert not special & set(r.prompt_token_ids)
        assert r.arrival_time is None


def test_mix_is_half_short_half_long(tokenizer):
    config = WorkloadConfig(name="mix", num_prompts=10, short_output_len=8, long_output_len=100,
                            range_ratio=0.0)
    outs = [r.max_tokens for r in build_workload(config, tokenizer)]
    assert sorted(outs) == [8] * 5 + [100] * 5
    assert outs != sorted(outs)  # shuffled, not all short first


def test_mixed_load_long_prompts_arrive_while_decoders_run(tokenizer):
    config = WorkloadConfig(name="mixed-load", num_prompts=4, input_len=16, long_output_len=50,
                            num_long_prompts=3, long_prompt_len=300, long_prompt_interval=0.5,
                            short_output_len=4, range_ratio=0.0)
    requests = build_workload(config, tokenizer)
    decoders, longs = requests[:4], requests[4:]
    assert all(r.arrival_time == 0.0 and r.max_tokens == 50 for r in decoders)
    assert [r.arrival_time for r in longs] == [0.5, 1.0, 1.5]
    assert all(len(r.prompt_token_ids) == 300 and r.max_tokens == 4 for r in longs)


def test_text_prompts_encode_back_to_their_ids(tokenizer):
    config = WorkloadConfig(name="random", num_prompts=5, input_len=30)
    for r in build_workload(config, tokenizer, with_text=True):
        assert tokenizer.encode(r.prompt, add_special_tokens=False) == list(r.prompt_token_ids)
        assert abs(len(r.prompt_token_ids) - 30) <= 30


def test_sharegpt_jsonl_and_json_list(tokenizer, tmp_path):
    rows = [{"conversations": [{"from": "human", "value": "def add(a, b):"},
                               {"from": "gpt", "value": "return a + b"}]},
            {"prompt": "import os", "output_len": 7},
            {"conversations": [{"from": "human", "value": "lonely"}]}]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    listed = tmp_path / "d.json"
    listed.write_text(json.dumps(rows))
    for path in (jsonl, listed):
        requests = build_workload(WorkloadConfig(name="sharegpt", dataset_path=str(path)), tokenizer)
        by_prompt = {r.prompt: r for r in requests}
        assert set(by_prompt) == {"def add(a, b):", "import os"}
        assert by_prompt["import os"].max_tokens == 7
        assert by_prompt["def add(a, b):"].max_tokens == len(
            tokenizer.encode("return a + b", add_special_tokens=False))


def test_sharegpt_bad_record_is_named(tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="record 0"):
        build_workload(WorkloadConfig(name="sharegpt", dataset_path=str(path)), tokenizer)


@pytest.mark.parametrize("field,value", [("name", "nope"), ("num_prompts", 0), ("range_ratio", 1.0),
                                         ("dataset_path", None)])
def test_bad_config_names_the_field(field, value):
    kwargs = {"name": "sharegpt", "dataset_path": "x"} if field == "dataset_path" else {}
    kwargs[field] = value
    with pytest.raises(ValueError, match=field if field != "name" else "workload"):
        WorkloadConfig(**kwargs)


def test_arrival_offsets_poisson_inf_and_workload_times():
    plain = [BenchRequest((1,), 4) for _ in range(200)]
    assert arrival_offsets(plain, float("inf"), 0) == [0.0] * 200
    offsets = arrival_offsets(plain, 10.0, seed=1)
    assert offsets == arrival_offsets(plain, 10.0, seed=1)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert 0.06 < offsets[-1] / 199 < 0.14  # mean gap near 1 / rate
    timed = [BenchRequest((1,), 4, 0.0), BenchRequest((1,), 4, 2.5)]
    assert arrival_offsets(timed, 10.0, 0) == [0.0, 2.5]


def test_sse_lines():
    assert _parse_sse('data: {"a": 1}') == {"a": 1}
    assert _parse_sse("data: [DONE]") is None
    assert _parse_sse("") is None and _parse_sse(": keep-alive") is None


def test_prefix_repetition_shares_each_prefix_among_its_users(tokenizer):
    config = WorkloadConfig(name="prefix-repetition", num_prompts=12, num_prefixes=3,
                            prefix_len=40, input_len=8, output_len=5, range_ratio=0.0)
    requests = build_workload(config, tokenizer)
    heads = [r.prompt_token_ids[:40] for r in requests]
    assert len(set(heads)) == 3 and all(heads.count(h) == 4 for h in heads)
    assert all(len(r.prompt_token_ids) == 48 and r.max_tokens == 5 for r in requests)
    assert len({r.prompt_token_ids for r in requests}) == 12
    for r in build_workload(config, tokenizer, with_text=True):
        assert tokenizer.encode(r.prompt, add_special_tokens=False) == list(r.prompt_token_ids)
