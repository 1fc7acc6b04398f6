"""%%gpumem on a fake CUDA machine: what its table says about streams, allocators and errors."""

from __future__ import annotations

import pytest
from fakegpu import GIB, FakeMachine, Gpu


@pytest.fixture
def machine(monkeypatch):
    machine = FakeMachine([Gpu(used=3 * GIB)], backend="cudaMallocAsync").install(monkeypatch)
    machine.start_cuda(0)
    return machine


def row(report, measure: str) -> str:
    """The value the table shows for `measure`."""
    for line in str(report).splitlines():
        if line.startswith(measure + "  "):
            return line[len(measure):].strip()
    raise AssertionError(f"no {measure!r} row in:\n{report}")


def gpumem(ip, machine, cell):
    ip.user_ns["machine"] = machine
    return ip.run_cell_magic("gpumem", "-o", cell)


def test_the_table_names_the_stream_the_allocator_and_nvml(ip, machine):
    report = gpumem(ip, machine, "machine.allocate(0, 2**30); machine.run(0, 20.0)")
    assert (report.device, report.device_delta_bytes, report.allocator) == (
        "cuda:0", GIB, "cudaMallocAsync")
    assert row(report, "device time") == "20.0 ms (current stream)"
    assert row(report, "allocator") == "cudaMallocAsync"
    assert report.nvml_used_bytes == 3 * GIB


def test_a_sticky_error_is_a_row_of_the_table(ip, machine):
    report = gpumem(ip, machine, "machine.sticky = 'device-side assert triggered'")
    assert report.device_error == "RuntimeError: CUDA error: device-side assert triggered"
    assert row(report, "error at the end") == report.device_error


def test_without_caching_the_allocator_row_says_why_figures_are_n_a(ip, machine, monkeypatch):
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    report = gpumem(ip, machine, "machine.allocate(0, 2**30)")
    assert report.device_delta_bytes is None and report.device_peak_bytes is None
    assert row(report, "allocated") == "n/a -> n/a (n/a)"
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1: torch keeps no counts" in row(report, "allocator")


def test_measure_needs_no_shell_only_a_namespace_and_a_run_function():
    import torch

    from torch_device_magic.gpumem import measure

    kept = torch.ones(4)
    ns = {"kept": kept, "rebound": torch.ones(2)}

    def run():
        ns["made"] = torch.ones(1000)
        ns["rebound"] = torch.ones(3)
        return "value"

    report, value = measure(ns, run, torch.device("cpu"))
    assert value == "value" and report.device is None  # the CPU: host memory only
    assert [(t.name, t.bytes) for t in report.tensors] == [("made", 4000), ("rebound", 12)]
    assert ns["kept"] is kept
