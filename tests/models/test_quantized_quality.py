"""Quantized weights keep the built-in model's quality: on its held-out text the mean
negative log-likelihood (from prompt logprobs) of a Q8_0 file is within 1% of the float
model's, and of a Q4 file within 3% (llama.cpp's own K-quant files: tests/fixtures/gguf)."""

from __future__ import annotations

import pytest

from carpool import LLM
from carpool.default_model_path import default_model_path
from carpool.testing.gguf_writer import write_gguf
from carpool.testing.held_out import held_out_windows, mean_prompt_nll

NUM_WINDOWS = 8  # 4,080 scored tokens
TOLERANCE = {"Q8_0": 0.01, "Q4_0": 0.03}


@pytest.fixture(scope="module")
def float_nll():
    llm = LLM(str(default_model_path()), dtype="float32")
    windows = held_out_windows(llm.get_tokenizer(), NUM_WINDOWS)
    return windows, mean_prompt_nll(llm, windows)


@pytest.mark.parametrize("qtype", list(TOLERANCE))
def test_nll_within_tolerance_of_float(qtype, float_nll, tmp_path):
    windows, reference = float_nll
    file = write_gguf(default_model_path(), tmp_path / f"default-{qtype}.gguf", qtype)
    nll = mean_prompt_nll(LLM(str(file), dtype="float32"), windows)
    assert reference > 2.0  # a trained model's loss, not a broken pipeline's
    assert abs(nll - reference) / reference < TOLERANCE[qtype], (qtype, nll, reference)
