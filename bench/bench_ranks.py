"""`%%profile` across a launcher's ranks (issue 40): a launch of 2 ranks, 200 DDP steps
each (gloo, the CPU, fork), profiled vs plain, rounds alternating in one process; the
ratio of the medians (goal: at most 1.5x).

    .venv/bin/python bench/bench_ranks.py          # --rounds N, --steps N
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "scripts"))

from IPython.testing.globalipapp import get_ipython


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    ip = get_ipython()
    ip.run_line_magic("load_ext", "torch_device_magic")
    ip.run_cell("import torch.multiprocessing as mp, ranks_train")
    folder = tempfile.mkdtemp()
    launch = ("mp.start_processes(ranks_train.train, args=(2, store, {steps}), nprocs=2, "
              "start_method='fork')")
    times: dict[str, list[float]] = {"plain": [], "profiled": []}
    for i in range(args.rounds):
        for case in ("plain", "profiled") if i % 2 == 0 else ("profiled", "plain"):
            ip.user_ns["store"] = os.path.join(folder, f"store{i}{case}")
            cell = launch.format(steps=args.steps)
            if case == "profiled":
                cell = "%%profile -o\n" + cell
            t0 = time.perf_counter()
            ip.run_cell(cell, silent=True)
            times[case].append(time.perf_counter() - t0)
    plain, profiled = (statistics.median(times[k]) for k in ("plain", "profiled"))
    print(f"2 ranks x {args.steps} steps, {args.rounds} rounds: plain {plain:.2f} s, "
          f"profiled {profiled:.2f} s: {profiled / plain:.2f}x (goal <= 1.5x)")


if __name__ == "__main__":
    main()
