"""The operator's GPU self-test (``scripts/gpu-selftest``).

Here, without a GPU, it must say so plainly, mark every check skipped and exit 0, and refuse
bad arguments before it runs anything. On a machine with CUDA the last test runs the whole
self-test (NCCL transfer against raw send/recv, a drain and a crash, bitwise, and Megatron's
DistributedOptimizer hand-overs) and skips
elsewhere, saying why. Its checks are described in the script's docstring and in
``docs/benchmarks.md`` ("GPU self-test"), with the figures of a run on an H200.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu-selftest"
CHECKS = {"transfer", "drain", "crash", "megatron"}


def selftest(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_skips_every_check(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    res = selftest("--json", str(report))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "needs a CUDA GPU" in res.stdout and "skipped" in res.stdout
    data = json.loads(report.read_text())
    assert data["device"] == "cuda"
    assert set(data["checks"]) == CHECKS
    assert all(c == {"skipped": "no CUDA GPU"} for c in data["checks"].values())


@pytest.mark.parametrize("args", [["--checks", "transfer,nope"], ["--rounds", "0"],
                                  ["--steps", "2"], ["--device", "tpu"]])
def test_bad_arguments_are_refused_before_anything_runs(args: list[str],
                                                        tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    res = selftest(*args, "--json", str(report))
    assert res.returncode == 2, res.stdout + res.stderr
    assert "error:" in res.stderr
    assert not report.exists()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and NCCL")
@pytest.mark.timeout(600)
def test_on_a_gpu_every_check_passes_bitwise(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    res = selftest("--json", str(report), "--timeout", "30", timeout=560)
    assert res.returncode == 0, res.stdout + res.stderr[-5000:]
    data = json.loads(report.read_text())
    assert set(data["checks"]) == CHECKS
    for name in ("drain", "crash", "megatron"):
        assert data["checks"][name]["passed"] and data["checks"][name]["bitwise"], name
    assert all(f["bitwise"] for f in data["checks"]["transfer"]["figures"].values())
