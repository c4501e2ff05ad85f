"""GGUF's quantized blocks -> the canonical form (`weight.QuantizedWeight`), without
dequantizing: integers stay integers, and only the per-block scales are multiplied out.

The block layouts are ggml's (the `gguf` package reads the file and its block sizes; its own
`gguf.quants.dequantize` is the reference the tests hold these conversions to, bit for bit).
Each function takes one matrix's blocks as uint8 [N, bytes per row] and returns the canonical
(qweight, scales, mins) of its N rows. K-quant super-blocks hold 256 inputs in sub-blocks of
32 (Q4_K, Q5_K) or 16 (Q6_K) with their own scales: the sub-block is the canonical group.
Q4_1, Q5_0 and Q5_1 are the legacy types llama.cpp's quantizer falls back to where a row is not
a multiple of 256 (Qwen2.5-0.5B's 896: its Q4_K_M files hold Q5_0 beside Q4_K and Q6_K).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from carpool.models.quant.weight import QuantizedWeight, pack_int4

QK_K = 256


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes [..., 2] -> float32 [...]."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _blocks(data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, int]:
    """[N, bytes] -> ([N, blocks per row, bytes per block], N)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n = data.shape[0]
    return data.reshape(n, -1, type_size), n


def q8_0(data: np.ndarray):
    blocks, n = _blocks(data, GGMLQuantizationType.Q8_0)
    d = _f16(blocks[..., :2])
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, -1)
    return q, d, None, 8, 32


def q4_0(data: np.ndarray):
    blocks, n = _blocks(data, GGMLQuantizationType.Q4_0)
    d = _f16(blocks[..., :2])
    qweight = np.ascontiguousarray(blocks[..., 2:]).reshape(n, -1)  # already canonical order
    return qweight, d, -8.0 * d, 4, 32


def q4_1(data: np.ndarray):
    blocks, n = _blocks(data, GGMLQuantizationType.Q4_1)
    d, m = _f16(blocks[..., :2]), _f16(blocks[..., 2:4])
    return np.ascontiguousarray(blocks[..., 4:]).reshape(n, -1), d, m, 4, 32


def _five_bits(blocks: np.ndarray, n: int) -> np.ndarray:
    """Q5_0 / Q5_1's 32 values a block: the high bit of value j is bit j of the 4-byte qh."""
    qh = np.ascontiguousarray(blocks[..., -20:-16]).view(np.uint32)  # [N, B, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [N, B, 32]
    qs = blocks[..., -16:]
    low = np.concatenate((qs & 0x0F, qs >> 4), axis=-1)  # values 0..15, then 16..31
    return low | (high << 4)


def q5_0(data: np.ndarray):
    blocks, n = _blocks(data, GGMLQuantizationType.Q5_0)
    q = (_five_bits(blocks, n).astype(np.int8) - np.int8(16)).reshape(n, -1)
    return q, _f16(blocks[..., :2]), None, 8, 32


def q5_1(data: np.ndarray):
    blocks, n = _blocks(data, GGMLQuantizationType.Q5_1)
    q = _five_bits(blocks, n).reshape(n, -1).view(np.int8)  # 0..31 fits int8
    return q, _f16(blocks[..., :2]), _f16(blocks[..., 2:4]), 8, 32


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K super-block header -> (scale, min) per sub-block of 32, float32 [N, B, 8]."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    packed = blocks[..., 4:16].astype(np.uint8)
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    m = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=-1)
    return d[..., None] * sc.astype(np.float32), dmin[..., None] * m.astype(np.float32)


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 4, 32] bytes of 64 inputs each -> [..., 4, 2, 32]: sub-block 2c from the low
    nibbles of chunk c, 2c + 1 from the high ones."""
    return np.stack((qs & 0x0F, qs >> 4), axis=-2)


def q4_k(data: np.ndarray):
    blocks, n = _blocks(data, GGMLQuantizationType.Q4_K)
    scale, dm = _k_scales(blocks)
    qs = blocks[..., 16:].reshape(n, -1, 4, 32)
    q = _low_high_nibbles(qs).reshape(n, -1)  # inputs in order, 0..15
    return _pack4(q), scale.reshape(n, -1), -dm.reshape(n, -1), 4, 32


def q5_k(data: np.ndarray):
    blocks, n = _blocks(data, GGMLQuantizationType.Q5_K)
    scale, dm = _k_scales(blocks)
    qh = blocks[..., 16:48].reshape(n, -1, 1, 32)
    qs = blocks[..., 48:].reshape(n, -1, 4, 32)
    low = _low_high_nibbles(qs).reshape(n, -1, 8, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    q = (low | (high << 4)).reshape(n, -1).view(np.int8)  # 0..31 fits int8
    return q, scale.reshape(n, -1), -dm.reshape(n, -1), 8, 32


def q6_k(data: np.ndarray):
    blocks, n = _blocks(data, GGMLQuantizationType.Q6_K)
    ql = blocks[..., :128].reshape(n, -1, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(n, -1, 2, 1, 32)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210])
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    low = low.reshape(n, -1, 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return q.reshape(n, -1), (d[..., None] * sc).reshape(n, -1), None, 8, 16


def _pack4(q: np.ndarray) -> np.ndarray:
    return pack_int4(torch.from_numpy(np.ascontiguousarray(q))).numpy()


CONVERTERS = {
    GGMLQuantizationType.Q8_0: q8_0,
    GGMLQuantizationType.Q4_0: q4_0,
    GGMLQuantizationType.Q4_1: q4_1,
    GGMLQuantizationType.Q5_0: q5_0,
    GGMLQuantizationType.Q5_1: q5_1,
    GGMLQuantizationType.Q4_K: q4_k,
    GGMLQuantizationType.Q5_K: q5_k,
    GGMLQuantizationType.Q6_K: q6_k,
}
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
SUPPORTED = tuple(t.name for t in FLOAT_TYPES + tuple(CONVERTERS))


def to_quantized(data: np.ndarray, qtype: GGMLQuantizationType) -> QuantizedWeight:
    """One matrix's blocks (uint8 [N, bytes per row], e.g. a `GGUFReader` tensor's data) as a
    canonical weight. ValueError for a type this table lacks."""
    convert = CONVERTERS.get(qtype)
    if convert is None:
        raise ValueError(f"GGUF type {qtype.name} is not supported (supported: "
                         f"{', '.join(SUPPORTED)})")
    q, scales, mins, bits, group = convert(np.asarray(data, dtype=np.uint8))

    def tensor(a):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a))
    return QuantizedWeight(tensor(q), tensor(scales).float(), tensor(mins), bits, group,
                           qtype.name)


def to_float(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    """A float tensor's data (F32, F16, BF16) as a torch tensor of its own dtype (a copy)."""
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(np.array(data, dtype=np.float32))
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(data, dtype=np.float16))
    raw = np.array(data).view(np.int16)  # bfloat16 bits
    return torch.from_numpy(raw).view(torch.bfloat16)
