"""Config parsing and loader errors: every failure names what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from carpool.models.config import load_model_config, parse_rope_config
from carpool.models.loader import load_model, resolve_model_path, weight_files


@pytest.fixture
def llama_copy(llama_checkpoint, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(llama_checkpoint, path)
    return path


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_config_fields(make_checkpoint):
    config = load_model_config(make_checkpoint("qwen3"))
    assert config.architecture == "Qwen3ForCausalLM"
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 32)
    assert config.qk_norm and not config.qkv_bias
    assert config.eos_token_ids == (0,)
    qwen2 = load_model_config(make_checkpoint("qwen2"))
    assert qwen2.tie_word_embeddings and qwen2.qkv_bias and not qwen2.o_proj_bias


def test_eos_ids_prefer_generation_config(llama_copy):
    (llama_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 7]}))
    assert load_model_config(llama_copy).eos_token_ids == (3, 7)
    (llama_copy / "generation_config.json").unlink()
    assert load_model_config(llama_copy).eos_token_ids == (0,)


def test_unsupported_architecture_is_named(llama_copy):
    _edit_config(llama_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model_config(llama_copy)


def test_unsupported_rope_type_is_named():
    with pytest.raises(ValueError, match="longrope"):
        parse_rope_config({"rope_scaling": {"type": "longrope"}})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        parse_rope_config({"rope_theta": 1e4, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="factor"):
        parse_rope_config({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}})


def test_missing_files_are_named(llama_copy, tmp_path):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        weight_files(llama_copy)
    (llama_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(llama_copy)
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        resolve_model_path(tmp_path / "does-not-exist")


def test_missing_shard_is_named(llama_copy):
    (llama_copy / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        weight_files(llama_copy)


def test_hub_id_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(FileNotFoundError, match="nobody/no-such-model"):
        resolve_model_path("nobody/no-such-model")


@pytest.mark.parametrize("offline", [False, True])
def test_unfound_hub_id_names_hf_hub_offline_only_when_it_is_set(monkeypatch, offline):
    """As huggingface_hub reads HF_HUB_OFFLINE (once, at import: its constant is the switch)."""
    import huggingface_hub
    from huggingface_hub import constants

    def unreachable(**_):
        raise OSError("cannot reach the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    with pytest.raises(FileNotFoundError, match="'no-such-model'.*cannot reach the hub") as info:
        resolve_model_path("no-such-model")
    assert ("HF_HUB_OFFLINE" in str(info.value)) == offline, str(info.value)
    assert "'carpool-default'" in str(info.value)  # the name that would have worked


def test_the_built_in_models_served_name_resolves_to_it(monkeypatch, tmp_path):
    from carpool.default_model_path import DEFAULT_MODEL_DIR

    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("carpool-default") == DEFAULT_MODEL_DIR
    (tmp_path / "carpool-default").mkdir()  # a folder of that name is what it names
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_path("carpool-default")


def test_missing_tensor_is_named(llama_copy):
    from safetensors.torch import load_file, save_file

    tensors = load_file(llama_copy / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, llama_copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(llama_copy, load_model_config(llama_copy), torch.float32, torch.device("cpu"))


def test_head_count_mismatch_is_named(llama_copy):
    _edit_config(llama_copy, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        load_model_config(llama_copy)
