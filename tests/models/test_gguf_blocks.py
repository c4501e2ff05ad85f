"""GGUF's block types convert to carpool's canonical quantized form exactly: dequantizing the
converted weight gives, bit for bit, what the `gguf` package's own dequantization gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from carpool.models.quant.gguf_blocks import SUPPORTED, to_float, to_quantized
from carpool.models.quant.weight import QuantizedWeight, pack_int4, unpack_int4

# Byte offsets of each type's float16 scales in its block (the rest are any bits at all).
F16_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0):
    """uint8 [rows, bytes per row]: random bits, with finite float16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for offset in F16_OFFSETS[qtype.name]:
        scales = rng.uniform(-0.05, 0.05, size=(rows, cols // block)).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("name", list(F16_OFFSETS))
def test_conversion_equals_gguf_dequantize(name):
    qtype = GGMLQuantizationType[name]
    raw = random_blocks(qtype, rows=7, cols=512)
    weight = to_quantized(raw, qtype)
    expected = quants.dequantize(raw, qtype).reshape(7, 512)
    assert weight.shape == (7, 512) and weight.kind == name
    assert np.array_equal(weight.dequantize().numpy(), expected)
    # rows stay independent: a row gather of the integers is a row gather of the values
    picked = weight.rows(torch.tensor([5, 0, 3]))
    assert np.array_equal(picked.dequantize().numpy(), expected[[5, 0, 3]])


def test_quantized_bytes_stay_integers():
    """The canonical form never holds a float copy of the weight: 1 byte (int8) or half a
    byte (int4) per value, plus per-group scales."""
    raw = random_blocks(GGMLQuantizationType.Q4_K, rows=4, cols=256)
    weight = to_quantized(raw, GGMLQuantizationType.Q4_K)
    assert weight.qweight.dtype == torch.uint8 and weight.qweight.shape == (4, 128)
    assert weight.bits == 4 and weight.group_size == 32


def test_float_types():
    values = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    assert torch.equal(to_float(values, GGMLQuantizationType.F32), torch.from_numpy(values))
    half = to_float(values.astype(np.float16), GGMLQuantizationType.F16)
    assert half.dtype == torch.float16 and torch.equal(half.float(),
                                                       torch.from_numpy(values).half().float())
    bf16 = quants.quantize(values, GGMLQuantizationType.BF16)
    got = to_float(bf16, GGMLQuantizationType.BF16)
    assert got.dtype == torch.bfloat16
    assert np.array_equal(got.float().numpy(), quants.dequantize(bf16, GGMLQuantizationType.BF16))


def test_unsupported_type_is_named():
    raw = np.zeros((2, 84), dtype=np.uint8)
    with pytest.raises(ValueError, match="Q2_K is not supported.*Q4_K"):
        to_quantized(raw, GGMLQuantizationType.Q2_K)
    assert "Q6_K" in SUPPORTED and "BF16" in SUPPORTED


def test_int4_packing_round_trips_in_ggml_order():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (3, 32)
    assert torch.equal(unpack_int4(packed), q)
    # byte j of a 32-value run: value j low, value 16 + j high (ggml's Q4_0 order)
    assert int(packed[0, 1]) == int(q[0, 1]) | (int(q[0, 17]) << 4)


def test_bad_canonical_weights_name_the_field():
    q = torch.zeros(2, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="group_size 48"):
        QuantizedWeight(q, torch.ones(2, 1), None, 8, 48, "x")
    with pytest.raises(ValueError, match="scales must be float32 of shape"):
        QuantizedWeight(q, torch.ones(2, 3), None, 8, 32, "x")
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        QuantizedWeight(q, torch.ones(2, 2), None, 3, 32, "x")
    with pytest.raises(ValueError, match="qweight of a 4-bit weight must be torch.uint8"):
        QuantizedWeight(q, torch.ones(2, 2), None, 4, 32, "x")
