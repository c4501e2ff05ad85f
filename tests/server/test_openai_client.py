"""The official `openai` client against a real `carpool serve`: shapes, streaming, n, stop, seeds."""

from __future__ import annotations

import pytest

from tests.server.live import MESSAGES

pytestmark = pytest.mark.slow  # a live server (still run in CI)

PROMPT = "def fibonacci(n):"


def test_completion_shape_and_usage(client, server):
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8,
                                    temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.created > 0
    assert out.model == server.model
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason in ("length", "stop")
    assert out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    if choice.finish_reason == "length":
        assert out.usage.completion_tokens == 8


def test_chat_shape(client, server):
    out = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6,
                                         temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    (choice,) = out.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert out.usage.completion_tokens <= 6


def test_max_completion_tokens_alias(client, server):
    out = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                         max_completion_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_streamed_completion_equals_whole(client, server):
    whole = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12,
                                      temperature=0)
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_streamed_chat_role_first_finish_last_usage(client, server):
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=10,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunk, content_chunks = chunks[-1], chunks[:-1]
    assert usage_chunk.choices == []
    # The same counts; not the same cached_tokens: the streamed request may find the whole
    # one's prompt in the prefix cache (it does when it is the first with these messages).
    counts = {"completion_tokens", "prompt_tokens", "total_tokens"}
    assert usage_chunk.usage.model_dump(include=counts) == whole.usage.model_dump(include=counts)
    assert (usage_chunk.usage.prompt_tokens_details.cached_tokens
            >= whole.usage.prompt_tokens_details.cached_tokens)
    assert content_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole.choices[0].message.content


def test_stream_without_include_usage_has_no_usage_chunk(client, server):
    chunks = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=4,
                                            temperature=0, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_n2_choices_and_seeded_sampling_reproducible(client, server):
    kwargs = dict(model=server.model, prompt=PROMPT, max_tokens=10, temperature=1.0, n=2,
                  seed=1234)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    # choice i runs with seed + i: choice 1 here is choice 0 of a request seeded 1235
    shifted = client.completions.create(**dict(kwargs, n=1, seed=1235))
    assert shifted.choices[0].text == first.choices[1].text
    assert first.usage.prompt_tokens == shifted.usage.prompt_tokens  # counted once, not per choice


def test_n2_streamed_chat_each_choice_complete(client, server):
    chunks = list(client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=5, temperature=0.8, seed=7, n=2,
        stream=True, stream_options={"include_usage": True}))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].finish_reason}
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [0, 1] and set(finishes) == {0, 1}
    assert chunks[-1].usage.completion_tokens <= 10


def test_batch_of_prompts_and_token_id_prompts(client, server):
    with server.http() as http:
        ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    texts = client.completions.create(model=server.model, prompt=[PROMPT, PROMPT + " #"],
                                      max_tokens=6, temperature=0)
    token_lists = client.completions.create(model=server.model, prompt=[ids, ids + ids[-1:]],
                                            max_tokens=6, temperature=0)
    single = client.completions.create(model=server.model, prompt=ids, max_tokens=6,
                                       temperature=0)
    assert [c.index for c in texts.choices] == [c.index for c in token_lists.choices] == [0, 1]
    assert texts.choices[0].text == token_lists.choices[0].text == single.choices[0].text
    assert token_lists.usage.prompt_tokens == 2 * len(ids) + 1


def test_stop_string_ends_the_text(client, server):
    base = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[3:6]
    assert stop.strip(), f"pick another prompt: {text!r}"
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]
    streamed = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=16,
                                              temperature=0, stop=stop, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_echo_prefixes_the_prompt(client, server):
    plain = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5,
                                      temperature=0)
    echoed = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    streamed = list(client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5,
                                              temperature=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_completion_logprobs_legacy_shape(client, server):
    out = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5,
                                    temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == logprob  # greedy: the chosen token is the most likely


def test_chat_logprobs_shape(client, server):
    out = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.bytes == list(entry.token.encode("utf-8"))
    streamed = list(client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs
              for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]


def test_models_version_tokenize_detokenize(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]
    with server.http() as http:
        assert http.get("/version").json()["version"]
        tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        assert text == PROMPT
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        out = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=1)
        assert chat["count"] == out.usage.prompt_tokens


def test_startup_log_states_the_kv_cache(server):
    log = server.local.log()
    assert "KV cache: 512 blocks of 16 tokens = 8192 tokens" in log
    assert "max concurrency at max_model_len 256: 32.00 requests" in log
    assert "test-key-123" not in log  # the API key is never logged
