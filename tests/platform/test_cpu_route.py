"""The CPU route (`platform/cpu_route.py`): every decision of the hot path per CPU class and
dtype, from injected CPU and kernel facts (no such hardware needed); the platform deciding
it once, logging it and applying it."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from carpool.attention.paths import DecodePath, PromptPath
from carpool.platform.cpu_route import (
    ALL_ROWS,
    SMALL_GEMM_AMX_TILE_MAX_ROWS,
    CpuClass,
    CpuFacts,
    KernelFacts,
    SmallGemmCut,
    SmallGemmRoute,
    decide_route,
)

BF16, F32 = torch.bfloat16, torch.float32
# Each class's CPU, and what its own kernels build reports there.
CPUS = {
    CpuClass.AMX: CpuFacts("AVX512", amx=True, zen4=False, avx512_bf16=True),
    CpuClass.AVX512_BF16: CpuFacts("AVX512", amx=False, zen4=False, avx512_bf16=True),
    CpuClass.ZEN4: CpuFacts("AVX512", amx=False, zen4=True, avx512_bf16=True),
    CpuClass.AVX512: CpuFacts("AVX512", amx=False, zen4=False, avx512_bf16=False),
    CpuClass.AVX2: CpuFacts("AVX2", amx=False, zen4=False, avx512_bf16=False,
                            onednn_bf16=False),
}
KERNELS = {
    CpuClass.AMX: KernelFacts(256, small_gemm_bf16=True, small_gemm_f32=True, bf16_gemm=True,
                              amx=True, prefill_head_dim_ok=True),
    CpuClass.AVX512_BF16: KernelFacts(256, True, True, bf16_gemm=True, amx=False,
                                      prefill_head_dim_ok=True),
    CpuClass.ZEN4: KernelFacts(256, True, True, bf16_gemm=True, amx=False,
                               prefill_head_dim_ok=True),
    CpuClass.AVX512: KernelFacts(256, small_gemm_bf16=False, small_gemm_f32=True,
                                 bf16_gemm=False, amx=False, prefill_head_dim_ok=True),
    CpuClass.AVX2: KernelFacts(128, small_gemm_bf16=True, small_gemm_f32=True, bf16_gemm=False,
                               amx=False, prefill_head_dim_ok=True),
}
PAGED, TORCH = DecodePath.PAGED_ATTENTION, DecodePath.PYTORCH

# (class, dtype) -> small GEMM (kernel, cut, AMX tile cut) or None, decodes, prompts, layer stack
TABLE = [
    (CpuClass.AMX, BF16, ("small_gemm_bf16", 2, SMALL_GEMM_AMX_TILE_MAX_ROWS), PAGED,
     PromptPath.PREFILL_AMX, True),
    (CpuClass.AMX, F32, ("small_gemm_f32", 128, 0), PAGED, PromptPath.PAGED_ATTENTION, True),
    (CpuClass.AVX512_BF16, BF16, ("small_gemm_bf16", 256, 0), PAGED, PromptPath.PREFILL_BF16,
     True),
    (CpuClass.AVX512_BF16, F32, ("small_gemm_f32", 4, 0), PAGED, PromptPath.PAGED_ATTENTION,
     True),
    (CpuClass.ZEN4, BF16, ("small_gemm_bf16", 256, 0), PAGED, PromptPath.PREFILL_BF16, True),
    (CpuClass.ZEN4, F32, ("small_gemm_f32", 128, 0), PAGED, PromptPath.PAGED_ATTENTION, True),
    (CpuClass.AVX512, BF16, None, PAGED, PromptPath.PAGED_ATTENTION, False),
    (CpuClass.AVX512, F32, ("small_gemm_f32", 4, 0), PAGED, PromptPath.PAGED_ATTENTION, True),
    (CpuClass.AVX2, BF16, ("small_gemm_bf16", 32, 0), PAGED, PromptPath.PAGED_ATTENTION, True),
    (CpuClass.AVX2, F32, ("small_gemm_f32", 32, 0), PAGED, PromptPath.PAGED_ATTENTION, True),
    (None, BF16, None, TORCH, PromptPath.PYTORCH, False),  # no kernels
    (None, F32, None, TORCH, PromptPath.PYTORCH, False),
]


def route_of(cpu_class, dtype, head_dim=64, window=None, **switches):
    cpu = CPUS[cpu_class or CpuClass.AVX512_BF16]
    kernels = None if cpu_class is None else KERNELS[cpu_class]
    return decide_route(cpu, dtype, head_dim, window, kernels, **switches)


@pytest.mark.parametrize("cpu_class,dtype,small,decodes,prompts,stack", TABLE,
                         ids=[f"{c.value if c else 'no kernels'}-{d}" for c, d, *_ in TABLE])
def test_the_route_of_each_cpu_class_and_dtype(cpu_class, dtype, small, decodes, prompts,
                                               stack):
    route = route_of(cpu_class, dtype, full_step_rows=2048)
    assert route.cpu_class is (cpu_class or CpuClass.AVX512_BF16)
    gemm = route.linears.small_gemm
    assert (None if gemm is None else (gemm.kernel, gemm.max_rows, gemm.amx_tile_max_rows)) \
        == small
    assert (route.attention.decodes, route.attention.prompts) == (decodes, prompts)
    assert route.layer_stack is stack
    assert route.fused_elementwise is (cpu_class is not None)
    assert route.linears.packed and not route.linears.tiles and route.linears.full_step_rows == 2048
    # bfloat16 through float32 oneDNN where it has no bfloat16; one padded call on AMX only
    assert route.linears.onednn_dtype == (F32 if cpu_class is CpuClass.AVX2 else dtype)
    assert route.linears.one_padded_call is (cpu_class is CpuClass.AMX and dtype == BF16)
    assert route.describe().startswith(f"{route.cpu_class.value} {str(dtype)[6:]} head_dim 64")


def test_a_layers_cut_follows_its_in_features():
    gemm = route_of(CpuClass.AMX, BF16).linears.small_gemm
    assert gemm.cut(64) == SmallGemmCut(SMALL_GEMM_AMX_TILE_MAX_ROWS, amx=True)
    assert gemm.cut(48) == SmallGemmCut(2, amx=False)  # K not in 32s: the AVX512-BF16 GEMM
    assert gemm.cut(47) is None  # the bfloat16 GEMM reads weight pairs
    assert route_of(CpuClass.AMX, F32).linears.small_gemm.cut(47) == SmallGemmCut(128, False)


def test_the_attention_shape_moves_the_prompt_path():
    assert route_of(CpuClass.AMX, BF16, head_dim=48).attention.prompts is PromptPath.PREFILL_BF16
    windowed = route_of(CpuClass.AMX, BF16, window=8)
    assert windowed.attention.prompts is PromptPath.PAGED_ATTENTION and windowed.layer_stack
    wide = route_of(CpuClass.AVX2, BF16, head_dim=256)  # above the AVX2 build's 128
    assert wide.attention.decodes is TORCH and not wide.layer_stack
    assert wide.linears.small_gemm is not None and wide.fused_elementwise
    unfit = dataclasses.replace(KERNELS[CpuClass.AMX], prefill_head_dim_ok=False)
    route = decide_route(CPUS[CpuClass.AMX], BF16, 64, None, unfit)
    assert route.attention.prompts is PromptPath.PAGED_ATTENTION


def test_the_switches_move_the_route():
    invariant = route_of(CpuClass.AMX, BF16, batch_invariant=True, full_step_rows=2048)
    assert invariant.linears.tiles and invariant.linears.packed
    # the vector small GEMM for every call, never the AMX tiles, and the stack on it
    assert invariant.linears.small_gemm == SmallGemmRoute("small_gemm_bf16", ALL_ROWS, 0)
    assert invariant.linears.full_step_rows == 0
    assert invariant.attention.batch_invariant and invariant.layer_stack
    no_small = dataclasses.replace(KERNELS[CpuClass.AMX], small_gemm_bf16=False)
    tiled = decide_route(CPUS[CpuClass.AMX], BF16, 64, None, no_small, batch_invariant=True)
    assert tiled.linears.tiles and tiled.linears.small_gemm is None and not tiled.layer_stack
    assert invariant.attention.prompts is PromptPath.PAGED_ATTENTION
    unpacked = route_of(CpuClass.AMX, BF16, packed_linears=False)
    assert not unpacked.linears.packed and not unpacked.layer_stack
    assert unpacked.attention.prompts is PromptPath.PREFILL_AMX
    sdpa = route_of(CpuClass.AMX, BF16, attention_backend="sdpa")
    assert sdpa.attention.backend == "sdpa" and not sdpa.layer_stack
    half = route_of(CpuClass.AMX, torch.float16)  # oneDNN packs float32 and bfloat16 only
    assert not half.linears.packed and not half.layer_stack and half.fused_elementwise
    with pytest.raises(ValueError, match="batch_invariant needs the cpu attention backend"):
        route_of(None, F32, batch_invariant=True)
    with pytest.raises(ValueError, match="head_dim up to 128"):
        route_of(CpuClass.AVX2, F32, head_dim=256, batch_invariant=True)


def test_this_cpu_is_one_of_the_classes():
    facts = CpuFacts.probe()
    assert facts is CpuFacts.probe()  # read once
    assert facts.cpu_class in CpuClass


def test_the_platform_decides_once_logs_and_describes_the_route(llama_checkpoint, caplog):
    from carpool.models.config import load_model_config
    from carpool.models.loader import load_model
    from carpool.platform import CpuPlatform

    platform = CpuPlatform(kernels=False)
    assert "route" not in platform.describe()
    model = load_model(llama_checkpoint, load_model_config(llama_checkpoint), F32,
                       torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="carpool.platform.cpu"):
        platform.prepare_model(model)
    route = platform.route
    assert route.attention.decodes is TORCH and not route.layer_stack
    assert [r.message for r in caplog.records] == [f"CPU route: {route.describe()}"]
    assert platform.describe().endswith(f"; route: {route.describe()})")
    config = model.config
    assert platform.decide_route(F32, config.head_dim, config.sliding_window) is route
    with pytest.raises(ValueError, match="already runs the route"):
        platform.decide_route(BF16, config.head_dim, config.sliding_window)


@pytest.mark.parametrize("cpu_class", list(CPUS))
def test_quantized_rows_take_the_rounded_weight_only_where_allowed(cpu_class):
    """bfloat16 calls of many rows may multiply by the weight rounded to bfloat16 on the CPUs
    with AVX512-BF16; never in float32, never under batch invariance (a row's bits would
    depend on its batch's size), never on the others (their kernels have no such path)."""
    from carpool.platform.cpu_route import decide_quant
    kernels = dataclasses.replace(KERNELS[cpu_class], quant_gemm=True)
    bf16 = decide_quant(cpu_class, BF16, kernels, batch_invariant=False)
    assert bool(bf16.rounded_from) == CPUS[cpu_class].avx512_bf16
    assert decide_quant(cpu_class, F32, kernels, batch_invariant=False).rounded_from == 0
    assert decide_quant(cpu_class, BF16, kernels, batch_invariant=True).rounded_from == 0


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("cpu_class", list(KERNELS))
def test_a_mixture_of_experts_takes_the_fused_experts_in_the_layer_stack(cpu_class, dtype):
    route = decide_route(CPUS[cpu_class], dtype, 64, None, KERNELS_WITH_MOE[cpu_class],
                         mixture_of_experts=True)
    dense = decide_route(CPUS[cpu_class], dtype, 64, None, KERNELS_WITH_MOE[cpu_class])
    # the stack runs the sparse layers wherever it runs the dense model's
    assert route.moe.fused and route.layer_stack == dense.layer_stack
    assert route.describe().endswith(
        "experts moe_route + moe_experts (rows sorted by expert, grouped GEMMs)")
    assert dense.moe is None and "experts" not in dense.describe()
    # without the kernels, or in float16: the model's PyTorch loop
    assert not decide_route(CPUS[cpu_class], dtype, 64, None, None,
                            mixture_of_experts=True).moe.fused
    half = decide_route(CPUS[cpu_class], torch.float16, 64, None, KERNELS_WITH_MOE[cpu_class],
                        mixture_of_experts=True)
    assert not half.moe.fused and "PyTorch loop over the experts" in half.describe()
    assert not half.layer_stack  # the stack runs kernels only: not the PyTorch loop
    invariant = decide_route(CPUS[cpu_class], dtype, 64, None, KERNELS_WITH_MOE[cpu_class],
                             batch_invariant=True, mixture_of_experts=True)
    assert invariant.moe.fused
    with pytest.raises(ValueError, match="batch_invariant needs the moe_experts kernel"):
        decide_route(CPUS[cpu_class], torch.float16, 64, None, KERNELS_WITH_MOE[cpu_class],
                     batch_invariant=True, mixture_of_experts=True)


KERNELS_WITH_MOE = {cls: dataclasses.replace(facts, moe_experts=True)
                    for cls, facts in KERNELS.items()}
