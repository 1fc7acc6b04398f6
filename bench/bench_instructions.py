"""Instructions per `x = 1` cell under valgrind: bare IPython, a commit's report, this checkout's.

    python bench/bench_instructions.py --against 0f75a5d            # about ten minutes
    python bench/bench_instructions.py --against 0f75a5d --repeats 3 --cells 2000
    python bench/bench_instructions.py --against 0f75a5d --walk     # the free-heap walk on

Wall time on a busy 2-core VM does not resolve a few µs a cell; the instructions a cell
executes do. Each tree runs in processes of its own under `valgrind --tool=cachegrind
--cache-sim=no`, two at a time: one makes the warm-up and exits, the other makes the
warm-up and `--cells` more cells; the difference of their instruction counts over
`--cells` is the tree's cost per cell. The trees: bare IPython (no extension), a copy of
each `--against` commit's package (`git archive`, as `bench_report.py --against` makes
it), a copy of this checkout's HEAD, and this checkout itself; the HEAD copy against the
checkout is the comparison's own noise (another name and place, the same code where
the checkout is clean), as is the spread over `--repeats`.

What would make the count follow the process's history rather than the code is pinned
alike in every tree: hash seed 0 and one BLAS/OpenMP thread; after the warm-up
`gc.collect()`, `gc.freeze()` and the collector off during the counted cells (what a
tree allocates still counts, its collections do not); both processes leave by
`os._exit`, so no finalisation is counted; and the free-heap walk (measure.py's
`FreeHeap`, whose cost follows malloc's free-chunk count, a fact of the process's past)
is switched off in every tree (`Meter._heap = None`) unless `--walk`, which keeps it and
prints how many chunks each tree's last walk went through. The live line stays as it
ships (on, its thread waking about once a delay).

The estimate in µs divides the instructions by bare IPython's pace on this machine:
its instructions per cell over the CPU time per cell of the same cells run natively
(`time.thread_time`, the median of `--repeats` processes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

WARMUP = 200
ENV = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "MKL_NUM_THREADS": "1"}
VALGRIND = ["valgrind", "--tool=cachegrind", "--cache-sim=no",
            "--cachegrind-out-file=/dev/null"]


def child(where: str, package: str, cells: int, walk: bool, timed: bool) -> None:
    """In the counted process: the shell, `package` loaded from `where` (none: bare), the
    warm-up, then `cells` cells; one line of JSON on stdout, and out without finalising."""
    sys.path.insert(0, where)
    from bench_report import CELL, quiet, shell

    ip = shell()
    chunks = None
    with quiet():
        if package:
            ip.run_line_magic("load_ext", package)
            reporter = next(cb.__self__ for cb in ip.events.callbacks["post_run_cell"]
                            if type(cb.__self__).__module__ == f"{package}.hooks")
            if not walk:
                reporter._meter._heap = None
        for _ in range(WARMUP):
            ip.run_cell(CELL, store_history=True)
        gc.collect()
        gc.freeze()
        gc.disable()
        start = time.thread_time()
        for _ in range(cells):
            ip.run_cell(CELL, store_history=True)
        cpu_us = (time.thread_time() - start) / cells * 1e6 if cells else None
    if package and walk:
        heap = reporter._meter._heap
        chunks = None if heap is None else heap._chunks
    print(json.dumps({"chunks": chunks, "cpu_us": cpu_us if timed else None}), flush=True)
    os._exit(0)


def command(where: str, package: str, cells: int, walk: bool) -> list[str]:
    return [sys.executable, __file__, "--child", where, package, str(cells)] + (
        ["--walk"] if walk else [])


def counted(where: str, package: str, cells: int, walk: bool) -> tuple[float, int | None]:
    """Instructions per cell of one tree, from two processes run side by side, and the
    chunks its last free-heap walk went through (None: not walked)."""
    env = {**os.environ, **ENV}
    runs = [subprocess.Popen(VALGRIND + command(where, package, n, walk), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for n in (0, cells)]
    refs, last = [], None
    for run in runs:
        out, err = run.communicate()
        found = re.search(r"I\s+refs:\s+([\d,]+)", err)
        if run.returncode or found is None:
            sys.exit(f"bench_instructions.py: a counted run failed:\n{err[-2000:]}")
        refs.append(int(found.group(1).replace(",", "")))
        last = json.loads(out.strip().splitlines()[-1])
    assert last is not None
    return (refs[1] - refs[0]) / cells, last["chunks"]


def native_cpu_us(cells: int) -> float:
    """CPU µs per cell of bare IPython's `x = 1`, natively (no valgrind), one process."""
    out = subprocess.run([*command(str(ROOT), "", cells, False), "--timed"], check=True,
                         env={**os.environ, **ENV}, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["cpu_us"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        where, package, cells = sys.argv[2], sys.argv[3], int(sys.argv[4])
        child(where, package, cells, "--walk" in sys.argv, "--timed" in sys.argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", action="append", default=[],
                        help="also a copy of this commit's package (repeatable)")
    parser.add_argument("--cells", type=int, default=1000, help="counted cells (default 1000)")
    parser.add_argument("--repeats", type=int, default=2, help="processes per tree (default 2)")
    parser.add_argument("--walk", action="store_true",
                        help="keep the free-heap walk on (its chunk counts printed)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        print("bench_instructions.py: valgrind is not installed here, so nothing is counted.")
        return
    from bench_report import CELL, package_at

    trees = {"bare": (str(ROOT), "")}
    for rev in [*args.against, "HEAD"]:
        name = package_at(rev)
        trees[f"at {rev}" + (" (a copy)" if rev == "HEAD" else "")] = (sys.path[0], name)
    trees["this checkout"] = (str(ROOT), "torch_device_magic")
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "torch_device_magic"],
                           capture_output=True, text=True).stdout.strip()

    found: dict[str, list[float]] = {tree: [] for tree in trees}
    chunks: dict[str, list[int | None]] = {tree: [] for tree in trees}
    for _ in range(args.repeats):
        for tree, (where, package) in trees.items():
            per_cell, walked = counted(where, package, args.cells, args.walk)
            found[tree].append(per_cell)
            chunks[tree].append(walked)
    pace = [native_cpu_us(args.cells) for _ in range(args.repeats)]
    bare_ir = statistics.median(found["bare"])
    per_us = bare_ir / statistics.median(pace)

    print(f"instructions per `{CELL}` cell: {args.cells} cells after {WARMUP} of warm-up, "
          f"{args.repeats} process pairs a tree; gc frozen and off in the counted cells; "
          f"the free-heap walk {'on' if args.walk else 'off in every tree'}; one BLAS thread")
    print(f"{'tree':<22} {'median':>11} {'over bare':>11}  each repeat"
          + ("  (free chunks walked)" if args.walk else ""))
    for tree, counts in found.items():
        median = statistics.median(counts)
        each = " / ".join(f"{c:,.0f}" for c in counts)
        walked = f"  ({', '.join(map(str, chunks[tree]))})" if args.walk and tree != "bare" else ""
        print(f"{tree:<22} {median:>11,.0f} {median - bare_ir:>+11,.0f}  {each}{walked}")
    print(f"bare IPython natively: {statistics.median(pace):.1f} CPU µs a cell "
          f"({' / '.join(f'{p:.1f}' for p in pace)}): {per_us:,.0f} instructions a µs")
    ours = statistics.median(found["this checkout"])
    for tree in trees:
        if tree.startswith("at "):
            diff = ours - statistics.median(found[tree])
            print(f"this checkout - {tree}: {diff:+,.0f} instructions a cell "
                  f"(about {diff / per_us:+.2f} µs at bare IPython's pace)")
    if dirty:
        print("(the checkout has uncommitted changes in the package: the HEAD copy is "
              "not the same code)")


if __name__ == "__main__":
    main()
