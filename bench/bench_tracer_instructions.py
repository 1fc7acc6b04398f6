"""The line tracer's own cost, in instructions: a loop shape of `bench_profile_shapes.py`
run plain and under the tracer past the steps window (no profiler), under valgrind.

    python bench/bench_tracer_instructions.py --against 9ec7cb8            # backprop, this Python
    python bench/bench_tracer_instructions.py --against 9ec7cb8 --shape mlp \\
        --python .venv/bin/python --python /path/to/python3.12             # each Python given

On a shared VM the wall clock does not resolve a few percent of a loop; the instructions it
executes do (`valgrind --tool=cachegrind --cache-sim=no`). Each run is a process of its own:
torch imported, the shape's set-up, the loop under one tracer, out by `os._exit`; each
tracer runs for `--steps` and for `--steps` + 100 steps, and the difference of the two
counts is its cost of 100 steps (the import and set-up cancel). The tracers: none (plain),
this checkout's (`sys.monitoring` on Python 3.12+), this checkout's forced onto
`sys.settrace` (on 3.12+ only), and each `--against` commit's (`bench_report.package_at`).
The tracer is this checkout's `LineTracer` with the shape's outer loops and the default
steps window, whose pause and resume do nothing: past the window it times every line, as in
a capture, and no profiler runs (its cost is the same for every tracer). One torch thread,
PYTHONHASHSEED=0. Two runs at a time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VALGRIND = ["valgrind", "--tool=cachegrind", "--cache-sim=no",
            "--cachegrind-out-file=/dev/null"]


class _Window:
    """A steps window whose pause and resume do nothing: no profiler runs."""

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


def child(tracer: str, steps: int, shape: str) -> None:
    """One counted run: the loop under `tracer` (plain, this, settrace, or a commit)."""
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import torch

    torch.set_num_threads(1)
    import bench_profile_shapes as shapes

    if tracer in ("plain", "this", "settrace"):
        lines = importlib.import_module("torch_device_magic.profile.lines")
        if tracer == "settrace":
            from torch_device_magic.profile import line_events

            line_events.MONITORING = None
    else:
        from bench_report import package_at

        lines = importlib.import_module(package_at(tracer) + ".profile.lines")
    ns: dict = {}
    exec(shapes.SETUP.format(steps=steps), ns)
    source = shapes.SHAPES[shape].format(steps=steps, half=steps // 2, steps2=steps // 2)
    code = compile(source, "<bench-cell>", "exec")
    traced = None if tracer == "plain" else lines.LineTracer(
        "<bench-cell>", "In[1]", (), lines.outer_loops(source), 5, _Window(), 1)
    if traced is not None:
        traced.start()
    exec(code, ns)
    if traced is not None:
        traced.stop()
    sys.stdout.flush()
    os._exit(0)


def count(python: str, tracer: str, steps: int, shape: str) -> int:
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*VALGRIND, python, __file__, "--child", tracer, "--steps", str(steps),
         "--shape", shape], capture_output=True, text=True, env=env)
    found = re.search(r"I\s+refs:\s+([\d,]+)", proc.stderr)
    if found is None:
        sys.exit(f"{python} {tracer}: no count\n{proc.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child")
    ap.add_argument("--python", action="append")
    ap.add_argument("--against", action="append", default=[])
    ap.add_argument("--shape", default="backprop")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.steps, args.shape)
    pythons = args.python or [sys.executable]
    jobs = {}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for python in pythons:
            new = subprocess.run([python, "-c", "import sys; print(sys.version_info >= (3, 12))"],
                                 capture_output=True, text=True).stdout.strip() == "True"
            for tracer in ["plain", "this", *(["settrace"] if new else []), *args.against]:
                for steps in (args.steps, args.steps + 100):
                    jobs[python, tracer, steps] = pool.submit(
                        count, python, tracer, steps, args.shape)
    print(f"{args.shape}: instructions of 100 steps ({args.steps} to {args.steps + 100})")
    for python in pythons:
        version = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"],
                                 capture_output=True, text=True).stdout.strip()
        cost = {tracer: jobs[p, tracer, args.steps + 100].result()
                - jobs[p, tracer, args.steps].result()
                for p, tracer, steps in jobs if p == python and steps == args.steps}
        for tracer, n in cost.items():
            print(f"  Python {version:8} {tracer:10} {n / 1e6:8.1f} M  "
                  f"{n / cost['plain']:.3f}x plain")


if __name__ == "__main__":
    main()
