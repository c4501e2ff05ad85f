"""Fed docs/lab/35-the-first-run-on-a-gpu-h200.md.

Does an error the compiled CPU kernels raise reach Python as a RuntimeError here?

On the H200 machine's image (Python 3.12.3, torch 2.11.0+cu130, g++ 13.3, Intel Xeon with
AMX) carpool's `paged_attention` crashed the process (SIGSEGV) on its first argument
check, while a one-file extension built there raised cleanly, inside `at::parallel_for`
too (BENCHMARKS.md §35). Each case runs in its own process; a crash shows as a negative
return code.

    python3 -m benchmarks.archive.kernel_errors_reach_python
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # each case runs there, to import carpool

PRELUDE = r'''
import torch
from torch.utils.cpp_extension import load_inline

SOURCE = """
#include <torch/extension.h>
#include <ATen/Parallel.h>
void boom() {{ TORCH_CHECK(false, "boom"); }}
void boom_parallel() {{
  at::parallel_for(0, 64, 1, [&](int64_t b, int64_t e) {{ TORCH_CHECK(b < 0, "boom"); }});
}}
// A frame the compiler must realign to 64 bytes (as AVX-512 spills make it in the kernels),
// thrown from after a call that keeps the buffer live.
__attribute__((noinline)) void touch(float* p) {{ p[0] += 1.0f; }}
void boom_aligned(int64_t n) {{
  alignas(64) float buffer[64] = {{}};
  touch(buffer);
  TORCH_CHECK(n < 0, "boom ", buffer[0]);
}}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{
  m.def("boom", &boom);
  m.def("boom_aligned", &boom_aligned, py::call_guard<py::gil_scoped_release>());
  m.def("boom_parallel", &boom_parallel);
  m.def("boom_released", &boom, py::call_guard<py::gil_scoped_release>());  // as carpool's
}}
"""

def inline_module(carpool_flags=False):
    from carpool import kernels as cpu_kernels
    flags = ["-O3", "-fopenmp"]
    name = "carpool_error_check"
    if carpool_flags:  # the vector-ISA flags carpool's own build gets on this CPU
        flags += cpu_kernels.loader.CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
        name += "_isa"
    return load_inline(name, cpp_sources=SOURCE, extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], verbose=False)

def carpool_paged_attention_bad_block_table(capability):
    from carpool import kernels as cpu_kernels
    kernels = cpu_kernels.load(capability=capability)
    q = torch.zeros(1, 4, 16)
    kernels.paged_attention(torch.empty_like(q), q, torch.zeros(2, 2, 4, 16, 16),
                            torch.zeros(1, 2, dtype=torch.int64),  # not int32: refused
                            torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                            torch.tensor([20], dtype=torch.int32), 1.0, 0)

def carpool_argmax_rows_bad_dtype():
    from carpool import kernels as cpu_kernels
    cpu_kernels.load().argmax_rows(torch.zeros(2, 8, dtype=torch.int32))
'''

# One difference at a time between a one-file extension and carpool's kernels, to tell which
# one crashes where carpool's did.
CASES = {
    "one-file extension, plain": "inline_module().boom()",
    "one-file extension, inside at::parallel_for": "inline_module().boom_parallel()",
    "one-file extension, GIL released (py::call_guard)": "inline_module().boom_released()",
    "one-file extension, carpool's ISA flags, GIL released":
        "inline_module(carpool_flags=True).boom_released()",
    "one-file extension, carpool's ISA flags, a 64-byte-aligned frame":
        "inline_module(carpool_flags=True).boom_aligned(1)",
    "carpool argmax_rows, int32 logits": "carpool_argmax_rows_bad_dtype()",
    "carpool paged_attention, native build": "carpool_paged_attention_bad_block_table(None)",
    "carpool paged_attention, AVX2 build": "carpool_paged_attention_bad_block_table('AVX2')",
}


def run_case(call: str) -> str:
    code = (PRELUDE.format() + f"\ntry:\n    {call}\n    print('no error')\n"
            "except RuntimeError as e:\n    print('RuntimeError:', str(e).splitlines()[0][:70])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True)
    if result.returncode != 0:
        return f"CRASHED (return code {result.returncode})"
    return result.stdout.strip().splitlines()[-1]


def main() -> int:
    crashed = 0
    for name, call in CASES.items():
        outcome = run_case(call)
        crashed += outcome.startswith("CRASHED")
        print(f"{name}: {outcome}", flush=True)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
