"""What the live line costs: a short cell's per-cell cost with it on and off, and a
10 s CPU-bound cell (single-threaded matmuls) with it on and off, in one process.

    python bench/bench_live.py            # 2,000-cell blocks over 9 rounds; 5 runs of a 10 s cell
    python bench/bench_live.py --quick    # smaller, for a smoke run (2 s cells)

Short cells (`x = 1`, `InteractiveShell.run_cell`, `store_history=True`): blocks of
cells in three modes, the order rotating each round so that drift and the load of
other processes hit all alike: bare IPython (the extension unloaded), the report with
the live line off (`live_delay = 0`), the report with it on (the default delay of 1 s,
so a short cell only wakes the sampler). The figure: the median per-cell cost over
rounds, and on against off.

The long cell: `a @ a` on a 256x256 float32 tensor in a loop, `torch.set_num_threads(1)`,
sized to about 10 s, run 5 times in each mode, alternating; the live line draws (stdout
is taken for a terminal and written to /dev/null), so that every tick's reads and
writes are paid. The figure: the median wall time of each mode, and their ratio
(target, issue 37: at most 1.01).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from IPython.core.interactiveshell import InteractiveShell

from torch_device_magic.live import engine


def shell() -> InteractiveShell:
    ip = InteractiveShell.instance()
    ip.history_manager.enabled = False
    return ip


def set_mode(ip: InteractiveShell, mode: str) -> None:
    loaded = "TorchDeviceMagics" in ip.magics_manager.registry
    if mode == "bare":
        if loaded:
            ip.run_line_magic("unload_ext", "torch_device_magic")
        return
    if not loaded:
        ip.run_line_magic("load_ext", "torch_device_magic")
    delay = 0.0 if mode == "live off" else 1.0
    ip.run_line_magic("config", f"TorchDeviceMagics.live_delay = {delay}")


def block(ip: InteractiveShell, cells: int) -> float:
    """Microseconds a cell over a block of `x = 1` cells."""
    started = time.perf_counter()
    for _ in range(cells):
        ip.run_cell("x = 1", store_history=True)
    return (time.perf_counter() - started) / cells * 1e6


def short_cells(ip: InteractiveShell, cells: int, rounds: int) -> dict[str, float]:
    modes = ["bare", "live off", "live on"]
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes[r % 3:] + modes[:r % 3]:
            set_mode(ip, mode)
            block(ip, 50)  # warm
            times[mode].append(block(ip, cells))
    return {m: statistics.median(t) for m, t in times.items()}


def long_cell(ip: InteractiveShell, seconds: float, runs: int) -> dict[str, float]:
    torch.set_num_threads(1)
    ip.user_ns["a"] = torch.randn(256, 256)
    set_mode(ip, "live off")
    started = time.perf_counter()
    ip.run_cell("for _ in range(200): a @ a")
    n = max(1, int(200 * seconds / (time.perf_counter() - started)))
    cell = f"for _ in range({n}): a @ a"
    times: dict[str, list[float]] = {"live off": [], "live on": []}
    for r in range(runs):
        for mode in (["live off", "live on"] if r % 2 == 0 else ["live on", "live off"]):
            set_mode(ip, mode)
            started = time.perf_counter()
            ip.run_cell(cell)
            times[mode].append(time.perf_counter() - started)
    return {m: statistics.median(t) for m, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cells, rounds, seconds = (500, 5, 2.0) if args.quick else (2000, 9, 10.0)
    engine._is_tty = lambda stream: True  # the line draws, into /dev/null
    ip = shell()
    real = sys.stdout
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        short = short_cells(ip, cells, rounds)
        long = long_cell(ip, seconds, 5)
    print(f"short cells (x = 1), median of {rounds} rounds of {cells} cells:", file=real)
    for mode, us in short.items():
        print(f"  {mode:<9} {us:8.1f} µs a cell", file=real)
    print(f"  live on / live off: {short['live on'] / short['live off']:.3f}", file=real)
    print(f"a {seconds:g} s CPU-bound cell (single-threaded matmuls), median of 5:", file=real)
    for mode, s in long.items():
        print(f"  {mode:<9} {s:8.3f} s", file=real)
    ratio = long["live on"] / long["live off"]
    verdict = "met" if ratio <= 1.01 else "NOT met"
    print(f"  live on / live off: {ratio:.4f} (target at most 1.01: {verdict})", file=real)


if __name__ == "__main__":
    main()
