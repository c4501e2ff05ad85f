"""Builds and loads the compiled CPU kernels (`csrc/`), once per process and build folder.

The extension is compiled with `torch.utils.cpp_extension.load` the first time `load()` is
called and cached on disk across processes (in $TORCH_EXTENSIONS_DIR, else torch's extension
folder, unless `build_dir` is given) under a name that carries a hash of what decides the
binary: the sources, flags, Python's version, torch's version and the compiler's own
version line, and none of an environment's paths. So an upgrade or another compiler never
loads another's binary, while two checkouts or two environments with the same torch and
compiler share one build: a build already there is imported as it is, never handed to
torch's loader again (whose ninja file holds this environment's include paths, and would
rebuild it for each environment in turn). The vector width
matches the capability torch itself dispatches to on this CPU. When the build cannot run,
`load()` logs one warning naming what falls back and returns None; callers keep the PyTorch
path (`carpool.kernels.reference` computes the same thing).

[NOTE] A build folder is shared by every process that loads the same sources: they take
turns through a lock the OS drops when its holder dies (torch's own lock file outlives a
killed builder, and then every later load waits on it forever).

`python3 -m carpool.kernels` builds it ahead of time (`.ci/run` does, so no test pays for
the build).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from carpool.kernels.cpu_info import cpu_flags

logger = logging.getLogger(__name__)

# Every file under it goes into the build's name and copy; every .cpp is a translation unit
# (headers are included from its root).
CSRC = Path(__file__).parent / "csrc"
# Flags that make ATen's Vectorized<float> use the same registers as torch's own kernels here.
CAPABILITY_FLAGS = {
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


def build_flags(capability: str) -> list[str]:
    """The compiler flags of a build for `capability` on this CPU."""
    flags = CAPABILITY_FLAGS.get(capability, [])
    if capability == "AVX512" and "avx512_vnni" in cpu_flags():
        flags = [*flags, "-mavx512vnni"]  # W8A8's int8 products (vpdpbusd)
    if capability == "AVX512" and "avx512_bf16" in cpu_flags():
        flags = [*flags, "-mavx512bf16", "-DCARPOOL_AVX512_BF16"]  # vdpbf16ps on bf16 prompts
        if {"amx_bf16", "amx_tile"} <= cpu_flags():
            flags = [*flags, "-DCARPOOL_AMX"]  # bf16 prompts' products on AMX tiles
    return flags


def _build(build_dir: str | None, capability: str | None = None) -> ModuleType | None:
    from torch.utils import cpp_extension

    capability = capability or torch.backends.cpu.get_cpu_capability()
    flags = build_flags(capability)
    try:
        csrc = _csrc_files()
        name = _extension_name(capability.lower() if flags else "default", flags, csrc,
                               build_dir)
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not installed")
        root = Path(build_dir) if build_dir is not None else _cache_folder(name)
        with _exclusive(root):
            built = root / f"{name}.so"
            if built.exists():  # linked by a holder of _exclusive: the name says the rest
                try:
                    return _import_built(name, built)
                except ImportError as exc:  # a link cut short: build it again below
                    logger.warning("C++ CPU kernels: %s does not load (%s); rebuilding it",
                                   built, exc)
            staged = _stage(root / "src", csrc)
            # Torch's lock file, if there is one, was left by a builder that died (every
            # live one holds _exclusive): torch would wait on it forever.
            (root / "lock").unlink(missing_ok=True)
            # A first start compiles for a while before it serves: say so, and how long it took.
            logger.info("C++ CPU kernels: compiling the %s build in %s (once for these "
                        "sources; the engine starts when it is done)", capability, root)
            started = time.monotonic()
            # -fopenmp: at::parallel_for is inline OpenMP (torch's parallel backend here);
            # without it the loop runs on one thread. The libgomp.so.1 torch already loaded
            # serves it.
            module = cpp_extension.load(
                name=name, sources=[str(staged / s) for s in csrc if s.endswith(".cpp")],
                extra_cflags=["-O3", "-fopenmp", *flags], extra_include_paths=[str(staged)],
                extra_ldflags=["-fopenmp"], build_directory=str(root), verbose=False)
            logger.info("C++ CPU kernels: compiled in %.0f s", time.monotonic() - started)
            return module
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the PyTorch path"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        logger.warning("C++ CPU kernels unavailable (%s build): paged attention, the small "
                       "GEMMs, the fused layer passes, the C++ layer stack and the greedy "
                       "argmax fall back to PyTorch: %s", capability, first_line)
        return None


def _import_built(name: str, path: Path) -> ModuleType:
    """The extension module at `path` (what torch's loader does once its build is done)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cache_folder(name: str) -> Path:
    """The build `name`'s folder in the shared extension cache, where torch puts its own
    (honouring TORCH_EXTENSIONS_DIR): torch reads its settings, carpool never the environment."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(name, verbose=False))


@contextlib.contextmanager
def _exclusive(root: Path) -> Iterator[None]:
    """Holds root/carpool.lock (an flock) while the block runs: one process at a time stages
    and builds in `root`, and the lock dies with its holder."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "carpool.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes or the process ends
        yield


def _csrc_files() -> dict[str, bytes]:
    """The files of csrc/ by path relative to it, sorted, read once for both the build's name
    and its copy."""
    return {path.relative_to(CSRC).as_posix(): path.read_bytes()
            for path in sorted(CSRC.rglob("*")) if path.is_file()}


def _stage(folder: Path, csrc: dict[str, bytes]) -> Path:
    """`csrc` (`_csrc_files`) written into `folder` (files rewritten only where they differ);
    returns `folder`. The build's ninja file names its sources by path, so building from the
    checkout itself made every other checkout or install of the same sources recompile the
    shared build and the next process compile it again; from a copy kept beside the build,
    named by the sources' hash, they all find it up to date."""
    for name, data in csrc.items():
        target = folder / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if not target.exists() or target.read_bytes() != data:
            partial = target.with_name(f".{target.name}.{os.getpid()}")
            partial.write_bytes(data)
            os.replace(partial, target)  # whole files only
    return folder


def _extension_name(capability: str, flags: list[str], csrc: dict[str, bytes],
                    build_dir: str | None = None) -> str:
    """carpool_cpu_kernels_<capability>_<hash>: each version of the sources, and each
    toolchain that compiles them, gets its own build in the shared extension cache.

    The hash covers what makes the binary differ: the flags, Python's and torch's versions
    (their headers and ABI), the compiler's version line, and the sources. Not the
    environment's paths (torch's and Python's include folders, the compiler's location):
    two environments with the same torch and compiler make the same binary and share it.
    A build folder of the caller's own is in it: torch renames a second load of a name it
    has loaded from another folder (name_v1) and rebuilds it from scratch.
    """
    from torch.utils import cpp_extension

    digest = hashlib.sha256(" ".join(["-fopenmp", *flags]).encode())
    digest.update(f"{sys.version_info.major}.{sys.version_info.minor} {torch.__version__} "
                  f"{torch.version.git_version}".encode())
    digest.update(compiler_version(cpp_extension.get_cxx_compiler()).encode())
    digest.update(b"" if build_dir is None else str(Path(build_dir).resolve()).encode())
    for name, data in csrc.items():  # sorted by path
        digest.update(name.encode())
        digest.update(data)
    return f"carpool_cpu_kernels_{capability}_{digest.hexdigest()[:12]}"


@functools.cache
def compiler_version(compiler: str) -> str:
    """The first line of `compiler --version` (its name, vendor and version); raises
    RuntimeError naming the compiler if it cannot be run."""
    try:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                              timeout=60, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot run the C++ compiler {compiler!r}: {exc}") from None
    return (done.stdout.strip().splitlines() or [compiler])[0]
