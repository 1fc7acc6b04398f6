"""What the per-cell report costs: in-process, on a real kernel, and over 10,000 cells.

    python bench/bench_report.py              # all three; a few minutes
    python bench/bench_report.py --quick      # fewer cells, for a smoke run
    python bench/bench_report.py --no-kernel  # without nbclient

Every part runs blocks of the same one-line cell, alternating the modes in one
process (or one kernel) with the order rotating, so that drift and the load of
other processes hit all modes alike; each round compares a mode with the bare
block next to it, and the figure is the median over rounds.

- In-process (`InteractiveShell.run_cell`, `store_history=True`): microseconds
  added per cell over bare IPython, and ours over ipython-autotime's (target 1.5).
- Real kernel (nbclient): the per-cell round trip over a bare kernel's (target
  1.10). "ours, line hidden" runs with a threshold no cell reaches: it measures
  every cell and sends nothing, which separates the measuring from the message.
- Long run: 10,000 cells with the report on: per tenth, the whole cell's cost,
  the part spent in our two callbacks, and what the reporter holds (its bounded
  history). IPython itself keeps every cell's input and printed output, so the
  whole cell slows a little as the session grows, with or without us.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CELL = "x = 1"
HIDE = "%config TorchDeviceMagics.report_min_seconds = "
MODES = {  # name: (lines run before its block, lines run after it)
    "bare": ([], []),
    "autotime": (["%load_ext autotime"], ["%unload_ext autotime"]),
    "ours": (["%load_ext torch_device_magic"], ["%unload_ext torch_device_magic"]),
    "ours, line hidden": (
        ["%load_ext torch_device_magic", f"{HIDE}3600"],
        [f"{HIDE}0", "%unload_ext torch_device_magic"],  # %config outlives the unload
    ),
}


def shell():
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    ip = InteractiveShell.instance(config=config)
    ip.run_cell("import torch", store_history=True)
    return ip


@contextlib.contextmanager
def quiet():
    """Send the cells' printed output to /dev/null (it is still formatted and written)."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def alternate(run_block, cells: int, rounds: int, compare) -> dict[str, float]:
    """Median over rounds of `compare(mode's block, the bare block of the same round)`."""
    order = list(MODES)
    for mode in order * 2:  # warm up every path
        run_block(mode, 20)
    found: dict[str, list[float]] = {m: [] for m in MODES}
    for n in range(rounds):
        turn = order[n % len(order) :] + order[: n % len(order)]
        seconds = {mode: run_block(mode, cells) for mode in turn}
        for mode in MODES:
            found[mode].append(compare(seconds[mode], seconds["bare"]))
    return {m: statistics.median(v) for m, v in found.items()}


def in_process(cells: int, rounds: int) -> dict[str, float]:
    """Seconds added per cell over bare IPython, per mode."""
    ip = shell()

    def run_block(mode: str, n: int) -> float:
        before, after = MODES[mode]
        for line in before:
            ip.run_cell(line)
        start = time.perf_counter()
        for _ in range(n):
            ip.run_cell(CELL, store_history=True)
        elapsed = (time.perf_counter() - start) / n
        for line in after:
            ip.run_cell(line)
        return elapsed

    with quiet():
        return alternate(run_block, cells, rounds, lambda mode, bare: mode - bare)


def on_kernel(cells: int, rounds: int) -> dict[str, float]:
    """Per-cell round trip on one real kernel over the bare kernel's, per mode."""
    import nbformat
    from nbclient import NotebookClient

    client = NotebookClient(nbformat.v4.new_notebook(), timeout=60, kernel_name="python3")

    def execute(source: str) -> None:
        cell = nbformat.v4.new_code_cell(source)
        client.nb.cells = [cell]  # one cell at a time: the notebook stays small
        client.execute_cell(cell, 0)

    def run_block(mode: str, n: int) -> float:
        before, after = MODES[mode]
        for line in before:
            execute(line)
        start = time.perf_counter()
        for _ in range(n):
            execute(CELL)
        elapsed = (time.perf_counter() - start) / n
        for line in after:
            execute(line)
        return elapsed

    with client.setup_kernel():
        execute("import torch")
        return alternate(run_block, cells, rounds, lambda mode, bare: mode / bare)


def long_run(cells: int) -> list[tuple[int, float, float, int, int]]:
    """Per tenth of the run: cells so far, µs per cell, µs of it in our two callbacks,
    records kept and the bytes they take."""
    ip = shell()
    ip.run_line_magic("load_ext", "torch_device_magic")
    reporter = ip.magics_manager.registry["TorchDeviceMagics"].reporter
    spent = [0.0]

    def timed(callback):
        def call(arg):
            start = time.perf_counter()
            callback(arg)
            spent[0] += time.perf_counter() - start

        return call

    for event in ("pre_run_cell", "post_run_cell"):
        ours = getattr(reporter, event)
        ip.events.unregister(event, ours)
        ip.events.register(event, timed(ours))
    tenth, rows = cells // 10, []
    with quiet():
        for done in range(tenth, cells + 1, tenth):
            spent[0] = 0.0
            start = time.perf_counter()
            for _ in range(tenth):
                ip.run_cell(CELL, store_history=True)
            cell_us = (time.perf_counter() - start) / tenth * 1e6
            history = reporter.history
            rows.append((done, cell_us, spent[0] / tenth * 1e6, len(history), held_bytes(history)))
    return rows


def held_bytes(history) -> int:
    """The history's container, records and the values in them (an upper bound)."""
    records = history.records()
    total = sys.getsizeof(records)
    for r in records:
        total += sys.getsizeof(r) + sum(sys.getsizeof(v) for v in r.as_dict().values())
    return total


def show(title: str, column: str, figures: dict[str, str]) -> None:
    print(title)
    print(f"{'mode':<18} {column:>18}")
    for mode, figure in list(figures.items())[1:]:  # bare is the reference
        print(f"{mode:<18} {figure:>18}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cells (a smoke run)")
    parser.add_argument("--no-kernel", action="store_true", help="skip the nbclient part")
    args = parser.parse_args()

    cells, rounds = (100, 8) if args.quick else (100, 60)
    added = in_process(cells, rounds)
    show(f"in-process: {rounds} rounds of {cells} cells per mode", "µs added per cell",
         {m: f"{added[m] * 1e6:.1f}" for m in MODES})
    print(f"ours / autotime: {added['ours'] / added['autotime']:.2f}x (target <= 1.5)\n")

    if not args.no_kernel:
        cells, rounds = (50, 4) if args.quick else (100, 30)
        kernel = on_kernel(cells, rounds)
        show(f"real kernel (nbclient): {rounds} rounds of {cells} cells per mode",
             "round trip / bare", {m: f"{kernel[m]:.3f}x" for m in MODES})
        print(f"ours / bare: {kernel['ours']:.3f}x (target <= 1.10)\n")

    total = 1000 if args.quick else 10_000
    rows = long_run(total)
    print(f"long run: {total} cells with the report on")
    print(f"{'cells':>6} {'µs/cell':>8} {'in ours':>8} {'records':>8} {'history':>11}")
    for done, cell_us, ours_us, kept, held in rows:
        print(f"{done:>6} {cell_us:8.1f} {ours_us:8.1f} {kept:>8} {held / 1024:7.1f} KiB")
    first, second = (statistics.median(r[2] for r in half) for half in (rows[:5], rows[5:]))
    print(f"µs in our callbacks, median of tenths, second half / first: {second / first:.2f}x; "
          f"history held at the end / at 50%: {rows[-1][4] / rows[4][4]:.2f}x")

if __name__ == "__main__":
    main()
