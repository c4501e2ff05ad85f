"""`carpool bench offline` end to end on a tiny checkpoint with a handful of requests."""

from __future__ import annotations

import json

import pytest
import torch

from carpool.bench.offline import run_variant
from carpool.bench.plots import slot_spans
from carpool.bench.workloads import WorkloadConfig, build_workload
from carpool.cli import main
from carpool.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint("llama")


def test_compare_runs_every_variant_on_the_same_requests(checkpoint, tmp_path, capsys):
    plot, result = tmp_path / "slots.png", tmp_path / "r.json"
    rc = main(["bench", "offline", "--model", str(checkpoint), "--workload", "mix", "--num-prompts", "6",
               "--input-len", "12", "--short-output-len", "2", "--long-output-len", "10",
               "--max-num-seqs", "3", "--compare", "--plot", str(plot), "--result-file", str(result)])
    assert rc == 0
    expected = build_workload(WorkloadConfig(name="mix", num_prompts=6, input_len=12, short_output_len=2,
                                             long_output_len=10), load_tokenizer(checkpoint))
    data = json.loads(result.read_text())
    (round_,) = data["rounds"]
    assert list(round_) == ["static", "continuous", "chunked"]
    for summary in round_.values():
        assert summary["num_completed"] == 6 and summary["num_failed"] == 0
        assert summary["total_output_tokens"] == sum(r.max_tokens for r in expected)
        assert summary["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in expected)
        assert summary["peak_concurrency"] <= 6
    assert set(data["ratios"]) == {"continuous", "chunked"}
    assert plot.read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out
    assert "Ratios vs static" in out and "Offline static, wall clock, round 1/1" in out
    steps = [int(line.split()[-1]) for line in out.splitlines() if line.startswith("Model steps:")]
    assert len(steps) == 3 and steps[1] < steps[0]  # static, continuous, chunked


def test_every_other_round_runs_the_variants_in_reverse(checkpoint, tmp_path, capsys):
    result = tmp_path / "r.json"
    rc = main(["bench", "offline", "--model", str(checkpoint), "--workload", "mix", "--num-prompts", "4",
               "--input-len", "8", "--short-output-len", "2", "--long-output-len", "6",
               "--max-num-seqs", "2", "--compare", "static,continuous", "--repeat", "2",
               "--result-file", str(result)])
    assert rc == 0
    titles = [line.strip("= ") for line in capsys.readouterr().out.splitlines()
              if ", wall clock, round " in line]
    assert titles == [f"Offline {variant}, wall clock, round {i}/2" for variant, i in
                      (("static", 1), ("continuous", 1), ("continuous", 2), ("static", 2))]
    rounds = json.loads(result.read_text())["rounds"]
    assert [list(r) for r in rounds] == [["static", "continuous"]] * 2  # variant order kept


def test_static_slots_wait_for_the_whole_batch(checkpoint):
    requests = build_workload(WorkloadConfig(name="mix", num_prompts=6, input_len=8, short_output_len=2,
                                             long_output_len=12, range_ratio=0.0), load_tokenizer(checkpoint))
    runs = {v: run_variant(str(checkpoint), requests, v, {"max_num_seqs": 3}, max_model_len=64)
            for v in ("static", "continuous")}
    static_spans = sorted(slot_spans(runs["static"]), key=lambda s: s.first_step)
    first_batch, second_batch = static_spans[:3], static_spans[3:]
    assert max(s.lane for s in static_spans) <= 2
    assert max(s.last_step for s in first_batch) < min(s.first_step for s in second_batch)
    # continuous starts a waiting request before the first batch's longest member ends
    continuous = sorted(slot_spans(runs["continuous"]), key=lambda s: s.first_step)
    assert continuous[3].first_step <= max(s.last_step for s in continuous[:3])
    assert len(runs["continuous"].steps) < len(runs["static"].steps)


def test_chunked_prefill_caps_the_step_while_long_prompts_arrive(checkpoint):
    config = WorkloadConfig(name="mixed-load", num_prompts=3, input_len=8, long_output_len=12,
                            num_long_prompts=2, long_prompt_len=200, long_prompt_interval=0.05,
                            short_output_len=2, range_ratio=0.0)
    requests = build_workload(config, load_tokenizer(checkpoint))
    common = {"max_num_seqs": 8, "max_num_batched_tokens": 64}
    unchunked = run_variant(str(checkpoint), requests, "continuous", common, max_model_len=256)
    chunked = run_variant(str(checkpoint), requests, "chunked", common, max_model_len=256, clock="cpu")
    assert max(s.num_prefill_tokens for s in unchunked.steps) >= 200
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in chunked.steps) <= 64
    for run in (unchunked, chunked):
        assert [r.num_output_tokens for r in run.results] == [r.max_tokens for r in requests]
        assert all(r.success and len(r.chunk_times) == r.num_output_tokens for r in run.results)
        assert all(s.end >= s.start for s in run.steps)
        assert all(first <= last for first, last in run.request_steps)
    # the long prompts arrived after the decoders started, under either clock
    for run in (unchunked, chunked):
        assert min(r.start_time for r in run.results[3:]) - run.results[0].start_time >= 0.04


def test_bad_variant_is_an_error(checkpoint, capsys):
    rc = main(["bench", "offline", "--model", str(checkpoint), "--compare", "static,warp"])
    assert rc == 2
    assert "--compare" in capsys.readouterr().err


def test_prefix_caching_on_and_off_on_the_shared_prefix_workload(checkpoint):
    config = WorkloadConfig(name="prefix-repetition", num_prompts=6, num_prefixes=2,
                            prefix_len=64, input_len=4, output_len=3, range_ratio=0.0)
    requests = build_workload(config, load_tokenizer(checkpoint))
    common = {"max_num_seqs": 8, "max_num_batched_tokens": 128}
    on = run_variant(str(checkpoint), requests, "chunked", common, max_model_len=128)
    off = run_variant(str(checkpoint), requests, "chunked-no-prefix-cache", common,
                      max_model_len=128)
    prefill = lambda run: sum(s.num_prefill_tokens for s in run.steps)
    assert prefill(off) == sum(len(r.prompt_token_ids) for r in requests)
    assert prefill(on) < prefill(off)
    for run in (on, off):
        assert [r.num_output_tokens for r in run.results] == [3] * 6


def test_dtype_flag_reaches_the_engine(checkpoint, tmp_path, monkeypatch):
    from carpool.bench import offline
    engines = []

    def build_and_keep(model, kwargs):
        engines.append(build_engine(model, kwargs))
        return engines[-1]

    build_engine = offline.build_engine
    monkeypatch.setattr(offline, "build_engine", build_and_keep)
    result = tmp_path / "r.json"
    rc = main(["bench", "offline", "--model", str(checkpoint), "--workload", "random",
               "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--dtype", "bfloat16",
               "--no-progress", "--result-file", str(result)])
    assert rc == 0
    assert json.loads(result.read_text())["engine"]["dtype"] == "bfloat16"
    assert [engine.runner.dtype for engine in engines] == [torch.bfloat16]
    with pytest.raises(SystemExit):
        main(["bench", "offline", "--model", str(checkpoint), "--dtype", "int8"])


def test_the_draft_variant_takes_its_draft_from_the_flag():
    from carpool.bench.offline import engine_kwargs

    with pytest.raises(ValueError, match="--draft-model"):
        engine_kwargs("chunked-draft", {}, 128)
    kwargs = engine_kwargs("chunked-draft", {"draft_model": "/a/draft"}, 128)
    assert kwargs["speculative_config"] == {"method": "draft_model",
                                            "num_speculative_tokens": 3, "model": "/a/draft"}
    assert "draft_model" not in engine_kwargs("chunked", {"draft_model": "/a/draft"}, 128)
