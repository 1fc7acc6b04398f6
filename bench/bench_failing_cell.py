"""What a failing cell costs with the notes on against off (issue 29, point 1).

    python bench/bench_failing_cell.py           # a few minutes; --quick: fewer rounds
    python bench/bench_failing_cell.py --case namespace   # one case (repeatable)

Each case sets up a namespace, then runs its failing cell in one shell with the
report on, alternating `TorchDeviceMagics.advice` True (the notes on) and False
(off), the order rotating, so that the load of the machine hits both alike; and
once more with `%devreport off` (no line, no notes) as a reference. The figure
per case is the median wall time of the cell (IPython formatting and printing
its traceback to /dev/null included) and the ratio on/off (target: at most 1.2).
The whole cell is noisy on a shared machine (the report-off reference moves as
much as the ratio), so "walk" times what the notes add on their own: the
traceback note's walk (`holders.traceback_bytes`) over the last error, median
of the rounds.

- `namespace`: a typo inside `train(data)`, where `data` is a list of 100,000
  tensors (200 MiB) held by a name.
- `300 frames, named`: a traceback of 300 frames that all hold one list of
  3,000 tensors that a name holds too.
- `300 frames, alone`: the same, the list made inside the failing call, so that
  only the traceback holds it: the note's walk enters it, once.
- `recursion`: a RecursionError over a list of 20,000 tensors held by a name.
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

from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

CASES = {  # name: (set-up cell, failing cell)
    "namespace": (
        "data = [torch.zeros(512) for _ in range(100_000)]\n"
        "def train(d):\n    return d[0].sizze()",
        "train(data)",
    ),
    "300 frames, named": (
        "items = [torch.zeros(512) for _ in range(3000)]\n"
        "def deep(xs, n):\n    return deep(xs, n - 1) if n else xs[0].sizze()",
        "deep(items, 300)",
    ),
    "300 frames, alone": (
        "def deep2(xs, n):\n    return deep2(xs, n - 1) if n else xs[0].sizze()",
        "deep2([torch.zeros(512) for _ in range(3000)], 300)",
    ),
    "recursion": (
        "many = [torch.zeros(512) for _ in range(20_000)]\n"
        "def forever(xs):\n    return forever(xs)",
        "forever(many)",
    ),
}
MODES = {"notes on": "advice = True", "notes off": "advice = False"}


def shell() -> InteractiveShell:
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    ip = InteractiveShell.instance(config=config)
    ip.run_cell("import torch")
    ip.run_line_magic("load_ext", "torch_device_magic")
    return ip


def timed(ip: InteractiveShell, cell: str) -> float:
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), \
            contextlib.redirect_stderr(null):
        start = time.perf_counter()
        ip.run_cell(cell, store_history=True)
        return time.perf_counter() - start


def walked(error: BaseException) -> float:
    """The traceback note's walk over `error`, in seconds (where this checkout has it)."""
    from torch_device_magic.advice import holders

    start = time.perf_counter()
    if hasattr(holders, "traceback_walk"):
        holders.traceback_bytes(error)
    else:  # before issue 29: the walk took the namespace and a minimum
        ip = InteractiveShell.instance()
        holders.traceback_bytes(error, ip.user_ns, ip.user_ns_hidden, 100 * 2**20)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    parser.add_argument("--case", action="append", choices=list(CASES),
                        help="only this case (repeatable); default: all")
    args = parser.parse_args()
    rounds = 3 if args.quick else 7
    ip = shell()
    print(f"{'case':<20} {'report off':>11} {'notes off':>10} {'notes on':>10} {'on/off':>7} "
          f"{'walk':>9}")
    for name in args.case or CASES:
        setup, cell = CASES[name]
        ip.run_cell(setup)
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        for r in range(rounds):
            order = list(MODES)[r % 2:] + list(MODES)[:r % 2]
            for mode in order:
                ip.run_line_magic("config", f"TorchDeviceMagics.{MODES[mode]}")
                times[mode].append(timed(ip, cell))
        ip.run_line_magic("config", "TorchDeviceMagics.advice = True")
        ip.run_line_magic("devreport", "off")
        bare = statistics.median(timed(ip, cell) for _ in range(rounds))
        ip.run_line_magic("devreport", "on")
        on, off = (statistics.median(times[m]) for m in ("notes on", "notes off"))
        walk = statistics.median(walked(sys.last_value) for _ in range(rounds))
        print(f"{name:<20} {bare * 1e3:>8.1f} ms {off * 1e3:>7.1f} ms {on * 1e3:>7.1f} ms "
              f"{on / off:>6.2f}x {walk * 1e3:>6.2f} ms")
        ip.run_cell("%reset -f")
        ip.run_cell("import torch")


if __name__ == "__main__":
    main()
