"""ModelRunner setup (device, dtype, KV sizing) and per-request state across steps."""

from __future__ import annotations

import json
import logging
import math
import shutil

import pytest
import torch

from runner_driver import Driver, DriverRequest
from carpool.platform.cpu import CPU_DEFAULT_MAX_BYTES
from carpool.sampling_params import SamplingParams


def test_explicit_blocks_and_info(llama_checkpoint, make_runner):
    runner = make_runner(llama_checkpoint, num_kv_blocks=40, block_size=8, max_model_len=100)
    assert runner.num_kv_blocks == 40 and runner.block_size == 8
    info = runner.kv_cache_info
    # 2 layers * 2 (k, v) * 8 tokens * 2 kv heads * 16 dims * 4 bytes = 4096 bytes a block
    assert info["bytes"] == 40 * 4096 and info["num_tokens"] == 320
    assert math.isclose(info["max_concurrency"], 40 / 13)
    assert runner.kv_caches[0].shape == (2, 2, 41, 8, 16)  # + the scratch block


def test_blocks_from_bytes(llama_checkpoint, make_runner):
    runner = make_runner(llama_checkpoint, num_kv_blocks=None, kv_cache_memory=10 * 4096 + 5,
                         block_size=8)
    assert runner.num_kv_blocks == 10
    with pytest.raises(ValueError, match="kv_cache_memory"):
        make_runner(llama_checkpoint, num_kv_blocks=None, kv_cache_memory=100)


def test_cpu_default_size_is_bounded(llama_checkpoint, make_runner, caplog):
    with caplog.at_level(logging.INFO):
        runner = make_runner(llama_checkpoint, num_kv_blocks=None)
    # 10% of RAM is far more than 8 requests of 512 tokens can use: capped at that need.
    assert runner.num_kv_blocks == 8 * 512 // 4
    assert "max concurrency" in caplog.text
    assert "attention backend: cpu" in caplog.text
    platform = runner.platform
    assert 0 < platform.default_kv_cache_bytes() <= CPU_DEFAULT_MAX_BYTES


def test_max_model_len_beyond_the_model_is_named(llama_checkpoint, make_runner):
    with pytest.raises(ValueError, match="max_model_len"):
        make_runner(llama_checkpoint, max_model_len=4096)


def test_float16_checkpoint_runs_in_float32_on_cpu(make_checkpoint, make_runner, tmp_path):
    path = make_checkpoint("qwen2", dtype="float16")
    assert make_runner(path, dtype="auto").dtype == torch.float32
    assert make_runner(path, dtype="bfloat16").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        make_runner(path, dtype="int8")


@pytest.mark.parametrize("avx512_bf16, amx, expected", [
    (False, False, torch.float32), (True, False, torch.bfloat16), (False, True, torch.bfloat16)])
def test_auto_runs_a_float32_checkpoint_in_bfloat16_where_the_cpu_has_it(
        llama_checkpoint, make_runner, monkeypatch, avx512_bf16, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    runner = make_runner(llama_checkpoint, dtype="auto")
    assert runner.dtype == expected
    assert runner.kv_caches[0].dtype == expected
    assert make_runner(llama_checkpoint, dtype="float32").dtype == torch.float32


@pytest.mark.parametrize("bf16, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_auto_on_cuda_runs_a_float32_checkpoint_in_half_precision(monkeypatch, bf16, expected):
    from carpool.utils.device import resolve_dtype
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    cuda = torch.device("cuda")
    assert resolve_dtype("auto", "float32", cuda) == expected
    assert resolve_dtype("auto", "bfloat16", cuda) == torch.bfloat16
    assert resolve_dtype("float32", "float32", cuda) == torch.float32


def test_device_auto_is_cpu_without_cuda(llama_checkpoint, make_runner):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert make_runner(llama_checkpoint, device="auto").device.type == "cpu"
    with pytest.raises(ValueError, match="cuda"):
        make_runner(llama_checkpoint, device="cuda")


def test_seeded_sampling_survives_preemption_and_batching(llama_checkpoint, make_runner, prompts):
    def seeded(arrival=0):
        return DriverRequest("s", prompts[0], SamplingParams(seed=7, max_tokens=10),
                             arrival_step=arrival)

    alone = Driver(make_runner(llama_checkpoint, seed=1)).run([seeded()])["s"]
    others = [DriverRequest("o1", prompts[1], SamplingParams(max_tokens=12)),
              DriverRequest("o2", prompts[2], SamplingParams(seed=3, max_tokens=6))]
    runner = make_runner(llama_checkpoint, seed=2)
    mixed = Driver(runner, chunk=8).run(others + [seeded(arrival=2)], preempt_at={8: "s"})["s"]
    assert mixed == alone
    assert runner.sampler.num_request_generators == 0  # finished ids dropped them


def test_logprobs_through_the_runner(llama_checkpoint, make_runner, prompts):
    import transformers

    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5)
    req = DriverRequest("a", prompts[0], params)
    Driver(make_runner(llama_checkpoint)).run([req])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(llama_checkpoint),
                                                           dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[0] + req.outputs])).logits[0]
    for step, entry in enumerate(req.logprobs):
        expected = torch.log_softmax(logits[len(prompts[0]) - 1 + step], dim=-1)
        top = expected.topk(5)
        assert list(entry)[:1] == [req.outputs[step]] and entry[req.outputs[step]].rank == 1
        assert set(entry) == set(top.indices.tolist())
        for token_id, lp in entry.items():
            assert math.isclose(lp.logprob, expected[token_id].item(), abs_tol=1e-4)


def test_profiling_steps_run_and_leave_the_cache_alone(llama_checkpoint, make_runner):
    """The CUDA sizing pass (a full-budget prefill, then max_num_seqs long decodes) runs on any device."""
    from carpool.runner.model_runner import profiling_steps

    num_blocks, steps = profiling_steps(100, 3, 64, 8)
    assert [len(s.token_ids) for s in steps[0].scheduled] == [50, 50]
    assert len(steps[1].scheduled) == 3
    assert all(s.num_computed_tokens == 63 for s in steps[1].scheduled)
    assert num_blocks == 14
    runner = make_runner(llama_checkpoint, max_num_batched_tokens=100, max_num_seqs=3,
                         max_model_len=64)
    caches = runner.kv_caches
    runner._profile_forward()
    assert runner.kv_caches is caches and runner.num_kv_blocks == 96
    assert all(c.abs().sum() == 0 for c in caches)
