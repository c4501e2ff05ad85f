"""A checkpoint's generation_config.json sampling fields fill what a request leaves unset."""

from __future__ import annotations

import json

from carpool.models.generation_defaults import load_sampling_defaults
from carpool.server.protocol import ChatCompletionRequest, CompletionRequest


def test_reads_only_sampling_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "repetition_penalty": 1.05, "top_k": 20, "temperature": 0.7,
         "do_sample": True, "top_p": None}))
    assert load_sampling_defaults(tmp_path) == {"repetition_penalty": 1.05, "top_k": 20,
                                                "temperature": 0.7}


def test_no_generation_config_means_no_defaults(tmp_path):
    assert load_sampling_defaults(tmp_path) == {}


def test_unset_request_fields_take_the_defaults_and_set_ones_win():
    defaults = {"repetition_penalty": 1.1, "temperature": 0.7, "top_k": 20}
    params = CompletionRequest(prompt="x").to_sampling_params(defaults)
    assert (params.repetition_penalty, params.temperature, params.top_k) == (1.1, 0.7, 20)
    params = CompletionRequest(prompt="x", temperature=0.0,
                               repetition_penalty=1.0).to_sampling_params(defaults)
    assert (params.repetition_penalty, params.temperature, params.top_k) == (1.0, 0.0, 20)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.to_sampling_params(defaults).repetition_penalty == 1.1
    assert chat.to_sampling_params().repetition_penalty == 1.0
