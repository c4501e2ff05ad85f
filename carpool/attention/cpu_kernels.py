"""The C++ CPU kernels, built on first use, and the attention kernel's PyTorch reference.

One extension holds every kernel of `csrc/` (bound in `bindings.cpp`): paged attention
(`paged_attention.cpp`), bfloat16 prompt-chunk attention on AVX512-BF16
(`prefill_attention.cpp`, the same arguments less the sliding window), the few-row
bfloat16 and float32 linears (`small_gemm.cpp`) and a decoder layer's fused elementwise passes
(`fused_ops.cpp`: RoPE, residual add + RMSNorm, SiLU x up, the KV write), and a model's
decoder layers run through those in one call (`layer_stack.cpp`, `LayerStack`). Callers check
`has_bf16_gemm()` before the AVX512-BF16 ones, `has_small_gemm_bf16()` before the bfloat16
small GEMM (AVX512-BF16, or AVX2 builds in float32 FMAs), `has_f32_gemm()` before the float32
one.

`paged_attention` in `csrc/paged_attention.cpp` reads keys and values in place through the
block table (the PyTorch decode path gathers the keys into a padded copy first). It is
compiled with `torch.utils.cpp_extension.load` the first time `load()` is called and cached
on disk across processes (torch's extension directory unless `build_dir` is given), under a
name that carries a hash of the sources; the vector width matches the capability torch
itself dispatches to on this CPU. When the build cannot run, `load()` logs one warning and
returns None, and callers keep the PyTorch path.
`paged_attention_reference` has the same signature: the test oracle and the fallback.

    module.paged_attention(out, q, kv_cache, block_tables, query_starts, query_lens,
                           seq_lens, scale, sliding_window, batch_invariant=False) -> None

out, q [T, H, D] (same dtype: float32, bfloat16 or float16; head_dim contiguous, token and
head strides free); kv_cache [2, Hkv, num_blocks, block_size, D] contiguous, same dtype;
block_tables [S, max_blocks], query_starts/query_lens/seq_lens [S]: contiguous int32 CPU
tensors; sliding_window 0 = none; batch_invariant: every row summed in one fixed order, so a
row's output does not depend on the other rows of its call (a little slower). Writes only
the rows some request covers; bad shapes, dtypes, lengths or block ids raise RuntimeError.
It releases the GIL and runs on torch's intra-op threads (`torch.set_num_threads`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "bindings.cpp", _CSRC / "paged_attention.cpp", _CSRC / "fused_ops.cpp",
            _CSRC / "small_gemm.cpp", _CSRC / "prefill_attention.cpp", _CSRC / "threads.cpp",
            _CSRC / "greedy.cpp", _CSRC / "layer_stack.cpp"]
# Flags that make ATen's Vectorized<float> use the same registers as torch's own kernels here.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
               "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
_lock = threading.Lock()
# per (build_dir, capability); None = the build failed
_modules: dict[tuple[str | None, str | None], ModuleType | None] = {}


def load(build_dir: str | os.PathLike | None = None,
         capability: str | None = None) -> ModuleType | None:
    """The compiled kernels module (built once per process, build dir and capability), or None
    if the build fails (no compiler, no ninja, a compile error), after one warning line.

    `capability` ("AVX512", "AVX2", "DEFAULT") picks the vector width of the build; None
    takes the one torch dispatches to on this CPU (what the engine uses). Another one is for
    tests and benchmarks of a narrower build on a wider CPU: the modules are independent, and
    several can be loaded in one process.
    """
    key = (None if build_dir is None else str(build_dir), capability)
    with _lock:
        if key not in _modules:
            _modules[key] = _build(key[0], capability)
        return _modules[key]


def _build(build_dir: str | None, capability: str | None = None) -> ModuleType | None:
    from torch.utils import cpp_extension

    capability = capability or torch.backends.cpu.get_cpu_capability()
    flags = _CAPABILITY_FLAGS.get(capability, [])
    if capability == "AVX512" and "avx512_bf16" in _cpu_flags():
        flags = [*flags, "-mavx512bf16", "-DCARPOOL_AVX512_BF16"]  # vdpbf16ps on bf16 prompts
        if {"amx_bf16", "amx_tile"} <= _cpu_flags():
            flags = [*flags, "-DCARPOOL_AMX"]  # bf16 prompts' products on AMX tiles
    try:
        csrc = _csrc_files()
        name = _extension_name(capability.lower() if flags else "default", flags, csrc)
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not installed")
        root = (Path(build_dir) if build_dir is not None
                else Path(cpp_extension.get_default_build_root()) / name)
        sources = _staged_sources(root / "src", csrc)
        # -fopenmp: at::parallel_for is inline OpenMP (torch's parallel backend here); without
        # it the loop runs on one thread. The libgomp.so.1 torch already loaded serves it.
        return cpp_extension.load(name=name, sources=[str(p) for p in sources],
                                  extra_cflags=["-O3", "-fopenmp", *flags],
                                  extra_ldflags=["-fopenmp"], build_directory=str(root),
                                  verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the PyTorch path"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        logger.warning("C++ CPU attention kernels unavailable, using the PyTorch path: %s",
                       first_line)
        return None


def _cpu_flags() -> set[str]:
    """This CPU's feature flags, from /proc/cpuinfo (empty where there is none)."""
    return set(_cpuinfo().get("flags", "").split())


def is_zen4() -> bool:
    """Whether this CPU is an AMD Zen 4 core: family 25 (0x19) with AVX-512, which no other
    Zen generation of that family has. Its AVX-512 runs on 256-bit units, so which GEMM wins
    at a row count differs from Intel's cores and Zen 5's (`cpu_linear.small_gemm_max_rows`)."""
    info = _cpuinfo()
    return (info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"
            and "avx512f" in info.get("flags", "").split())


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none); read once,
    as every packed linear layer asks for its small GEMM's cut."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _csrc_files() -> dict[str, bytes]:
    """The files of csrc/ by name, read once for both the build's name and its copy."""
    return {path.name: path.read_bytes() for path in sorted(_CSRC.iterdir()) if path.is_file()}


def _staged_sources(folder: Path, csrc: dict[str, bytes]) -> list[Path]:
    """`csrc` (`_csrc_files`) written into `folder` (files rewritten only where they differ),
    and the sources there. The build's ninja file names its sources by path, so building from
    the checkout itself made every other checkout or install of the same sources recompile
    the shared build (30 s here) and the next process from the first one compile it again;
    from a copy kept beside the build, named by the sources' hash, they all find it up to
    date."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in csrc.items():
        target = folder / name
        if not target.exists() or target.read_bytes() != data:
            partial = target.with_name(f".{name}.{os.getpid()}")
            partial.write_bytes(data)
            os.replace(partial, target)  # whole files only, for a process building beside
    return [folder / path.name for path in _SOURCES]


def _extension_name(capability: str, flags: list[str], csrc: dict[str, bytes]) -> str:
    """carpool_cpu_kernels_<capability>_<hash of csrc/, flags, Python and torch>: each version
    of the sources gets its own build in the shared extension cache, so two checkouts (or an
    upgrade) never rebuild over, or load, each other's binary."""
    digest = hashlib.sha256(" ".join(["-fopenmp", *flags]).encode())
    digest.update(f"{sys.version_info.major}.{sys.version_info.minor} {torch.__version__}".encode())
    for name, data in csrc.items():  # sorted by name
        digest.update(name.encode())
        digest.update(data)
    return f"carpool_cpu_kernels_{capability}_{digest.hexdigest()[:12]}"


def paged_attention_reference(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_starts: torch.Tensor,
                              query_lens: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                              sliding_window: int) -> None:
    """What the kernel computes, one request at a time: writes the covered rows of out.

    Request i's queries q[query_starts[i] : + query_lens[i]] sit at the last query_lens[i]
    of positions 0 .. seq_lens[i] - 1 and attend the keys at positions <= their own (and
    less than sliding_window behind, if it is > 0), in a float32 softmax of scale * q.k.
    """
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    group_size = q.shape[1] // num_kv_heads
    for i in range(block_tables.shape[0]):
        start, q_len, seq_len = int(query_starts[i]), int(query_lens[i]), int(seq_lens[i])
        if q_len == 0:
            continue
        blocks = block_tables[i, :-(-seq_len // block_size)].long()
        # (2, Hkv, num_blocks, block_size, D) -> (2, Hkv, seq_len, D)
        kv = kv_cache[:, :, blocks].flatten(2, 3)[:, :, :seq_len].float()
        keys = kv[0].repeat_interleave(group_size, dim=0)  # (H, seq_len, D)
        values = kv[1].repeat_interleave(group_size, dim=0)
        queries = q[start:start + q_len].float().transpose(0, 1)  # (H, q_len, D)
        scores = scale * (queries @ keys.transpose(1, 2))  # (H, q_len, seq_len)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed &= q_pos - k_pos < sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        out[start:start + q_len] = (probs @ values).transpose(0, 1).to(out.dtype)
