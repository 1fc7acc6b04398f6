"""scripts/gpu-check: its help says how to prepare and run it; without CUDA it refuses,
and its CPU path (--cpu-ok) passes only when every CUDA test skips with a reason."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from kernel import ROOT

GPU_CHECK = ROOT / "scripts" / "gpu-check"


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GPU_CHECK), *args], cwd=ROOT, timeout=300,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_help_says_how_to_prepare_and_run_it():
    proc = gpu_check("--help")
    assert proc.returncode == 0
    help_text = " ".join(proc.stdout.replace("\\\n", " ").split())
    assert "pip download --only-binary=:all: --python-version 3.12" in help_text
    assert "-d .whl ipython ipykernel nbclient nbformat traitlets pexpect" in help_text
    assert "pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl" in help_text
    assert "PYTHONPATH=/tmp/site python3 scripts/gpu-check" in help_text


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs scripts/gpu-check")
def test_the_cpu_path_skips_every_cuda_test_and_runs_the_demo(tmp_path):
    refused = gpu_check("--out", str(tmp_path))
    assert refused.returncode == 2 and "--cpu-ok" in refused.stdout

    proc = gpu_check("--cpu-ok", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:]
    tests = re.search(r"^pytest -m cuda\s+ok\s+[\d.]+\s+0 passed, 0 failed, (\d+) skipped$",
                      proc.stdout, re.M)
    assert tests and int(tests[1]) >= 1, proc.stdout[-3000:]
    assert re.search(r"^demo\.ipynb\s+ok\s+[\d.]+\s+\d+ cells, \d+ report lines; device = ",
                     proc.stdout, re.M)
    assert (tmp_path / "demo.ipynb").exists() and (tmp_path / "gpu-check-pytest.xml").exists()
