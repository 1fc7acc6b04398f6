"""What the per-cell report costs: in-process, on a real kernel, and over 10,000 cells.

    python bench/bench_report.py            # all three; about a minute
    python bench/bench_report.py --quick    # fewer cells, for a smoke run

In-process: one InteractiveShell runs blocks of cells (`store_history=True`),
alternating bare / ipython-autotime / torch_device_magic, so that drift hits all
three alike; the figure is each extension's added microseconds per cell over
bare (median of the rounds) and ours divided by autotime's (target <= 1.5).
On a kernel: one nbclient kernel runs blocks alternating bare and ours (and
autotime); the figure is the per-cell round trip over bare (target <= 1.10).
Long run: 10,000 cells with the report on; the cost per cell in each tenth of the
run, and the memory our package holds (tracemalloc) at the end of each tenth.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CELL = "x = 1"
MODES = {  # name: the extension to load, None for bare
    "bare": None,
    "autotime": "autotime",
    "ours": "torch_device_magic",
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


def in_process(cells: int, rounds: int) -> dict[str, float]:
    """Added seconds per cell over bare for each mode: the median over rounds of the
    difference to the bare block run next to it (blocks alternate, order rotating)."""
    ip = shell()
    added: dict[str, list[float]] = {m: [] for m in MODES}
    order = list(MODES.items())
    with quiet():
        for _mode, ext in order * 3:  # warm up every path
            run_block(ip, ext, 50)
        for n in range(rounds):
            turn = order[n % 3 :] + order[: n % 3]
            times = {mode: run_block(ip, ext, cells) for mode, ext in turn}
            for mode in MODES:
                added[mode].append(times[mode] - times["bare"])
    return {m: statistics.median(a) for m, a in added.items()}


def run_block(ip, ext: str | None, cells: int) -> float:
    if ext:
        ip.run_line_magic("load_ext", ext)
    start = time.perf_counter()
    for _ in range(cells):
        ip.run_cell(CELL, store_history=True)
    elapsed = (time.perf_counter() - start) / cells
    if ext:
        ip.run_line_magic("unload_ext", ext)
    return elapsed


def on_kernel(cells: int, rounds: int) -> dict[str, float]:
    """Median seconds per cell round trip on one real kernel, blocks alternating."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    client = NotebookClient(nb, timeout=60, kernel_name="python3")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    with client.setup_kernel():
        execute(client, "import torch")
        for _ in range(2):
            for ext in MODES.values():
                kernel_block(client, ext, 20)
        for _ in range(rounds):
            for mode, ext in MODES.items():
                times[mode].append(kernel_block(client, ext, cells))
    return {m: statistics.median(t) for m, t in times.items()}


def execute(client, source: str) -> None:
    import nbformat

    client.nb.cells.append(nbformat.v4.new_code_cell(source))
    index = len(client.nb.cells) - 1
    client.execute_cell(client.nb.cells[index], index)
    client.nb.cells[index].outputs = []  # keep the notebook small over thousands of cells


def kernel_block(client, ext: str | None, cells: int) -> float:
    if ext:
        execute(client, f"%load_ext {ext}")
    start = time.perf_counter()
    for _ in range(cells):
        execute(client, CELL)
    elapsed = (time.perf_counter() - start) / cells
    if ext:
        execute(client, f"%unload_ext {ext}")
    return elapsed


def long_run(cells: int) -> list[tuple[int, float, int]]:
    """(cells so far, µs per cell in that tenth, bytes our package holds) per tenth."""
    ip = shell()
    ip.run_line_magic("load_ext", "torch_device_magic")
    tenth = cells // 10
    rows = []
    with quiet():
        for done in range(tenth, cells + 1, tenth):
            start = time.perf_counter()
            for _ in range(tenth):
                ip.run_cell(CELL, store_history=True)
            rows.append((done, (time.perf_counter() - start) / tenth * 1e6))
    held = package_memory(ip, cells)
    return [(done, us, held_bytes) for (done, us), held_bytes in zip(rows, held)]


def package_memory(ip, cells: int) -> list[int]:
    """Bytes allocated by our package's code and still alive, after each tenth of `cells`."""
    ip.run_line_magic("reload_ext", "torch_device_magic")  # a fresh, empty history
    package = str(ROOT / "torch_device_magic")
    tracemalloc.start()
    held = []
    with quiet():
        for _ in range(10):
            for _ in range(cells // 10):
                ip.run_cell(CELL, store_history=True)
            snapshot = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(True, f"{package}/*")]
            )
            held.append(sum(s.size for s in snapshot.statistics("filename")))
    tracemalloc.stop()
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cells (a smoke run)")
    parser.add_argument("--no-kernel", action="store_true", help="skip the nbclient part")
    args = parser.parse_args()
    cells, rounds = (100, 9) if args.quick else (100, 60)

    added = in_process(cells, rounds)
    print(f"in-process: {rounds} rounds of {cells} cells per mode, alternating")
    print(f"{'mode':<10} {'added µs per cell (median of rounds)':>38}")
    for m in ("autotime", "ours"):
        print(f"{m:<10} {added[m] * 1e6:38.1f}")
    print(f"ours / autotime added cost: {added['ours'] / added['autotime']:.2f}x (target <= 1.5)\n")

    if not args.no_kernel:
        kcells, krounds = (50, 3) if args.quick else (200, 7)
        kernel = on_kernel(kcells, krounds)
        print(f"real kernel (nbclient), {krounds} rounds of {kcells} cells per mode")
        print(f"{'mode':<10} {'ms/cell':>9} {'vs bare':>8}")
        for m in MODES:
            print(f"{m:<10} {kernel[m] * 1e3:9.3f} {kernel[m] / kernel['bare']:7.3f}x")
        print(f"ours / bare round trip: {kernel['ours'] / kernel['bare']:.3f}x (target <= 1.10)\n")

    total = 1000 if args.quick else 10_000
    print(f"long run: {total} cells with the report on")
    print(f"{'cells':>6} {'µs/cell':>8} {'held by us':>11}")
    rows = long_run(total)
    for done, us, held in rows:
        print(f"{done:>6} {us:8.1f} {held / 1024:8.1f} KiB")
    first, last = rows[0][1], rows[-1][1]
    print(f"cost per cell, last tenth / first tenth: {last / first:.2f}x; "
          f"memory held at the end / at 50%: {rows[-1][2] / rows[4][2]:.2f}x")


if __name__ == "__main__":
    main()
