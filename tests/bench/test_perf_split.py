"""`benchmarks.profile.perf_split`: the workload's linear FLOP against torch's own FLOP counter
on Hugging Face's Llama, and its profile kinds against the symbols of the built kernels."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.profile.perf_split import KINDS, row_flop, workload

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 300, "torch_dtype": "bfloat16"}


def test_linear_flop_matches_torch_counter_on_hf_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items()
                                         if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(torch.tensor([[5]]))  # one token: attention is 1 x 1 per head
    head_dim = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    attention = CONFIG["num_hidden_layers"] * CONFIG["num_attention_heads"] * 4 * head_dim
    lm_head = 2 * CONFIG["hidden_size"] * CONFIG["vocab_size"]
    assert row_flop(CONFIG) == counter.get_total_flops() - attention - lm_head

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    work, _ = workload(str(tmp_path), num_requests=4, seed=0)
    assert work.prompt_linear_flop == work.prompt_tokens * row_flop(CONFIG)
    assert work.decode_linear_flop == (work.output_tokens - 4) * row_flop(CONFIG)
    assert work.lm_head_flop == work.output_tokens * lm_head


def kind_of(dso: str, sym: str) -> str:
    return next(name for name, test in KINDS if test(dso, sym))


def test_each_kernel_namespace_of_the_build_has_its_kind():
    kernels = pytest.importorskip("carpool.kernels").load()
    if kernels is None or shutil.which("nm") is None:
        pytest.skip("no compiled kernels or no nm")
    symbols = subprocess.run(["nm", "-C", "--defined-only", kernels.__file__],
                             capture_output=True, text=True, check=True).stdout
    dso = kernels.__file__.rsplit("/", 1)[-1]
    expected = {"carpool_gemm::": "linears, small GEMM (decode steps, LM head)",
                "carpool_cpu::": "attention, decode rows",
                "carpool_prefill::": "attention, prompt rows",
                "carpool_fused::": "elementwise (RMSNorm, RoPE, SiLU, KV write)",
                "carpool_greedy::": "sampling (argmax)"}
    for namespace, kind in expected.items():
        names = [line.split(" ", 2)[-1] for line in symbols.splitlines() if namespace in line]
        assert names, f"the build has no {namespace} symbols: the profile's kinds need updating"
        assert kind_of(dso, names[0]) == kind
    assert kind_of("[JIT] tid 7", "0x00007f0000000010") == "linears, oneDNN (prompt steps)"
    assert kind_of("libgomp.so.1", "0x000000000001de62") == "OpenMP waits (idle / sync)"
