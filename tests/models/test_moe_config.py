"""Mixture-of-experts checkpoints read into `MoeConfig` (`models/moe_config.py`): which layers
are sparse (Qwen's `mlp_only_layers` and `decoder_sparse_step`, Mixtral's all), the expert
sizes and router switches each spelling names; the model built from it (`MoeForCausalLM`);
the errors that name a bad field: a tensor-parallel size the experts cannot split, quantized
weights, a missing expert tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from carpool.models.config import load_model_config
from carpool.models.loader import load_model
from carpool.models.moe import MoeForCausalLM, SparseMoeBlock
from carpool.models.sharding import check_divisible


def test_qwen3_moe_fields_and_dense_layers(make_checkpoint):
    config = load_model_config(make_checkpoint("qwen3_moe"))
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.expert_intermediate_size) == (8, 2, 32)
    assert moe.norm_topk_prob and moe.weights_in_model_dtype
    assert moe.sparse_layers == (True, False, True)  # mlp_only_layers=[1]
    assert moe.shared_expert_intermediate_size == 0
    assert config.intermediate_size == 128 and config.qk_norm


def test_mixtral_and_qwen2_moe_fields(make_checkpoint):
    mixtral = load_model_config(make_checkpoint("mixtral")).moe
    assert (mixtral.num_experts, mixtral.expert_intermediate_size) == (8, 32)
    assert mixtral.norm_topk_prob and not mixtral.weights_in_model_dtype
    assert mixtral.sparse_layers == (True, True)
    qwen2 = load_model_config(make_checkpoint("qwen2_moe"))
    assert qwen2.moe.sparse_layers == (False, True, False)  # decoder_sparse_step=2
    assert qwen2.moe.shared_expert_intermediate_size == 48 and qwen2.qkv_bias
    assert load_model_config(make_checkpoint("llama")).moe is None


def test_the_model_has_experts_in_its_sparse_layers_only(make_checkpoint):
    path = make_checkpoint("qwen3_moe")
    model = load_model(path, load_model_config(path), torch.float32, torch.device("cpu"))
    assert isinstance(model, MoeForCausalLM)
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert kinds == [True, False, True]
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 64)


def test_tensor_parallel_size_must_divide_the_experts(make_checkpoint):
    config = load_model_config(make_checkpoint("qwen3_moe", moe_intermediate_size=30))
    check_divisible(config, 2)
    with pytest.raises(ValueError, match="moe_intermediate_size \\(30\\)"):
        check_divisible(config, 4)


def test_quantized_moe_and_a_missing_expert_are_named(make_checkpoint, tmp_path):
    source = make_checkpoint("mixtral")
    copy = tmp_path / "mixtral"
    shutil.copytree(source, copy)
    config = load_model_config(copy)
    raw = json.loads((copy / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128,
                                  "version": "gemm", "zero_point": True}
    (copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_model(copy, config, torch.float32, torch.device("cpu"))
    from safetensors.torch import load_file, save_file
    shutil.copy(source / "config.json", copy / "config.json")
    tensors = load_file(str(copy / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.7.w3.weight"]
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(ValueError, match="experts.7.w3"):
        load_model(copy, config, torch.float32, torch.device("cpu"))
