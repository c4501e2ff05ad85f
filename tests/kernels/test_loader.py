"""The kernels' loader (carpool/kernels/loader.py): one build per sources and toolchain,
shared by every checkout and process that has them, taken in turns; the fallback's one
warning; and a build that runs on torch's threads."""

from __future__ import annotations

import fcntl
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from carpool import kernels as cpu_kernels
from carpool.kernels import loader


def test_runs_on_torchs_threads(kernels):
    """at::parallel_for is inline OpenMP: a build without -fopenmp would run on one thread."""
    num_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert kernels.parallel_width() == 2
    finally:
        torch.set_num_threads(num_threads)


def test_another_checkout_of_the_same_sources_reuses_the_build(tmp_path):
    """The same sources from another folder (a second checkout, an installed copy) load the
    binary already built instead of compiling it again: the build is named by the sources'
    hash and compiled from a copy of them kept beside it, not from the checkout's paths. In
    a fresh process, as torch skips the build of a name it has loaded once. Whether it
    compiled is read from its own log, not the binary's time: another user of the shared
    cache may load (never relink) the same build meanwhile.

    The other checkout gets the sources this build was made from (its staged src/), not this
    checkout's csrc/ as it is now: csrc/ may have changed since this process loaded (an edit,
    a checkout of another commit), and those sources are another build."""
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("the compiled kernels are unavailable here")
    built = Path(module.__file__)
    other = tmp_path / "checkout" / "csrc"
    shutil.copytree(built.parent / "src", other)
    script = (
        "import logging, sys\n"
        "from pathlib import Path\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from carpool.kernels import loader\n"
        "loader.CSRC = Path(sys.argv[1])\n"
        "print(loader.load().__file__)\n")
    done = subprocess.run([sys.executable, "-c", script, str(other)], capture_output=True,
                          text=True, timeout=600, check=True)
    assert Path(done.stdout.strip().splitlines()[-1]) == built
    assert "compiling" not in done.stderr, done.stderr


def test_another_environment_with_the_same_toolchain_shares_the_build(tmp_path):
    """Another virtual environment (its own include folders, Python and compiler at other
    paths) with the same torch, compiler and sources loads the same build as it is: the
    build's name carries versions, not paths, and a build already there is imported, not
    handed to torch's loader, whose ninja file names this environment's paths and would
    rebuild it (~90 s, for each environment in turn)."""
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("the compiled kernels are unavailable here")
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from torch.utils import cpp_extension\n"
        "paths = [f'{sys.argv[1]}/{p}' for p in cpp_extension.include_paths()]\n"
        "cpp_extension.include_paths = lambda *a, **k: paths\n"
        "from carpool.kernels import loader\n"
        "print(loader.load().__file__)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "other-venv")],
                          capture_output=True, text=True, timeout=600, check=True)
    assert Path(done.stdout.strip().splitlines()[-1]) == Path(module.__file__)
    assert "compiling" not in done.stderr, done.stderr


def fake_build(calls: list[dict], result="module", during=None):
    """A stand-in for cpp_extension.load that records its arguments (and runs `during`)."""
    def build(**kwargs):
        calls.append(kwargs)
        if during is not None:
            during(Path(kwargs["build_directory"]))
        return result
    return build


def test_builders_take_turns_and_clear_a_dead_builders_lock(tmp_path, monkeypatch):
    """torch's lock file, left by a builder killed mid-build, would make every later load of
    that folder wait forever; a live builder holds carpool.lock, which the OS drops with it."""
    from torch.utils import cpp_extension

    (tmp_path / "lock").touch()  # a dead builder's

    def held_by_the_build(root: Path) -> None:
        assert not (root / "lock").exists()
        with open(root / "carpool.lock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another builder must wait

    calls = []
    monkeypatch.setattr(cpp_extension, "load", fake_build(calls, during=held_by_the_build))
    assert cpu_kernels.load(tmp_path) == "module"
    with open(tmp_path / "carpool.lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the build


def test_every_source_file_is_staged_and_every_cpp_compiled(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load", fake_build(calls))
    cpu_kernels.load(tmp_path)
    csrc = loader.CSRC
    sources = {Path(s).relative_to(tmp_path / "src") for s in calls[0]["sources"]}
    assert sources == {p.relative_to(csrc) for p in csrc.rglob("*.cpp")}
    staged = {p.relative_to(tmp_path / "src") for p in (tmp_path / "src").rglob("*")
              if p.is_file()}
    assert staged == {p.relative_to(csrc) for p in csrc.rglob("*") if p.is_file()}


def test_the_name_follows_the_sources_and_the_toolchain_not_the_paths(monkeypatch, tmp_path):
    """The sources, flags, torch's version and the compiler's version line are in the name;
    the environment's paths (include folders) are not, so environments with the same torch
    and compiler share one build. A folder of the caller's own is: torch renames a second
    load of a name from another folder (name_v1) and builds it from scratch."""
    from torch.utils import cpp_extension

    csrc = {"bindings.cpp": b"int x;"}

    def name(**changes) -> str:
        return loader._extension_name("avx512", changes.get("flags", ["-mavx512f"]),
                                      changes.get("csrc", csrc), changes.get("build_dir"))

    monkeypatch.delenv("CXX", raising=False)
    base = name()
    assert name() == base
    assert name(csrc={"bindings.cpp": b"int y;"}) != base
    assert name(flags=["-mavx2"]) != base
    assert name(build_dir=str(tmp_path)) != base
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: ["/elsewhere/include"])
    assert name() == base  # another environment's paths
    monkeypatch.setattr(loader, "compiler_version", lambda cxx: "c++ (GCC) 99.1")
    assert name() != base  # another compiler
    monkeypatch.undo()
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert name() != base  # another torch


def test_failed_build_warns_once_and_returns_none(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # torch reads CXX
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert cpu_kernels.load(tmp_path / "build") is None
        assert cpu_kernels.load(tmp_path / "build") is None  # remembered, not retried
    ours = [r for r in caplog.records if r.name == loader.__name__]
    assert len(ours) == 1
    assert "unavailable" in ours[0].getMessage()
    assert "\n" not in ours[0].getMessage()


def test_missing_ninja_warns_and_returns_none(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert cpu_kernels.load(tmp_path / "build") is None
    ours = [r for r in caplog.records if r.name == loader.__name__]
    assert [r.getMessage().endswith("ninja is not installed") for r in ours] == [True]


def test_concurrent_loads_build_once(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    calls = []
    monkeypatch.setattr(cpp_extension, "load",
                        fake_build(calls, during=lambda _: time.sleep(0.2)))
    results = []
    threads = [threading.Thread(target=lambda: results.append(cpu_kernels.load(tmp_path)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == ["module", "module"] and len(calls) == 1


def test_a_compile_is_logged_at_its_start_and_end(tmp_path, monkeypatch, caplog):
    """A first start spends a while compiling before the engine serves: the log says so
    (and a load of a build already there says nothing)."""
    from torch.utils import cpp_extension

    def build(**kwargs):
        (Path(kwargs["build_directory"]) / f"{kwargs['name']}.so").touch()
        return "module"

    monkeypatch.setattr(cpp_extension, "load", build)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        assert cpu_kernels.load(tmp_path) == "module"
    messages = [r.getMessage() for r in caplog.records if r.name == loader.__name__]
    assert len(messages) == 2
    assert "compiling" in messages[0] and str(tmp_path) in messages[0]
    assert messages[1].startswith("C++ CPU kernels: compiled in ")
    caplog.clear()
    monkeypatch.delitem(loader._modules, (str(tmp_path), None))  # as a new process would
    imported = []
    monkeypatch.setattr(loader, "_import_built", lambda name, path: imported.append(path)
                        or "built module")
    monkeypatch.setattr(cpp_extension, "load", fake_build([]))
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        assert cpu_kernels.load(tmp_path) == "built module"  # imported, torch not asked
    assert not [r for r in caplog.records if r.name == loader.__name__]
    assert [p.parent for p in imported] == [tmp_path]

