"""Pinning torch's threads to CPUs (`cpu_omp_threads_bind`) and how long they spin before they
sleep (`cpu_omp_spin_count`); see carpool/utils/cpu_threads.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from carpool.arg_utils import add_engine_arguments
from carpool.config import EngineConfig
from carpool.cpu_options import CpuOptions
from carpool.utils.cpu_threads import (
    DEFAULT_OMP_SPIN_COUNT,
    cpus_for_slot,
    openmp_wait_environment,
    parse_cpu_list,
    resolve_auto,
    validate,
)


def test_cpu_lists_parse_like_vllms():
    assert parse_cpu_list("0-3") == [0, 1, 2, 3]
    assert parse_cpu_list("0,2,4-5") == [0, 2, 4, 5]
    assert parse_cpu_list(" 7 ") == [7]


@pytest.mark.parametrize("bad", ["", "a", "3-1", "-1", "0,0", "0-2,1", "1|x", "0-"])
def test_a_bad_setting_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="cpu_omp_threads_bind"):
        validate(bad)
    with pytest.raises(ValueError, match="cpu_omp_threads_bind"):
        CpuOptions(omp_threads_bind=bad)


def test_each_slot_takes_its_own_cpus():
    assert cpus_for_slot("0-3", slot=0, num_threads=2) == [0, 1]
    assert cpus_for_slot("0-3", slot=1, num_threads=2) == [2, 3]
    assert cpus_for_slot("4-5|0-1", slot=0, num_threads=2) == [4, 5]
    assert cpus_for_slot("4-5|0-1", slot=1, num_threads=2) == [0, 1]
    assert cpus_for_slot("0-7", slot=0, num_threads=3) == [0, 1, 2]


def test_too_few_cpus_auto_and_nobind_pin_nothing(caplog):
    assert cpus_for_slot("auto", 0, 2) is None  # unresolved: not carpool's own process
    assert cpus_for_slot("nobind", 0, 2) is None
    with caplog.at_level("WARNING"):
        assert cpus_for_slot("0-2", slot=1, num_threads=2) is None
        assert cpus_for_slot("0-1|2", slot=1, num_threads=2) is None
        assert cpus_for_slot("0-1", slot=1, num_threads=1) == [1]
        assert cpus_for_slot("0-1|2-3", slot=2, num_threads=2) is None
    assert len([r for r in caplog.records if "stay unpinned" in r.message]) == 3


def test_auto_resolves_to_the_cpus_this_process_may_use():
    allowed = sorted(os.sched_getaffinity(0))
    assert parse_cpu_list(resolve_auto("auto")) == allowed
    assert resolve_auto("nobind") == "nobind"
    assert resolve_auto("0-1") == "0-1"


def test_the_flag_reaches_the_config():
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--cpu-omp-threads-bind", "0-1|2-3"])
    config = EngineConfig.from_cli_args(argparse.Namespace(model=None, **vars(args)))
    assert config.cpu.omp_threads_bind == "0-1|2-3"
    assert EngineConfig().cpu.omp_threads_bind == "auto"


def test_the_spin_count_becomes_the_started_processes_environment():
    spin = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(DEFAULT_OMP_SPIN_COUNT)}
    assert openmp_wait_environment(None, {"PATH": "/bin"}) == spin
    # unset: the user's own OpenMP setting stands
    assert openmp_wait_environment(None, {"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert openmp_wait_environment(None, {"GOMP_SPINCOUNT": "300000"}) == {}
    # given: it wins over the environment
    assert openmp_wait_environment(0, {"GOMP_SPINCOUNT": "300000"}) == {
        "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}
    assert openmp_wait_environment(250, {}) == {"OMP_WAIT_POLICY": "PASSIVE",
                                                "GOMP_SPINCOUNT": "250"}


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_a_bad_spin_count_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="cpu_omp_spin_count"):
        CpuOptions(omp_spin_count=bad)


def test_the_spin_flag_reaches_the_config():
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--cpu-omp-spin-count", "0"])
    config = EngineConfig.from_cli_args(argparse.Namespace(model=None, **vars(args)))
    assert config.cpu.omp_spin_count == 0
    assert EngineConfig().cpu.omp_spin_count is None
    with pytest.raises(ValueError, match="--cpu-omp-spin-count"):
        EngineConfig.from_cli_args(argparse.Namespace(
            model=None, **vars(parser.parse_args(["--cpu-omp-spin-count", "-5"]))))


_PIN_SCRIPT = """
import json, os, sys
import torch
from carpool import kernels as cpu_kernels
from carpool.platform import CpuPlatform
cpus = json.loads(sys.argv[1])
torch.set_num_threads(len(cpus))
platform = CpuPlatform(omp_threads_bind=",".join(map(str, cpus)), thread_slot=0)
platform.prepare_process()
torch.ones(1 << 16).exp_().sum()  # a parallel region after pinning: the same pool threads
def allowed(tid):
    for line in open(f"/proc/self/task/{tid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":")[1].strip()
threads = {tid: allowed(tid) for tid in os.listdir("/proc/self/task")}
tids = cpu_kernels.load().bind_threads(cpus)
print(json.dumps({"main": allowed(os.getpid()), "threads": sorted(threads.values()),
                  "tids": tids, "pid": os.getpid()}))
"""


def test_prepare_process_pins_each_torch_thread_to_its_own_cpu():
    from carpool import kernels as cpu_kernels
    if cpu_kernels.load() is None:
        pytest.skip("no C++ toolchain here")
    cpus = sorted(os.sched_getaffinity(0))[:2]
    # A child process: pinning is for the life of a process, and this one runs other tests.
    done = subprocess.run([sys.executable, "-c", _PIN_SCRIPT, json.dumps(cpus)],
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["main"] == str(cpus[0])  # the caller is torch's thread 0
    assert {str(cpu) for cpu in cpus} <= set(result["threads"])  # a thread on each CPU
    # bind_threads itself: one thread per CPU (not one thread twice), the caller first.
    assert len(set(result["tids"])) == len(cpus) and result["tids"][0] == result["pid"]
