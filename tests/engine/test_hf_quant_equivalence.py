"""A Hugging Face quantized checkpoint serves the greedy tokens transformers generates from it.

compressed-tensors (W8A8 int8 with dynamic per-token activations, W4A16 pack-quantized) is
made here with the compressed-tensors package itself and run by transformers on the CPU
beside carpool; its asymmetric W4A16, which transformers cannot load, against the float
model of compressed-tensors' own decompression. GPTQ and AWQ checkpoints were written by
GPTQModel (tests/fixtures/hf_quant, README there), which carpool's torch cannot install
beside it: their references are transformers' tokens recorded with GPTQModel's CPU kernels
when they were made.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from carpool import LLM, SamplingParams
from carpool.testing.checkpoints import random_prompt
from tests.engine.conftest import SEPARATED

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_quant"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
WIDE = dict(hidden_size=128, intermediate_size=256)  # group 128 needs 128 inputs
SETTINGS = {
    "default": dict(num_kv_blocks=256),
    # 24-token chunks beside decodes, and a pool small enough that growth preempts.
    "chunked_preemption": dict(num_kv_blocks=18, block_size=4, max_num_batched_tokens=24),
}


def carpool_greedy(path, prompts, **settings) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), dtype="float32", **settings)
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in prompts],
                        [SamplingParams(max_tokens=n, temperature=0) for _, n in prompts],
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


def hf_greedy(path, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    result = []
    for ids, n in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=n)
        result.append(out[0, len(ids):].tolist())
    return result


# every checkpoint by default, the act-order one also under chunked prefill with preemption
FIXTURE_CASES = [(name, "default") for name in FIXTURE_NAMES] + [
    ("gptq-int4-g32-desc-act", "chunked_preemption")]


@pytest.mark.parametrize(("name", "setting"), FIXTURE_CASES)
def test_gptqmodel_checkpoint_matches_transformers(name, setting):
    reference = json.loads((FIXTURES / name / "reference.json").read_text())
    prompts = [(case["prompt_token_ids"], len(case["greedy"])) for case in reference["cases"]]
    got, llm = carpool_greedy(FIXTURES / name, prompts, **SETTINGS[setting])
    assert got == [case["greedy"] for case in reference["cases"]], name
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    assert (stats.num_preemptions > 0) == (setting == "chunked_preemption")


def compress(source: Path, out: Path, preset: str, fmt: str, dtype: torch.dtype) -> Path:
    """`source` quantized by compressed-tensors (round-to-nearest scales from each weight's
    min / max through its own calculate_qparams, then its ModelCompressor) into `out`, with
    scales in `dtype`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(
        preset, ["Linear"])}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        w, args = module.weight.data, scheme.weights
        grouped = (w.reshape(w.shape[0], -1, args.group_size) if args.strategy == "group"
                   else w.unsqueeze(1))
        scale, zero_point = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero_point.reshape(
                module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    for file in source.iterdir():  # the tokenizer and generation config
        if not (out / file.name).exists():
            shutil.copy(file, out / file.name)
    return out


def decompressed(quantized: Path, source: Path, out: Path) -> Path:
    """The float checkpoint of compressed-tensors' own decompression of `quantized`, its
    scales made float32 first so the products are exact (in bfloat16 they would round)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open
    from safetensors.torch import save_file

    raw = json.loads((quantized / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(raw)
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config.format)
    tensors = {}
    with safe_open(str(quantized / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        for name in names:
            prefix, _, suffix = name.rpartition(".")
            if suffix == "weight_packed":
                state = {k.rpartition(".")[2]: f.get_tensor(k) for k in names
                         if k.rpartition(".")[0] == prefix}
                state["weight_scale"] = state["weight_scale"].float()
                tensors[f"{prefix}.weight"] = compressor.decompress(state, scheme)["weight"]
            elif not suffix.startswith("weight_"):
                tensors[name] = f.get_tensor(name)
    shutil.copytree(source, out)
    save_file(tensors, str(out / "model.safetensors"))
    return out


# name -> (preset, format, architecture, checkpoint shape, dtype of the scales). transformers
# decompresses in the scales' dtype, so where it is the reference the scales are float32
# (bfloat16 ones would round its weights, not carpool's). qwen2: q/k/v biases beside
# quantized weights, and a tied head.
CT_CASES = {
    "w8a8": ("W8A8", "int-quantized", "llama", {}, torch.float32),
    "w8a8-qwen2": ("W8A8", "int-quantized", "qwen2", {}, torch.float32),
    "w4a16": ("W4A16", "pack-quantized", "llama", WIDE, torch.float32),
    "w4a16-asym": ("W4A16_ASYM", "pack-quantized", "llama", WIDE, torch.bfloat16),
}


@pytest.mark.parametrize("name", list(CT_CASES))
def test_compressed_tensors_checkpoint_matches_transformers(name, make_checkpoint, tmp_path):
    preset, fmt, arch, shape, dtype = CT_CASES[name]
    source = make_checkpoint(arch, **SEPARATED, **shape)
    quantized = compress(source, tmp_path / name, preset, fmt, dtype)
    # transformers cannot load asymmetric pack-quantized zero points: the float model of
    # compressed-tensors' own decompression is the reference there
    reference = (decompressed(quantized, source, tmp_path / "float") if preset.endswith("ASYM")
                 else quantized)
    rng = random.Random(11)
    prompts = [(random_prompt(rng, n), m) for n, m in ((1, 16), (9, 12), (40, 16), (90, 8))]
    got, llm = carpool_greedy(quantized, prompts, num_kv_blocks=128)
    if preset == "W8A8":
        assert_equal_up_to_near_ties(reference, prompts, got)
    else:
        assert got == hf_greedy(reference, prompts), name
    assert "compressed-tensors" in llm.engine.runner.model.quantization


# W8A8 rounds every activation to int8: a last-bit difference in a sum (the compiled kernel
# adds in another order than transformers' matmul) can move one activation a whole int8 step,
# and so a logit by about this much at most (a 1e-2 of the logits' spread).
W8A8_TIE = 0.05


def assert_equal_up_to_near_ties(path, prompts, got) -> None:
    """carpool's greedy tokens equal transformers' until a position where transformers' own
    logits put carpool's token within W8A8_TIE of its top one (after which the texts differ)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for (ids, n), tokens in zip(prompts, got):
        x = torch.tensor([ids])
        with torch.no_grad():
            ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=n)[0, len(ids):].tolist()
        if tokens == ref:
            continue
        i = next(k for k in range(min(len(tokens), len(ref))) if tokens[k] != ref[k])
        with torch.no_grad():
            logits = model(torch.tensor([ids + ref[:i]])).logits[0, -1]
        gap = float(logits[ref[i]] - logits[tokens[i]])
        assert gap < W8A8_TIE, f"prompt of {len(ids)}: token {i} is {tokens[i]}, transformers' " \
                               f"{ref[i]} leads it by {gap:.4f}"


def test_w8a8_activations_are_int8(make_checkpoint, tmp_path):
    """Running W8A8 with float activations gives other logits than the int8 ones
    transformers computes: the activation rounding is part of the model."""
    from carpool.models.config import load_model_config
    from carpool.models.loader import load_model

    source = make_checkpoint("llama", **SEPARATED)
    path = compress(source, tmp_path / "w8a8", "W8A8", "int-quantized", torch.float32)
    model = load_model(path, load_model_config(path), torch.float32, torch.device("cpu"))
    layer = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(5, layer.in_features)
    rounded = layer(x)
    for part in layer.parts:
        object.__setattr__(part, "input_int8", False)
    assert not torch.allclose(layer(x), rounded)


def test_quantization_flag_mismatch_is_refused():
    with pytest.raises(ValueError, match="--quantization awq does not match"):
        LLM(str(FIXTURES / "gptq-int4-g128-asym"), dtype="float32", quantization="awq")
    llm = LLM(str(FIXTURES / "awq-gemm-g128"), dtype="float32", quantization="awq",
              num_kv_blocks=16)
    assert llm.engine.runner.model.quantization.startswith("awq int4")


def test_quantization_flag_on_a_float_checkpoint_is_refused(make_checkpoint):
    with pytest.raises(ValueError, match="--quantization gptq: .* no quantization_config"):
        LLM(str(make_checkpoint("llama")), quantization="gptq")


def test_serve_flag_reaches_the_config():
    """`carpool serve MODEL -q gptq` (vLLM's flag) becomes EngineConfig.quantization; a value
    the checkpoint does not match fails before anything loads."""
    from carpool.config import EngineConfig
    from tests.flags import serve_parser

    gptq = str(FIXTURES / "gptq-int4-g32-desc-act")
    config = EngineConfig.from_cli_args(serve_parser().parse_args([gptq, "-q", "gptq"]))
    assert config.quantization == "gptq"
    args = serve_parser().parse_args([gptq, "--quantization", "compressed-tensors"])
    with pytest.raises(ValueError, match="--quantization compressed-tensors does not match"):
        EngineConfig.from_cli_args(args)


def test_tensor_parallel_is_refused():
    from carpool.distributed.group import TensorParallelGroup
    from carpool.models.config import load_model_config
    from carpool.models.loader import load_model

    path = FIXTURES / "awq-gemm-g128"
    with pytest.raises(ValueError, match="tensor_parallel_size > 1 is not supported with a "
                                         "quantized checkpoint"):
        load_model(path, load_model_config(path), torch.float32, torch.device("cpu"),
                   TensorParallelGroup(0, 2))
