"""The compiled CPU kernels: one C++ extension (`csrc/`, organised by op), its loader and
the CPU probe that picks its build, and `reference.py`, the PyTorch oracle of every op.

    csrc/attention/   attend (a step's attention: its rows to the two below),
                      paged_attention (decodes and prompt chunks, in place through the block
                      tables), prefill_attention_bf16 (bfloat16 prompt chunks, AVX512-BF16/AMX)
    csrc/gemm/        small_gemm_bf16 / small_gemm_f32 and their weight packing (few-row
                      linears on AVX512-BF16, AMX or AVX2); quant_linear, pack_quant_weight,
                      dequantize_rows (quantized int8 / int4 weights); w8a8_linear,
                      pack_w8a8_weight (W8A8 per channel: int8 x int8, VNNI)
    csrc/elementwise/ rotary_, rms_norm, silu_and_mul, write_kv_; int8_per_token (W8A8's
                      activation rounding)
    csrc/layers/      LayerStack: a model's decoder layers in one call, through the ops above
    csrc/sampling/    argmax_rows (the greedy rows of a step)
    csrc/runtime/     bind_threads (torch's threads pinned to CPUs)
    csrc/bindings.cpp every op bound to Python, in one place, and two checks of the build:
                      parallel_width (OpenMP threads), shares_claims (the AMX GEMM's split)

Every .cpp under csrc/ is compiled. `load()` returns the module or None (no compiler:
everything keeps its PyTorch path). Which of these a CPU step runs is decided once at load,
in `carpool.platform.cpu_route`. `tests/kernels/` mirrors the ops, each compared with its
function in `reference.py`.
"""

from carpool.kernels.cpu_info import cpu_flags, is_zen4
from carpool.kernels.loader import load

__all__ = ["cpu_flags", "is_zen4", "load"]
