"""A loop of small ops run plainly, under `%%ondevice cpu` and under `%device cpu` (issue 36).

    python bench/bench_ondevice_pace.py             # seconds; --rounds N, --steps N
    python bench/bench_ondevice_pace.py --quick     # a smoke run

One IPython shell with the extension loaded runs the same cell, a loop of
3,000 steps of `(x * 2 + 1).tanh().sum()` and a `torch.zeros(3)`, four ways:
plain (the baseline); under `%%ondevice cpu`; after `%device cpu`; and inside
`with torch.device("cpu"):`, torch's own DeviceContext mode, which `%%ondevice`
entered up to issue 36 (every torch call of the cell then passes through
Python's `__torch_function__`). The ways alternate, the rounds going through
the 24 orders in turn; each figure is the median over rounds of the ratio to
the plain cell of the same round, next to the ratio of the fastest cells. The
whole cell is timed, in process CPU time, one thread: the move's walk and the
report line are in it, as a user sees them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import textwrap
import time
from pathlib import Path

import torch
from rotation import rotated

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WAYS = ("plain", "%%ondevice cpu", "%device cpu", "torch's mode")


def loop(steps: int) -> str:
    return (f"for _ in range({steps}):\n"
            "    total = (x * 2 + 1).tanh().sum()\n"
            "    z = torch.zeros(3)\n")


def cells(steps: int) -> dict[str, str]:
    body = loop(steps)
    return {"plain": body, "%%ondevice cpu": "%%ondevice cpu\n" + body, "%device cpu": body,
            "torch's mode": "with torch.device('cpu'):\n" + textwrap.indent(body, "    ")}


def timed(shell, way: str, cell: str) -> float:
    with contextlib.redirect_stdout(io.StringIO()):  # the report line, `device = cpu`
        if way == "%device cpu":
            shell.run_line_magic("device", "cpu")
        try:
            start = time.process_time()
            result = shell.run_cell(cell)
            seconds = time.process_time() - start
            result.raise_error()
            return seconds
        finally:
            if way == "%device cpu":
                shell.run_line_magic("device", "reset")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument("--rounds", type=int, default=48, help="rounds (default 48)")
    parser.add_argument("--steps", type=int, default=3000, help="loop steps (default 3000)")
    args = parser.parse_args()
    rounds, steps = (4, 300) if args.quick else (args.rounds, args.steps)
    torch.set_num_threads(1)
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=config)
    with contextlib.redirect_stdout(io.StringIO()):
        shell.run_line_magic("load_ext", "torch_device_magic")
        shell.run_cell("import torch\nx = torch.randn(8)")
    source = cells(steps)
    for way in WAYS:  # warm up every path
        timed(shell, way, source[way])
    seconds, ratios = rotated(WAYS, rounds, lambda way: timed(shell, way, source[way]))
    print(f"torch {torch.__version__}, 1 thread; a cell of {steps:,} steps, "
          f"{rounds} rounds per way")
    for way in WAYS:
        line = f"  {way:<15} {statistics.median(seconds[way]) * 1e3:8.1f} ms a cell"
        if way in ratios:
            r = ratios[way]
            line += (f"   {statistics.median(r):.3f}x plain (rounds {min(r):.2f}x-{max(r):.2f}x; "
                     f"fastest cells {min(seconds[way]) / min(seconds['plain']):.3f}x)")
        print(line)


if __name__ == "__main__":
    main()
