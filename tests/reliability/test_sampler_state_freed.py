"""No per-request state outlives its request in the runner: seeded generators are freed
even when the last thing the engine does is abort them (an empty step)."""

from __future__ import annotations

import pytest

from carpool.config import EngineConfig
from carpool.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(llama_checkpoint):
    from carpool.engine.llm_engine import LLMEngine
    return LLMEngine.from_config(EngineConfig.from_args(
        str(llama_checkpoint), num_kv_blocks=64, max_model_len=128, device="cpu",
        max_num_seqs=8))


def _drain(engine) -> None:
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("engine never went idle")


@pytest.mark.parametrize("num_steps_before_abort", [0, 1, 3])
def test_aborted_seeded_requests_free_their_generators(engine, num_steps_before_abort):
    params = SamplingParams(max_tokens=50, temperature=1.0, seed=1234, ignore_eos=True)
    ids = [f"seeded-{num_steps_before_abort}-{i}" for i in range(3)]
    for rid in ids:
        engine.add_request(rid, "def f(x):", params)
    for _ in range(num_steps_before_abort):
        engine.step()
    engine.abort_request(ids)
    _drain(engine)
    engine.check_integrity()
    assert engine.runner.sampler.num_request_generators == 0


def test_finished_seeded_requests_free_their_generators(engine):
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=99, ignore_eos=True)
    engine.add_request("short", "x = ", params)
    _drain(engine)
    engine.add_request("other", "y = ", SamplingParams(max_tokens=2, temperature=0.0))
    _drain(engine)  # the next step hands the finished request's id to the runner
    assert engine.runner.sampler.num_request_generators == 0
