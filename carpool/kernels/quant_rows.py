"""A quantized linear of any number of rows, from one packed weight (`pack_quant_weight`).

Up to a cut, `quant_linear`: the weight streams once, dequantized in registers, and each row's
result is the same bits in any batch. Above it, the rows are many enough that the product is
bound by multiply-adds, not by the weight's bytes: the weight is dequantized to x's dtype once
per call (`dequantize_rows`) and multiplied by oneDNN's GEMM (`F.linear`), which outruns the
register kernel there (its results differ from the kernel's in the last bits, so a row's
result depends on which side of the cut its batch falls: batch-invariant callers keep
`quant_linear` for every row count). The cuts were measured in
docs/lab/53-quantized-gemm.md; which one applies (the CPU's class, x's dtype, the bits) is
the route's (`platform/cpu_route.QuantRoute`).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F


def quant_matmul(kernels: ModuleType, x: torch.Tensor, packed, bias: torch.Tensor | None,
                 max_rows: int, rounded_from: int = 0) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16, contiguous rows) @ W.T (+ bias) -> [M, N] in x's dtype:
    `quant_linear` up to max_rows rows (from `rounded_from` bfloat16 rows on, on the weight
    rounded to bfloat16; 0: never), above them the weight dequantized to x's dtype and
    multiplied by `F.linear` (oneDNN)."""
    if x.shape[0] <= max_rows:
        return kernels.quant_linear(x, packed, bias, rounded_from)
    weight = kernels.dequantize_rows(packed, 0, packed.n, x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))
