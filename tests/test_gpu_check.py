"""`make gpu-check`'s driver on a CPU machine: it skips cleanly, and its summary says what ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check  # noqa: E402

XDIST_LOG = """\
[gw1] [ 12%] PASSED tests/test_cuda.py::test_stage0_on_cuda_matches_cpu_reference
[gw0] [ 25%] FAILED tests/test_cuda.py::test_resilience_on_cuda
[gw2] [ 37%] SKIPPED tests/test_cuda.py::test_tensor_parallel_on_cuda_matches_plain_pytorch
"""
PLAIN_LOG = """\
tests/test_zero_stage3.py::test_gathers_once PASSED                      [ 50%]
tests/test_zero_stage3.py::test_frees_after_forward ERROR                [100%]
=========================== short test summary info ============================
PASSED tests/test_zero_stage3.py::test_gathers_once
"""


def test_outcomes_are_read_from_both_pytest_formats():
    outcomes = gpu_check.parse_outcomes(XDIST_LOG + PLAIN_LOG)
    assert outcomes == {
        "tests/test_cuda.py::test_stage0_on_cuda_matches_cpu_reference": "PASSED",
        "tests/test_cuda.py::test_resilience_on_cuda": "FAILED",
        "tests/test_cuda.py::test_tensor_parallel_on_cuda_matches_plain_pytorch": "SKIPPED",
        "tests/test_zero_stage3.py::test_gathers_once": "PASSED",
        "tests/test_zero_stage3.py::test_frees_after_forward": "ERROR",
    }


def test_summary_names_failures_figures_and_what_did_not_run(tmp_path):
    bench = {"device": "NVIDIA H200", "peak_bf16_tflops": 989.4, "skipped": {}, "jobs": [], "figures": {
        "offload_1.3B_terascale": {"params": 1.3e9, "step_s": 2.0, "tokens_per_s": 16384.0, "tflops": 130.0,
                                   "losses": [10.9], "peak_device_gib": 20.0, "peak_rss_gib": 30.0},
        "inmem_1.3B_terascale_stage0": {"params": 1.3e9, "step_s": 0.3, "tokens_per_s": 54000.0, "tflops": 450.0,
                                        "mfu": 0.455, "peak_device_gib": 50.0},
        "largest_deepspeed": {"best": None, "tried": [{"layers": 28, "fits": False, "error": "stopped"}],
                              "stopped_by": "budget"}}}
    facts = {"device": "NVIDIA H200", "driver": "580.159.04", "torch": "2.11.0+cu130"}
    phases = [{"name": "tests/test_cuda.py", "seconds": 52.3, "result": "exit 1"}]
    summary = gpu_check.write_summary(tmp_path, facts, phases, gpu_check.parse_outcomes(XDIST_LOG), bench)

    assert summary["failed"] == ["tests/test_cuda.py::test_resilience_on_cuda"]
    assert summary["counts"] == {"PASSED": 1, "FAILED": 1, "SKIPPED": 1}
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    md = (tmp_path / "summary.md").read_text()
    for expected in ("driver: 580.159.04", "| tests/test_cuda.py | 52 | exit 1 |", "1 failed, 1 passed, 1 skipped",
                     "FAILED tests/test_cuda.py::test_resilience_on_cuda", "| 45.5% |", "16384",
                     "largest_deepspeed (budget; tried layers [28])", "Not exercised on one GPU"):
        assert expected in md, expected


def test_without_a_gpu_the_check_skips_and_succeeds(tmp_path):
    if torch.cuda.is_available():
        return  # on a GPU machine the check runs for real (make gpu-check)
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "skipped" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_failures_are_written_as_they_happen(tmp_path):
    (tmp_path / "test_fails.py").write_text("def test_fails():\n    assert 1 + 1 == 3\n\ndef test_passes():\n    pass\n")
    failures = tmp_path / "failures.txt"
    env = {**os.environ, "GPU_CHECK_FAILURES": str(failures),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "gpu_failures", "-p", "no:cacheprovider",
                           str(tmp_path / "test_fails.py")], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout
    text = failures.read_text()
    assert "test_fails.py::test_fails (call)" in text and "assert 1 + 1 == 3" in text
    assert "test_passes" not in text
