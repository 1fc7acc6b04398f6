"""The report and %%gpumem on a CUDA GPU: synchronised times, exact device peaks, no context."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        torch.version.cuda is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"
    ),
]

GiB = 2**30


def record(ip):
    return ip.magics_manager.registry["TorchDeviceMagics"].reporter.history.records()[-1]


def run(ip, cell: str):
    return ip.run_cell(cell, store_history=True)


def matmul_seconds(a: torch.Tensor) -> float:
    """Seconds one `a @ a` takes on the device, timed with events after a warm-up."""
    a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        a @ a
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / 5


def test_queued_matmuls_count_in_wall_and_device_time(ip):
    run(ip, "a = torch.randn(8192, 8192, device='cuda')")
    n = int(0.25 / matmul_seconds(ip.user_ns["a"])) + 1  # about 250 ms of work, queued
    run(ip, f"for _ in range({n}):\n    b = a @ a")
    synced = record(ip)
    assert synced.wall_s >= 0.200
    assert synced.device_s is not None and synced.device_s >= 0.200
    run(ip, "%config TorchDeviceMagics.sync = False")
    run(ip, f"for _ in range({n}):\n    b = a @ a")
    assert record(ip).wall_s < 0.200  # without the synchronise only the launches are timed
    torch.cuda.synchronize()


def test_transient_gigabyte_is_the_device_peak(ip):
    run(ip, "warm = torch.zeros(1, device='cuda')")
    run(ip, "t = torch.empty(2**30, dtype=torch.uint8, device='cuda'); del t")
    auto = record(ip)
    report = run(ip, "%%gpumem -o\nt = torch.empty(2**30, dtype=torch.uint8, device='cuda')\ndel t")
    for measured in (auto, report.result):
        assert measured.device == f"cuda:{torch.cuda.current_device()}"
        assert measured.device_peak_bytes == pytest.approx(GiB, rel=0.02)
        assert abs(measured.device_delta_bytes) < 0.02 * GiB
    used = report.result.nvml_used_bytes  # the whole device: context and cache included
    assert used is None or used >= torch.cuda.memory_reserved()


def test_device_time_is_none_for_a_cell_without_device_work(ip):
    run(ip, "warm = torch.zeros(1, device='cuda')")
    run(ip, "q = 1 + 1")
    assert record(ip).device_s is None
    assert record(ip).device == f"cuda:{torch.cuda.current_device()}"


def test_twenty_reported_cells_never_create_a_context():
    script = textwrap.dedent(
        """
        import torch
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        config = Config()
        config.HistoryManager.hist_file = ":memory:"
        ip = InteractiveShell.instance(config=config)
        ip.run_cell("%load_ext torch_device_magic", store_history=True)
        cells = ["x = torch.ones(1000)", "%%gpumem\\ny = x * 2", "%devhistory", "%devreport"]
        for i in range(20):
            ip.run_cell(cells[i % len(cells)], store_history=True)
        print("initialized:", torch.cuda.is_initialized())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    assert out.strip().endswith("initialized: False")
