"""The notes and hints of issue 21 that only a real CUDA GPU confirms (scripts/gpu-check
runs them; test_notes.py covers their logic on the fake CUDA machine): the GPU busy
share read from NVML, a peak near the device's capacity, a CUDA-graph output that a
later run overwrote."""

from __future__ import annotations

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell

from torch_device_magic.advice.hints import PREFIX

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        torch.version.cuda is None or not torch.cuda.is_available(), reason="needs a CUDA GPU"
    ),
]


def run(ip, cell: str):
    return ip.run_cell(cell, store_history=True)


def record(ip):
    return ip.magics_manager.registry["TorchDeviceMagics"].reporter.history.records()[-1]


def rules(ip) -> set[str]:
    return {note.rule for note in record(ip).notes}


def test_a_busy_cell_reads_the_gpus_busy_share_and_gets_no_busy_note(ip):
    run(ip, "import time\na = torch.randn(4096, 4096, device='cuda')")
    # Matmuls queued for about a second: the GPU runs one after another all along.
    run(ip, "end = time.monotonic() + 1.0\nwhile time.monotonic() < end:\n    b = a @ a\n"
            "torch.cuda.synchronize()")
    busy = record(ip).gpu_busy
    if busy is None:
        pytest.skip("NVML gave no busy share for this process: no samples, or a container "
                    "that lists the GPU's processes under the host's ids")
    assert busy >= 50, busy
    assert not rules(ip) & {"gpu_busy", "gpu_idle"}


def test_an_idle_cell_holding_a_gigabyte_gets_the_busy_note(ip):
    run(ip, "import time\nwarm = torch.ones(1, device='cuda')")
    run(ip, "held = torch.empty(2**30, dtype=torch.uint8, device='cuda')\ntime.sleep(1.5)")
    busy = record(ip).gpu_busy
    if busy is None:
        pytest.skip("NVML gave no busy share for this process (no samples for an idle GPU, "
                    "or a container that hides the process ids)")
    assert busy < 50, busy
    assert rules(ip) & {"gpu_busy", "gpu_idle"}


def test_a_peak_near_the_devices_capacity_gets_the_note(ip):
    run(ip, "total = torch.cuda.get_device_properties(0).total_memory\n"
            "free = torch.cuda.mem_get_info(0)[0]")
    total, free = ip.user_ns["total"], ip.user_ns["free"]
    if free < 0.93 * total:
        pytest.skip(f"only {free / total:.0%} of the GPU is free: other processes hold it")
    run(ip, "block = torch.empty(int(0.93 * total) - torch.cuda.memory_allocated(0), "
            "dtype=torch.uint8, device='cuda:0')\ndel block")
    try:
        (note,) = [n for n in record(ip).notes if n.rule == "near_capacity"]
        assert note.figure >= 0.9 and note.where == "cuda:0"
        assert note.text.startswith("peak at 9")
    finally:
        torch.cuda.empty_cache()


# When torch marks an output as overwritten (torch/_inductor/cudagraph_trees.py, read at
# 2.13): a call in a new generation (each call of a compiled function is one) ends the last
# *warm-up* or *recording* run and marks its live outputs (try_end_curr_warmup,
# try_end_curr_recording); a *replay* is ended without marking (try_end_curr_execution), so
# an output kept past a replay is overwritten silently. On 2.11 the docs' example (the
# first call's output read after the second) did not raise (FACTS.md). So: the docs' case,
# and a recording's output (the second call's, read after the third).
OVERWRITE_CASES = {
    "the docs' example, a warm-up's output": "",
    "a recording's output": "fast(x)  # the warm-up: the next call records",
}


@pytest.mark.parametrize("before", OVERWRITE_CASES.values(), ids=list(OVERWRITE_CASES))
def test_an_overwritten_cuda_graph_output_gets_the_hint_naming_its_holder(ip, capsys, before):
    run(ip, "def square(x):\n    return x @ x\n"
            "fast = torch.compile(square, mode='reduce-overhead')\n"
            "x = torch.randn(10, 10, device='cuda')")
    run(ip, before)
    run(ip, "y1 = fast(x)\ny2 = fast(x)")
    capsys.readouterr()
    result = InteractiveShell.run_cell(ip, "y1 + 1", store_history=True)
    if result.error_in_exec is None:
        shared = ip.user_ns["y1"].data_ptr() == ip.user_ns["y2"].data_ptr()
        pytest.skip(f"torch {torch.__version__} does not raise here (y1 and y2 "
                    f"{'share memory: overwritten silently' if shared else 'are apart'}); the "
                    "hint applies on the torch versions that raise 'accessing tensor output of "
                    "CUDAGraphs that has been overwritten' for it (it keys on that message)")
    assert "overwritten by a subsequent run" in str(result.error_in_exec)
    out = capsys.readouterr().out
    assert f"{PREFIX} a compiled function's output (CUDA graphs" in out
    assert "  Held by: y1" in out and ".clone()" in out
