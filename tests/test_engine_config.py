"""One config path: `EngineConfig.from_args` checks values against the model's real limits.

The built-in model's max_position_embeddings is 512, below the scheduler's default
budget (2048): the cases that a placeholder max_model_len used to reject wrongly.
"""

from __future__ import annotations

import argparse

import pytest

from carpool.cli import main
from carpool.config import DEFAULT_MAX_MODEL_LEN_CAP, EngineConfig, as_flags
from carpool.sampling_params import GrammarLimits
from tests.flags import serve_parser

BUILT_IN_MAX_LEN = 512


def serve_args(*argv: str) -> argparse.Namespace:
    return serve_parser().parse_args(list(argv))


def test_unchunked_budget_is_checked_against_the_models_limit():
    config = EngineConfig.from_args(enable_chunked_prefill=False, max_num_batched_tokens=1024)
    assert config.max_model_len == config.scheduler.max_model_len == BUILT_IN_MAX_LEN
    assert config.scheduler.max_num_batched_tokens == 1024
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(256\) must be >= "
                                         r"max_model_len \(512\)"):
        EngineConfig.from_args(enable_chunked_prefill=False, max_num_batched_tokens=256)


def test_serve_flags_resolve_against_the_model():
    config = EngineConfig.from_cli_args(serve_args("--no-enable-chunked-prefill",
                                                   "--max-num-batched-tokens", "1024"))
    assert (config.scheduler.max_num_batched_tokens, config.max_model_len) == (1024, 512)
    with pytest.raises(ValueError, match=r"--max-num-batched-tokens \(256\) must be >= "
                                         r"--max-model-len \(512\)"):
        EngineConfig.from_cli_args(serve_args("--no-enable-chunked-prefill",
                                              "--max-num-batched-tokens", "256"))
    with pytest.raises(ValueError, match=r"--max-model-len \(4096\) is larger than the "
                                         r"model's max_position_embeddings \(512\)"):
        EngineConfig.from_cli_args(serve_args("--max-model-len", "4096"))


def test_defaults_come_from_the_model():
    config = EngineConfig.from_args()
    assert config.max_model_len == min(BUILT_IN_MAX_LEN, DEFAULT_MAX_MODEL_LEN_CAP)
    assert config.scheduler.max_num_batched_tokens == 2048
    unchunked = EngineConfig.from_args(enable_chunked_prefill=False)
    assert unchunked.scheduler.max_num_batched_tokens == 2048  # already >= 512


def test_default_unchunked_budget_grows_to_max_model_len(make_checkpoint):
    model = str(make_checkpoint("llama", max_position_embeddings=4096))
    config = EngineConfig.from_args(model, enable_chunked_prefill=False)
    assert config.scheduler.max_num_batched_tokens == config.max_model_len == 4096


@pytest.mark.parametrize("kwargs,words", [
    (dict(trust_remote_code=True), "trust_remote_code is not supported"),
    # The built-in model: 4 query heads, 2 KV heads, intermediate_size 688.
    (dict(tensor_parallel_size=3), r"tensor_parallel_size \(3\) must divide the model's "
                                   r"num_attention_heads \(4\)"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(distributed_init_method="file:///tmp/x"), "distributed_init_method must start with"),
    (dict(max_model_len=0), "max_model_len must be a positive integer"),
    (dict(block_size=0), "block_size must be a positive integer"),
    (dict(dtype="int4"), "dtype must be one of"),
    (dict(grammar_cache_memory=-1), "grammar_cache_memory must be a number of bytes"),
    (dict(max_grammar_rules=0), "max_grammar_rules must be an integer >= 1"),
    (dict(max_grammar_bytes=True), "max_grammar_bytes must be an integer >= 1"),
    (dict(grammar_check_timeout=0), "grammar_check_timeout must be a number of seconds > 0"),
])
def test_errors_name_the_argument(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig.from_args(**kwargs)


def test_tensor_parallel_size_must_split_the_kv_heads_and_mlp(make_checkpoint):
    model = str(make_checkpoint("llama", hidden_size=96, num_attention_heads=6,
                                num_key_value_heads=3, intermediate_size=130))
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must divide the model's "
                                         r"num_key_value_heads \(3\) or be a multiple of it"):
        EngineConfig.from_args(model, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size \(3\) must divide the "
                                         r"model's intermediate_size \(130\)"):
        EngineConfig.from_cli_args(serve_args(model, "--tensor-parallel-size", "3"))


def test_grammar_cache_memory_flag_reaches_the_config():
    assert EngineConfig.from_cli_args(
        serve_args("--grammar-cache-memory", "64MiB")).grammar_cache_memory == 64 * 2**20
    assert EngineConfig.from_cli_args(serve_args()).grammar_cache_memory == 128 * 2**20


def test_grammar_limit_flags_reach_the_config():
    limits = EngineConfig.from_cli_args(serve_args(
        "--max-grammar-bytes", "1MiB", "--max-grammar-rules", "7", "--max-grammar-depth", "8",
        "--max-grammar-alternatives", "9", "--grammar-check-timeout", "2.5")).grammar_limits
    assert (limits.max_bytes, limits.max_rules, limits.max_depth, limits.max_alternatives,
            limits.check_timeout) == (2**20, 7, 8, 9, 2.5)
    assert EngineConfig.from_cli_args(serve_args()).grammar_limits == GrammarLimits()
    with pytest.raises(ValueError, match="--max-grammar-depth must be an integer >= 1"):
        EngineConfig.from_cli_args(serve_args("--max-grammar-depth", "0"))


def test_errors_in_flag_words():
    names = ("max_model_len", "max_num_batched_tokens", "model")
    assert as_flags("max_num_batched_tokens (1) < max_model_len (2); model", names) == (
        "--max-num-batched-tokens (1) < --max-model-len (2); model")
    assert as_flags("the model's max_position_embeddings", names) == (
        "the model's max_position_embeddings")


def test_llm_and_generate_accept_an_unchunked_budget_below_the_default(capsys):
    from carpool import LLM, SamplingParams

    llm = LLM(enable_chunked_prefill=False, max_num_batched_tokens=1024, num_kv_blocks=64,
              device="cpu")
    assert llm.engine.scheduler_config.max_num_batched_tokens == 1024
    out = llm.generate("def f", SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 2
    assert main(["generate", "--prompt", "def f", "--max-tokens", "2", "--no-tqdm",
                 "--no-enable-chunked-prefill", "--max-num-batched-tokens", "1024",
                 "--num-kv-blocks", "64", "--device", "cpu"]) == 0
    assert main(["generate", "--prompt", "x", "--no-tqdm", "--max-model-len", "4096"]) == 2
    assert "--max-model-len (4096)" in capsys.readouterr().err


def test_resolving_the_config_imports_no_torch():
    """`carpool serve` resolves its config before binding the port: that must stay quick."""
    import subprocess
    import sys

    code = ("import sys; from carpool.config import EngineConfig; EngineConfig.from_args(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_max_num_seqs_defaults_are_vllms_per_usage_and_device(monkeypatch):
    """vLLM's CPU defaults: a server runs at most 128 requests at once, the offline LLM
    256; on CUDA 256 for both (until the engine knows the device, the CUDA value)."""
    import carpool.utils.device
    from carpool.config import SERVER_CPU_MAX_NUM_SEQS
    from carpool.engine.runner_setup import resolve_for_model

    def seats(config: EngineConfig) -> int:
        return resolve_for_model(config)[0].scheduler.max_num_seqs

    server = EngineConfig.from_cli_args(serve_args(), usage="server")
    assert (server.usage, server.max_num_seqs, server.scheduler.max_num_seqs) == (
        "server", None, 256)
    assert seats(server) == SERVER_CPU_MAX_NUM_SEQS == 128  # device auto, no CUDA here
    assert seats(EngineConfig.from_cli_args(serve_args())) == 256  # offline
    assert seats(EngineConfig.from_args()) == 256
    assert EngineConfig.from_args(usage="server", device="cpu").scheduler.max_num_seqs == 128
    assert EngineConfig.from_args(usage="server", device="cuda").scheduler.max_num_seqs == 256
    assert server.for_device("cuda").scheduler.max_num_seqs == 256
    # Given, it stays, whatever the usage and device.
    given = EngineConfig.from_cli_args(serve_args("--max-num-seqs", "300"), usage="server")
    assert given.max_num_seqs == 300 and seats(given) == 300
    assert given.for_device("cpu").scheduler.max_num_seqs == 300
    # "auto" resolves to CUDA where torch sees a card.
    monkeypatch.setattr(carpool.utils.device.torch.cuda, "is_available", lambda: True)
    assert server.for_device(carpool.utils.device.resolve_device("auto").type) \
        .scheduler.max_num_seqs == 256


def test_step_budget_defaults_are_vllms_per_usage_and_device():
    """vLLM's: the offline LLM on CPU takes 4096 tokens a step, a server (or CUDA) 2048;
    given, or without chunked prefill below max_model_len, the budget is the user's rule."""
    from carpool.config import OFFLINE_CPU_MAX_NUM_BATCHED_TOKENS
    from carpool.core.config import SchedulerConfig
    from carpool.engine.runner_setup import resolve_for_model

    def budget(config: EngineConfig) -> int:
        return resolve_for_model(config)[0].scheduler.max_num_batched_tokens

    offline = EngineConfig.from_cli_args(serve_args())
    assert (offline.max_num_batched_tokens, offline.scheduler.max_num_batched_tokens) == (
        None, 2048)  # the CUDA value until the device is known
    assert budget(offline) == OFFLINE_CPU_MAX_NUM_BATCHED_TOKENS == 4096  # no CUDA here
    assert budget(EngineConfig.from_cli_args(serve_args(), usage="server")) == 2048
    assert EngineConfig.from_args(device="cpu").scheduler.max_num_batched_tokens == 4096
    assert EngineConfig.from_args(device="cuda").scheduler.max_num_batched_tokens == 2048
    assert offline.for_device("cuda").scheduler.max_num_batched_tokens == 2048
    given = EngineConfig.from_cli_args(serve_args("--max-num-batched-tokens", "1000"))
    assert given.max_num_batched_tokens == 1000 and budget(given) == 1000
    unchunked = EngineConfig.from_args(device="cpu", enable_chunked_prefill=False)
    assert unchunked.scheduler.max_num_batched_tokens == 4096  # >= max_model_len (512)
    unchunked = EngineConfig.from_args(device="cuda", enable_chunked_prefill=False)
    assert unchunked.scheduler.max_num_batched_tokens == 2048
    by_fields = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=512))
    assert by_fields.for_device("cpu").scheduler.max_num_batched_tokens == 512


def test_usage_must_be_known():
    with pytest.raises(ValueError, match="usage must be one of"):
        EngineConfig.from_args(usage="batch")
    with pytest.raises(ValueError, match="usage must be one of"):
        EngineConfig(usage="batch")


def test_cpu_switches_are_one_object_with_vllm_like_names_at_the_edges():
    """`LLM(cpu_kernels=False)` and `--no-cpu-kernels` both fill `EngineConfig.cpu.kernels`;
    every field of CpuOptions has its --cpu-* flag and every --cpu-* flag is a field, so a new
    switch is a field and a flag."""
    from carpool.cpu_options import CpuOptions

    config = EngineConfig.from_args(cpu_kernels=False, cpu_omp_threads_bind="0-1")
    assert config.cpu == CpuOptions(kernels=False, omp_threads_bind="0-1")
    assert EngineConfig.from_args().cpu == CpuOptions() == EngineConfig().cpu
    flags = EngineConfig.from_cli_args(serve_args("--no-cpu-packed-linears",
                                                  "--cpu-omp-spin-count", "0"))
    assert flags.cpu == CpuOptions(packed_linears=False, omp_spin_count=0)
    dests = {action.dest for action in serve_parser()._actions
             if any(opt.startswith("--cpu-") for opt in action.option_strings)}
    assert dests == set(CpuOptions.argument_names())
    with pytest.raises(TypeError, match="cpu_kernel"):
        EngineConfig.from_args(cpu_kernel=False)  # a misspelt switch is not dropped silently


@pytest.mark.parametrize("fields,words", [
    (dict(kernels="no"), "cpu_kernels must be True or False"),
    (dict(kv_huge_pages=1), "cpu_kv_huge_pages must be True or False"),
    (dict(omp_threads_bind="3-1"), "cpu_omp_threads_bind"),
    (dict(omp_spin_count=-1), "cpu_omp_spin_count"),
])
def test_cpu_options_errors_name_the_switch(fields, words):
    from carpool.cpu_options import CpuOptions

    with pytest.raises(ValueError, match=words):
        CpuOptions(**fields)
    with pytest.raises(ValueError, match="--" + words.split()[0].replace("_", "-")):
        EngineConfig.from_cli_args(argparse.Namespace(
            model=None, **{"cpu_" + name: value for name, value in fields.items()}))
    with pytest.raises(ValueError, match="cpu must be a CpuOptions"):
        EngineConfig(cpu=fields)
