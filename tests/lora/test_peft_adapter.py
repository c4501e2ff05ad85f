"""PEFT adapter folders: what carpool refuses (by name) and the fused forms it takes."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from carpool import LLM, LoRARequest, SamplingParams
from carpool.lora.adapter_cache import AdapterCache
from carpool.lora.peft_adapter import WEIGHTS_FILE, check_adapter, load_adapter
from carpool.models.config import load_model_config
from carpool.testing.checkpoints import random_prompt
from carpool.testing.peft_adapters import build_adapter

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llama(make_checkpoint):
    return make_checkpoint("llama", initializer_range=0.2)


@pytest.fixture(scope="module")
def plain(llama, tmp_path_factory):
    return build_adapter(llama, tmp_path_factory.mktemp("plain") / "a", seed=1, rank=8,
                         target_modules=("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))


@pytest.mark.parametrize("option, message", [
    (dict(use_dora=True), "use_dora"),
    (dict(bias="lora_only"), "bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(target_modules=["lm_head", "q_proj"]), "lm_head"),
    (dict(rank=32), "rank 32, above max_lora_rank"),
])
def test_unsupported_options_are_refused_by_name(llama, tmp_path, option, message):
    args = dict(rank=4, target_modules=("q_proj", "v_proj"))
    args.update(option)
    folder = build_adapter(llama, tmp_path / "a", **args)
    with pytest.raises(ValueError, match=message):
        check_adapter(folder, load_model_config(llama), max_lora_rank=16)


def test_an_adapter_of_another_model_is_refused(make_checkpoint, llama, tmp_path):
    qwen3 = make_checkpoint("qwen3")  # head_dim 32: q_proj has other shapes
    folder = build_adapter(qwen3, tmp_path / "q", rank=4)
    with pytest.raises(ValueError, match="not an adapter of this model"):
        check_adapter(folder, load_model_config(llama), max_lora_rank=16)
    deeper = make_checkpoint("llama", num_hidden_layers=3)
    folder = build_adapter(deeper, tmp_path / "deep", rank=4)
    with pytest.raises(ValueError, match="layer 2, the base model has 2 layers"):
        check_adapter(folder, load_model_config(llama), max_lora_rank=16)
    with pytest.raises(ValueError, match="adapter_config.json"):
        check_adapter(llama, load_model_config(llama), max_lora_rank=16)


def test_engine_refuses_before_any_step(llama, plain, tmp_path):
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    off = LLM(str(llama), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="enable_lora"):
        off.generate("hi", greedy, use_tqdm=False, lora_request=LoRARequest("a", 1, str(plain)))
    on = LLM(str(llama), dtype="float32", num_kv_blocks=32, enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="above max_lora_rank"):
        on.generate("hi", greedy, use_tqdm=False, lora_request=LoRARequest("a", 1, str(plain)))
    with pytest.raises(ValueError, match="does not exist"):
        on.generate("hi", greedy, use_tqdm=False,
                    lora_request=LoRARequest("b", 2, str(tmp_path / "none")))
    assert not on.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="enable_lora needs tensor_parallel_size 1"):
        LLM(str(llama), enable_lora=True, tensor_parallel_size=2)


def test_fused_qkv_and_gate_up_equal_their_parts(llama, plain, tmp_path):
    """Phi-3-style fused names: one A for q/k/v (and for gate/up) with B stacked by rows
    equals the separate modules with that A each."""
    config = load_model_config(llama)
    tensors = load_file(str(plain / WEIGHTS_FILE))
    rng = torch.Generator().manual_seed(5)
    shared, fused = {}, {}
    for layer in range(config.num_layers):
        for block, parts, name in (("self_attn", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                   ("mlp", ("gate_proj", "up_proj"), "gate_up_proj")):
            prefix = f"base_model.model.model.layers.{layer}.{block}"
            a = torch.randn(tensors[f"{prefix}.{parts[0]}.lora_A.weight"].shape, generator=rng)
            bs = [tensors[f"{prefix}.{p}.lora_B.weight"] for p in parts]
            for p, b in zip(parts, bs):
                shared[f"{prefix}.{p}.lora_A.weight"] = a.clone()
                shared[f"{prefix}.{p}.lora_B.weight"] = b.clone()
            fused[f"{prefix}.{name}.lora_A.weight"] = a.clone()
            fused[f"{prefix}.{name}.lora_B.weight"] = torch.cat(bs).contiguous()
    raw = json.loads((plain / "adapter_config.json").read_text())
    folders = {}
    for kind, weights, targets in (("shared", shared, ["q_proj", "k_proj", "v_proj",
                                                       "gate_proj", "up_proj"]),
                                   ("fused", fused, ["qkv_proj", "gate_up_proj"])):
        folder = tmp_path / kind
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({**raw,
                                                                "target_modules": targets}))
        save_file(weights, str(folder / WEIGHTS_FILE))
        folders[kind] = folder
    llm = LLM(str(llama), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    prompts = [{"prompt_token_ids": random_prompt(random.Random(i), 20)} for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    out = {kind: [o.outputs[0].token_ids for o in llm.generate(
        prompts, greedy, use_tqdm=False, lora_request=LoRARequest(kind, i + 1, str(folder)))]
        for i, (kind, folder) in enumerate(folders.items())}
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert out["fused"] == out["shared"] != base


def test_loaded_bytes_are_the_files_and_the_cache_evicts_least_recently_used(llama, plain,
                                                                             tmp_path):
    config = load_model_config(llama)
    weights = load_adapter("a", plain, config, 16, torch.float32)
    file_tensors = load_file(str(plain / WEIGHTS_FILE))
    assert weights.nbytes == sum(t.numel() * 4 for t in file_tensors.values())
    loads = []

    def load(request):
        loads.append(request.lora_int_id)
        return weights

    cache = AdapterCache(2, load)
    r = [LoRARequest(f"a{i}", i, str(plain)) for i in range(1, 4)]
    cache.activate([r[0]])
    cache.activate([r[1]])
    cache.activate([r[0]])  # 1 is now the most recent
    cache.activate([r[2]])  # evicts 2
    assert 2 not in cache and 1 in cache and 3 in cache
    cache.activate([r[0], r[1]])  # 3 goes, never one of the step's own
    assert loads == [1, 2, 3, 2] and cache.num_evictions == 2
    with pytest.raises(ValueError, match="max_cpu_loras"):
        cache.activate(r)


def test_data_parallel_stats_merge_per_adapter_counts():
    from carpool.engine.dp_client import merge_stats
    from carpool.outputs import EngineStats

    def stats(running, waiting, loads):
        return EngineStats(num_steps=1, num_generated_tokens=1, num_prompt_tokens=1,
                           last_step_num_tokens=1, last_step_num_prefill_tokens=0,
                           last_step_num_decode_tokens=1, num_preemptions=0,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_free_blocks=1,
                           num_total_blocks=2, num_running=1, num_waiting=0,
                           kv_cache_usage=0.5, lora_running=running, lora_waiting=waiting,
                           max_lora=2, lora_loads=loads)

    merged = merge_stats([stats({"a": 1}, {}, 2), stats({"a": 2, "b": 1}, {"c": 4}, 3)])
    assert merged.lora_running == {"a": 3, "b": 1} and merged.lora_waiting == {"c": 4}
    assert merged.max_lora == 2 and merged.lora_loads == 5 and merged.num_running == 2
