"""The server's pieces on their own: flags, request models, error bodies, SSE, metrics."""

from __future__ import annotations

import argparse

import pytest
from fastapi.exceptions import RequestValidationError
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from carpool.arg_utils import parse_bytes
from carpool.config import EngineConfig
from carpool.metrics import ServerMetrics
from carpool.outputs import EngineStats, RequestMetrics, StepOutput
from carpool.server import cli
from carpool.server.app import ServerSettings
from carpool.server.errors import APIError, bad_request, validation_error
from carpool.server.protocol import REQUEST_FIELDS, ChatCompletionRequest, CompletionRequest
from carpool.server.responses_protocol import ResponsesRequest
from carpool.server.sse import DONE, sse_event
from tests.flags import serve_parser


def parse(*argv: str) -> argparse.Namespace:
    return serve_parser().parse_args(list(argv))


def test_flags_map_to_engine_config():
    args = parse("--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                 "--max-model-len", "256", "--max-num-partial-prefills", "4",
                 "--max-long-partial-prefills", "2", "--long-prefill-token-threshold", "64",
                 "--block-size", "32", "--kv-cache-memory", "1GiB", "--scheduler", "static",
                 "--dtype", "float32", "--device", "cpu", "--seed", "5",
                 "--served-model-name", "m", "--gpu-memory-utilization", "0.5")
    config = EngineConfig.from_cli_args(args)
    s = config.scheduler
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len) == (8, 512, 256)
    assert (s.max_num_partial_prefills, s.max_long_partial_prefills) == (4, 2)
    assert (s.long_prefill_token_threshold, s.block_size, s.scheduler) == (64, 32, "static")
    assert config.kv_cache_memory == 2**30 and config.max_model_len == 256
    assert (config.model, config.dtype, config.device, config.seed) == (None, "float32", "cpu", 5)
    assert config.served_model_name == "m" and config.gpu_memory_utilization == 0.5


def test_defaults_and_unchunked_budget():
    args = parse()
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, None)
    config = EngineConfig.from_cli_args(parse("--no-enable-chunked-prefill",
                                              "--max-model-len", "512"))
    assert not config.scheduler.enable_chunked_prefill
    assert config.scheduler.max_num_batched_tokens == 2048  # the default already fits 512
    with pytest.raises(ValueError, match="--max-long-partial-prefills"):
        EngineConfig.from_cli_args(parse("--max-long-partial-prefills", "3"))


def test_every_flag_has_one_line_help():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 20
    for action in flags:
        assert action.help and "\n" not in action.help, action.option_strings
    names = {opt for a in flags for opt in a.option_strings}
    for required in ("--max-num-seqs", "--max-num-batched-tokens", "--max-model-len",
                     "--enable-chunked-prefill", "--max-num-partial-prefills",
                     "--max-long-partial-prefills", "--long-prefill-token-threshold",
                     "--block-size", "--gpu-memory-utilization", "--kv-cache-memory",
                     "--scheduler", "--dtype", "--device", "--served-model-name", "--api-key",
                     "--host", "--port", "--seed"):
        assert required in names


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("CARPOOL_API_KEY", "from-env")
    assert parse().api_key == "from-env"
    assert parse("--api-key", "flag").api_key == "flag"
    with pytest.raises(ValueError, match="api_key"):
        ServerSettings(api_key="")


@pytest.mark.parametrize("text,expected", [("1000", 1000), ("4GiB", 4 * 2**30),
                                           ("512MiB", 512 * 2**20), ("2e9", 2 * 10**9),
                                           ("1.5 GB", 1_500_000_000)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "4 parsecs", "1e"])
def test_parse_bytes_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_prompt_shapes():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    for empty in ([], [[]], [[1], []]):
        with pytest.raises(ValueError, match="prompt"):
            CompletionRequest(prompt=empty).prompts()


def test_sampling_fields_map_to_sampling_params():
    params = CompletionRequest(prompt="a", max_tokens=7, temperature=0.5, top_p=0.9, n=3,
                               stop="x", seed=4, top_k=5, min_p=0.1, repetition_penalty=1.2,
                               min_tokens=2, ignore_eos=True, stop_token_ids=[9],
                               logprobs=2).to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (7, 0.5, 0.9, 3)
    assert (params.stop, params.seed, params.top_k, params.min_p) == (("x",), 4, 5, 0.1)
    assert (params.repetition_penalty, params.min_tokens, params.ignore_eos) == (1.2, 2, True)
    assert (params.stop_token_ids, params.logprobs) == (frozenset({9}), 2)
    assert CompletionRequest(prompt="a").to_sampling_params().max_tokens == 16


def test_chat_fields_map_to_sampling_params():
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                          "text": "b"}]}]
    request = ChatCompletionRequest(messages=msgs, max_tokens=9, max_completion_tokens=4,
                                    logprobs=True, top_logprobs=3)
    assert request.messages[0].text() == "ab"
    params = request.to_sampling_params()
    assert (params.max_tokens, params.logprobs) == (4, 3)
    assert ChatCompletionRequest(messages=msgs).to_sampling_params().max_tokens is None
    assert ChatCompletionRequest(messages=msgs, logprobs=True).to_sampling_params().logprobs == 0
    with pytest.raises(ValueError, match="top_logprobs"):
        ChatCompletionRequest(messages=msgs, top_logprobs=2).to_sampling_params()


def test_bad_request_names_known_fields_only():
    error = bad_request(ValueError("temperature must be in [0.0, 2.0], got 3"), REQUEST_FIELDS)
    assert error.status_code == 400 and error.param == "temperature"
    assert bad_request(ValueError("This model's maximum context length is 8"),
                       REQUEST_FIELDS).param is None
    body = APIError(401, "no", code="invalid_api_key").body()
    assert body == {"error": {"message": "no", "type": "invalid_request_error", "param": None,
                              "code": "invalid_api_key"}}


BOOLEAN_LOOKALIKES = [
    (CompletionRequest, {"prompt": "a"}, "stream", 1),
    (CompletionRequest, {"prompt": "a"}, "echo", "true"),
    (CompletionRequest, {"prompt": "a"}, "ignore_eos", 0),
    (CompletionRequest, {"prompt": "a"}, "stream_options", {"include_usage": "yes"}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}]}, "logprobs", 1),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"}]},
     "parallel_tool_calls", "false"),
    (ResponsesRequest, {"input": "a"}, "stream", 1),
    (ResponsesRequest, {"input": "a"}, "store", "false"),
    (ResponsesRequest, {"input": "a"}, "text",
     {"format": {"type": "json_schema", "schema": {}, "strict": 1}}),
]


@pytest.mark.parametrize("model,body,field,value", BOOLEAN_LOOKALIKES)
def test_boolean_fields_take_only_json_booleans(model, body, field, value):
    with pytest.raises(ValidationError) as info:
        model.model_validate({**body, field: value})
    error = validation_error(RequestValidationError(info.value.errors()))
    assert (error.status_code, error.param) == (400, field)
    assert "valid boolean" in error.message, error.message
    fine = {"stream_options": {"include_usage": True},
            "text": {"format": {"type": "json_schema", "schema": {}, "strict": True}}}
    model.model_validate({**body, field: fine.get(field, False)})  # a real boolean is fine


def test_sse_event_format():
    assert sse_event({"a": "é", "b": [1]}) == 'data: {"a":"é","b":[1]}\n\n'
    assert DONE == "data: [DONE]\n\n"


def _samples(metrics: ServerMetrics) -> dict:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            key = (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items()
                                             if k not in ("model_name", "le"))))
            if "le" not in sample.labels:
                out[key] = sample.value
    return out


def engine_stats(**values) -> EngineStats:
    fields = {name: 0 for name in EngineStats.__dataclass_fields__}
    return EngineStats(**{**fields, "kv_cache_usage": 0.0,
                          "spec_decode_num_accepted_tokens_per_pos": (), **values})


def test_metrics_record_steps():
    metrics = ServerMetrics("m")
    metrics.update_gauges(engine_stats(num_running=2, num_waiting=1, kv_cache_usage=0.25))
    first = [StepOutput("a", [5], "x", num_prompt_tokens=7, num_output_tokens=1),
             StepOutput("b", [6], "y", num_prompt_tokens=3, num_output_tokens=1)]
    metrics.record_step(first, engine_stats(last_step_num_tokens=10, num_preemptions=1,
                                            num_steps=1), now=1.0)
    done = StepOutput("a", [8], "z", num_prompt_tokens=7, num_output_tokens=2,
                      finish_reason="length",
                      request_metrics=RequestMetrics(
                          arrival_time=0.0, first_scheduled_time=0.25, first_token_time=0.5,
                          finished_time=1.5, num_preemptions=1))
    aborted = StepOutput("b", [], "", num_prompt_tokens=3, num_output_tokens=1,
                         finish_reason="abort")
    metrics.record_step([done], engine_stats(last_step_num_tokens=1, num_preemptions=1,
                                             num_steps=2), now=1.5)
    # a step that only reports an abort ran no model: no iteration is recorded
    metrics.record_step([aborted], engine_stats(last_step_num_tokens=0, num_preemptions=1,
                                                num_steps=2), now=1.6)
    s = _samples(metrics)
    assert s[("carpool:num_requests_running", ())] == 2
    assert s[("carpool:kv_cache_usage_perc", ())] == 0.25
    assert s[("carpool:prompt_tokens_total", ())] == 10
    assert s[("carpool:generation_tokens_total", ())] == 3
    assert s[("carpool:num_preemptions_total", ())] == 1
    assert s[("carpool:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("carpool:request_success_total", (("finished_reason", "abort"),))] == 1
    assert s[("carpool:iteration_tokens_total_sum", ())] == 11
    assert s[("carpool:iteration_tokens_total_count", ())] == 2
    assert s[("carpool:inter_token_latency_seconds_sum", ())] == 0.5
    assert s[("carpool:time_to_first_token_seconds_sum", ())] == 0.5
    assert s[("carpool:e2e_request_latency_seconds_sum", ())] == 1.5
    assert s[("carpool:request_queue_time_seconds_sum", ())] == 0.25
    assert s[("carpool:request_num_preemptions_sum", ())] == 1


def test_metrics_log_line_while_busy(caplog):
    metrics = ServerMetrics("m", log_interval_s=5.0)
    stats = engine_stats(num_running=3, num_waiting=1, kv_cache_usage=0.5)
    out = lambda rid: [StepOutput(rid, [1, 2], "ab", num_prompt_tokens=10, num_output_tokens=2)]
    with caplog.at_level("INFO", logger="carpool.metrics"):
        metrics.record_step(out("a"), stats, now=100.0)
        metrics.record_step(out("b"), stats, now=102.0)
        assert not caplog.records
        metrics.record_step(out("c"), stats, now=105.0)
    (record,) = caplog.records
    message = record.getMessage()
    assert "Running: 3 reqs" in message and "Waiting: 1 reqs" in message
    assert "KV cache usage: 50.0%" in message
    assert "Avg prompt throughput: 4.0 tokens/s" in message  # b and c: 20 tokens in 5 s
    assert "Avg generation throughput: 0.8 tokens/s" in message


def test_unknown_request_fields_are_named_not_dropped_silently():
    body = CompletionRequest(prompt="a", frobnicate=1, guided_decoding_backend="x")
    assert body.ignored_fields == ["frobnicate", "guided_decoding_backend"]
    assert CompletionRequest(prompt="a").ignored_fields == []
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools_x=True)
    assert chat.ignored_fields == ["tools_x"]


def test_metrics_count_prefix_cache_tokens_and_log_the_hit_rate(caplog):
    metrics = ServerMetrics("m", log_interval_s=5.0)

    def out(rid, cached):
        return [StepOutput(rid, [1], "a", num_prompt_tokens=40, num_output_tokens=1,
                           num_cached_tokens=cached)]

    with caplog.at_level("INFO", logger="carpool.metrics"):
        metrics.record_step(out("a", 0), engine_stats(prefix_cache_queries=40), now=100.0)
        metrics.record_step(out("b", 32),
                            engine_stats(prefix_cache_queries=80, prefix_cache_hits=32),
                            now=106.0)
    s = _samples(metrics)
    assert s[("carpool:prefix_cache_queries_total", ())] == 80
    assert s[("carpool:prefix_cache_hits_total", ())] == 32
    assert s[("carpool:prompt_tokens_cached_total", ())] == 32
    (record,) = caplog.records
    assert "Prefix cache hit rate: 40.0%" in record.getMessage()


def test_metrics_count_spec_decode_tokens_and_log_acceptance(caplog):
    metrics = ServerMetrics("m", log_interval_s=5.0)
    out = [StepOutput("a", [1, 2, 3], "abc", num_prompt_tokens=4, num_output_tokens=3)]
    with caplog.at_level("INFO", logger="carpool.metrics"):
        metrics.record_step(out, engine_stats(), now=100.0)
        metrics.record_step(out, engine_stats(
            spec_decode_num_drafts=4, spec_decode_num_draft_tokens=16,
            spec_decode_num_accepted_tokens=6,
            spec_decode_num_accepted_tokens_per_pos=(3, 2, 1, 0)), now=106.0)
        metrics.record_step(out, engine_stats(
            spec_decode_num_drafts=5, spec_decode_num_draft_tokens=20,
            spec_decode_num_accepted_tokens=10,
            spec_decode_num_accepted_tokens_per_pos=(4, 3, 2, 1)), now=107.0)
    s = _samples(metrics)
    assert s[("carpool:spec_decode_num_drafts_total", ())] == 5
    assert s[("carpool:spec_decode_num_draft_tokens_total", ())] == 20
    assert s[("carpool:spec_decode_num_accepted_tokens_total", ())] == 10
    assert [s[("carpool:spec_decode_num_accepted_tokens_per_pos_total",
               (("position", str(p)),))] for p in range(4)] == [4, 3, 2, 1]
    (record,) = caplog.records  # the window 100-106: 6 of 16 draft tokens in 4 drafts
    assert "Draft acceptance rate: 37.5%, Mean acceptance length: 2.50" in record.getMessage()


def test_finished_request_stats_are_vllms_intervals():
    from carpool.metrics import FinishedRequestStats, buckets_1_2_5
    from carpool.outputs import RequestMetrics, StepOutput

    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, first_token_time=2.0,
                             finished_time=4.5, num_preemptions=0, last_token_time=4.0,
                             max_tokens=9)
    out = StepOutput("r", [], "", 7, 5, finish_reason="length", request_metrics=metrics)
    stats = FinishedRequestStats.of(out)
    assert (stats.num_prompt_tokens, stats.num_generation_tokens, stats.max_tokens) == (7, 5, 9)
    assert (stats.prefill_time, stats.decode_time, stats.inference_time) == (0.5, 2.0, 2.5)
    assert stats.time_per_output_token == 0.5  # 2.0 s over the 4 tokens after the first
    waiting = RequestMetrics(1.0, None, None, 3.0, 0, None, 9)
    aborted = FinishedRequestStats.of(StepOutput("r", [], "", 7, 0, finish_reason="abort",
                                                 request_metrics=waiting))
    assert (aborted.prefill_time, aborted.decode_time, aborted.inference_time,
            aborted.time_per_output_token) == (None, None, None, None)
    assert buckets_1_2_5(256) == (1, 2, 5, 10, 20, 50, 100, 200)


def test_text_offset_skips_special_tokens_left_out_of_the_text():
    """Issue 21: with skip_special_tokens (the default) the generated text has no EOS text,
    so an EOS generated under ignore_eos must not move the offsets of the tokens after it."""
    from carpool.default_model_path import default_model_path
    from carpool.engine.tokenizer import load_tokenizer
    from carpool.server.logprobs import completion_logprobs
    tokenizer = load_tokenizer(default_model_path())
    eos = tokenizer.eos_token_id
    token_ids = tokenizer.encode("def f(x):")[:2] + [eos] + tokenizer.encode(" return")
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    body, end = completion_logprobs(tokenizer, token_ids, [{}] * len(token_ids), 0,
                                    skip_special_tokens=True)
    assert body["tokens"][2] == tokenizer.decode([eos])  # listed, as OpenAI lists it
    assert end == len(text)
    for token, offset, token_id in zip(body["tokens"], body["text_offset"], token_ids):
        if token_id != eos:
            assert text[offset:offset + len(token)] == token
    kept, end_kept = completion_logprobs(tokenizer, token_ids, [{}] * len(token_ids), 0)
    assert end_kept == len(tokenizer.decode(token_ids, skip_special_tokens=False))
