"""%%devcompare, the out-of-memory hint and %gpufree on a real CUDA GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from torch_device_magic.gpufree import free_memory

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_devcompare_cpu_cuda_on_a_large_matmul(ip):
    ip.run_cell("a = torch.randn(4096, 4096); b = torch.randn(4096, 4096)")
    result = ip.run_cell_magic("devcompare", "cpu cuda -n 3 -o", "a @ b")
    cpu, gpu = result.devices
    assert cpu.device == "cpu"
    assert gpu.device.startswith("cuda")
    assert gpu.speedup > 1
    # synchronised: each timed run holds the matmul itself, not only its launch
    a = ip.user_ns["a"].cuda()
    a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ a
    end.record()
    end.synchronize()
    assert gpu.min_s >= 0.5 * start.elapsed_time(end) / 1000
    # float32 sums of 4096 products of N(0, 1) (about 64 in size) differ by rounding only
    assert gpu.max_abs_diff is not None and gpu.max_abs_diff < 1e-2
    assert ip.user_ns["a"].device.type == "cpu"


def test_a_real_out_of_memory_gets_its_hint(shell, capsys):
    shell.run_line_magic("load_ext", "torch_device_magic")
    run = super(type(shell), shell).run_cell  # prints the error instead of raising it
    run("import torch; big = torch.empty(2**28, device='cuda')")
    capsys.readouterr()
    result = run("huge = torch.empty(2**50, device='cuda')")
    out = capsys.readouterr().out
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert out.index("OutOfMemoryError") < out.index("Hint (torch_device_magic): out of memory:")
    assert "GiB free of" in out
    assert "big 1.0 GiB (cuda:0)" in out
    assert "%gpufree" in out


def test_gpufree_gives_back_what_a_deleted_tensor_held(ip, capsys):
    ip.run_cell("x = torch.empty(2**28, device='cuda'); del x")
    assert free_memory().released_bytes >= 2**30
    ip.run_cell("y = torch.empty(2**28, device='cuda'); del y")
    capsys.readouterr()
    ip.run_line_magic("gpufree", "")
    out = capsys.readouterr().out
    assert "cuda:0: 1.0 GiB came back" in out or "cuda:0: 1.1 GiB came back" in out
