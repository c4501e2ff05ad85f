"""The canonical quantized weight every format converts to, and its PyTorch dequantization.

A weight W of shape [N, K] (out_features, in_features) is held as integers q with one scale
and one offset ("min") per group of `group_size` consecutive inputs of a row:

    W[n, k] = scales[n, k // g] * q[n, k] + mins[n, k // g]        (float32; mins None: 0)

- bits 8: `qweight` int8 [N, K], q as stored (signed).
- bits 4: `qweight` uint8 [N, K // 2], q in 0..15. Each run of 32 inputs is 16 bytes: byte j
  holds input j in its low nibble and input 16 + j in its high nibble (ggml's Q4_0 order, so a
  16-byte load yields 16 inputs per nibble half).

Every supported format is exact in this form (GGUF's d * sc products and AWQ / GPTQ zero
points fit float32 exactly), so dequantizing it equals the format's own dequantization.
Rows are independent, so rows can be selected or permuted without touching the values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_RUN = 32  # inputs per packed 16-byte run of a 4-bit weight


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """One quantized matrix in the canonical form; `kind` names its source type ("Q4_K")."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int
    kind: str

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        n, k = self.shape
        g = self.group_size
        if g < 1 or k % g or (self.bits == 4 and g % INT4_RUN):
            raise ValueError(f"group_size {g} must divide in_features {k}"
                             + (f" and be a multiple of {INT4_RUN} for 4 bits"
                                if self.bits == 4 else ""))
        want = torch.int8 if self.bits == 8 else torch.uint8
        if self.qweight.dtype != want:
            raise ValueError(f"qweight of a {self.bits}-bit weight must be {want}, "
                             f"got {self.qweight.dtype}")
        groups = (n, k // g)
        for name in ("scales", "mins"):
            value = getattr(self, name)
            if value is None:
                continue
            if value.dtype != torch.float32 or tuple(value.shape) != groups:
                raise ValueError(f"{name} must be float32 of shape {groups}, got "
                                 f"{value.dtype} {tuple(value.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        n, stored = self.qweight.shape
        return n, stored * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        parts = (self.qweight, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The weight of the selected rows (an index tensor or a slice), values untouched."""
        def pick(t):
            return None if t is None else t[index]
        return QuantizedWeight(pick(self.qweight), pick(self.scales), pick(self.mins),
                               self.bits, self.group_size, self.kind)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [N, K] (for references, embeddings' rows and prompt-size calls)."""
        return dequantize(self.qweight, self.scales, self.mins, self.bits,
                          self.group_size).to(dtype)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] in the canonical nibble order -> uint8 [N, K] of values 0..15."""
    n = qweight.shape[0]
    runs = qweight.reshape(n, -1, INT4_RUN // 2)
    return torch.stack((runs & 0x0F, runs >> 4), dim=2).reshape(n, -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of values 0..15 (K a multiple of 32) -> the canonical [N, K // 2]."""
    n, k = q.shape
    if k % INT4_RUN:
        raise ValueError(f"in_features {k} is not a multiple of {INT4_RUN}")
    runs = q.to(torch.uint8).reshape(n, -1, 2, INT4_RUN // 2)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
               bits: int, group_size: int) -> torch.Tensor:
    """float32 [N, K] = scales * q + mins per group (the oracle every kernel is held to)."""
    q = unpack_int4(qweight) if bits == 4 else qweight
    n, k = q.shape
    grouped = q.reshape(n, k // group_size, group_size).to(torch.float32)
    w = grouped * scales.unsqueeze(-1)
    if mins is not None:
        w = w + mins.unsqueeze(-1)
    return w.reshape(n, k)
