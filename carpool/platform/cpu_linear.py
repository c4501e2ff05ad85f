"""float32 and bfloat16 linear layers through oneDNN with their weights packed once, on CPU.

PyTorch sends a float32 `F.linear` on CPU to MKL's sgemm, which on this
project's benchmark machine (AMD EPYC, AVX-512) ran 2x (4096 rows) to 3x
(1 row) slower than oneDNN's matmul on a weight reordered once at load time
(`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`, the pair
torch.compile's CPU weight freezing emits). bfloat16 `F.linear` already runs on
oneDNN but reorders the weight on every call; packed, the 135M model's linears
ran 1.1x (512 rows) to 1.6x (1 row) faster. Results equal `F.linear`'s up to
rounding (another summation order).

oneDNN builds (JIT-compiles) one primitive per input row count and keeps its
memory: fed every row count 1..1024, one 384x1024 layer grew the process by
about 0.9 MiB per row count, for good. So rows are cut into pieces of at most
`MAX_ROWS` and the last piece is zero-padded up to a bucket (`padded_rows`):
a layer only ever sees `len(ROW_BUCKETS)` shapes, whatever the batch sizes,
and memory stops growing once they have all been seen. Padding costs at most
7 rows per call up to 128 rows, 15 above.

Where oneDNN's matmul has no bfloat16 kernel (AVX2 CPUs: it needs AVX512BW/VL/DQ or
AVX-NE-CONVERT), torch runs a bfloat16 `F.linear` on its own GEMM, which on an AMD EPYC of
the first Zen generation (2 threads, the 135M model's layer shapes) took 4-7x the time of
oneDNN's packed float32 matmul from 8 rows on. There a bfloat16 weight is packed as float32
(`onednn_dtype`; twice the weight's bytes), each call's rows are converted to float32 and its
result rounded to bfloat16 once: a bfloat16 matmul's arithmetic (float32 sums of exact
products), in another summation order (BENCHMARKS §37). Its few-row calls (at most
`SMALL_GEMM_AVX2_MAX_ROWS`) take the AVX2 build's `small_gemm_bf16` instead, which reads the
bfloat16 weight itself (half the bytes) and widens it in registers: on that EPYC's 135M
layers, weights streamed from memory, it took 0.37x oneDNN's float32 time at 1-4 rows,
0.53x at 8, 0.67x at 16, 0.84-0.91x at 24-32 and 1.01x at 64 (2 threads); the AVX2
`small_gemm_f32` took 0.55-0.65x at 1-8 rows, 0.75x at 16, 0.85-0.90x at 24-32 and 0.94x
at 64 (`SMALL_GEMM_F32_AVX2_MAX_ROWS`). At 32 rows on 1 thread the two were level with
oneDNN (0.97-1.02x), hence both cuts at 32 (BENCHMARKS §38).

A call of exactly `full_rows` rows (the step token budget, which every prefill-heavy step
fills) is the one exception: it runs as a single oneDNN call of that many rows, one more
shape per layer. On the 135M bfloat16 model's layers, 2048 rows in one call took
0.87-0.92x the time of four 512-row calls and their `torch.cat` (1 and 2 threads); the
shape's primitive held about 3 MiB per layer shape at 2048 rows (BENCHMARKS §23). On an
AMX machine one call gains far more (0.64x at 2048 rows, 0.72x at 1295 padded to 1536: its
tiles reuse each weight block across many more rows), so there bfloat16 calls of more than
2 * MAX_ROWS rows below `full_rows` also run as one call, zero-padded to whole MAX_ROWS
(float32 calls keep the pieces: one padded call took 1.04-1.32x their time, BENCHMARKS §26):
at most `full_rows / MAX_ROWS - 2` more shapes per layer shape (5 at a 4096-token budget),
a fixed set whatever the step sizes, so memory still stops growing. Up to 2 * MAX_ROWS
the pieces stay (padding 513 rows to 1024 would double the work).

bfloat16 calls of at most `SMALL_GEMM_MAX_ROWS` rows (decode batches, short prompt
chunks, the LM head's sampled rows) take the compiled `small_gemm_bf16` instead when the
CPU has AVX512-BF16 (`csrc/small_gemm.cpp`): it streams the weight once at close to the
memory bandwidth, where oneDNN's matmul ran the 135M model's 120 layers 2x slower at 1-4
rows and 1.2-1.5x slower at 8-32 (1 thread, a microbenchmark of those layers). With its
row padding oneDNN stays behind up to 256 rows: the small GEMM took 0.85x its time at
64-100 rows, 0.94-0.96x at 160-256 (2 threads; 0.90x at 100 rows, even from 128, on 1),
so oneDNN keeps only the larger calls. The cost is a second packed copy of each bfloat16
weight (the model's weight bytes again). No row buckets are needed there: it builds
nothing per shape.

On a CPU with AMX (Intel Sapphire Rapids and later) oneDNN's bfloat16 matmul runs on the
tile unit, and the AVX512-BF16 small GEMM wins only at 1-2 rows: on the 135M model's 120 layers (2
threads, `benchmarks/small_gemm.py --dtype bfloat16`) it took 0.70x oneDNN's time at 1 row,
0.89x at 2, 1.0-1.05x at 3-5, 1.4x at 8, 2.2x at 16, 3.9x at 64 and 7.1x at 256. There the
cut is `SMALL_GEMM_AMX_MAX_ROWS` (`small_gemm_max_rows`). There the small GEMM itself runs on
the tile unit instead where the build has it (`small_gemm_bf16(amx=True)`, in_features a
multiple of 32), from the same packed weight, and takes every call up to
`SMALL_GEMM_AMX_TILE_MAX_ROWS` (1024): on the same 120 layers it took 0.65-0.70x oneDNN's
time at 1-16 rows, 0.74x at 64, 0.87x at 128, 0.87-1.00x at 256-512 (2 threads,
`benchmarks/small_gemm.py --dtype bfloat16 --amx`), and 0.68-0.77x oneDNN's 512-row pieces
at 600-1024 rows. Like the other small GEMM it builds nothing per row count, so no
buckets.

float32 calls of at most `SMALL_GEMM_F32_MAX_ROWS` rows take `small_gemm_f32` (plain
AVX-512, the same layout in float32), `SMALL_GEMM_F32_AMX_MAX_ROWS` on CPUs with AMX (the
flag stands for the core generation here: on the Intel Xeon with AMX measured, the 120
layers took 0.75-0.89x oneDNN's time at 4-64 rows on 2 threads, 0.85-0.93x at 4-32 on 1,
BENCHMARKS §26). On the AMD EPYC of §22: the 135M model's 120 layers, weights streamed from
memory, took 0.70-0.90x oneDNN's time at 1 row and 0.56-0.92x at 2 (2 threads or 1), about
the same at 4 and 8 on 2 threads, but 1.16x at 8 rows on 1 thread: from a few rows the work
turns compute-bound and oneDNN's kernel is as fast or faster (1.1-1.2x the small GEMM's
time at 16-48 rows on 1 thread), so it keeps those. A lone float32 decode step on that
model: 0.72-0.84x of its CPU time before on 2 threads, 0.84-0.92x on 1 (BENCHMARKS §22).
AMD Zen 4 (AVX-512 on 256-bit units) is the other way round: the small GEMM took 0.71-0.96x
oneDNN's time at 4-128 rows on the 135M shapes (2 threads; 0.59x at 8 rows and 1.00x at 128
on 1), 1.01-1.04x at 200-256, so there it takes up to `SMALL_GEMM_F32_ZEN4_MAX_ROWS` (§30).

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

from carpool.kernels import is_zen4

MAX_ROWS = 512  # rows per oneDNN call; above this, throughput no longer grows with rows
# Powers of two up to 8 (single decodes stay cheap), multiples of 8 up to 128 (decode
# batches), then multiples of 16: at most 7 or 15 padding rows.
ROW_BUCKETS = (1, 2, 4) + tuple(range(8, 129, 8)) + tuple(range(144, MAX_ROWS + 1, 16))
SMALL_GEMM_MAX_ROWS = 256  # bfloat16 calls up to this many rows take small_gemm_bf16
SMALL_GEMM_AMX_MAX_ROWS = 2  # the same where oneDNN has AMX (and is far faster above it)
# bfloat16 calls up to this many rows take small_gemm_bf16 on AMX tiles where the build has
# them (`has_amx`) and in_features is a multiple of 32
SMALL_GEMM_AMX_TILE_MAX_ROWS = 2 * MAX_ROWS
SMALL_GEMM_F32_MAX_ROWS = 4  # float32 calls up to this many rows take small_gemm_f32
# the same on the AMX-generation Intel cores measured (an Emerald Rapids VM, small_gemm.py
# --dtype float32: 0.79x/0.85x oneDNN's time on the 135M shapes at 96/128 rows, level on
# vs_vllm.py's tiny model, 0.62-0.70x on the 0.3M model's; BENCHMARKS §47)
SMALL_GEMM_F32_AMX_MAX_ROWS = 128
SMALL_GEMM_F32_ZEN4_MAX_ROWS = 128  # the same on AMD Zen 4 (`carpool.kernels.is_zen4`)
# The cuts of AVX2 builds (CPUs without AVX-512): their small GEMMs run float32 FMAs
SMALL_GEMM_AVX2_MAX_ROWS = 32  # bfloat16: the weight read as bfloat16, widened in registers
SMALL_GEMM_F32_AVX2_MAX_ROWS = 32


def padded_rows(rows: int) -> int:
    """The smallest bucket holding `rows` (1 <= rows <= MAX_ROWS)."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    step = 8 if rows <= 128 else 16
    return -(-rows // step) * step


def small_gemm_max_rows(dtype: torch.dtype, amx: bool | None = None,
                        zen4: bool | None = None, avx2: bool | None = None) -> int:
    """The most rows a `dtype` call sends to the compiled small GEMM rather than oneDNN, on
    this CPU (amx: whether oneDNN has AMX tiles; None: ask torch; zen4: whether the core is
    AMD Zen 4; None: ask /proc/cpuinfo; avx2: whether torch and the kernels run their AVX2
    code, no AVX-512; None: ask torch)."""
    if avx2 is None:
        avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
    if avx2:
        return SMALL_GEMM_F32_AVX2_MAX_ROWS if dtype == torch.float32 else SMALL_GEMM_AVX2_MAX_ROWS
    if amx is None:
        amx = torch.cpu._is_amx_tile_supported()
    if dtype == torch.float32:
        if amx:
            return SMALL_GEMM_F32_AMX_MAX_ROWS
        if zen4 is None:
            zen4 = is_zen4()
        return SMALL_GEMM_F32_ZEN4_MAX_ROWS if zen4 else SMALL_GEMM_F32_MAX_ROWS
    return SMALL_GEMM_AMX_MAX_ROWS if amx else SMALL_GEMM_MAX_ROWS


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
    """An `nn.Linear` whose forward multiplies by a oneDNN-packed copy of its weight (and,
    given the compiled kernels, a bfloat16 weight's few-row calls by `small_gemm_bf16`'s
    packed copy on an AVX512-BF16 CPU or an AVX2 build, a float32 weight's by
    `small_gemm_f32`'s on AVX-512 or AVX2 builds)."""

    def __init__(self, linear: nn.Linear, kernels: ModuleType | None = None,
                 full_rows: int = 0, small_max_rows: int | None = None,
                 small_amx: bool | None = None) -> None:
        """small_max_rows: the most rows a call sends to the small GEMM (None: this CPU's
        `small_gemm_max_rows`, or SMALL_GEMM_AMX_TILE_MAX_ROWS on AMX tiles). small_amx:
        whether a bfloat16 small GEMM runs on AMX tiles (None: where the kernels have them
        and in_features is a multiple of 32)."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._full_rows = full_rows if full_rows > MAX_ROWS else 0  # 0: no one-call shape
        # Mid-size calls as one padded call: where oneDNN's bfloat16 matmul has AMX tiles only
        # (float32's took 1.04-1.32x the pieces' time there: the padding is all loss).
        self._one_padded_call = (linear.weight.dtype == torch.bfloat16
                                 and torch.cpu._is_amx_tile_supported())
        self.weight = linear.weight  # kept: tied embeddings, inspection
        self.bias = linear.bias
        # What oneDNN multiplies in: float32 for a bfloat16 weight where its matmul has no
        # bfloat16 (AVX2 CPUs), rows converted on the way in and the result on the way out.
        self._onednn_dtype = onednn_dtype(linear.weight.dtype)
        self._onednn_bias = None if linear.bias is None else linear.bias.detach().to(
            self._onednn_dtype)
        self._packed = torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach().to(self._onednn_dtype))
        self._small_gemm = None
        self.small = None
        dtype = linear.weight.dtype
        if (kernels is not None and dtype == torch.bfloat16
                and linear.in_features % 2 == 0 and kernels.has_small_gemm_bf16()):
            packed = kernels.pack_bf16_weight(linear.weight.detach())
            if small_amx is None:
                small_amx = kernels.has_amx() and linear.in_features % 32 == 0
            self._small_gemm = (functools.partial(kernels.small_gemm_bf16, amx=True)
                                if small_amx else kernels.small_gemm_bf16)
        elif kernels is not None and dtype == torch.float32 and kernels.has_f32_gemm():
            self._small_gemm = kernels.small_gemm_f32
            packed = kernels.pack_f32_weight(linear.weight.detach())
            small_amx = False
        if self._small_gemm is not None:
            default = SMALL_GEMM_AMX_TILE_MAX_ROWS if small_amx else small_gemm_max_rows(dtype)
            self.small = SmallGemm(packed=packed, out_features=self.out_features, bias=self.bias,
                                   float32=dtype == torch.float32, amx=bool(small_amx),
                                   max_rows=default if small_max_rows is None else small_max_rows)
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


def onednn_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype oneDNN multiplies a `dtype` weight in here: float32 for bfloat16 where its
    matmul has no bfloat16 kernel (a CPU without AVX512BW/VL/DQ or AVX-NE-CONVERT), else the
    weight's own."""
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.float32
    return dtype


def can_pack(model: nn.Module) -> bool:
    """float32 or bfloat16 weights on CPU, oneDNN available."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return param.dtype in (torch.float32, torch.bfloat16)


def pack_linears(model: nn.Module, kernels: ModuleType | None = None,
                 full_rows: int = 0) -> int:
    """Replace every `nn.Linear` inside `model` with a `PackedLinear` (given `kernels`, the
    compiled module, few-row calls also take `small_gemm_bf16` / `small_gemm_f32`; given
    `full_rows` above MAX_ROWS, calls of exactly that many rows take one oneDNN call);
    returns how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, kernels, full_rows))
    return len(targets)
