"""Careless and hostile sampling settings (issue 21): each is served right or refused with a
400 naming the field (offline: a ValueError), never answered wrongly or slowly."""

from __future__ import annotations

import time

import httpx
import pytest

from carpool import SamplingParams
from carpool.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from tests.reliability.live import API_KEY, MODEL, assert_openai_error, greedy_texts, wait_idle_and_intact

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


TOO_MANY_STOPS = [
    (["s%d" % i for i in range(MAX_STOP_STRINGS + 1)], "at most 64 strings"),
    (["x" * 1001], "at most 1000 characters each"),
    (["%d" % i + "x" * 990 for i in range(9)], "total at most 8192 characters"),
]


@pytest.mark.parametrize("stop,words", TOO_MANY_STOPS, ids=["count", "length", "total"])
def test_stop_strings_over_the_caps_are_a_value_error(stop, words):
    with pytest.raises(ValueError, match=rf"^stop .*{words}"):
        SamplingParams(stop=stop)


def test_stop_strings_at_the_caps_are_served(edge_server):
    stop = ["%02d" % i + "z" * 126 for i in range(MAX_STOP_STRINGS)]  # 8192 characters
    with edge_server.http() as http:
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stop": stop})
    assert response.status_code == 200, response.text


def test_a_hundred_thousand_stop_strings_get_a_quick_400(edge_server):
    with edge_server.http() as http:
        start = time.monotonic()
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 4,
            "stop": ["s%d" % i for i in range(100_000)]})
        elapsed = time.monotonic() - start
    error = assert_openai_error(response, 400, "at most 64 strings", "100000")
    assert error["param"] == "stop"
    assert elapsed < 5, elapsed
    wait_idle_and_intact(edge_server)


def test_stop_token_ids_are_a_set_capped_in_number():
    params = SamplingParams(stop_token_ids=[7, 3, 7, 3, 9])
    assert params.stop_token_ids == frozenset({3, 7, 9})
    assert isinstance(params.stop_token_ids, frozenset)  # looked up per token: O(1)
    assert SamplingParams(stop_token_ids=range(MAX_STOP_TOKEN_IDS)).stop_token_ids == frozenset(
        range(MAX_STOP_TOKEN_IDS))
    # the cap counts ids as given, duplicates too: it bounds the work of reading them
    for ids in (range(MAX_STOP_TOKEN_IDS + 1), [1] * 700_000):
        with pytest.raises(ValueError, match=rf"^stop_token_ids must hold at most "
                                             rf"{MAX_STOP_TOKEN_IDS} ids, got {len(ids)}$"):
            SamplingParams(stop_token_ids=ids)
    for bad in ([1, -1], [1, True], [2.0], 5, "12"):
        with pytest.raises(ValueError, match=r"^stop_token_ids must be"):
            SamplingParams(stop_token_ids=bad)


def test_four_hundred_thousand_stop_token_ids_get_a_quick_400(edge_server):
    with edge_server.http() as http:
        start = time.monotonic()
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 4,
            "stop_token_ids": [i % 10 for i in range(400_000)]})  # under the 1MiB body limit
        elapsed = time.monotonic() - start
    error = assert_openai_error(response, 400, f"at most {MAX_STOP_TOKEN_IDS} ids", "400000")
    assert error["param"] == "stop_token_ids"
    assert elapsed < 5, elapsed
    wait_idle_and_intact(edge_server)


def test_stop_token_ids_outside_the_vocabulary_are_a_400(edge_server):
    with edge_server.http() as http:
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 4,
            "stop_token_ids": [5, VOCAB_SIZE, 10**9]})
    error = assert_openai_error(response, 400, f"[0, {VOCAB_SIZE})", str(VOCAB_SIZE))
    assert error["param"] == "stop_token_ids"
    wait_idle_and_intact(edge_server)


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(edge_server, scheme):
    with httpx.Client(base_url=edge_server.base_url, timeout=60) as http:
        response = http.get("/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("values", [
    [f"Bearer {API_KEY}", f"Bearer {API_KEY}"],
    ["Bearer wrong", f"Bearer {API_KEY}"],
    [f"Bearer {API_KEY}", "Bearer wrong"],
], ids=["both-right", "right-last", "right-first"])
def test_two_authorization_headers_are_refused(edge_server, values):
    with httpx.Client(base_url=edge_server.base_url, timeout=60) as http:
        response = http.get("/v1/models", headers=[("Authorization", v) for v in values])
    assert assert_openai_error(response, 401)["code"] == "invalid_api_key"


@pytest.mark.parametrize("scheme", ["Basic", "Token", "Bearer:"])
def test_other_schemes_are_refused(edge_server, scheme):
    with httpx.Client(base_url=edge_server.base_url, timeout=60) as http:
        response = http.get("/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
    assert_openai_error(response, 401)


@pytest.mark.parametrize("field,value", [("max_tokens", True), ("n", True), ("seed", False),
                                         ("temperature", True), ("max_tokens", 4.0),
                                         ("max_tokens", "4")])
def test_booleans_and_lookalikes_are_not_numbers(edge_server, field, value):
    with edge_server.http() as http:
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 4, field: value})
    assert assert_openai_error(response, 400)["param"] == field


def test_token_id_prompt_of_booleans_is_a_400(edge_server):
    with edge_server.http() as http:
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": [True, False], "max_tokens": 4})
    assert_openai_error(response, 400)


VOCAB_SIZE = 512  # the test checkpoints' vocabulary


def test_settings_masking_every_token_are_a_value_error_offline(reference_llm):
    params = SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=range(VOCAB_SIZE))
    with pytest.raises(ValueError, match=r"^stop_token_ids: .* mask all 512 tokens"):
        reference_llm.generate([PROMPT], params, use_tqdm=False)
    # One token left unmasked: it is generated until min_tokens.
    eos = reference_llm.get_tokenizer().eos_token_id
    params = SamplingParams(min_tokens=3, max_tokens=3, temperature=0,
                            stop_token_ids=[t for t in range(VOCAB_SIZE) if t not in (eos, 42)])
    out = reference_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [42, 42, 42]


def test_settings_masking_every_token_are_a_400(edge_server):
    with edge_server.http() as http:
        response = http.post("/v1/completions", json={
            "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "min_tokens": 2,
            "stop_token_ids": list(range(VOCAB_SIZE))})
    assert assert_openai_error(response, 400, "mask all")["param"] == "stop_token_ids"
    wait_idle_and_intact(edge_server)
