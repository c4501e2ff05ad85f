"""`carpool serve model.gguf`: the file's own tokenizer and chat template, its quantization
shown by /v1/models and /metrics, and what the official openai client gets equal to what the
same file gives in transformers."""

from __future__ import annotations

import pytest
import torch

from carpool.bench.local_server import LocalServer
from carpool.default_model_path import default_model_path
from carpool.testing.gguf_writer import write_gguf
from tests.server.live import MESSAGES


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf_server")
    file = write_gguf(default_model_path(), folder / "default-Q8_0.gguf", "Q8_0")
    flags = ["--num-kv-blocks", "128", "--max-model-len", "256", "--dtype", "float32"]
    with LocalServer(file, flags, folder / "server.log") as base_url:
        yield base_url, file


def test_models_and_metrics_show_the_quantization(gguf_server):
    import httpx

    base_url, file = gguf_server
    card = httpx.get(f"{base_url}/v1/models").json()["data"][0]
    assert card["id"] == str(file)
    assert card["quantization"].startswith("gguf") and "Q8_0" in card["quantization"]
    metrics = httpx.get(f"{base_url}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("carpool:model_config_info{"))
    assert 'quantization="gguf' in line and "Q8_0" in line


def test_chat_uses_the_files_template_and_matches_transformers(gguf_server):
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_url, file = gguf_server
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=str(file), messages=MESSAGES, max_tokens=16,
                                           temperature=0, logprobs=True)
    tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    assert tokenizer.chat_template  # the file carries it; the server used it
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    assert reply.usage.prompt_tokens == len(ids)
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                 dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16)
    expected = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert reply.choices[0].message.content == expected
