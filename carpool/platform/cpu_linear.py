"""float32 and bfloat16 linear layers through oneDNN with their weights packed once, on CPU.

PyTorch sends a float32 `F.linear` on CPU to MKL's sgemm, and a bfloat16 one to oneDNN with
the weight reordered on every call; oneDNN's matmul on a weight reordered once at load time
(`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`, the pair torch.compile's CPU
weight freezing emits) is faster at every row count
(docs/lab/05-carpool-vs-vllm-cpu-on-the-same.md). Results equal `F.linear`'s up to rounding
(another summation order).

oneDNN builds (JIT-compiles) one primitive per input row count and keeps its memory for good,
so rows are cut into pieces of at most `MAX_ROWS` and the last piece is zero-padded up to a
bucket (`padded_rows`): a layer only ever sees `len(ROW_BUCKETS)` shapes, whatever the batch
sizes, and memory stops growing once they have all been seen.

What else a call takes is the route's (`cpu_route.LinearRoute`, decided once at load):
- a call of exactly the step token budget (a full prefill step) is one oneDNN call of that many
  rows (docs/lab/23-full-prefill-steps-in-one-onednn-call.md);
- where oneDNN has AMX tiles, bfloat16 calls above 2 * MAX_ROWS and below the full step are one
  call padded to whole MAX_ROWS (a fixed set of shapes: memory still stops growing);
- where oneDNN has no bfloat16 kernel (AVX2 CPUs) a bfloat16 weight is packed as float32 and
  each call's rows converted on the way in and out (docs/lab/37-an-avx2-only-machine.md);
- few-row calls (decodes, short prompt chunks, the LM head's sampled rows), up to the route's
  cut, take the compiled `small_gemm_bf16` / `small_gemm_f32` (`csrc/gemm/small_gemm.cpp`),
  which stream the weight once and build nothing per row count (the cuts per CPU class:
  `cpu_route.SMALL_GEMM_MAX_ROWS`). The cost is a second packed copy of each weight.

Batch-invariant mode calls `packed_matmul` on fixed row counts instead
(`cpu_invariant_linear`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from carpool.platform.cpu_route import CpuFacts, KernelFacts, LinearRoute, decide_linears

MAX_ROWS = 512  # rows per oneDNN call; above this, throughput no longer grows with rows
# Powers of two up to 8 (single decodes stay cheap), multiples of 8 up to 128 (decode
# batches), then multiples of 16: at most 7 or 15 padding rows.
ROW_BUCKETS = (1, 2, 4) + tuple(range(8, 129, 8)) + tuple(range(144, MAX_ROWS + 1, 16))


def padded_rows(rows: int) -> int:
    """The smallest bucket holding `rows` (1 <= rows <= MAX_ROWS)."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    step = 8 if rows <= 128 else 16
    return -(-rows // step) * step


@dataclass(frozen=True)
class SmallGemm:
    """A packed linear's few-row path as the kernels take it: `small_gemm_f32(x, packed,
    out_features, bias)` for float32, else `small_gemm_bf16(..., amx=amx)`, for calls of up
    to max_rows rows (what `PackedLinear.forward` does there; the layer stack calls it
    itself, `cpu_layer_stack`)."""

    packed: torch.Tensor
    out_features: int
    bias: torch.Tensor | None
    float32: bool
    amx: bool
    max_rows: int


class PackedLinear(nn.Module):
    """An `nn.Linear` whose forward multiplies by a oneDNN-packed copy of its weight, and its
    few-row calls by the compiled small GEMM's packed copy where the route has one."""

    def __init__(self, linear: nn.Linear, kernels: ModuleType | None = None,
                 route: LinearRoute | None = None) -> None:
        """route: the platform's (`CpuRoute.linears`); None: this CPU's for the weight's dtype
        with `kernels` and no full-step shape (what a layer packed on its own gets)."""
        super().__init__()
        dtype = linear.weight.dtype
        if route is None:
            route = this_cpu_route(dtype, kernels)
        if route.onednn_dtype is None:
            raise ValueError(f"PackedLinear: the route packs no {dtype} weights")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        full_rows = route.full_step_rows
        self._full_rows = full_rows if full_rows > MAX_ROWS else 0  # 0: no one-call shape
        self._one_padded_call = route.one_padded_call
        self.weight = linear.weight  # kept: tied embeddings, inspection
        self.bias = linear.bias
        self._onednn_dtype = route.onednn_dtype
        self._onednn_bias = None if linear.bias is None else linear.bias.detach().to(
            self._onednn_dtype)
        self._packed = torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach().to(self._onednn_dtype))
        self._small_gemm = None
        self.small = None
        cut = None
        if kernels is not None and route.small_gemm is not None:
            cut = route.small_gemm.cut(linear.in_features)
        if cut is not None:
            float32 = route.small_gemm.kernel == "small_gemm_f32"
            if float32:
                packed = kernels.pack_f32_weight(linear.weight.detach())
                self._small_gemm = kernels.small_gemm_f32
            else:
                packed = kernels.pack_bf16_weight(linear.weight.detach())
                self._small_gemm = (functools.partial(kernels.small_gemm_bf16, amx=True)
                                    if cut.amx else kernels.small_gemm_bf16)
            self.small = SmallGemm(packed=packed, out_features=self.out_features, bias=self.bias,
                                   float32=float32, amx=cut.amx, max_rows=cut.max_rows)
        self._small_max_rows = 0 if self.small is None else self.small.max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] <= self._small_max_rows:
            out = self._small_gemm(flat if flat.stride(-1) == 1 else flat.contiguous(),
                                   self.small.packed, self.out_features, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        num_rows = flat.shape[0]
        if num_rows == self._full_rows:
            return self.packed_matmul(flat).view(*x.shape[:-1], self.out_features)
        if self._one_padded_call and 2 * MAX_ROWS < num_rows < self._full_rows:
            # one call, padded to whole MAX_ROWS
            padding = -num_rows % MAX_ROWS
            out = self.packed_matmul(F.pad(flat, (0, 0, 0, padding)) if padding else flat)
            return out[:num_rows].view(*x.shape[:-1], self.out_features)
        pieces = [self._matmul(flat[start:start + MAX_ROWS])
                  for start in range(0, flat.shape[0], MAX_ROWS)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return out.view(*x.shape[:-1], self.out_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, in] with n <= MAX_ROWS -> [n, out], computed at a bucketed row count."""
        num_rows = rows.shape[0]
        padding = padded_rows(num_rows) - num_rows
        if padding:
            rows = F.pad(rows, (0, 0, 0, padding))
        out = self.packed_matmul(rows)
        return out[:num_rows] if padding else out

    def packed_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, in] -> [n, out] in one oneDNN call of exactly n rows."""
        if rows.dtype == self._onednn_dtype:
            return torch.ops.mkldnn._linear_pointwise(rows, self._packed, self.bias, "none",
                                                      [], "")
        out = torch.ops.mkldnn._linear_pointwise(rows.to(self._onednn_dtype), self._packed,
                                                 self._onednn_bias, "none", [], "")
        return out.to(rows.dtype)


def this_cpu_route(dtype: torch.dtype, kernels: ModuleType | None = None,
                   full_rows: int = 0) -> LinearRoute:
    """The linear route of a `dtype` weight on this CPU with `kernels` (`cpu_route`)."""
    facts = None if kernels is None else KernelFacts.of(kernels, head_dim=0)
    return decide_linears(CpuFacts.probe(), dtype, facts, full_step_rows=full_rows)


def can_pack(model: nn.Module) -> bool:
    """float32 or bfloat16 weights on CPU, oneDNN available."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return param.dtype in (torch.float32, torch.bfloat16)


def pack_linears(model: nn.Module, kernels: ModuleType | None = None,
                 route: LinearRoute | None = None) -> int:
    """Replace every `nn.Linear` inside `model` with a `PackedLinear` taking `route` (None: this
    CPU's for each weight's dtype, `this_cpu_route`), whose small GEMMs are `kernels`'
    (the compiled module, or None); returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, kernels, route))
    return len(targets)
