"""Which code runs a CPU step, decided once at load: the one table of the CPU hot path.

`decide_route` turns the CPU's class (`CpuFacts`), the model's dtype and attention shape, the
loaded kernels (`KernelFacts`, None without them) and the platform's switches into a frozen
`CpuRoute`; `CpuPlatform` logs it at start, shows it in its description, and hands each part
to what it picks: `PackedLinear` (the small-GEMM cut), the fused elementwise modules, the
attention backend (decode and prompt paths), the C++ layer stack and a mixture of experts'
experts (`MoeRoute`). Nothing else on the hot
path asks what the CPU is. `describe()` prints a route in one line. The routes per CPU class
and dtype (tests/platform/test_cpu_route.py holds this table):

    class        dtype     small GEMM (rows up to)             prompt chunks
    AMX          bfloat16  AMX tiles 1024 (K in 32s), else 2   prefill_attention_bf16 on AMX
    AMX          float32   small_gemm_f32 128                  paged_attention
    AVX512-BF16  bfloat16  small_gemm_bf16 256                 prefill_attention_bf16
    AVX512-BF16  float32   small_gemm_f32 4                    paged_attention
    Zen 4        bfloat16  small_gemm_bf16 256                 prefill_attention_bf16
    Zen 4        float32   small_gemm_f32 128                  paged_attention
    AVX512       bfloat16  none (oneDNN only; no layer stack)  paged_attention
    AVX512       float32   small_gemm_f32 4                    paged_attention
    AVX2         bfloat16  small_gemm_bf16 32 (oneDNN in f32)  paged_attention
    AVX2         float32   small_gemm_f32 32                   paged_attention
    no kernels   any       none (oneDNN only)                  PyTorch

With the kernels, decodes take paged_attention and the layer stack runs the decoder layers
(under batch invariance too: the vector small GEMM then takes every call). A sliding
window or a head_dim the prefill kernel does not take sends bfloat16 prompts to
paged_attention; a head_dim above the build's `max_head_dim` sends attention to PyTorch.
Measurements behind each cut live in docs/lab/ (linked at the table); the code gives reasons.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from carpool.attention.paths import AttentionRoute, decide_attention
from carpool.platform.cpu_facts import CpuClass, CpuFacts, KernelFacts

# The small-GEMM cut: a call of at most this many rows takes the compiled small GEMM, a larger
# one oneDNN. One row per CPU class; each is where the two cross on the 135M model's layers.
SMALL_GEMM_MAX_ROWS: dict[CpuClass, dict[torch.dtype, int]] = {
    # oneDNN's bfloat16 matmul runs on the tile unit and wins from 3 rows
    # (docs/lab/24-an-amx-machine.md); float32 stays level with the small GEMM much longer
    # (docs/lab/26-prefix-blocks-shared-within-the-step-that.md,
    # docs/lab/47-the-decoder-layers-in-one-c-call.md).
    CpuClass.AMX: {torch.bfloat16: 2, torch.float32: 128},
    # The bfloat16 GEMM streams the weight once at about memory bandwidth, ahead of oneDNN's
    # padded rows up to 256; float32 turns compute-bound from a few rows
    # (docs/lab/22-the-server-at-vllm-s-cpu-defaults.md).
    CpuClass.AVX512_BF16: {torch.bfloat16: 256, torch.float32: 4},
    # AVX-512 on 256-bit units: oneDNN's float32 kernel loses its edge up to about 128 rows
    # (docs/lab/30-the-small-gemms-prefetch-their-next-weight.md).
    CpuClass.ZEN4: {torch.bfloat16: 256, torch.float32: 128},
    CpuClass.AVX512: {torch.bfloat16: 256, torch.float32: 4},
    # Both AVX2 GEMMs run float32 FMAs and level with oneDNN at 32 rows
    # (docs/lab/38-the-avx2-small-gemms-were-store-bound.md).
    CpuClass.AVX2: {torch.bfloat16: 32, torch.float32: 32},
    CpuClass.OTHER: {torch.bfloat16: 256, torch.float32: 4},
}
# bfloat16 calls of up to this many rows take small_gemm_bf16 on AMX tiles, where the build has
# them and in_features is a multiple of 32: it stays ahead of oneDNN's 512-row pieces that far
# (2 x cpu_linear.MAX_ROWS; docs/lab/43-the-amx-small-gemm.md).
SMALL_GEMM_AMX_TILE_MAX_ROWS = 1024
# A cut that takes every call. Under batch invariance the vector small GEMM and quant_linear
# take calls of every size: a row's sums run in the same order whatever the call's rows
# (csrc/gemm/small_gemm.cpp, quant_gemm.cpp), so the fast path is the invariant one.
ALL_ROWS = 1 << 30


@dataclass(frozen=True)
class SmallGemmCut:
    """One linear layer's few-row path: calls of up to max_rows rows, on AMX tiles or not."""

    max_rows: int
    amx: bool


@dataclass(frozen=True)
class SmallGemmRoute:
    """The compiled small GEMM of the model's dtype and its cut on this CPU."""

    kernel: str  # "small_gemm_bf16" or "small_gemm_f32"
    max_rows: int  # the vector GEMM's cut (SMALL_GEMM_MAX_ROWS)
    amx_tile_max_rows: int  # bfloat16 on AMX tiles up to this (layers with K in 32s); 0: none

    def cut(self, in_features: int) -> SmallGemmCut | None:
        """The cut of a layer with `in_features` inputs; None where the kernel does not take it
        (the bfloat16 GEMM reads weight pairs: K even)."""
        if self.kernel == "small_gemm_bf16":
            if in_features % 2:
                return None
            if self.amx_tile_max_rows and in_features % 32 == 0:
                return SmallGemmCut(self.amx_tile_max_rows, amx=True)
        return SmallGemmCut(self.max_rows, amx=False)

    def describe(self) -> str:
        if self.max_rows >= ALL_ROWS:
            return f"{self.kernel} for every call (batch-invariant)"
        vector = f"{self.kernel} up to {self.max_rows} rows"
        if self.amx_tile_max_rows:
            return f"{self.kernel} on AMX tiles up to {self.amx_tile_max_rows} rows (K in 32s), " \
                   f"else {vector}"
        return vector


@dataclass(frozen=True)
class LinearRoute:
    """How a linear layer multiplies (`cpu_linear`, `cpu_invariant_linear`)."""

    packed: bool  # oneDNN on a weight packed once (else F.linear)
    tiles: bool  # batch-invariant: calls the small GEMM does not take in a few fixed row counts
    onednn_dtype: torch.dtype | None  # what oneDNN multiplies in (None: not packed)
    full_step_rows: int  # a call of exactly this many rows is one oneDNN call (0: none)
    # bfloat16 calls between 2 pieces and a full step as one padded call: AMX tiles reuse each
    # weight block over the rows (docs/lab/26-prefix-blocks-shared-within-the-step-that.md)
    one_padded_call: bool
    small_gemm: SmallGemmRoute | None  # few-row calls by the compiled kernels

    def describe(self, dtype: torch.dtype) -> str:
        """One line, for a model of `dtype`."""
        if not self.packed:
            return "F.linear in batch-invariant tiles" if self.tiles else "F.linear"
        if self.tiles:
            tiled = "oneDNN packed, in batch-invariant tiles"
            return tiled if self.small_gemm is None else \
                f"{self.small_gemm.describe()}, the layers it does not take {tiled}"
        onednn = "oneDNN packed" + (f" in {_name(self.onednn_dtype)}"
                                    if self.onednn_dtype != dtype else "")
        if self.full_step_rows:
            onednn += f", full steps of {self.full_step_rows} rows in one call"
        if self.one_padded_call:
            onednn += ", mid-size calls in one padded call"
        return onednn if self.small_gemm is None else f"{onednn}; {self.small_gemm.describe()}"


@dataclass(frozen=True)
class QuantRoute:
    """How the parts of a quantized linear (`models.quant.QuantLinear`) multiply
    (`cpu_quant`): the compiled `quant_linear` up to `int8_max_rows` / `int4_max_rows` rows
    (0: never), larger calls by the weight dequantized into `F.linear` (the kernels'
    `dequantize_rows` where they are built, else PyTorch's slices); without the kernels under
    batch invariance, every call in the invariant tiles of `cpu_invariant_linear`."""

    int8_max_rows: int
    int4_max_rows: int
    tiles: bool
    rounded_from: int = 0  # bfloat16 calls from this many rows: the weight rounded (0: never)

    def max_rows(self, bits: int) -> int:
        """The cut for a weight packed in `bits` (5 bits, unpacked like 4, takes int4's; 6
        bits, a byte a weight, int8's)."""
        return self.int8_max_rows if bits in (6, 8) else self.int4_max_rows

    def describe(self) -> str:
        if not self.int8_max_rows:
            return "PyTorch: dequantized slices into F.linear" + (
                ", in batch-invariant tiles" if self.tiles else "")
        if self.int8_max_rows >= ALL_ROWS:
            return "quant_linear at every row count (batch-invariant)"
        rounded = (f", from {self.rounded_from} rows on the weight rounded to bfloat16"
                   if self.rounded_from else "")
        return (f"quant_linear up to {self.int8_max_rows} rows (int8) / {self.int4_max_rows} "
                f"(int4){rounded}, else dequantize_rows into F.linear")


# Quantized calls of up to these many rows take the compiled quant_linear, which reads each
# weight byte once and dequantizes in registers; above, the product is bound by multiply-adds
# and oneDNN's GEMM on the weight dequantized once per call wins. By CPU class and x's dtype:
# (int8, int4). Measured on Zen 4, both builds (docs/lab/53-quantized-gemm.md); the other
# AVX-512 classes take Zen 4's until measured (AMX's bfloat16 GEMM may cross earlier).
QUANT_GEMM_MAX_ROWS: dict[CpuClass, dict[torch.dtype, tuple[int, int]]] = {
    cls: {torch.bfloat16: (256, 128), torch.float32: (256, 256)}
    for cls in (CpuClass.AMX, CpuClass.AVX512_BF16, CpuClass.ZEN4, CpuClass.AVX512,
                CpuClass.OTHER)}
QUANT_GEMM_MAX_ROWS[CpuClass.AVX2] = {torch.bfloat16: (32, 32), torch.float32: (32, 32)}
# From these many bfloat16 rows, quant_linear multiplies by the weight rounded to bfloat16
# (csrc/gemm/quant_bf16_rounded.h: the small GEMM's arithmetic, no per-group folds), on the
# CPUs with AVX512-BF16; rows then depend on their batch's size, so never under batch
# invariance. Measured on Zen 4 (docs/lab/58-quantized-batched-decode.md).
QUANT_ROUNDED_FROM: dict[CpuClass, int] = {cls: 16 for cls in (CpuClass.AMX,
                                                                CpuClass.AVX512_BF16,
                                                                CpuClass.ZEN4)}


def decide_quant(cpu_class: CpuClass, dtype: torch.dtype, kernels: KernelFacts | None,
                 batch_invariant: bool) -> QuantRoute:
    """The compiled quantized GEMM where the kernels have one, up to the class's cut; at every
    row count under batch invariance (a row's sums never depend on the others)."""
    if kernels is None or not kernels.quant_gemm:
        return QuantRoute(0, 0, tiles=batch_invariant)
    if batch_invariant:
        return QuantRoute(ALL_ROWS, ALL_ROWS, tiles=False)
    int8, int4 = QUANT_GEMM_MAX_ROWS[cpu_class].get(dtype, (0, 0))
    rounded = QUANT_ROUNDED_FROM.get(cpu_class, 0) if dtype == torch.bfloat16 else 0
    return QuantRoute(int8, int4, tiles=False, rounded_from=rounded)


@dataclass(frozen=True)
class MoeRoute:
    """How a mixture-of-experts model's experts run (`cpu_moe`): the fused `moe_experts`
    kernel and the kernels' router `moe_route` (float32 and bfloat16 with the kernels; each
    row's sums independent of the others, so batch invariance keeps it), which the C++ layer
    stack runs as a step of its own; or the model's PyTorch loop over the experts, with the
    decoder loop in Python."""

    fused: bool

    def describe(self) -> str:
        return "experts " + ("moe_route + moe_experts (rows sorted by expert, grouped GEMMs)"
                             if self.fused else "PyTorch loop over the experts")


def decide_moe(dtype: torch.dtype, kernels: KernelFacts | None) -> MoeRoute:
    return MoeRoute(fused=kernels is not None and kernels.moe_experts
                    and dtype in (torch.float32, torch.bfloat16))


@dataclass(frozen=True)
class CpuRoute:
    """Every decision of the CPU hot path for one model on this CPU (`decide_route`)."""

    cpu_class: CpuClass
    dtype: torch.dtype
    head_dim: int
    sliding_window: int | None
    linears: LinearRoute
    attention: AttentionRoute
    fused_elementwise: bool  # RoPE, RMSNorm and SiLU x up by the kernels (`cpu_fused`)
    layer_stack: bool  # the C++ layer stack runs the decoder layers (`cpu_layer_stack`)
    quant: QuantRoute  # quantized linears, where the model has them (`cpu_quant`)
    moe: MoeRoute | None = None  # a mixture of experts' experts (`cpu_moe`); None: dense
    # LoRA adapters' term by the kernels' `lora_add_` (one call a linear for every adapter's
    # rows; float32 and bfloat16), else torch's matmuls per adapter (`lora/step_lora.py`)
    lora_kernel: bool = False

    def describe(self) -> str:
        """One line: the CPU, the model, then each decision."""
        window = f", window {self.sliding_window}" if self.sliding_window else ""
        return (f"{self.cpu_class.value} {_name(self.dtype)} head_dim {self.head_dim}{window}: "
                f"linears {self.linears.describe(self.dtype)}; "
                f"attention {self.attention.describe()}; "
                f"fused elementwise {'on' if self.fused_elementwise else 'off'}; "
                f"C++ layer stack {'on' if self.layer_stack else 'off'}"
                + f"; LoRA steps {self.lora_steps}, term by "
                f"{'lora_add_' if self.lora_kernel else 'torch matmuls'}"
                + ("" if self.moe is None else f"; {self.moe.describe()}"))

    @property
    def lora_steps(self) -> str:
        """Who runs a step in which some row has a LoRA adapter: the layer stack where the
        term is the kernels' `lora_add_` (the stack calls it after each linear, as the Python
        layers' `lora.add` does), else the Python layers (`KernelLayerStack.takes`)."""
        return "in the C++ layer stack" if self.layer_stack and self.lora_kernel else \
            "on the Python layers"


def decide_route(cpu: CpuFacts, dtype: torch.dtype, head_dim: int, sliding_window: int | None,
                 kernels: KernelFacts | None, *, packed_linears: bool = True,
                 batch_invariant: bool = False, full_step_rows: int = 0,
                 attention_backend: str = "cpu", mixture_of_experts: bool = False) -> CpuRoute:
    """The route of a `dtype` model of `head_dim` (and `sliding_window`) on `cpu` with `kernels`
    (None: switched off or not built), under the platform's switches. attention_backend: the
    resolved name the user asked for ("cpu" or "sdpa"); mixture_of_experts: the model routes its
    sparse layers' rows to experts (`MoeRoute`; the layer stack only with the fused experts).
    ValueError where batch_invariant cannot be honoured."""
    linears = decide_linears(cpu, dtype, kernels, packed_linears=packed_linears,
                             batch_invariant=batch_invariant, full_step_rows=full_step_rows)
    attention = decide_attention(
        dtype, head_dim, sliding_window,
        max_head_dim=None if kernels is None else kernels.max_head_dim,
        prefill_bf16=kernels is not None and kernels.bf16_gemm and kernels.prefill_head_dim_ok,
        amx=kernels is not None and kernels.amx, batch_invariant=batch_invariant,
        attention_backend=attention_backend)
    # The stack makes the modules' kernel calls itself: every one of them must be a kernel, a
    # sparse layer's experts too (a layer tiled for batch invariance keeps the modules).
    moe = decide_moe(dtype, kernels) if mixture_of_experts else None
    layer_stack = (kernels is not None and linears.packed
                   and (moe is None or moe.fused)
                   and linears.small_gemm is not None
                   and attention.backend == "cpu-kernel")
    if batch_invariant and moe is not None and not moe.fused:
        raise ValueError(f"batch_invariant needs the moe_experts kernel for a mixture of "
                         f"experts (float32 or bfloat16, the C++ kernels); this model is "
                         f"{_name(dtype)}")
    return CpuRoute(cpu_class=cpu.cpu_class, dtype=dtype, head_dim=head_dim,
                    sliding_window=sliding_window, linears=linears, attention=attention,
                    fused_elementwise=kernels is not None, layer_stack=layer_stack,
                    quant=decide_quant(cpu.cpu_class, dtype, kernels, batch_invariant),
                    moe=moe,
                    lora_kernel=kernels is not None and dtype in (torch.float32, torch.bfloat16))


def decide_linears(cpu: CpuFacts, dtype: torch.dtype, kernels: KernelFacts | None, *,
                   packed_linears: bool = True, batch_invariant: bool = False,
                   full_step_rows: int = 0) -> LinearRoute:
    """oneDNN-packed (float32 and bfloat16 with oneDNN), in batch-invariant tiles, or F.linear;
    the small GEMM of few-row calls where the kernels have one for `dtype`."""
    packed = packed_linears and cpu.onednn and dtype in (torch.float32, torch.bfloat16)
    if not packed:
        return LinearRoute(packed=False, tiles=batch_invariant, onednn_dtype=None,
                           full_step_rows=0, one_padded_call=False, small_gemm=None)
    # Without oneDNN bfloat16 (AVX2 CPUs) torch's own bfloat16 GEMM is far slower than oneDNN
    # in float32 (docs/lab/37-an-avx2-only-machine.md).
    onednn = torch.float32 if dtype == torch.bfloat16 and not cpu.onednn_bf16 else dtype
    if batch_invariant:
        # the vector small GEMM for every call (on AMX too: one kernel whatever the rows),
        # the layers it does not take through oneDNN in fixed row counts
        small = decide_small_gemm(cpu, dtype, kernels)
        if small is not None:
            small = SmallGemmRoute(small.kernel, ALL_ROWS, 0)
        return LinearRoute(packed=True, tiles=True, onednn_dtype=onednn, full_step_rows=0,
                           one_padded_call=False, small_gemm=small)
    return LinearRoute(packed=True, tiles=False, onednn_dtype=onednn,
                       full_step_rows=full_step_rows,
                       one_padded_call=dtype == torch.bfloat16 and cpu.amx,
                       small_gemm=decide_small_gemm(cpu, dtype, kernels))


def decide_small_gemm(cpu: CpuFacts, dtype: torch.dtype,
                      kernels: KernelFacts | None) -> SmallGemmRoute | None:
    """The compiled small GEMM of `dtype` and its cut (SMALL_GEMM_MAX_ROWS), or None."""
    if kernels is None:
        return None
    cuts = SMALL_GEMM_MAX_ROWS[cpu.cpu_class]
    if dtype == torch.bfloat16 and kernels.small_gemm_bf16:
        return SmallGemmRoute("small_gemm_bf16", cuts[torch.bfloat16],
                              SMALL_GEMM_AMX_TILE_MAX_ROWS if kernels.amx else 0)
    if dtype == torch.float32 and kernels.small_gemm_f32:
        return SmallGemmRoute("small_gemm_f32", cuts[torch.float32], 0)
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
