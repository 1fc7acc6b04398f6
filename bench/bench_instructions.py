"""Instructions per `x = 1` cell under valgrind: bare IPython, a commit's report, this checkout's.

    python bench/bench_instructions.py --against 0f75a5d            # about 15 minutes
    python bench/bench_instructions.py --against 0f75a5d --layouts 5 --cells 2000
    python bench/bench_instructions.py --against 0f75a5d --walk     # the free-heap walk on

Wall time on a busy 2-core VM does not resolve a few µs a cell; the instructions a cell
executes do. Each tree runs in processes of its own under `valgrind --tool=cachegrind
--cache-sim=no`, two at a time: one makes the warm-up and exits, the other makes the
warm-up and `--cells` more cells; the difference of their instruction counts over
`--cells` is the tree's cost per cell. The trees: bare IPython (no extension), a copy of
each `--against` commit's package (`git archive`, as `bench_report.py --against` makes
it), a copy of this checkout's HEAD, and this checkout itself; the HEAD copy against the
checkout is the comparison's own noise (another name and place, the same code where
the checkout is clean).

What would make the count follow the process's history rather than the code is pinned
alike in every tree: one BLAS/OpenMP thread; after the warm-up `gc.collect()`,
`gc.freeze()` and the collector off during the counted cells (what a tree allocates
still counts, its collections do not); both processes leave by `os._exit`, so no
finalisation is counted; and the free-heap walk (measure.py's `FreeHeap`, whose cost
follows malloc's free-chunk count, a fact of the process's past) is switched off in
every tree (`Meter._heap = None`) unless `--walk`, which keeps it and prints how many
chunks each tree's last walk went through. The live line stays as it ships (on, its
thread waking about once a delay).

What cannot be pinned is the layout: CPython's type attribute cache (4,096 entries,
indexed by a type's version tag and the name's address) misses where two lookups
collide, and each miss walks the class's MRO dicts; which lookups collide follows the
order types were first looked up and where strings were allocated, so any change of
code moves it (bare IPython reads 13,000 instructions a cell apart from one layout to
the next, a copy of the same code 5,000). So each tree runs in `--layouts` layouts,
the same in every tree: layout n sets PYTHONHASHSEED=n, and before anything else makes
n*37 classes that take the first version tags and allocates n*7 pages. The figure is
the mean over layouts; the difference between two trees is the mean of their
layout-by-layout differences, which are printed: their spread is the comparison's
noise. Under valgrind a cell runs some
50 times slower, so the children check that the Meter skips after a cell quicker than
100 µs runs after every cell, in every tree alike.

The estimate in µs divides the instructions by bare IPython's pace on this machine:
its instructions per cell over the CPU time per cell of the same cells run natively
(`time.thread_time`, the fastest of three processes: the least slowed by other load).
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


def child(where: str, package: str, cells: int, walk: bool, timed: bool, layout: int) -> None:
    """In the counted process: the layout, the shell, `package` loaded from `where` (none:
    bare), the warm-up, then `cells` cells; one line of JSON on stdout, and out without
    finalising."""
    # Layout n: n*37 classes take the first type version tags and n*7 pages the first heap
    # (PYTHONHASHSEED=n is set by the caller); what follows is laid out differently.
    shift = [type(f"Layout{i}", (), {}) for i in range(layout * 37)]
    for kind in shift:
        getattr(kind, "tag", None)
    padding = bytearray(layout * 7 * 4096)
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
    print(json.dumps({"chunks": chunks, "cpu_us": cpu_us if timed else None,
                      "shift": len(shift) + len(padding)}), flush=True)
    os._exit(0)


def command(where: str, package: str, cells: int, walk: bool, layout: int) -> list[str]:
    return [sys.executable, __file__, "--child", where, package, str(cells), str(layout)] + (
        ["--walk"] if walk else [])


def environment(layout: int) -> dict[str, str]:
    return {**os.environ, **ENV, "PYTHONHASHSEED": str(layout)}


def counted(
    where: str, package: str, cells: int, walk: bool, layout: int
) -> tuple[float, int | None]:
    """Instructions per cell of one tree in one layout, from two processes run side by
    side, and the chunks its last free-heap walk went through (None: not walked)."""
    env = environment(layout)
    runs = [subprocess.Popen(VALGRIND + command(where, package, n, walk, layout), env=env,
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
    out = subprocess.run([*command(str(ROOT), "", cells, False, 0), "--timed"], check=True,
                         env=environment(0), capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["cpu_us"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        where, package, cells, layout = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        child(where, package, cells, "--walk" in sys.argv, "--timed" in sys.argv, layout)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="REV", action="append", default=[],
                        help="also a copy of this commit's package (repeatable)")
    parser.add_argument("--cells", type=int, default=1000, help="counted cells (default 1000)")
    parser.add_argument("--layouts", type=int, default=3,
                        help="process layouts, a pair of processes each, per tree (default 3)")
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
    for layout in range(args.layouts):
        for tree, (where, package) in trees.items():
            per_cell, walked = counted(where, package, args.cells, args.walk, layout)
            found[tree].append(per_cell)
            chunks[tree].append(walked)
    pace = [native_cpu_us(args.cells) for _ in range(3)]
    bare_ir = statistics.mean(found["bare"])
    per_us = bare_ir / min(pace)

    print(f"instructions per `{CELL}` cell: {args.cells} cells after {WARMUP} of warm-up, "
          f"{args.layouts} layouts a tree (a pair of processes each); gc frozen and off in "
          f"the counted cells; the free-heap walk {'on' if args.walk else 'off in every tree'}; "
          "one BLAS thread")
    print(f"{'tree':<22} {'mean':>9} {'over bare':>10} {'spread':>7}  each layout"
          + ("  (free chunks walked)" if args.walk else ""))
    for tree, counts in found.items():
        mean = statistics.mean(counts)
        each = " / ".join(f"{c:,.0f}" for c in counts)
        walked = f"  ({', '.join(map(str, chunks[tree]))})" if args.walk and tree != "bare" else ""
        print(f"{tree:<22} {mean:>9,.0f} {mean - bare_ir:>+10,.0f} "
              f"{max(counts) - min(counts):>7,.0f}  {each}{walked}")
    print(f"bare IPython natively: {min(pace):.1f} CPU µs a cell (the fastest of "
          f"{' / '.join(f'{p:.1f}' for p in pace)}): {per_us:,.0f} instructions a µs")
    ours = found["this checkout"]
    for tree in trees:
        if tree.startswith("at "):
            paired = [a - b for a, b in zip(ours, found[tree])]
            diff = statistics.mean(paired)
            print(f"this checkout - {tree}: {diff:+,.0f} instructions a cell (about "
                  f"{diff / per_us:+.2f} µs at bare IPython's pace); layout by layout "
                  + " / ".join(f"{d:+,.0f}" for d in paired))
    if dirty:
        print("(the checkout has uncommitted changes in the package: the HEAD copy is "
              "not the same code)")


if __name__ == "__main__":
    main()
