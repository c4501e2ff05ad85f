"""A vLLM launch line starts `carpool serve` and every flag in it is honoured; start-up
errors are one line, before anything is served, exit status 1."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import sys

import httpx
import pytest

from carpool import LLM
from carpool.arg_utils import human_readable_int, human_readable_int_or_auto
from carpool.bench.local_server import LocalServer, free_port
from carpool.config import EngineConfig
from carpool.config.named_files import read_chat_template
from carpool.engine.llm_engine import LLMEngine
from carpool.engine.tokenizer import load_tokenizer
from tests.flags import serve_parser

TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


@pytest.mark.parametrize("text,value", [("4096", 4096), ("32k", 32000), ("32K", 32768),
                                        ("1.5k", 1500), ("2m", 2 * 10**6), ("2M", 2 * 2**20),
                                        ("1G", 2**30), (" 7 ", 7)])
def test_human_readable_int_is_vllms(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "k", "32kb", "", "1e3"])
def test_human_readable_int_refuses_with_a_hint(text):
    with pytest.raises(argparse.ArgumentTypeError, match="32k"):
        human_readable_int(text)


def test_max_model_len_auto_and_model_flag_forms():
    assert human_readable_int_or_auto("auto") is None and human_readable_int_or_auto("-1") is None
    parser = serve_parser()
    assert parser.parse_args(["--model", "a"]).model == "a"
    assert parser.parse_args(["a", "--model", "a"]).model == "a"
    assert parser.parse_args(["a"]).model == "a" and parser.parse_args([]).model is None
    with pytest.raises(SystemExit):
        parser.parse_args(["a", "--model", "b"])
    args = parser.parse_args(["--dtype", "half", "--kv-cache-memory-bytes", "2G"])
    assert args.kv_cache_memory == 2 * 2**30
    config = EngineConfig.from_cli_args(args)
    assert config.dtype == "float16" and config.kv_cache_memory == 2 * 2**30
    assert parser.parse_args(["--kv-cache-memory", "2GiB"]).kv_cache_memory == 2 * 2**30


@pytest.mark.parametrize("argv", [["carpool-default"], ["--model", "carpool-default"]])
def test_the_built_in_models_served_name_is_a_model_argument(argv):
    config = EngineConfig.from_cli_args(serve_parser().parse_args(argv), usage="server")
    engine = LLMEngine.from_config(dataclasses.replace(config, num_kv_blocks=8))
    assert engine.served_model_name == "carpool-default"
    assert engine.model_config == LLMEngine.from_config(dataclasses.replace(
        config, model=None, num_kv_blocks=8)).model_config  # the built-in model's


def test_chat_template_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE == read_chat_template(TEMPLATE)
    with pytest.raises(ValueError, match="chat_template 'missing.jinja' is neither"):
        read_chat_template("missing.jinja")


def test_generation_config_auto_vllm_or_folder(llama_checkpoint, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3,
                                                                  "top_k": 7}))
    common = dict(device="cpu", num_kv_blocks=8, max_model_len=64)
    folder = LLM(str(llama_checkpoint), generation_config=str(tmp_path), **common)
    defaults = folder.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.3, 7)
    none = LLM(str(llama_checkpoint), generation_config="vllm", **common)
    assert none.get_default_sampling_params().temperature == 1.0
    with pytest.raises(ValueError, match="generation_config must be"):
        EngineConfig.from_args(str(llama_checkpoint), generation_config=str(tmp_path / "no"))


@pytest.mark.slow
def test_vllm_launch_line_is_honoured(llama_checkpoint, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    # LocalServer passes the model positionally; vLLM's --model form names the same one
    flags = ["--model", str(llama_checkpoint), "--tokenizer", str(llama_checkpoint),
             "--chat-template", str(template), "--generation-config", "vllm",
             "--max-logprobs", "3", "--uvicorn-log-level", "warning", "--disable-log-stats",
             "--enable-log-requests", "--enforce-eager", "--kv-cache-memory-bytes", "1M",
             "--dtype", "float", "--max-model-len", "0.2k", "--served-model-name", "m"]
    local = LocalServer(llama_checkpoint, flags, tmp_path / "server.log")
    with local as base_url, httpx.Client(base_url=base_url, timeout=60) as http:
        assert http.get("/v1/models").json()["data"][0]["max_model_len"] == 200
        tokens = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                              "add_generation_prompt": False}).json()["tokens"]
        expected = load_tokenizer(llama_checkpoint).encode("[hi]", add_special_tokens=False)
        assert tokens == expected
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        refused = http.post("/v1/completions", json={**body, "logprobs": 4})
        assert refused.status_code == 400 and "--max-logprobs" in refused.json()["error"]["message"]
        assert http.post("/v1/completions", json={**body, "logprobs": 3}).status_code == 200
    log = local.log()
    assert "request cmpl-" in log  # --enable-log-requests
    assert "Uvicorn running" not in log and "POST /v1/completions" not in log  # uvicorn: warning
    kv = re.search(r"KV cache: (\d+) blocks of 16 tokens = \d+ tokens, (\d+) bytes", log)
    num_blocks, num_bytes = int(kv.group(1)), int(kv.group(2))
    assert num_bytes <= 2**20 < num_bytes + num_bytes // num_blocks  # 1M = 2**20, vLLM's M


@pytest.mark.slow
@pytest.mark.parametrize("argv,says", [
    (["{ckpt}", "--max-model-len", "100k"], "--max-model-len (100000) is larger than the "
                                             "model's max_position_embeddings"),
    (["{tmp}/no-such-model"], "no-such-model"),
    (["{ckpt}", "--chat-template", "no-such.jinja"], "--chat-template 'no-such.jinja'"),
    (["{ckpt}", "--speculative-config", '{{"method": "ngram", "num_speculative_tokens": 0}}'],
     "--speculative-config.num_speculative_tokens must be a positive integer"),
    (["{ckpt}", "--speculative-config", '{{"method": "ngram", "lookahead": 3}}'],
     "--speculative-config.lookahead is not a known key"),
    (["{ckpt}", "--speculative-config",
      '{{"method": "draft_model", "model": "{tmp}/no-such-draft"}}'],
     "--speculative-config.model: model folder"),
])
def test_start_up_errors_are_one_line_exit_1(llama_checkpoint, tmp_path, argv, says):
    argv = [a.format(ckpt=llama_checkpoint, tmp=tmp_path) for a in argv]
    process = subprocess.run([sys.executable, "-m", "carpool.cli", "serve", *argv, "--port",
                              str(free_port())], capture_output=True, text=True, timeout=120)
    assert process.returncode == 1
    lines = [line for line in process.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], process.stderr
    assert "Traceback" not in process.stderr and "Uvicorn running" not in process.stderr
