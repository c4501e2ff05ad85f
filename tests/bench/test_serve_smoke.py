"""`carpool bench serve` against a real `carpool serve` subprocess on a free loopback port."""

from __future__ import annotations

import json

import pytest

from carpool.bench.local_server import LocalServer
from carpool.bench.workloads import WorkloadConfig, build_workload
from carpool.cli import main
from carpool.engine.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # a live server (still run in CI)

MODEL_NAME = "bench-tiny"
API_KEY = "bench-key"


@pytest.fixture(scope="module")
def server(make_checkpoint, tmp_path_factory):
    """`carpool serve` on the tiny checkpoint; yields (base_url, checkpoint)."""
    checkpoint = make_checkpoint("llama")
    flags = ["--served-model-name", MODEL_NAME, "--max-model-len", "256", "--max-num-seqs", "4",
             "--num-kv-blocks", "256", "--api-key", API_KEY, "--log-level", "warning"]
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    with LocalServer(checkpoint, flags, log_path) as base_url:
        yield base_url, checkpoint


def test_load_generator_streams_every_request(server, tmp_path, capsys):
    base_url, checkpoint = server
    result = tmp_path / "serve.json"
    rc = main(["bench", "serve", "--base-url", base_url, "--tokenizer", str(checkpoint),
               "--api-key", API_KEY, "--workload", "random", "--num-prompts", "6", "--input-len", "16", "--output-len", "6",
               "--request-rate", "20", "--max-concurrency", "2", "--ignore-eos",
               "--slo", "ttft=600000,tpot=600000", "--no-progress", "--result-file", str(result)])
    assert rc == 0
    expected = build_workload(WorkloadConfig(name="random", num_prompts=6, input_len=16, output_len=6),
                              load_tokenizer(checkpoint), with_text=True)
    data = json.loads(result.read_text())
    assert data["num_completed"] == 6 and data["num_failed"] == 0
    assert data["total_output_tokens"] == sum(r.max_tokens for r in expected)
    assert data["total_input_tokens"] == sum(len(r.prompt_token_ids) for r in expected)
    assert 1 <= data["peak_concurrency"] <= 2
    assert data["goodput"] == pytest.approx(data["request_throughput"])  # generous SLOs: all meet them
    assert 0 < data["ttft"]["median_ms"] <= data["e2el"]["median_ms"]
    assert data["itl"]["mean_ms"] > 0
    out = capsys.readouterr().out
    assert "Successful requests:" in out and "P99 ITL (ms):" in out


def test_unknown_model_counts_as_failed_requests(server, capsys):
    base_url, checkpoint = server
    rc = main(["bench", "serve", "--base-url", base_url, "--tokenizer", str(checkpoint),
               "--api-key", API_KEY, "--model", "no-such-model", "--workload", "random", "--num-prompts", "2",
               "--input-len", "8", "--output-len", "2", "--no-progress"])
    assert rc == 1
    captured = capsys.readouterr()
    assert "Failed requests:" in captured.out and "HTTP 404" in captured.err


def test_wrong_api_key_is_a_clear_error(server, capsys):
    base_url, checkpoint = server
    rc = main(["bench", "serve", "--base-url", base_url, "--tokenizer", str(checkpoint),
               "--api-key", "wrong", "--num-prompts", "1", "--no-progress"])
    assert rc == 2
    assert "/v1/models answered HTTP 401" in capsys.readouterr().err
