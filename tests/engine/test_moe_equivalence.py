"""Mixture-of-experts models give Hugging Face's greedy tokens, token for token, in float32.

Tiny random checkpoints written by transformers: Qwen3-MoE (top 2 of 8 experts,
renormalised, its middle layer dense via `mlp_only_layers`), Qwen3-MoE routing to 8 of 16,
Mixtral (top 2 of 8, every layer sparse) and Qwen2-MoE (a shared expert behind its gate,
every second layer sparse via `decoder_sparse_step`). The workload and references are
`test_hf_equivalence`'s; the experts run through the fused kernel inside the C++ layer stack
(`cpu`) and the model's PyTorch loop (`cpu-pytorch`), under the default, chunked prefill,
preemption, prefix-cache hits and the static scheduler; and at tensor-parallel size 2 (each
rank a slice of every expert). The router's load counter adds up to top_k rows per token of
every sparse layer.
"""

from __future__ import annotations

import pytest

from carpool import LLM, SamplingParams
from tests.engine.test_hf_equivalence import expected_finish_reason, workload

ARCHS = ("qwen3_moe", "qwen3_moe-top8", "mixtral", "qwen2_moe")
SETTINGS = {
    # Each prompt is sent three times: the later copies are prefix-cache hits.
    "default": dict(num_kv_blocks=256),
    "chunked_prefill": dict(num_kv_blocks=256, max_num_batched_tokens=32, block_size=8),
    "chunked_preemption": dict(num_kv_blocks=96, block_size=4, max_num_batched_tokens=32),
    "static": dict(num_kv_blocks=256, scheduler="static", max_num_seqs=8),
}
BACKENDS = {"cpu": {}, "cpu-pytorch": dict(cpu_kernels=False)}


def check_greedy(llm: LLM, arch: str, setting: str, hf_greedy, copies=(1.0, 0.5, 0.0)) -> None:
    prompts = workload()
    references = [hf_greedy(arch, ids, n) for ids, n in prompts]
    requests = [(ids, ref, max(1, int(n * c))) for (ids, n), ref in zip(prompts, references)
                for c in copies][::-1]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids, _, _ in requests],
                           [SamplingParams(temperature=0.0, max_tokens=m) for _, _, m in requests],
                           use_tqdm=False)
    for (ids, ref, max_tokens), out in zip(requests, outputs):
        expected = ref[:max_tokens]
        assert out.outputs[0].token_ids == expected, (
            f"{arch}/{setting}: prompt of {len(ids)} tokens, max_tokens={max_tokens}")
        assert out.outputs[0].finish_reason == expected_finish_reason(expected, max_tokens)
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert (stats.num_preemptions > 0) == setting.endswith("preemption")
    if setting != "static":  # the static baseline has no prefix cache
        assert stats.prefix_cache_hits > 0


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_moe_greedy_matches_transformers(arch, setting, backend, separated_checkpoint,
                                         hf_greedy):
    with LLM(str(separated_checkpoint(arch)), dtype="float32", **BACKENDS[backend],
             **SETTINGS[setting]) as llm:
        route = llm.engine.runner.platform.route
        assert route.moe is not None and route.layer_stack == route.moe.fused
        assert route.moe.fused == (backend == "cpu" and route.fused_elementwise)
        # the C++ layer stack runs the sparse layers, but for a shared expert's (Qwen2-MoE)
        stack = llm.engine.runner.model.layer_stack
        assert (stack is not None) == (route.layer_stack and arch != "qwen2_moe")
        check_greedy(llm, arch, setting, hf_greedy)


@pytest.mark.parametrize("arch,setting", [("qwen3_moe", "default"), ("mixtral", "default"),
                                          ("qwen2_moe", "chunked_preemption"),
                                          ("qwen3_moe-top8", "static")])
def test_moe_tensor_parallel_matches_transformers(arch, setting, separated_checkpoint,
                                                  hf_greedy):
    with LLM(str(separated_checkpoint(arch)), dtype="float32", tensor_parallel_size=2,
             **SETTINGS[setting]) as llm:
        assert llm.engine.runner.group.world_size == 2
        check_greedy(llm, arch, setting, hf_greedy, copies=(1.0, 0.0))
        processes = list(llm.engine.runner._processes)
    assert [p.exitcode for p in processes] == [0]


def test_router_load_counts_rows_per_expert_as_hugging_faces_router(separated_checkpoint):
    """With moe_router_stats, each sparse layer's counts equal the top-k of Hugging Face's own
    router logits over the same prompts (max_tokens=1: the prompts' rows only); without it,
    router_load is None."""
    import torch
    from transformers import AutoModelForCausalLM

    path = separated_checkpoint("qwen3_moe")
    prompts = [ids for ids, _ in workload()[:6]]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    expected = None
    for ids in prompts:
        with torch.no_grad():
            logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits
        counts = [torch.bincount(torch.topk(layer.float().reshape(len(ids), -1), 2).indices
                                 .flatten(), minlength=8) for layer in logits]
        expected = counts if expected is None else [a + b for a, b in zip(expected, counts)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    with LLM(str(path), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False,
             moe_router_stats=True) as llm:
        llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        load = llm.stats().router_load
    assert len(load) == 2  # layers 0 and 2; layer 1 is dense (mlp_only_layers)
    assert [list(layer) for layer in load] == [c.tolist() for c in expected]
    with LLM(str(path), dtype="float32", num_kv_blocks=64) as llm:
        llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        assert llm.stats().router_load is None
