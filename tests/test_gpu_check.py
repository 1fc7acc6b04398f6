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
from pythonpath import ROOT, child_env

pytestmark = pytest.mark.once  # nothing here depends on IPython's version

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


def test_a_test_that_hangs_fails_alone_after_its_timeout(tmp_path):
    """gpu-check's --test-timeout (tests/conftest.py): a hang costs one test, and the next
    one runs; no pytest-timeout needed. A broad `except Exception` in the code that hangs
    (probes.guarded has one) does not swallow the timeout, as it does not Ctrl-C."""
    (tmp_path / "test_hang.py").write_text(
        "import threading\n"
        "def test_hangs():\n"
        "    try:\n"
        "        threading.Event().wait()\n"
        "    except Exception:\n"
        "        pass\n"
        "def test_after():\n"
        "    pass\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "--test-timeout", "2", "-q",
         "-p", "no:cacheprovider", "test_hang.py"],
        cwd=tmp_path, timeout=240, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=child_env(ROOT / "tests"),
    )
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout[-3000:]
    assert "TimedOut: the test's call ran past --test-timeout=2 s" in proc.stdout


def test_the_gpu_benchmarks_fit_five_minutes_and_each_exists():
    gpu_check = load_gpu_check()
    assert sum(budget for _, budget in gpu_check.BENCHES.values()) <= 300
    for script in gpu_check.BENCHES:
        assert (ROOT / "bench" / script).exists(), script


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs their GPU cases")
@pytest.mark.parametrize("script", ["bench_report.py", "bench_profile_loop.py"])
def test_a_benchmark_asked_for_its_gpu_case_without_cuda_fails_saying_so(script):
    """gpu-check's flags ask for the CUDA case: without CUDA it is refused, not measured
    on the CPU instead."""
    flags, _ = load_gpu_check().BENCHES[script]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *flags], cwd=ROOT,
                          timeout=120, capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip().endswith("torch sees no CUDA GPU here"), proc.stderr[-2000:]


def test_a_benchmarks_report_is_printed_as_it_comes(tmp_path, capsys):
    slow = tmp_path / "bench_slow.py"
    slow.write_text("import time\nprint('first')\ntime.sleep(60)\n")  # not flushed by hand
    stopped = load_gpu_check().run_bench(slow, timeout_s=3)
    assert (stopped.ok, stopped.figures, stopped.output) == (False, "timed out", "first\n")
    assert "  first\n" in capsys.readouterr().out  # printed before the end


def test_help_lists_what_only_a_gpu_confirms():
    help_text = gpu_check("--help").stdout
    assert "What only a GPU confirms (issue 12" in help_text
    for item in ("A1", "A2", "A3", "C3", "D1", "D2", "E "):
        assert f"\n  {item}" in help_text, item
    assert "And for issue 21" in help_text
    for item in ("N1", "N2", "N3", "N4"):
        assert f"\n  {item}" in help_text, item
    assert "bench/bench_notes.py" in help_text
    assert "bench_notes.py" in load_gpu_check().BENCHES


@pytest.mark.parametrize(("cuda", "counts", "ok"), [
    (True, {"passed": 0, "failed": 0, "skipped": 12}, False),  # all skipped on a GPU
    (True, {"passed": 0, "failed": 0, "skipped": 0}, False),  # none collected
    (True, {"passed": 9, "failed": 0, "skipped": 3}, True),
    (True, {"passed": 9, "failed": 1, "skipped": 0}, False),
    (False, {"passed": 0, "failed": 0, "skipped": 12}, True),
    (False, {"passed": 1, "failed": 0, "skipped": 11}, False),
])
def test_on_a_cuda_machine_some_cuda_test_must_pass(cuda, counts, ok):
    rc = 1 if counts["failed"] else (0 if sum(counts.values()) else 5)
    verdict, figures = load_gpu_check().verdict(rc, counts, 0, cuda)
    assert verdict is ok
    assert ("none passed on a CUDA machine" in figures) is (cuda and not counts["passed"])


def test_the_demo_the_tests_ran_is_reported_not_run_again(tmp_path, monkeypatch):
    import nbformat
    import run_demo

    gpu_check = load_gpu_check()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%device auto", outputs=[
        nbformat.v4.new_output("stream", name="stdout", text="device = cuda:0 (NVIDIA H200)\n")
    ])]
    executed = tmp_path / "executed.ipynb"
    nbformat.write(nb, executed)

    def run_again(*args, **kwargs):
        raise AssertionError("the demo ran a second time")

    monkeypatch.setattr(run_demo, "run_demo", run_again)
    stage = gpu_check.run_notebook(tmp_path / "out", 60, since=0, executed=executed)
    assert stage.ok and stage.figures == "1 cells, 0 report lines; device = cuda:0 (NVIDIA H200)"
    assert (tmp_path / "out" / "demo.ipynb").exists()
