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
    expected = build_workload(WorkloadConfig(name="random", num_prompts=6, input_len=16,
                                             output_len=6, range_ratio=0.0),
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


def test_chat_backend_times_the_first_token_not_the_role_chunk(server, tmp_path):
    """openai-chat streams /v1/chat/completions; the role-only chunk is no token, so every
    request counts exactly its output tokens' chunks (ignore_eos: max_tokens each)."""
    base_url, checkpoint = server
    result = tmp_path / "chat.json"
    rc = main(["bench", "serve", "--base-url", base_url, "--tokenizer", str(checkpoint),
               "--api-key", API_KEY, "--backend", "openai-chat", "--dataset-name", "random",
               "--num-prompts", "3", "--random-input-len", "12", "--random-output-len", "5",
               "--temperature", "0", "--ignore-eos", "--no-progress",
               "--result-file", str(result)])
    assert rc == 0
    data = json.loads(result.read_text())
    assert data["num_completed"] == 3 and data["total_output_tokens"] == 15
    assert 0 < data["ttft"]["median_ms"] <= data["e2el"]["median_ms"]


def test_serve_defaults_are_vllm_bench_serves_and_all_shown():
    import argparse

    from carpool.bench import cli as bench_cli

    parser = argparse.ArgumentParser(prog="carpool bench")
    bench_cli.add_arguments(parser)
    args = parser.parse_args(["serve"])
    assert (args.workload, args.num_prompts, args.input_len, args.output_len,
            args.range_ratio, args.request_rate, args.temperature, args.backend,
            args.max_concurrency, args.seed) == (
        "random", 1000, 1024, 128, 0.0, float("inf"), None, "openai", None, 0)
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve_parser = serve.choices["serve"]
    help_text = " ".join(serve_parser.format_help().split())
    for action in serve_parser._actions:
        if action.option_strings and action.dest != "help":
            assert f"(default: {action.default})" in help_text, action.dest
