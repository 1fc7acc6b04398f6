"""Loading and plain cells never start CUDA: a notebook can still fork later.

On a CPU build no torch.cuda function is called at all; on a GPU (CUDA-marked)
only those that start nothing are, after `%device`, `auto`, `cuda`, `%gpufree`,
`%tensors`, twenty reported cells and `%%profile`, and a child forked after any
of them but `%%profile` can still use CUDA (torch's profiler initialises the
CUDA driver as it starts). On the fake GPU (tests/fakegpu.py) what would leave a
forked child unable to use CUDA is recorded, and the same holds.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fakegpu import FakeMachine, Gpu
from pythonpath import ROOT, child_env

from torch_device_magic import probes

SPY = Path(__file__).parent / "scripts" / "cuda_spy.py"
# Flags and queues that start nothing: is_initialized reads a flag (how probes learn
# that a context exists); _lazy_call queues `%device cuda:N`'s set_device for later.
NO_START = ["is_initialized", "_lazy_call"]


def spy(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SPY), *args],
        capture_output=True, text=True, timeout=300,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_spy_keeps_the_pythonpath_it_was_given_after_this_checkout(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert child_env()["PYTHONPATH"] == str(ROOT)
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")  # dependencies installed with --target
    assert child_env()["PYTHONPATH"] == f"{ROOT}{os.pathsep}/tmp/site"
    assert child_env("/a")["PYTHONPATH"] == os.pathsep.join(["/a", str(ROOT), "/tmp/site"])


# The magics of the spy's sequence (`%%profile` aside: see below), on a fake GPU where
# CUDA is not up: the user's own CUDA work is the only thing that may poison a fork.
MAGICS = [
    "x = torch.ones(3)", "%device auto", "%device", "%device cuda", "%device",
    "%gpufree", "%tensors", "%device reset", "%device cuda:0",
    *[f"z = x * {i}" if i % 2 else "s = sum(range(10))" for i in range(20)],
]


def test_on_a_gpu_where_cuda_is_not_up_the_magics_leave_a_fork_able_to_use_cuda(
    shell, monkeypatch
):
    machine = FakeMachine([Gpu(), Gpu("NVIDIA H200", capability=(9, 0))]).install(monkeypatch)
    shell.run_line_magic("load_ext", "torch_device_magic")
    for cell in MAGICS:
        shell.run_cell(cell)
    assert (machine.initialized, machine.fork_poisons) == (False, [])
    assert probes.cuda_arch_list() == []
    machine.start_cuda()  # the user's own CUDA work: from here torch's build facts are read
    assert probes.cuda_arch_list() == machine.arch_flags.split()


def test_profile_on_a_gpu_where_cuda_is_not_up_says_that_it_started_the_driver(
    shell, monkeypatch
):
    """torch.profiler's start initialises the CUDA driver whatever it records (kineto's
    `at::hasCUDA()`): the profile says so, in one line, where CUDA was not up."""
    machine = FakeMachine([Gpu()]).install(monkeypatch)
    shell.run_line_magic("load_ext", "torch_device_magic")
    report = shell.run_cell("%%profile -o\ny = torch.ones(3) * 2").result
    assert machine.fork_poisons == [
        "torch.profiler's start (cudaGetDeviceCount initialises the driver)"]
    (said,) = [n for n in report.notes if "fork" in n]
    assert "torch's profiler initialised the CUDA driver as it started" in said
    assert "no kernel recorded: CUDA was not up" in said and said in str(report)
    machine.start_cuda()
    report = shell.run_cell("%%profile -o\ny = torch.ones(3) * 2").result
    assert not any("fork" in n for n in report.notes)  # CUDA is up: the user's own doing


def test_loading_and_cells_call_no_torch_cuda_function():
    report = spy(*NO_START)
    assert report == {"calls": [], "initialized": False, "fork_clean": True}


@pytest.mark.cuda
def test_on_a_gpu_nothing_initialises_cuda_and_a_forked_child_can_use_it_until_profile():
    """A child forked after each cell (the bisect) can use CUDA, up to the first
    `%%profile`: torch's profiler initialises the CUDA driver as it starts."""
    # device_count reads NVML here (torch's NVML-based count): it starts no context.
    report = spy("--cuda", "--bisect", *NO_START, "device_count")
    assert (report["calls"], report["initialized"]) == ([], False), report
    assert report["first_unclean"] in (None, "%%profile\nz = x * 2"), report
