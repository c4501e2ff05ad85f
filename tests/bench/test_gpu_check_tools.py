"""The tools `scripts/gpu_check.sh` runs on a lent GPU, run here on the CPU, so that a rare
GPU session does not spend its minutes on a script that rotted (BENCHMARKS.md §35)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> str:
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], check=True)


def test_decode_step_groups_times_both_settings(make_checkpoint):
    out = run("-m", "benchmarks.profile.decode_step_groups",
              "--model", str(make_checkpoint("llama")), "--num-running", "32", "--device", "cpu",
              "--dtype", "float32", "--rounds", "2", "--steps", "2", "--compare-cudnn", "--profile")
    assert "32 running, 8 decode group(s):" in out and "32 running, 1 decode group(s):" in out
    assert "Self CPU time total" in out  # the profile's table


def test_sdpa_new_shapes_times_each_case():
    out = run("-m", "benchmarks.archive.sdpa_new_shapes", "--device", "cpu", "--dtype", "float32",
              "--lengths", "2", "--decodes", "4")
    assert "fresh prompt (causal)    math" in out and "decode group (masked)    math" in out
