"""The report and %%gpumem on a CUDA GPU: synchronised times, exact device peaks, no context;
device time on the current stream, allocator backends and a sticky CUDA error."""

from __future__ import annotations

import json
import os
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
    assert used is not None and used >= torch.cuda.memory_reserved()


def test_an_in_place_cell_keeps_its_device_time(ip):
    """No allocation at all (`out=`): the device time is still measured."""
    run(ip, "a = torch.randn(8192, 8192, device='cuda'); b = a @ a")
    n = int(0.25 / matmul_seconds(ip.user_ns["a"])) + 1
    run(ip, f"for _ in range({n}):\n    torch.matmul(a, a, out=b)")
    measured = record(ip)
    assert measured.device_delta_bytes == 0
    assert measured.device_s is not None and measured.device_s >= 0.200
    assert "current stream" in measured.summary()


def test_work_on_another_stream_is_said_to_be_outside_the_current_streams_time(ip):
    run(ip, "a = torch.randn(4096, 4096, device='cuda'); s = torch.cuda.Stream()")
    run(ip, "with torch.cuda.stream(s):\n    b = a @ a")
    measured = record(ip)
    assert measured.device_s is not None
    assert f"{measured.device} " in measured.summary()
    assert "current stream," in measured.summary()


def in_fresh_process(cells: list[str], **env: str) -> dict:
    """Run `cells` reported, in a new Python with `env`: the record of each cell, in order
    (`import torch` first: None for a cell without one), and `extra`'s value."""
    script = textwrap.dedent(
        """
        import json, sys
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        config = Config()
        config.HistoryManager.hist_file = ":memory:"
        ip = InteractiveShell.instance(config=config)
        ip.run_cell("%load_ext torch_device_magic", store_history=True)  # a record of its own
        ran = [ip.run_cell(cell, store_history=True) for cell in json.loads(sys.argv[1])]
        history = ip.magics_manager.registry["TorchDeviceMagics"].reporter.history
        by_cell = {r.cell: dict(r.as_dict(), summary=r.summary()) for r in history}
        records = [by_cell.get(result.execution_count) for result in ran]
        print(json.dumps({"records": records, "extra": ip.user_ns.get("extra")}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(["import torch", *cells])],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cuda_malloc_async_keeps_device_time_and_peaks():
    ran = in_fresh_process(
        [
            "warm = torch.zeros(1, device='cuda')",
            "t = torch.empty(2**30, dtype=torch.uint8, device='cuda'); del t",
            "a = torch.randn(4096, 4096, device='cuda'); b = a @ a",
            "for _ in range(20):\n    torch.matmul(a, a, out=b)",
            "extra = torch.cuda.get_allocator_backend()",
        ],
        PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync",
    )
    assert ran["extra"] == "cudaMallocAsync"
    transient, in_place = ran["records"][2], ran["records"][4]
    assert transient["device_peak_bytes"] == pytest.approx(GiB, rel=0.05)
    assert abs(transient["device_delta_bytes"]) < 0.05 * GiB
    assert in_place["device_s"] is not None and in_place["device_s"] > 0


def test_without_memory_caching_the_figures_read_n_a():
    ran = in_fresh_process(
        ["warm = torch.zeros(1, device='cuda')", "t = torch.ones(2**28, device='cuda')"],
        PYTORCH_NO_CUDA_MEMORY_CACHING="1",
    )
    last = ran["records"][-1]
    assert last["device"] == "cuda:0" and last["device_delta_bytes"] is None
    assert "n/a (peak n/a)" in last["summary"]


def test_a_sticky_cuda_error_surfaces_in_the_line_of_the_cell_that_caused_it():
    ran = in_fresh_process([
        "a = torch.ones(4, device='cuda')",
        "b = a[torch.tensor([10], device='cuda')]",  # a device-side assert, raised late
    ])
    last = ran["records"][-1]
    assert last["device_error"] is not None and "CUDA error" in last["device_error"]
    assert "a CUDA error surfaced at the end of the cell: " in last["summary"]


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
