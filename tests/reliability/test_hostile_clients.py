"""Careless and hostile sampling settings (issue 21): each is served right or refused with a
400 naming the field (offline: a ValueError), never answered wrongly or slowly."""

from __future__ import annotations

import pytest

from carpool import SamplingParams
from tests.reliability.live import MODEL, assert_openai_error, greedy_texts, wait_idle_and_intact

pytestmark = pytest.mark.slow  # a live server (still run in CI)

PROMPT = "def f(x):"

# Values that pass a float64 range check but vanish in the float32 sampler.
FLOAT32_UNDERFLOWS = [("top_p", 1e-50), ("min_p", 1e-45), ("repetition_penalty", 1e-300),
                      ("presence_penalty", -1e-40), ("frequency_penalty", 1e-39)]


def test_underflowing_temperature_is_greedy_offline(reference_llm):
    expected = greedy_texts(reference_llm, [PROMPT], 8)[0]
    assert expected
    for temperature in (1e-40, 1e-6):
        params = SamplingParams(max_tokens=8, temperature=temperature, ignore_eos=True, seed=3)
        out = reference_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
        assert out.text == expected, temperature


@pytest.mark.parametrize("field,value", FLOAT32_UNDERFLOWS)
def test_underflowing_float_is_a_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be 0 or at least 1.17549e-38"):
        SamplingParams(**{field: value})
    SamplingParams(**{field: 2e-38 if field != "presence_penalty" else -2e-38})  # normal: fine


def test_underflowing_temperature_over_http_is_the_greedy_answer(edge_server, reference_llm):
    expected = greedy_texts(reference_llm, [PROMPT], 8)[0]
    with edge_server.http() as http:
        for temperature in (1e-40, 0):
            response = http.post("/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": temperature,
                "ignore_eos": True})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected, temperature


@pytest.mark.parametrize("field,value", FLOAT32_UNDERFLOWS)
def test_underflowing_float_over_http_is_a_400_naming_it(edge_server, field, value):
    with edge_server.http() as http:
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 4, field: value})
    error = assert_openai_error(response, 400, "float32")
    assert error["param"] == field
    wait_idle_and_intact(edge_server)
