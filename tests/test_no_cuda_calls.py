"""Loading and plain cells never start CUDA: a notebook can still fork later.

On a CPU build no torch.cuda function is called at all; on a GPU (CUDA-marked)
only those that start nothing are, after `%device`, `auto`, `cuda`, `%gpufree`,
`%tensors`, `%%profile` and twenty reported cells, and a forked child can still
use CUDA.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SPY = Path(__file__).parent / "scripts" / "cuda_spy.py"
ROOT = Path(__file__).parent.parent
# Flags and queues that start nothing: is_initialized reads a flag (how probes learn
# that a context exists); _lazy_call queues `%device cuda:N`'s set_device for later.
NO_START = ["is_initialized", "_lazy_call"]


def spy(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SPY), *args],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_loading_and_cells_call_no_torch_cuda_function():
    report = spy(*NO_START)
    assert report == {"calls": [], "initialized": False, "fork_clean": True}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_nothing_initialises_cuda_and_a_forked_child_can_use_it():
    # device_count reads NVML here (torch's NVML-based count): it starts no context.
    report = spy("--cuda", *NO_START, "device_count")
    assert report == {"calls": [], "initialized": False, "fork_clean": True}
