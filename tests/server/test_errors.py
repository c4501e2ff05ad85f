"""Every rejection gets OpenAI's error body and the right status; FastAPI's 422 never leaks."""

from __future__ import annotations

import pytest

from tests.server.live import MODEL_NAME

pytestmark = pytest.mark.slow  # a live server (still run in CI)

COMPLETION = {"model": MODEL_NAME, "prompt": "def f(x):", "max_tokens": 4}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def assert_error(response, status: int, param: str | None = None,
                 mentions: tuple[str, ...] = ()) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    for word in mentions:
        assert word in error["message"], error["message"]
    return error


INVALID_COMPLETION_FIELDS = [
    ({"max_tokens": -1}, "max_tokens", ()),
    ({"max_tokens": 0}, "max_tokens", ()),
    ({"max_tokens": "many"}, "max_tokens", ()),
    ({"temperature": 2.5}, "temperature", ()),
    ({"temperature": -0.1}, "temperature", ()),
    ({"top_p": 1.5}, "top_p", ()),
    ({"top_p": 0}, "top_p", ()),
    ({"n": 0}, "n", ()),
    ({"n": 10**6}, "n", ()),
    ({"logprobs": -1}, "logprobs", ()),
    ({"logprobs": 21}, "logprobs", ("--max-logprobs", "20")),
    ({"logprobs": 10**6}, "logprobs", ()),
    ({"presence_penalty": 3}, "presence_penalty", ()),
    ({"frequency_penalty": -3}, "frequency_penalty", ()),
    ({"top_k": -5}, "top_k", ()),
    ({"min_p": 2}, "min_p", ()),
    ({"repetition_penalty": 0}, "repetition_penalty", ()),
    ({"min_tokens": 9}, "min_tokens", ()),
    ({"stop": [""]}, "stop", ()),
    ({"stop": ["x"] * 65}, "stop", ("64",)),
    ({"max_tokens": True}, "max_tokens", ()),
    ({"temperature": True}, "temperature", ()),
    ({"stop": "x" * 1001}, "stop", ("1000",)),
    ({"stop_token_ids": [-1]}, "stop_token_ids", ()),
    ({"seed": "abc"}, "seed", ()),
    ({"stream": "sometimes"}, "stream", ()),
    ({"stream": 1}, "stream", ("boolean",)),
    ({"echo": "true"}, "echo", ("boolean",)),
    ({"stop_token_ids": [1] * 4097}, "stop_token_ids", ("4096",)),
    ({"prompt": []}, "prompt", ()),
    ({"prompt": [[]]}, "prompt", ()),
    ({"prompt": [1, 2, 10**9]}, None, ("10", "out of range")),
    ({"prompt": None}, "prompt", ()),
    ({"max_tokens": 253}, None, ("256", "253")),  # 5 prompt tokens + 253 > max_model_len 256
    ({"max_tokens": 10**12}, None, ("256",)),
    ({"prompt_logprobs": -1}, "prompt_logprobs", ()),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", ("stream",)),
    ({"logit_bias": {"5": 10}}, "logit_bias", ()),
    ({"suffix": "end"}, "suffix", ()),
    ({"guided_choice": []}, "guided_choice", ()),
    ({"structured_outputs": {"regex": "a", "structural_tag": "x"}}, "structured_outputs",
     ("structural_tag",)),
]


INVALID_CHAT_FIELDS = [
    ({"messages": []}, "messages", ()),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", ()),
    ({"messages": [{"content": "hi"}]}, "messages", ()),
    ({"messages": "hi"}, "messages", ()),
    ({"top_logprobs": 2}, "top_logprobs", ("logprobs",)),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", ()),
    ({"logprobs": True, "top_logprobs": 21}, "logprobs", ("--max-logprobs", "20")),
    ({"max_completion_tokens": -3}, "max_tokens", ()),
    ({"max_completion_tokens": True}, "max_completion_tokens", ()),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs", ()),
    ({"stream_options": {"include_usage": "maybe"}}, "stream_options", ()),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice",
     ("--enable-auto-tool-choice",)),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", ()),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", ("'g'",)),
    ({"tool_choice": "required"}, "tool_choice", ("needs tools",)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", ("nonsense",)),
    ({"response_format": {"type": "xml"}}, "response_format", ("xml",)),
    ({"guided_regex": "[a-"}, "guided_regex", ("regex",)),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs",
     ("undefined_rule",)),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex",
     ("only one",)),
]


INVALID_FIELDS = ([("/v1/completions", COMPLETION, *case) for case in INVALID_COMPLETION_FIELDS]
                  + [("/v1/chat/completions", CHAT, *case) for case in INVALID_CHAT_FIELDS])


@pytest.mark.parametrize("path,base,fields,param,mentions", INVALID_FIELDS,
                         ids=[f"{path.rsplit('/', 1)[-1]}-{fields}"
                              for path, _, fields, _, _ in INVALID_FIELDS])
def test_invalid_field_is_400(server, path, base, fields, param, mentions):
    with server.http() as http:
        response = http.post(path, json={**base, **fields})
    assert_error(response, 400, param, mentions)


def test_streaming_request_rejected_before_the_stream(server):
    with server.http() as http:
        response = http.post("/v1/completions", json={**COMPLETION, "stream": True,
                                                        "max_tokens": 1000})
    assert_error(response, 400, None, ("256",))


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_sampling_floats_are_400(server, literal):
    body = b'{"model": "%s", "prompt": "x", "temperature": %s}' % (MODEL_NAME.encode(), literal)
    with server.http() as http:
        response = http.post("/v1/completions", content=body,
                             headers={"Content-Type": "application/json"})
    assert_error(response, 400, "temperature")


@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b'{"prompt": "x",}'])
def test_malformed_json_is_400(server, body):
    with server.http() as http:
        response = http.post("/v1/completions", content=body,
                             headers={"Content-Type": "application/json"})
    assert_error(response, 400)


def test_missing_required_field_is_400_not_422(server):
    with server.http() as http:
        assert_error(http.post("/v1/completions", json={"model": MODEL_NAME}), 400, "prompt")
        assert_error(http.post("/v1/chat/completions", json={"model": MODEL_NAME}), 400,
                     "messages")
        assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
        assert_error(http.post("/tokenize", json={}), 400, "prompt")


def test_unknown_model_is_404(server):
    with server.http() as http:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            error = assert_error(http.post(path, json={**body, "model": "gpt-17"}), 404, "model")
            assert error["code"] == "model_not_found" and "gpt-17" in error["message"]


def test_unknown_route_is_404_with_openai_body(server):
    with server.http() as http:
        assert_error(http.get("/v1/nothing-here"), 404)
        assert_error(http.get("/v1/completions"), 405)


def test_api_key_required_on_v1_and_state_routes_only(server):
    import httpx
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL_NAME}")):
            error = assert_error(anonymous.request(method, path, json=COMPLETION), 401)
            assert error["code"] == "invalid_api_key"
        # scrapers, probes and orchestrators send no key
        for path in ("/health", "/ping", "/metrics", "/version", "/load"):
            assert anonymous.get(path).status_code == 200, path
        # the routes that cost work or change or reveal the server's state need it
        assert_error(anonymous.post("/tokenize", json={"prompt": "hi"}), 401)
        assert_error(anonymous.get("/stats"), 401)
        wrong = anonymous.post("/v1/completions", json=COMPLETION,
                               headers={"Authorization": "Bearer test-key-124"})
        assert_error(wrong, 401)


def test_openai_client_sees_errors_as_exceptions(server):
    import openai
    bad_key = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL_NAME, prompt="x", temperature=3)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=CHAT["messages"])


def test_unknown_fields_are_ignored_with_one_warning_naming_them(server):
    with server.http() as http:
        response = http.post("/v1/completions", json={**COMPLETION, "frobnicate_xyz": 1})
        assert response.status_code == 200, response.text
        response = http.post("/v1/chat/completions", json={**CHAT, "quux_field": True})
        assert response.status_code == 200, response.text
    log = server.local.log()
    assert log.count("ignored: frobnicate_xyz") == 1 and log.count("ignored: quux_field") == 1
