"""What the GPU busy note's NVML read costs a cell (issue 21), on a CUDA GPU.

    python bench/bench_notes.py            # a few seconds; --quick: fewer calls

A CUDA cell of 0.5 s or more gets its GPU's busy share read once, at its end
(`probes.nvml_busy_percent`: `nvmlDeviceGetSamples` for the device, then
`nvmlDeviceGetProcessUtilization`). After a second of queued matmuls, the read
for that second's window is timed, call after call: the median and the slowest
in µs, and what it read (the busy percent, or n/a where NVML gave none). The
first call, which opens NVML and finds the device's handle, is timed apart.
Without CUDA it says so and exits 0 (scripts/gpu-check runs every benchmark).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from torch_device_magic.probes import nvml_busy_percent


def busy_second(device: torch.device) -> None:
    """About a second of matmuls queued back to back on `device`."""
    a = torch.randn(4096, 4096, device=device)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        a @ a
    torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_notes: no CUDA GPU here; nothing to time")
        return
    device = torch.device("cuda", torch.cuda.current_device())
    since_us = int(time.time() * 1e6)
    busy_second(device)
    pids = {os.getpid()}
    start = time.perf_counter()
    first = nvml_busy_percent(device.index, since_us, pids)
    first_us = (time.perf_counter() - start) * 1e6
    times = []
    for _ in range(50 if args.quick else 500):
        start = time.perf_counter()
        nvml_busy_percent(device.index, since_us, pids)
        times.append((time.perf_counter() - start) * 1e6)
    read = "n/a" if first is None else f"{first:.0f}%"
    print(f"{torch.cuda.get_device_name(device)}: the busy read (two NVML calls) after a second "
          f"of matmuls read {read}")
    print(f"  first call (opens NVML): {first_us:.0f} µs")
    print(f"  then, {len(times)} calls: median {statistics.median(times):.0f} µs, "
          f"slowest {max(times):.0f} µs")


if __name__ == "__main__":
    main()
