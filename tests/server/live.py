"""The server tests' live server and what they read from it (importable; fixtures in conftest)."""

from __future__ import annotations

import time
import typing
from dataclasses import dataclass
from pathlib import Path

import httpx

from carpool.bench.local_server import LocalServer

API_KEY = "test-key-123"
MODEL_NAME = "tiny-llama"
SERVER_FLAGS = ["--num-kv-blocks", "512", "--max-model-len", "256", "--max-num-seqs", "64",
                "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                "--dtype", "float32"]  # compared with transformers in float32
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Print the first ten squares."}]


@dataclass
class Server:
    local: LocalServer
    base_url: str
    model: str
    checkpoint: Path

    def client(self, **kwargs):
        """The official client; its response models built up front, so threads may share it."""
        import openai
        prebuild_models(openai.types.Completion, openai.types.chat.ChatCompletion)
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=API_KEY, max_retries=0,
                             timeout=60, **kwargs)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=60,
                            headers={"Authorization": f"Bearer {API_KEY}"}, **kwargs)


def prebuild_models(*models) -> None:
    """Build each pydantic model reachable from `models` now.

    The openai client defers building its response models to their first use, and
    two threads parsing their first responses at once can race in that build
    (pydantic then raises "BaseModel cannot be instantiated directly").
    """
    import pydantic

    seen: set[type] = set()
    todo: list = list(models)
    while todo:
        annotation = todo.pop()
        todo.extend(typing.get_args(annotation))
        if (isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel)
                and annotation not in seen):
            seen.add(annotation)
            annotation.model_rebuild()
            todo.extend(field.annotation for field in annotation.model_fields.values())


def wait_until_idle(server: Server, timeout: float = 30.0) -> dict:
    """Poll /stats until no request is running or waiting; returns the last snapshot."""
    deadline = time.monotonic() + timeout
    with server.http() as http:
        while True:
            snapshot = http.get("/stats").json()
            if snapshot["num_running"] == 0 and snapshot["num_waiting"] == 0:
                return snapshot
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout}s: {snapshot}")
            time.sleep(0.05)


def metric_value(text: str, name: str, **labels) -> float:
    """One sample of Prometheus text format; 0.0 if a labelled counter was never incremented."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    if labels:
        return 0.0
    raise KeyError(f"{name} not in metrics")


def assert_greedy_equals_offline(server: Server, prompts: list[str], max_tokens: int) -> list:
    """The server's greedy completions of `prompts` (one request) and its chat reply to
    MESSAGES equal the offline `LLM`'s on the same checkpoint; returns the offline outputs."""
    from carpool import LLM, SamplingParams

    with LLM(str(server.checkpoint), dtype="float32", num_kv_blocks=128,
             max_model_len=256) as llm:
        expected = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0),
                                use_tqdm=False)
        chat = llm.chat(MESSAGES, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
    client = server.client()
    out = client.completions.create(model=server.model, prompt=prompts, max_tokens=max_tokens,
                                    temperature=0)
    assert [c.text for c in out.choices] == [want.outputs[0].text for want in expected]
    reply = client.chat.completions.create(model=server.model, messages=MESSAGES,
                                           max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == chat[0].outputs[0].text
    return expected
