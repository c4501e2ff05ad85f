"""Hugging Face quantized checkpoints: the packed tensors of one linear, in the layout of its
`hf_config.HfScheme`, converted to the canonical `QuantizedWeight` (`to_quantized`), exactly,
never through float.

The layouts (N = out_features, K = in_features, G = groups):
- AWQ GEMM: `qweight` int32 [K, N / 8] and `qzeros` int32 [G, N / 8], eight 4-bit values
  per word along N in the order [0, 2, 4, 6, 1, 3, 5, 7]; `scales` [G, N];
  W = s * (q - z) (`zero_point` false: the fixed zero 8, as vLLM reads it).
- GPTQ: `qweight` int32 [K * bits / 32, N] packed along K, `qzeros` int32 [G, N * bits / 32]
  packed along N, `scales` [G, N], `g_idx` [K] (the group of each input). Symmetric weights
  have the fixed zero 2^(bits-1) (what vLLM assumes); asymmetric ones store z - 1 in
  `checkpoint_format` "gptq" (the original AutoGPTQ convention) and z in "gptq_v2".
  desc_act groups inputs out of order: the columns are sorted by group and the weight keeps
  the permutation (`input_perm`).
- compressed-tensors pack-quantized: `weight_packed` int32 [N, K * bits / 32] packed along
  K, each value stored + 2^(bits-1); `weight_scale` [N, G]; `weight_zero_point` (asymmetric)
  packed along N. int-quantized: `weight` int8 [N, K], `weight_scale` [N, G] (or one per
  tensor); W8A8 rounds activations to int8 per token (`input_int8`).
"""

from __future__ import annotations

import torch

from carpool.models.quant.hf_config import HfScheme
from carpool.models.quant.weight import QuantizedWeight, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column within 8 held by nibble i of an AWQ word


def to_quantized(scheme: HfScheme, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
    """One linear's tensors by suffix (`scheme.suffixes`) -> its canonical weight."""
    if scheme.layout == "awq":
        q, zeros, scales = _awq(tensors, scheme)
        perm = None
    elif scheme.layout == "gptq":
        q, zeros, scales, perm = _gptq(tensors, scheme)
    elif scheme.layout == "ct-packed":
        q, zeros, scales = _ct_packed(tensors, scheme)
        perm = None
    else:
        q, zeros, scales = _ct_int(tensors)
        perm = None
    return canonical(q, zeros, scales, scheme.bits, f"{scheme.method}-int{scheme.bits}", perm,
                     scheme.input_int8)


def canonical(q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor, bits: int,
              kind: str, input_perm: torch.Tensor | None = None,
              input_int8: bool = False) -> QuantizedWeight:
    """Unsigned codes q [N, K] (0..2^bits - 1), zero points [N, G] in the same codes (None:
    the midpoint 2^(bits-1)) and scales [N, G]: W = s * (q - z) -> the canonical form.

    4 bits keep q (mins = -z s); 8 bits store q - 128 as int8 (mins = (128 - z) s, None for
    the midpoint). Every product is a 16-bit float scale times a small integer, exact in
    float32."""
    n, k = q.shape
    scales = scales.to(torch.float32).contiguous()
    group_size = k // scales.shape[1]
    mid = 1 << (bits - 1)
    offset = None if zeros is None else zeros.to(torch.float32)
    if bits == 4:
        qweight = pack_int4(q.to(torch.uint8))
        mins = -(mid if offset is None else offset) * scales
    else:
        qweight = (q.to(torch.int16) - mid).to(torch.int8)
        mins = None if offset is None else (mid - offset) * scales
    return QuantizedWeight(qweight.contiguous(), scales,
                           None if mins is None else mins.contiguous(), bits, group_size,
                           kind, input_perm, input_int8)


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words each holding 32 / bits values, lowest bits first -> int32 codes, the
    values of a word consecutive along `dim` (0: rows, 1: columns)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    if dim == 0:
        codes = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & mask
        return codes.reshape(words.shape[0] * per_word, words.shape[1])
    codes = (words.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(words.shape[0], words.shape[1] * per_word)


def _awq(t: dict[str, torch.Tensor], scheme: HfScheme):
    reverse = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])

    def columns(words):  # [R, N / 8] -> [R, N] in column order
        codes = unpack_int32(words, 4, dim=1)
        return codes.view(codes.shape[0], -1, 8)[:, :, reverse].reshape(codes.shape[0], -1)
    q = columns(t["qweight"]).T
    zeros = None if scheme.symmetric else columns(t["qzeros"]).T
    return q, zeros, t["scales"].T


def _gptq(t: dict[str, torch.Tensor], scheme: HfScheme):
    bits = scheme.bits
    q = unpack_int32(t["qweight"], bits, dim=0).T  # [N, K]
    n, k = q.shape
    scales = t["scales"].T  # [N, G]
    groups = scales.shape[1]
    zeros = None
    if not scheme.symmetric:
        zeros = unpack_int32(t["qzeros"], bits, dim=1)[:, :n].T + scheme.zero_offset
    contiguous = torch.arange(k) // (k // groups)
    perm = None
    g_idx = t.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), contiguous):
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[perm], contiguous):
            raise ValueError(f"g_idx does not give each of the {groups} groups "
                             f"{k // groups} inputs")
        q = q[:, perm]
    return q, zeros, scales, perm


def _ct_packed(t: dict[str, torch.Tensor], scheme: HfScheme):
    bits = scheme.bits
    n, k = (int(v) for v in t["weight_shape"].tolist())
    q = unpack_int32(t["weight_packed"], bits, dim=1)[:, :k]
    scales = _ct_scales(t["weight_scale"], n)
    zeros = None
    if "weight_zero_point" in t:
        zeros = unpack_int32(t["weight_zero_point"], bits, dim=0)[:n]
    return q, zeros, scales


def _ct_int(t: dict[str, torch.Tensor]):
    weight = t["weight"]
    if weight.dtype != torch.int8:
        raise ValueError(f"weight must be int8 in an int-quantized checkpoint, got "
                         f"{weight.dtype}")
    n = weight.shape[0]
    scales = _ct_scales(t["weight_scale"], n)
    zeros = t.get("weight_zero_point")
    if zeros is not None:
        zeros = (zeros.to(torch.int16) + 128).reshape(-1, 1).expand(n, 1) \
            if zeros.numel() == 1 else zeros.to(torch.int16).reshape(n, -1) + 128
    return weight.to(torch.int16) + 128, zeros, scales


def _ct_scales(scale: torch.Tensor, n: int) -> torch.Tensor:
    """[N, G], or one scale for the tensor ([], [1], [1, 1]) as one per row."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, 1)
    return scale.reshape(n, -1)
