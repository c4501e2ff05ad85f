"""LoRA adapters through the OpenAI API of a live `carpool serve`, with the official client:
adapters by name (`--lora-modules`, both forms) listed with their parent, greedy text equal
to PEFT's model with the adapter applied, an unknown name a 404 in OpenAI's shape, and
adapters loaded and unloaded at run time while requests on them run: none lost, no block
leaked, loads and evictions in /metrics."""

from __future__ import annotations

import json
import threading

import pytest

from carpool.bench.local_server import LocalServer
from carpool.testing.peft_adapters import ALL_MODULES, PeftGreedy, build_adapter
from tests.server.live import API_KEY, MODEL_NAME, SERVER_FLAGS, Server, metric_value

pytestmark = pytest.mark.slow  # a live server (still run in CI)

PROMPTS = ["def fibonacci(n):", "import sys\nimport os\n", "class Point:\n    def __init__(self"]
SPECS = (dict(rank=8, target_modules=ALL_MODULES), dict(rank=4, use_rslora=True),
         dict(rank=16, alpha=8, target_modules=("gate_proj", "up_proj", "down_proj")),
         dict(rank=8, alpha=32, target_modules=("q_proj", "o_proj")))


@pytest.fixture(scope="module")
def adapter_dirs(llama_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-adapters")
    return [build_adapter(llama_checkpoint, root / f"a{i}", seed=20 + i, **spec)
            for i, spec in enumerate(SPECS)]


@pytest.fixture(scope="module")
def lora_server(llama_checkpoint, adapter_dirs, tmp_path_factory):
    modules = [f"a0={adapter_dirs[0]}", f"a1={adapter_dirs[1]}",
               json.dumps({"name": "a2", "path": str(adapter_dirs[2]),
                           "base_model_name": MODEL_NAME})]
    flags = [*SERVER_FLAGS, "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2",
             "--allow-runtime-lora-updating", "--lora-modules", *modules]
    local = LocalServer(llama_checkpoint, flags,
                        tmp_path_factory.mktemp("lora-server") / "server.log")
    with local as base_url:
        yield Server(local, base_url, MODEL_NAME, llama_checkpoint)


@pytest.fixture(scope="module")
def peft_text(llama_checkpoint):
    from transformers import AutoTokenizer
    greedy = PeftGreedy(llama_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(str(llama_checkpoint))

    def text(adapter_dir, prompt: str, max_tokens: int) -> str:
        ids = tokenizer(prompt)["input_ids"]
        return tokenizer.decode(greedy(adapter_dir, ids, max_tokens), skip_special_tokens=True)
    return text


def test_models_lists_adapters_with_their_parent(lora_server, adapter_dirs):
    with lora_server.http() as http:
        cards = http.get("/v1/models").json()["data"]
    assert [c["id"] for c in cards] == [MODEL_NAME, "a0", "a1", "a2"]
    assert cards[0]["parent"] is None
    assert all(c["parent"] == MODEL_NAME for c in cards[1:])
    assert [c["root"] for c in cards[1:]] == [str(d) for d in adapter_dirs[:3]]
    assert lora_server.client().models.retrieve("a1").id == "a1"


def test_each_adapter_equals_peft(lora_server, adapter_dirs, peft_text):
    client = lora_server.client()
    texts = {}
    for name, folder in ((MODEL_NAME, None), ("a0", adapter_dirs[0]), ("a1", adapter_dirs[1]),
                         ("a2", adapter_dirs[2])):
        out = client.completions.create(model=name, prompt=PROMPTS, max_tokens=16,
                                        temperature=0)
        assert out.model == name
        texts[name] = [c.text for c in out.choices]
        assert texts[name] == [peft_text(folder, p, 16) for p in PROMPTS], name
    assert len({tuple(t) for t in texts.values()}) == 4  # every adapter changes the text


def test_unknown_adapter_is_openai_404(lora_server):
    import openai
    with pytest.raises(openai.NotFoundError) as caught:
        lora_server.client().completions.create(model="no-such-adapter", prompt="x",
                                                max_tokens=2)
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "no-such-adapter" in error["message"]


def test_load_unload_under_load_loses_nothing(lora_server, adapter_dirs, peft_text):
    client = lora_server.client()
    with lora_server.http() as http:
        assert http.post("/v1/load_lora_adapter",
                         json={"lora_name": "a3", "lora_path": str(adapter_dirs[3])}
                         ).status_code == 200
        again = http.post("/v1/load_lora_adapter",
                          json={"lora_name": "a3", "lora_path": str(adapter_dirs[3])})
        assert again.status_code == 400
        bad = http.post("/v1/load_lora_adapter",
                        json={"lora_name": "bad", "lora_path": str(lora_server.checkpoint)})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    results, errors = {}, []

    def run(i: int, name: str) -> None:
        try:
            out = client.completions.create(model=name, prompt=PROMPTS[i % 3], max_tokens=24,
                                            temperature=0)
            results[i] = (name, out.choices[0].text, out.choices[0].finish_reason)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append((i, name, exc))

    names = [MODEL_NAME, "a0", "a1", "a2", "a3"] * 4  # five models, two adapters a step
    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    with lora_server.http() as http:  # a3 goes while its requests run
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a3"}).status_code == 200
    for t in threads:
        t.join(120)
    assert not errors and len(results) == len(names)
    for i, (name, text, finish_reason) in results.items():
        assert finish_reason in ("stop", "length")
        if name != "a3":  # (a3's requests may have started before or after the unload)
            folder = None if name == MODEL_NAME else adapter_dirs[int(name[1])]
            assert text == peft_text(folder, PROMPTS[i % 3], 24), name
    import openai
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a3", prompt="x", max_tokens=2)
    with lora_server.http() as http:
        stats = http.get("/stats", params={"integrity": "true"}).json()
        assert stats["integrity"] == "ok"
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert http.post("/v1/unload_lora_adapter",
                         json={"lora_name": "a3"}).status_code == 404
        metrics = http.get("/metrics").text
    assert metric_value(metrics, "carpool:lora_adapter_loads_total") >= 4
    assert metric_value(metrics, "carpool:lora_adapter_evictions_total") >= 2
    assert "carpool:lora_requests_info{" in metrics and 'max_lora="2"' in metrics


def test_runtime_updates_off_without_the_flag(llama_checkpoint, adapter_dirs, tmp_path):
    flags = [*SERVER_FLAGS, "--enable-lora", "--max-lora-rank", "8"]
    with LocalServer(llama_checkpoint, flags, tmp_path / "server.log") as base_url:
        server = Server(None, base_url, MODEL_NAME, llama_checkpoint)
        with server.http() as http:
            off = http.post("/v1/load_lora_adapter",
                            json={"lora_name": "a0", "lora_path": str(adapter_dirs[0])})
            assert off.status_code == 404
            assert "--allow-runtime-lora-updating" in off.json()["error"]["message"]
    assert API_KEY  # (the shared flags' key guards these routes too)
