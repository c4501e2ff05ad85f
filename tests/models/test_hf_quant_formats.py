"""Hugging Face quantized checkpoints convert to carpool's canonical form exactly: dequantizing
the converted weight gives what the packing tool's own dequantization gives (GPTQModel's for
the GPTQ / AWQ fixtures it wrote, compressed-tensors' own `decompress` for its formats), and
unsupported settings are refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from carpool.config import QUANTIZATION_METHODS
from carpool.models.quant import hf_config
from carpool.models.quant.hf_config import check_quantization, detect_scheme
from carpool.models.quant.hf_formats import AWQ_ORDER, to_quantized
from carpool.models.quant.linear import QuantLinear
from carpool.models.quant.weight import int8_per_token

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "hf_quant"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())


def linear_tensors(folder: Path, prefix: str, suffixes) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {s: f.get_tensor(f"{prefix}.{s}") for s in suffixes if f"{prefix}.{s}" in f.keys()}


def full_matrix(weight) -> torch.Tensor:
    """The dequantized [N, K] in the checkpoint's input order (input_perm undone)."""
    sorted_w = weight.dequantize()
    if weight.input_perm is None:
        return sorted_w
    full = torch.empty_like(sorted_w)
    full[:, weight.input_perm] = sorted_w
    return full


def test_fixtures_cover_the_formats():
    assert {"gptq-int4-g32-desc-act", "gptq-int8-g64-asym", "gptq-int4-g128-asym",
            "awq-gemm-g128", "awq-gemm-g64-sym"} <= set(FIXTURE_NAMES)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_gptqmodel_checkpoints_convert_exactly(name):
    """The canonical weight dequantizes to GPTQModel's own dequantization (run with float32
    scales, so exact) bit for bit."""
    folder = FIXTURES / name
    scheme = check_quantization(folder, None)
    assert scheme.method == name.split("-")[0]
    with safe_open(str(folder / "reference.safetensors"), framework="pt") as f:
        for prefix in f.keys():
            weight = to_quantized(scheme, linear_tensors(folder, prefix, scheme.suffixes))
            expected = f.get_tensor(prefix)
            assert weight.shape == tuple(expected.shape)
            assert weight.bits == scheme.bits and weight.qweight.element_size() == 1
            assert torch.equal(full_matrix(weight), expected), (name, prefix)


def test_desc_act_sorts_columns_and_permutes_the_input():
    folder = FIXTURES / "gptq-int4-g32-desc-act"
    scheme = check_quantization(folder, "gptq")
    prefix = "model.layers.0.self_attn.q_proj"
    weight = to_quantized(scheme, linear_tensors(folder, prefix, scheme.suffixes))
    assert weight.input_perm is not None and weight.group_size == 32
    x = torch.randn(3, weight.shape[1])
    expected = x @ full_matrix(weight).T
    got = QuantLinear([weight], None)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def ct_scheme(preset: str):
    from compressed_tensors.quantization import preset_name_to_scheme
    return preset_name_to_scheme(preset, ["Linear"])


@pytest.mark.parametrize(("preset", "fmt"), [("W4A16", "pack-quantized"),
                                             ("W4A16_ASYM", "pack-quantized"),
                                             ("W8A16", "pack-quantized"),
                                             ("W8A8", "int-quantized")])
def test_compressed_tensors_convert_exactly(preset, fmt):
    """compressed-tensors' own compressor packs a weight; its own decompress (in the scales'
    bfloat16, one rounding of scale times code) and the canonical form's exact float32
    dequantization rounded to bfloat16 agree bit for bit."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = ct_scheme(preset)
    args = scheme.weights
    weight = (torch.randn(96, 256) * 0.05).to(torch.bfloat16)
    if args.strategy == "group":
        grouped = weight.reshape(96, -1, args.group_size)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    else:
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    scale, zero_point = calculate_qparams(lo, hi, args)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
    compressor = BaseCompressor.get_value_from_registry(fmt)
    compressed = compressor.compress(state, scheme)
    expected = compressor.decompress(compressed, scheme)["weight"].float()
    config = {"quant_method": "compressed-tensors", "format": fmt,
              "config_groups": {"group_0": json.loads(scheme.model_dump_json())}}
    ours = detect_scheme(config)
    assert ours.input_int8 == (preset == "W8A8")
    converted = to_quantized(ours, dict(compressed))
    assert converted.shape == (96, 256)
    assert torch.equal(converted.dequantize().to(torch.bfloat16).float(), expected)


def test_int8_activations_match_compressed_tensors():
    """W8A8's dynamic per-token activation rounding equals compressed-tensors' own."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = ct_scheme("W8A8").input_activations
    x = torch.randn(1, 7, 64) * torch.tensor([0.1, 1.0, 30.0, 0.0, 1, 1, 1]).view(1, 7, 1)
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, module=None)
    expected = fake_quantize(x, scale, zero_point, args)
    assert torch.equal(int8_per_token(x[0]), expected[0])


def test_awq_nibble_order():
    """An AWQ GEMM word holds columns 0, 2, 4, 6, 1, 3, 5, 7 in nibbles 0..7."""
    codes = torch.arange(8, dtype=torch.int64)  # column j holds code j
    word = sum(int(codes[col]) << (4 * i) for i, col in enumerate(AWQ_ORDER))
    qweight = torch.tensor([[word - (1 << 32) if word >= 1 << 31 else word]] * 32,
                           dtype=torch.int32)
    tensors = {"qweight": qweight, "qzeros": torch.zeros(1, 1, dtype=torch.int32),
               "scales": torch.ones(1, 8, dtype=torch.float16)}
    scheme = detect_scheme({"quant_method": "awq", "bits": 4, "group_size": 32,
                            "zero_point": True, "version": "gemm"})
    weight = to_quantized(scheme, tensors)
    assert torch.equal(weight.dequantize()[:, 0], codes.float())


def test_flag_values_are_the_detectable_ones():
    assert QUANTIZATION_METHODS == ("auto", *hf_config.QUANTIZATION_METHODS)


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True, "desc_act": False}
CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                               "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "strategy": "token", "dynamic": True}}


def ct(**group_changes):
    group = json.loads(json.dumps(CT_GROUP))
    for dotted, value in group_changes.items():
        *path, key = dotted.split("__")
        node = group
        for part in path:
            node = node[part]
        node[key] = value
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": group}}


@pytest.mark.parametrize(("config", "field"), [
    ({"quant_method": "bitsandbytes"}, r"quantization_config\.quant_method"),
    ({**GPTQ, "bits": 3}, r"quantization_config\.bits = 3"),
    ({**GPTQ, "checkpoint_format": "marlin"}, r"quantization_config\.checkpoint_format"),
    ({**GPTQ, "group_size": 48}, r"quantization_config\.group_size = 48"),
    ({**GPTQ, "dynamic": {"-:.*": {}}}, r"quantization_config\.dynamic"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
     r"quantization_config\.version = 'gemv'"),
    ({"quant_method": "awq", "w_bit": 8, "q_group_size": 128}, r"quantization_config\.bits"),
    (ct(input_activations__dynamic=False),
     r"config_groups\.group_0\.input_activations\.dynamic = False"),
    (ct(input_activations__strategy="tensor"),
     r"config_groups\.group_0\.input_activations\.strategy"),
    (ct(weights__type="float"), r"config_groups\.group_0\.weights\.type = 'float'"),
    (ct(weights__actorder="group"), r"config_groups\.group_0\.weights\.actorder"),
    (ct(weights__num_bits=4), r"quantization_config\.format = 'int-quantized'"),
    ({**ct(), "kv_cache_scheme": {"num_bits": 8}}, r"quantization_config\.kv_cache_scheme"),
    ({**ct(), "format": "float-quantized"}, r"quantization_config\.format"),
])
def test_unsupported_settings_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        detect_scheme(config)


def test_supported_settings():
    assert detect_scheme({**GPTQ, "desc_act": True}).zero_offset == 1
    assert detect_scheme({**GPTQ, "checkpoint_format": "gptq_v2"}).zero_offset == 0
    assert detect_scheme({**GPTQ, "group_size": -1}).group_size is None
    assert detect_scheme(ct()).describe() == (
        "compressed-tensors int8 symmetric per channel, int8 activations per token")
    assert not detect_scheme(ct(input_activations=None)).input_int8


def test_quantization_flag_must_match_the_checkpoint(tmp_path):
    gptq = FIXTURES / "gptq-int4-g128-asym"
    assert check_quantization(gptq, "auto").method == "gptq"
    with pytest.raises(ValueError, match="--quantization awq does not match .*'gptq'"):
        check_quantization(gptq, "awq")
    with pytest.raises(ValueError, match="--quantization gguf needs a .gguf file"):
        check_quantization(gptq, "gguf")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert check_quantization(tmp_path, None) is None
    with pytest.raises(ValueError, match="--quantization gptq: .* has no quantization_config"):
        check_quantization(tmp_path, "gptq")
    with pytest.raises(ValueError, match="--quantization awq does not match model.gguf"):
        check_quantization(tmp_path / "model.gguf", "awq")


def test_input_fields_are_checked_and_kept_by_row_selection():
    from carpool.models.quant.weight import QuantizedWeight

    q, scales = torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 1)
    with pytest.raises(ValueError, match=r"input_perm must be int64 of shape \(64,\)"):
        QuantizedWeight(q, scales, None, 8, 64, "x", input_perm=torch.arange(32))
    weight = QuantizedWeight(q, scales, None, 8, 64, "x", torch.arange(64).flip(0), True)
    picked = weight.rows(slice(1, 3))
    assert picked.input_int8 and torch.equal(picked.input_perm, weight.input_perm)
    x = torch.arange(64.0).unsqueeze(0)
    assert torch.equal(weight.prepare_input(x), int8_per_token(x.flip(1)))
