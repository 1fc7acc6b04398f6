"""scripts/gpu-check: its help says how to prepare and run it; without CUDA it refuses,
and its CPU path (--cpu-ok) passes only when every CUDA test skips with a reason."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import subprocess
import sys
import types

import pytest
import torch
from kernel import ROOT

GPU_CHECK = ROOT / "scripts" / "gpu-check"


def load_gpu_check() -> types.ModuleType:
    """scripts/gpu-check as a module (its name has no .py)."""
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(GPU_CHECK))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    sys.modules[loader.name] = module  # dataclasses look their module up there
    loader.exec_module(module)
    return module


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GPU_CHECK), *args], cwd=ROOT, timeout=300,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_help_says_how_to_prepare_and_run_it():
    proc = gpu_check("--help")
    assert proc.returncode == 0
    help_text = " ".join(proc.stdout.replace("\\\n", " ").split())
    assert "pip download --only-binary=:all: --python-version 3.12" in help_text
    wheels = "-d .whl ipython ipykernel nbclient nbformat traitlets pexpect ipython-autotime"
    assert wheels in help_text
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


def test_a_benchmarks_report_is_kept_and_a_slow_one_is_stopped(tmp_path):
    gpu_check = load_gpu_check()
    fine = tmp_path / "bench_fine.py"
    fine.write_text("print('case  ratio')\nprint('copy  1.1x')\n")
    slow = tmp_path / "bench_slow.py"
    slow.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    broken = tmp_path / "bench_broken.py"
    broken.write_text("raise SystemExit('no GPU here')\n")

    done = gpu_check.run_bench(fine, timeout_s=60)
    assert (done.ok, done.name) == (True, "bench/bench_fine.py")
    assert done.output == "case  ratio\ncopy  1.1x\n"
    stopped = gpu_check.run_bench(slow, timeout_s=2)
    assert (stopped.ok, stopped.figures, stopped.output) == (False, "timed out", "started\n")
    failed = gpu_check.run_bench(broken, timeout_s=60)
    assert not failed.ok and failed.figures.startswith("exit 1") and "no GPU here" in failed.output
