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

Two optional fields describe what happens to the input x where it meets the weight
(`prepare_input`, called by every multiply before the kernel): `input_perm`, a gather of x's
columns (GPTQ's act-order checkpoints group inputs out of order; the loader sorts the columns
by group so groups are contiguous, and y = x[:, perm] @ W_sorted.T), and `input_int8`, x
rounded to int8 per token with a dynamic scale (compressed-tensors' W8A8: the checkpoint was
calibrated for int8 activations, so running them in float would not be the model it names).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

INT4_RUN = 32  # inputs per packed 16-byte run of a 4-bit weight
# compressed-tensors' dynamic int8 scale: a token's largest |x| over half the int8 range's
# width (255 / 2), so the largest value rounds to 127.5 -> 128 and clamps to 127.
INT8_HALF_RANGE = 127.5


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """One quantized matrix in the canonical form; `kind` names its source type ("Q4_K")."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int
    kind: str
    input_perm: torch.Tensor | None = None  # int64 [K]: the multiply takes x[:, input_perm]
    input_int8: bool = False  # x fake-quantized to int8 per token first (`int8_per_token`)

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
        perm = self.input_perm
        if perm is not None and (perm.dtype != torch.int64 or tuple(perm.shape) != (k,)):
            raise ValueError(f"input_perm must be int64 of shape ({k},), got "
                             f"{perm.dtype} {tuple(perm.shape)}")

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
        return replace(self, qweight=pick(self.qweight), scales=pick(self.scales),
                       mins=pick(self.mins))

    @property
    def int8_product(self) -> bool:
        """W8A8 with one scale per output column (compressed-tensors' channel strategy, no
        zero points): multiplied int8 x int8 (`w8a8_product`), as vLLM does."""
        return (self.input_int8 and self.bits == 8 and self.mins is None
                and self.group_size == self.shape[1] and self.input_perm is None)

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] as the stored matrix multiplies it: columns gathered by `input_perm`,
        then int8-rounded per token where `input_int8` (identity for most weights)."""
        return self.input_preparation()(x)

    def input_preparation(self, round_int8=None):
        """`prepare_input` as a function holding only what it needs, not the weight: a
        multiply of a packed copy keeps it without keeping the canonical tensors alive.
        `round_int8` replaces the eager `int8_per_token` (a platform's compiled one, the same
        bits)."""
        perm = self.input_perm
        to_int8 = (round_int8 or int8_per_token) if self.input_int8 else None

        def prepare(x: torch.Tensor) -> torch.Tensor:
            if perm is not None:
                x = x[:, perm]
            return to_int8(x) if to_int8 is not None else x
        return prepare

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [N, K] (for references, embeddings' rows and prompt-size calls)."""
        return dequantize(self.qweight, self.scales, self.mins, self.bits,
                          self.group_size).to(dtype)


def stack_rows(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """The weights stacked by rows as one (rows are independent), or None where they differ in
    what a multiply needs to know (bits, group, mins or none, the input's permutation or
    rounding): q/k/v of one type become one matrix and one kernel call."""
    first = weights[0]
    for w in weights[1:]:
        if (w.bits, w.group_size, w.mins is None, w.input_int8) != (
                first.bits, first.group_size, first.mins is None, first.input_int8) or \
                w.input_perm is not None or first.input_perm is not None:
            return None

    def cat(name):
        parts = [getattr(w, name) for w in weights]
        return None if parts[0] is None else torch.cat(parts)
    kinds = dict.fromkeys(w.kind for w in weights)
    return QuantizedWeight(cat("qweight"), cat("scales"), cat("mins"), first.bits,
                           first.group_size, "+".join(kinds), input_int8=first.input_int8)


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


def int8_steps(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows as compressed-tensors rounds them with dynamic per-token scales: (q, scale),
    scale = max|x| / 127.5 per row [M, 1] (0 -> the dtype's eps), q = clamp(round(x / scale),
    -128, 127), both in x's dtype (q integral)."""
    scale = x.abs().amax(dim=-1, keepdim=True).div_(INT8_HALF_RANGE)
    scale.masked_fill_(scale == 0, torch.finfo(x.dtype).eps)
    # in place after the division: the same values, without a new [M, K] tensor per step
    return torch.div(x, scale).round_().clamp_(-128, 127), scale


def int8_per_token(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 steps per row (token) and scaled back, as compressed-tensors quantizes
    activations with dynamic per-token scales: x' = q * scale in x's dtype (`int8_steps`)."""
    q, scale = int8_steps(x)
    return q.mul_(scale)


# int8 x int8 products of up to this many k sum exactly in float32 (|sum| <= 128 * 128 * K
# <= 2 ** 24); longer rows sum in float64
FLOAT32_EXACT_K = 1024


def w8a8_product(x: torch.Tensor, qweight: torch.Tensor, col_scales: torch.Tensor) -> torch.Tensor:
    """W8A8 as vLLM multiplies it: x [M, K] rounded per token (`int8_steps`), then
    (sum_k q_x q_w) * scale_x * scale_w per output, in float32, rounded to x's dtype once.
    The sums are integers that float32 (float64 for long rows) holds exactly, so any order
    of summation gives the same value. col_scales: float32 [N] (one scale per column)."""
    q, scale = int8_steps(x)
    wide = torch.float32 if x.shape[-1] <= FLOAT32_EXACT_K else torch.float64
    sums = (q.to(wide) @ qweight.to(wide).T).float()
    return (sums * scale.float() * col_scales.reshape(1, -1)).to(x.dtype)
