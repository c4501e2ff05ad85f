"""What vLLM users already run works unchanged against a live `carpool serve`: the openai
client's routes, a Prometheus scrape without a key, vLLM's request histograms and a Grafana
dashboard over them, lm-evaluation-harness' echo + logprobs requests (prompt logprobs equal
transformers' log-softmax), and chat streams whose role chunk waits for the first token."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from carpool.outputs import StepOutput
from carpool.server import chat
from tests.server.live import MODEL_NAME, metric_value

pytestmark = pytest.mark.slow  # a live server (still run in CI)

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "carpool.json"
PROMPT_IDS = [7, 81, 300, 12, 45, 199, 3, 66, 250, 18, 91, 140]


@pytest.fixture(scope="module")
def hf_logprobs(server):
    """transformers' float32 log-softmax over PROMPT_IDS: row p scores token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(server.checkpoint),
                                                 dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([PROMPT_IDS])).logits[0].float(), dim=-1)


def test_models_retrieve_ping_load_and_no_embeddings(client, server):
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.model_extra["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
    with pytest.raises(openai.NotFoundError, match="embeddings"):
        client.embeddings.create(model=MODEL_NAME, input="hi")
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        assert anonymous.get("/ping").status_code == 200
        assert anonymous.post("/ping").status_code == 200
        assert anonymous.get("/load").json() == {"server_load": 0, "engine_stalled": False}


def test_echo_logprobs_max_tokens_0_scores_the_prompt_like_transformers(client, hf_logprobs):
    """lm-evaluation-harness' loglikelihood request: the prompt back, with its logprobs."""
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, echo=True, logprobs=2,
                                    max_tokens=0, temperature=0)
    choice = out.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(PROMPT_IDS) and "".join(logprobs.tokens) == choice.text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.text_offset[0] == 0
    for p, token_id in enumerate(PROMPT_IDS[1:]):
        assert logprobs.token_logprobs[p + 1] == pytest.approx(
            hf_logprobs[p, token_id].item(), abs=1e-3)
        # keyed by text, so tokens that decode alike share one entry: the likelier one's
        top = logprobs.top_logprobs[p + 1]
        assert max(top.values()) == pytest.approx(hf_logprobs[p].max().item(), abs=1e-3)
        floor = min(hf_logprobs[p].topk(2).values.min().item(), hf_logprobs[p, token_id].item())
        assert min(top.values()) >= floor - 1e-3


def test_echo_logprobs_with_generation_puts_the_prompt_first(client, hf_logprobs):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, echo=True, logprobs=0,
                                    max_tokens=3, temperature=0)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, logprobs=0,
                                      max_tokens=3, temperature=0)
    echoed = out.choices[0]
    assert echoed.text.endswith(plain.choices[0].text)
    logprobs = echoed.logprobs
    assert len(logprobs.tokens) == len(PROMPT_IDS) + 3
    assert logprobs.token_logprobs[len(PROMPT_IDS):] == pytest.approx(
        plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert logprobs.token_logprobs[1] == pytest.approx(hf_logprobs[0, PROMPT_IDS[1]].item(),
                                                       abs=1e-3)
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, echo=True,
                                              logprobs=0, max_tokens=3, temperature=0,
                                              stream=True))
    first = streamed[0].choices[0]
    assert first.logprobs.token_logprobs[0] is None
    assert first.logprobs.token_logprobs[1:] == pytest.approx(
        logprobs.token_logprobs[1:len(PROMPT_IDS)], abs=1e-4)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.text


def test_vllm_prompt_logprobs_field(client, server, hf_logprobs):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=1,
                                    extra_body={"prompt_logprobs": 1})
    positions = out.choices[0].model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(PROMPT_IDS)
    for p, token_id in enumerate(PROMPT_IDS[1:]):
        entry = positions[p + 1][str(token_id)]
        assert entry["logprob"] == pytest.approx(hf_logprobs[p, token_id].item(), abs=1e-3)
        assert entry["rank"] == int((hf_logprobs[p] > hf_logprobs[p, token_id]).sum()) + 1
    chat_out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0})
    assert chat_out.model_extra["prompt_logprobs"][0] is None
    with server.http() as http:
        refused = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi",
                                                     "prompt_logprobs": 21})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_metrics_scrape_needs_no_key_and_has_vllm_request_histograms(client, server):
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        before = anonymous.get("/metrics").text
        out = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=5, n=2,
                                        temperature=1.0, seed=1, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 10
        # the loop thread records a step's metrics just after handing out its outputs
        deadline = time.monotonic() + 10
        while True:
            text = anonymous.get("/metrics").text
            done = metric_value(text, "carpool:request_success_total", model_name=MODEL_NAME,
                                finished_reason="length")
            if done - metric_value(before, "carpool:request_success_total",
                                   model_name=MODEL_NAME, finished_reason="length") >= 2 \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.05)

    def gained(name: str, **labels) -> float:
        return (metric_value(text, f"carpool:{name}", model_name=MODEL_NAME, **labels)
                - metric_value(before, f"carpool:{name}", model_name=MODEL_NAME, **labels))

    assert gained("request_prompt_tokens_count") == 2
    assert gained("request_prompt_tokens_sum") == 2 * len(PROMPT_IDS)
    assert gained("request_generation_tokens_sum") == 10
    assert gained("request_params_max_tokens_sum") == 10
    assert gained("request_params_n_count") == 1 and gained("request_params_n_sum") == 2
    for name in ("request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds"):
        assert gained(f"{name}_count") == 2, name
        assert gained(f"{name}_sum") >= 0, name
    info = [line for line in text.splitlines() if line.startswith("carpool:cache_config_info{")]
    assert len(info) == 1 and 'block_size="16"' in info[0] and 'num_gpu_blocks="512"' in info[0]
    assert info[0].endswith(" 1.0")


def test_grafana_dashboard_queries_only_exported_metrics(server):
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    queries.append(dashboard["templating"]["list"][1]["query"]["query"])
    assert len(queries) >= 10
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        text = anonymous.get("/metrics").text
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                if line and not line.startswith("#")}
    for query in queries:
        names = re.findall(r"carpool:[a-z0-9_]+", query)
        assert names, query
        for name in names:
            assert name in exported, f"{name} (in {query!r}) is not exported"


def test_chat_role_chunk_comes_with_the_first_output():
    """Nothing is sent before the engine produced the choice's first output; then the role
    chunk and the first content go out together."""
    ctx = chat.ChatContext("chatcmpl-1", 0, "m", None, tokenizer=None)
    queue: asyncio.Queue = asyncio.Queue()

    async def outputs():
        while (item := await queue.get()) is not None:
            yield item

    async def main() -> list[dict]:
        events = chat._events(outputs(), ctx, 1, None)
        first = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done()  # the prefill is still running: no role chunk yet
        await queue.put((0, StepOutput("r-0", [5], "Hi", 3, 1)))
        chunks = [await first, await events.__anext__()]
        await queue.put((0, StepOutput("r-0", [6], "!", 3, 2, finish_reason="length")))
        await queue.put(None)
        chunks += [event async for event in events]
        return [json.loads(c.removeprefix("data: ")) for c in chunks]

    chunks = asyncio.run(main())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hi"}, {"content": "!"}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_live_chat_stream_role_then_content(client):
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].delta.content
