"""Which GPU and which stream, on real GPUs: `%device cuda:N` becomes the current device,
device time is taken on the measured device's stream, every GPU a cell changed is named.

Each test runs in a fresh Python so that contexts made by other tests do not hide ours."""

from __future__ import annotations

import pytest
import torch
from test_gpu_measure import in_fresh_process

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)
GiB = 2**30


def test_device_cuda_n_is_queued_as_the_current_device_until_cuda_starts():
    last = torch.cuda.device_count() - 1
    ran = in_fresh_process([
        f"%device cuda:{last}",
        "extra = [torch.cuda.is_initialized()]",
        "x = torch.ones(1)",  # on the default device: CUDA starts here
        "extra += [torch.cuda.current_device(), x.device.index]",
    ])
    assert ran["extra"] == [False, last, last]


@two_gpus
def test_device_time_goes_on_the_chosen_gpus_stream_and_gpu_0_gets_no_context():
    ran = in_fresh_process([
        "%device cuda:1",
        "a = torch.randn(8192, 8192); b = a @ a",
        "for _ in range(200):\n    torch.matmul(a, a, out=b)",
        "extra = [torch._C._cuda_hasPrimaryContext(0), torch.cuda.current_device()]",
    ])
    busy = ran["records"][-2]
    assert busy["device"] == "cuda:1"
    assert busy["device_s"] is not None and busy["device_s"] >= 0.5 * busy["wall_s"]
    assert ran["extra"] == [False, 1]


@two_gpus
def test_every_gpu_a_cell_changed_is_named_and_a_lone_other_gpu_is_shown():
    ran = in_fresh_process([
        "%device cuda:0",
        "x0 = torch.ones(1, device='cuda:0'); x1 = torch.ones(1, device='cuda:1')",
        "y0 = torch.empty(2**20, device='cuda:0'); y1 = torch.empty(2**20, device='cuda:1')",
        "z1 = torch.empty(2**28, device='cuda:1')",
    ])
    both, other = ran["records"][-2], ran["records"][-1]
    assert (both["device"], both["other_devices"]) == ("cuda:0", "cuda:1")
    assert "(also used: cuda:1)" in both["summary"]
    assert (other["device"], other["device_delta_bytes"]) == ("cuda:1", GiB)
