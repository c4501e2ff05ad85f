"""carpool's network gives Hugging Face's logits on the same checkpoint (float32, every position).

The prompt is prefilled in chunks through the paged cache, so attention reads
keys written by earlier steps through a non-trivial block table.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from carpool.models.config import load_model_config
from carpool.models.loader import load_model

ATOL = 1e-4

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32, "rope_theta": 500000.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "rope_theta": 10000.0}
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}

VARIANTS = {
    "llama-gqa": ("llama", {}),
    "mistral-mqa": ("mistral", {}),
    "qwen2-bias-tied": ("qwen2", {}),
    "qwen3-head-dim-qk-norm": ("qwen3", {}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-attention-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-linear": ("llama", {"rope_parameters": LINEAR}),
    "llama-rope-llama3": ("llama", {"rope_parameters": LLAMA3}),
    "qwen2-rope-yarn": ("qwen2", {"rope_parameters": YARN}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 24}),
}


def _load(path, dtype=torch.float32):
    return load_model(path, load_model_config(path), dtype, torch.device("cpu"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_hf(variant, make_checkpoint, prompt, carpool_logits, hf_logits):
    arch, overrides = VARIANTS[variant]
    path = make_checkpoint(arch, **overrides)
    ours = carpool_logits(_load(path), prompt, chunk=37)
    ref = hf_logits(path, prompt)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("rope", [LINEAR, LLAMA3, YARN], ids=lambda r: r["rope_type"])
def test_legacy_rope_spelling(rope, make_checkpoint, tmp_path, prompt, carpool_logits, hf_logits):
    """`rope_theta` at the top and `rope_scaling` with `type` load the same as `rope_parameters`."""
    new = make_checkpoint("llama", rope_parameters=rope)
    legacy = tmp_path / "legacy"
    shutil.copytree(new, legacy)
    config = json.loads((legacy / "config.json").read_text())
    params = dict(config.pop("rope_parameters"))
    config["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    config["rope_scaling"] = params
    (legacy / "config.json").write_text(json.dumps(config))
    assert load_model_config(legacy).rope == load_model_config(new).rope
    assert load_model_config(legacy).rope.rope_type == rope["rope_type"]
    torch.testing.assert_close(carpool_logits(_load(legacy), prompt, chunk=64),
                               hf_logits(legacy, prompt), atol=ATOL, rtol=0)


def test_sharded_checkpoint(make_checkpoint, tmp_path, prompt, carpool_logits, hf_logits):
    import transformers

    source = make_checkpoint("qwen3")
    sharded = tmp_path / "sharded"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    hf.save_pretrained(str(sharded), max_shard_size="100KB")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    torch.testing.assert_close(carpool_logits(_load(sharded), prompt, chunk=150),
                               hf_logits(source, prompt), atol=ATOL, rtol=0)


def test_bfloat16_checkpoint_runs_in_bfloat16(make_checkpoint, prompt, carpool_logits, hf_logits):
    path = make_checkpoint("llama", dtype="bfloat16")
    config = load_model_config(path)
    assert config.dtype == "bfloat16"
    model = _load(path, torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    ours = carpool_logits(model, prompt[:40], chunk=16)
    ref = hf_logits(path, prompt[:40], dtype=torch.bfloat16)
    # bfloat16 keeps ~3 significant digits; same weights, same op order -> close, not exact.
    assert (ours - ref).abs().max() < 0.05
