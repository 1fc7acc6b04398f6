"""What `%%profile` costs against torch.profiler used by hand, and what its line table adds.

    python bench/bench_profile.py            # about a minute
    python bench/bench_profile.py --quick    # fewer rounds

The step: ten training steps of a small MLP (64 -> 128 -> 128 -> 10, batch 32;
zero_grad, forward and cross-entropy, backward, SGD step), written as a cell
of five lines, as a notebook would have it. Both sides run in one IPython
shell with the extension loaded (so the per-cell report costs both alike) and
produce what a user looks at: the op table and a trace file.

- `%%profile`: the cell under `%%profile --trace PATH` (its tables rendered).
- by hand: the same cell inside `with torch.profiler.profile(activities=[CPU],
  record_shapes=True, profile_memory=True) as prof:`, then
  `prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)` and
  `prof.export_chrome_trace(PATH)`.
- the line table's cost: the engine alone, with and without the line tracer
  (`Options(lines=False)`), both rendering their tables.

Each round times one of each, the order rotating; the figure is the median
over rounds of the ratio to the baseline of the same round, in wall time
(`time.perf_counter`), one torch thread, output going to a null device.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from torch_device_magic import cells
from torch_device_magic.profile import Capture, Options, TraceFiles, profile_cell

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(64, 128), torch.nn.ReLU(),
    torch.nn.Linear(128, 128), torch.nn.ReLU(),
    torch.nn.Linear(128, 10),
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
"""
STEP = """for _ in range(10):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()"""


def shell() -> InteractiveShell:
    import torch

    torch.set_num_threads(1)  # two threads on a shared 2-core machine spin and skew
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    ip = InteractiveShell.instance(config=config)
    ip.run_cell("%load_ext torch_device_magic")
    ip.run_cell(SETUP)
    return ip


def by_hand(ip: InteractiveShell, trace: str) -> None:
    body = "\n".join("    " + line for line in STEP.splitlines())
    ip.run_cell(
        "with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], "
        f"record_shapes=True, profile_memory=True) as prof:\n{body}\n"
        'print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))\n'
        f"prof.export_chrome_trace({trace!r})"
    )


def magic(ip: InteractiveShell, trace: str) -> None:
    ip.run_cell(f"%%profile --steps 0 --trace {trace}\n{STEP}")  # every step, as by hand


def engine(ip: InteractiveShell, lines: bool, trace: str) -> None:
    run, filename = cells.compile_cell(ip, STEP)
    capture = Capture(run, filename, "In[1]", Options(trace=trace, lines=lines, steps=0))
    report, _ = profile_cell(capture, print, TraceFiles())
    print(report)


def timed(fn, *args) -> float:
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
        t0 = time.perf_counter()
        fn(*args)
        return time.perf_counter() - t0


def rounds(pairs, n: int) -> tuple[float, float, float, float]:
    """Median, min and max ratio over `n` rounds, and the baseline's median seconds."""
    ratios, bases = [], []
    for i in range(n):
        (a, a_args), (b, b_args) = pairs
        if i % 2:
            tb = timed(b, *b_args)
            ta = timed(a, *a_args)
        else:
            ta = timed(a, *a_args)
            tb = timed(b, *b_args)
        ratios.append(ta / tb)
        bases.append(tb)
    return statistics.median(ratios), min(ratios), max(ratios), statistics.median(bases)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 rounds instead of 15")
    parser.add_argument("--repeats", type=int, default=3, help="independent runs of the rounds")
    args = parser.parse_args()
    n = 5 if args.quick else 15
    ip = shell()
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for _ in range(3):  # warm-up: torch.profiler's import and first capture
            by_hand(ip, trace)
            magic(ip, trace)
            engine(ip, True, trace)
    for repeat in range(args.repeats):
        med, lo, hi, base = rounds(((magic, (ip, trace)), (by_hand, (ip, trace))), n)
        print(f"[{repeat + 1}] %%profile / by hand: {med:.3f}x (rounds {lo:.2f}-{hi:.2f}x; "
              f"by hand {base * 1e3:.1f} ms)")
        med, lo, hi, base = rounds(
            ((engine, (ip, True, trace)), (engine, (ip, False, trace))), n)
        print(f"[{repeat + 1}] line table on / off: {med:.3f}x (rounds {lo:.2f}-{hi:.2f}x; "
              f"off {base * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
