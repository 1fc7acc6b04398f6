"""The live line on a real CUDA GPU (scripts/gpu-check runs it; test_live.py covers the
logic on the fake CUDA machine): the allocator's figures and the device's memory read
from the sampler's thread, NVML's busy share, and no context made on any other GPU."""

from __future__ import annotations

import re

import pytest
import torch

from torch_device_magic.live import engine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        torch.version.cuda is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"
    ),
]


def test_a_long_gpu_cell_gets_its_device_figures_in_the_live_line(ip, monkeypatch, capsys):
    monkeypatch.setattr(engine, "_is_tty", lambda stream: True)
    monkeypatch.setenv("COLUMNS", "400")
    ip.run_line_magic("config", "TorchDeviceMagics.live_delay = 0.2")
    ip.magics_manager.registry["TorchDeviceMagics"].reporter.live.period_s = 0.2
    ip.run_cell("import time, torch\na = torch.randn(4096, 4096, device='cuda')")
    capsys.readouterr()
    ip.run_cell("end = time.monotonic() + 1.5\nwhile time.monotonic() < end:\n    b = a @ a\n"
                "torch.cuda.synchronize()", store_history=True)
    out = capsys.readouterr().out
    drawn = re.findall(r"\r\x1b\[2K(running [^\r]*)", out)
    assert drawn, repr(out)
    last = drawn[-1]
    assert re.search(r"cuda:0 \d+(\.\d+)? [KMG]iB allocated \(peak .* of .*GiB\)", last), last
    busy = re.search(r"GPU (\d+)% busy", last)
    if busy is not None:  # NVML gives this process a share (not in every container)
        assert int(busy.group(1)) > 0, last
    others = range(1, torch.cuda.device_count())
    assert not any(torch._C._cuda_hasPrimaryContext(i) for i in others)
