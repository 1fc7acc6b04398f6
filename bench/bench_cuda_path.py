"""What the per-cell Meter's CUDA path costs the CPU, on the fake CUDA layer, against a commit.

    python bench/bench_cuda_path.py                    # against e936bae (before issue 27)
    python bench/bench_cuda_path.py --against HEAD~3 --rounds 40

The fake layer (`tests/fakegpu.py`) answers torch.cuda's calls the way torch does:
its allocator counters come from a stand-in for the C++ call
(`torch._C._cuda_memoryStats`, every key, nested, each dict new), and
`torch.cuda.memory_stats` is torch's own Python flattening of them, so that
the flattening costs about what it does on a GPU (116 µs on an H200; the C++
call itself 22 µs there, its stand-in 11-18 µs here). The fake's other calls
(events, the synchronise, the context check) are Python standing in for C++
calls of 0.2-4 µs each; there is no kernel to wait for, so the figures are the
Meter's own CPU cost.

Each round times `--pairs` start/stop pairs of an empty cell in the thread's CPU
time, for each Meter (this checkout's and the commit's, its package extracted
with `git archive`, as `bench_report.py --against` does), in rotated order: with
CUDA up (a context on cuda:0, one GPU), and with no accelerator runtime up (the
CPU path: the host's reads alone). The CUDA path's own cost is the difference;
the medians over rounds are printed (and the best round, the least disturbed by
other load), and the target (issue 27): at most 60 µs a cell.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "tests")]

TARGET_US = 60.0


def fake_cuda(packages: list[str]):
    """One fake H200 behind torch.cuda with CUDA up and 1 GiB held, its NVML and MPS
    switches set in every package's probes."""
    import pytest
    from fakegpu import GIB, FakeMachine, Gpu

    patch = pytest.MonkeyPatch()
    machine = FakeMachine([Gpu("NVIDIA H200", total=140 * GIB)]).install(patch)
    for name in packages:
        probes = importlib.import_module(f"{name}.probes")
        patch.setattr(probes, "_nvml_module", None)
        patch.setattr(probes, "mps_available", lambda: False, raising=False)
        patch.setattr(probes, "_MPS_BUILT", False)
    machine.start_cuda(0)
    machine.allocate(0, GIB)
    return machine


def pair_us(meter, machine, cuda: bool, pairs: int) -> float:
    """CPU µs of one start and stop with nothing between, CUDA up or not."""
    machine.initialized = cuda
    machine.calls.clear()
    start = time.thread_time()
    for _ in range(pairs):
        meter.start()
        meter.stop()
    return (time.thread_time() - start) / pairs * 1e6


def main() -> None:
    from bench_report import package_at, reporters_meter, rotated

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="COMMIT", default="e936bae")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=300)
    args = parser.parse_args()

    then = package_at(args.against)
    machine = fake_cuda(["torch_device_magic", then])
    from torch_device_magic.measure import Meter

    meters = {"ours": reporters_meter(Meter), f"at {args.against}": reporters_meter(
        importlib.import_module(f"{then}.measure").Meter)}
    for meter in meters.values():  # warm every path
        for cuda in (True, False):
            pair_us(meter, machine, cuda, 50)
    found: dict[str, dict[bool, list[float]]] = {m: {True: [], False: []} for m in meters}
    runs = [(m, cuda) for m in meters for cuda in (True, False)]
    for n in range(args.rounds):
        for name, cuda in rotated(runs, n):  # type: ignore[arg-type]
            found[name][cuda].append(pair_us(meters[name], machine, cuda, args.pairs))
    machine.initialized = True

    print(f"the Meter, start + stop of an empty cell, on the fake CUDA layer: {args.rounds} "
          f"rounds of {args.pairs} pairs, median of the thread's CPU µs a cell")
    print(f"{'meter':<16} {'CUDA up':>9} {'no CUDA':>9} {'CUDA path':>10} {'its best round':>15}")
    own: dict[str, float] = {}
    for name, by in found.items():
        diffs = [a - b for a, b in zip(by[True], by[False])]
        own[name] = statistics.median(diffs)
        print(f"{name:<16} {statistics.median(by[True]):9.1f} {statistics.median(by[False]):9.1f}"
              f" {own[name]:10.1f} {min(diffs):15.1f}")
    ours, old = own["ours"], own[f"at {args.against}"]
    met = "met" if ours <= TARGET_US else "NOT met"
    print(f"the CUDA path's own cost (medians): ours {ours:.1f} µs, at {args.against} "
          f"{old:.1f} µs ({ours / old:.2f}x); target <= {TARGET_US:.0f} µs: {met}")


if __name__ == "__main__":
    main()
