"""`carpool/core` and `carpool simulate` must stay tensor-free: importing them loads no torch."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import carpool.core

REPO = Path(__file__).resolve().parents[2]


def _torch_loaded_after_importing(modules: list[str]) -> bool:
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "print('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, check=True)
    return result.stdout.strip() == "True"


def test_core_modules_import_no_torch():
    modules = [m.name for m in pkgutil.iter_modules(carpool.core.__path__, "carpool.core.")]
    assert {"carpool.core.scheduler", "carpool.core.static_scheduler",
            "carpool.core.block_manager"} <= set(modules)
    assert not _torch_loaded_after_importing(modules)


def test_simulator_imports_no_torch():
    modules = ["carpool.cli", "carpool.sim.cli", "carpool.sim.simulator", "carpool.sim.report"]
    assert not _torch_loaded_after_importing(modules)


def test_the_check_can_fail():
    assert _torch_loaded_after_importing(["torch"])
