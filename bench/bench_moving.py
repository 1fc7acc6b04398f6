"""Benchmark of `%%ondevice`'s move path; each figure is a ratio to a baseline timed in this run.

    python bench/bench_moving.py [--against COMMIT]

1. A cell naming one tensor, with 10,000 unrelated tensors in the namespace,
   against the same cell in an otherwise empty namespace (target: <= 1.2x).
2. Moving a dict of 10,000 small tensors held by a name against doing it by
   hand, `ns["d"] = {k: v.to(dev) for k, v in ns["d"].items()}` (target:
   <= 1.5x). Both leave the name holding the moved tensors, and both free the
   old ones inside the timing (the loop by dropping the old dict, the move by
   dropping the old C++ tensors it swapped out); the new ones are freed after
   it. The target is `meta`, so that no GPU is needed: nothing is copied
   there, so this is the worst case for the ratio, the per-tensor bookkeeping
   against the bare cost of `.to`. With CUDA, the same to `cuda` too.
   Also the same dict when it is already on the target (`cpu`), as in every
   `%%ondevice` cell after the first: `.to` returns the tensor itself and
   the move copies nothing.
3. On CUDA: moving a model of about 1 GiB host -> device against one flat
   `tensor.to("cuda")` of the same size (target: >= 80% of its bandwidth, that
   is a time ratio <= 1.25x).

CPU-only cases are timed in process CPU time (the machine may be shared);
GPU cases in wall time, synchronised. `--against COMMIT` also times case 2 with
that commit's mover (`moving.py`, or the `moving/` package, from `git show`),
alternating with this one's in the same run, so that a change is measured
before and after under the same load.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch_device_magic.cells import cell_names
from torch_device_magic.moving import move
from torch_device_magic.reports import Table
from torch_device_magic.units import fmt_seconds

ROOT = Path(__file__).resolve().parent.parent
META = torch.device("meta")
CELL = "y = x * 2\ny.sum()"
REPEATS = 21
DICT_SIZE = 10_000


def timed(
    setup: Callable[[], object], run: Callable[[object], object], clock: Callable[[], float]
) -> float:
    """Seconds `run(setup())` takes, setup not counted."""
    arg = setup()
    start = clock()
    result = run(arg)
    seconds = clock() - start
    del result
    return seconds


def compare(*cases: tuple, clock: Callable[[], float] = time.process_time) -> list[float]:
    """Median seconds of each (setup, run) case, timed in turn so drift hits all, with the
    garbage collector off (what is freed is freed by reference counting)."""
    times: list[list[float]] = [[] for _ in cases]
    gc.collect()
    gc.disable()
    try:
        for _ in range(REPEATS):
            for case, seconds in zip(cases, times):
                seconds.append(timed(*case, clock))
    finally:
        gc.enable()
    return [statistics.median(seconds) for seconds in times]


def moving_at(commit: str):  # -> the module
    """The mover as it was at `commit`, as a module of the package: `moving.py`, or the
    `moving/` package (written to a temporary folder)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout

    name = f"torch_device_magic._moving_{commit}"
    listed = git("ls-tree", "--name-only", commit, "torch_device_magic/moving/").split()
    files = [Path(path).name for path in listed]
    if files:  # a package: its modules import each other
        folder = Path(tempfile.mkdtemp(prefix=f"moving_{commit}_"))
        for file in files:
            (folder / file).write_text(git("show", f"{commit}:torch_device_magic/moving/{file}"))
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    source = git("show", f"{commit}:torch_device_magic/moving.py")
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    module.__package__ = "torch_device_magic"
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{commit}:moving.py", "exec"), module.__dict__)
    return module


def ondevice_path(ns: dict) -> object:
    """What %%ondevice does before running a cell: find its names, move what they hold."""
    return move(ns, cell_names(CELL), META)


def namespace(extra: int) -> Callable[[], dict]:
    unrelated = {f"t{i}": torch.zeros(4) for i in range(extra)}

    def setup() -> dict:
        ns = dict(unrelated)
        ns["x"] = torch.zeros(4)
        return ns

    return setup


def small_tensors() -> dict:
    """A namespace whose name `d` holds the only references to 10,000 small tensors."""
    return {"d": {f"t{i}": torch.zeros(4) for i in range(DICT_SIZE)}}


def by_hand(dev: torch.device) -> Callable[[dict], None]:
    def run(ns: dict) -> None:
        ns["d"] = {k: v.to(dev) for k, v in ns["d"].items()}

    return run


def names_cost() -> tuple[str, float, float, str]:
    empty, full = compare((namespace(0), ondevice_path), (namespace(10_000), ondevice_path))
    return "cell naming 1 tensor: 10,000 others vs none", empty, full, "<= 1.2x"


def dict_cost(
    dev: torch.device, clock: Callable[[], float], old=None
) -> list[tuple[str, float, float, str]]:
    """Case 2; with `old` (a previous moving module), that version's figure too."""
    cases = [
        (small_tensors, synced(by_hand(dev))),
        (small_tensors, synced(lambda ns: move(ns, ["d"], dev))),
    ]
    if old is not None:
        cases.append((small_tensors, synced(lambda ns: old.move(ns, ["d"], dev))))
    base, ours, *before = compare(*cases, clock=clock)
    if dev.type == "cpu":  # where they are already: the issue sets no target for it
        what, target = "dict of 10,000 tensors already on cpu: move vs by hand", "-"
    else:
        what, target = f"dict of 10,000 tensors to {dev.type}: move vs by hand", "<= 1.5x"
    rows = [(what, base, ours, target)]
    if old is not None:
        rows.append((f"  the same with {old.__name__.rsplit('_', 1)[1]}", base, before[0], target))
    return rows


def synced(fn: Callable[[object], object]) -> Callable[[object], object]:
    """`fn`, then wait for the GPU when one is in use."""

    def run(arg: object) -> object:
        out = fn(arg)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return out

    return run


def bandwidth(cuda: torch.device) -> tuple[str, float, float, str]:
    def model() -> dict:  # 16 x Linear(4096, 4096): about 1 GiB of float32
        return {"m": torch.nn.Sequential(*(torch.nn.Linear(4096, 4096) for _ in range(16)))}

    def flat() -> torch.Tensor:
        return torch.empty(sum(p.numel() for p in model()["m"].parameters()))

    flat_s, model_s = compare(
        (flat, synced(lambda t: t.to(cuda))),
        (model, synced(lambda ns: move(ns, ["m"], cuda))),
        clock=time.perf_counter,
    )
    return "1 GiB model host->device vs one flat .to", flat_s, model_s, "<= 1.25x"


def figures(old=None) -> tuple[list, list[str]]:
    found = [
        names_cost(),
        *dict_cost(META, time.process_time, old),
        *dict_cost(torch.device("cpu"), time.process_time),
    ]
    if not torch.cuda.is_available():
        return found, ["GPU cases: skipped, CUDA is not available on this machine"]
    cuda = torch.device("cuda", torch.cuda.current_device())
    return [*found, *dict_cost(cuda, time.perf_counter, old), bandwidth(cuda)], []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", metavar="COMMIT", help="also time case 2 at this commit")
    args = parser.parse_args()
    found, notes = figures(moving_at(args.against) if args.against else None)
    notes.insert(0, f"median of {REPEATS} alternating runs; torch {torch.__version__}")
    rows = []
    for what, base, ours, target in found:
        rows.append((what, fmt_seconds(base), fmt_seconds(ours), f"{ours / base:.2f}x", target))
        if what.startswith(("dict", "  the same")):
            extra = (ours - base) / DICT_SIZE * 1e6
            notes.append(f"{what.split(':')[0]}: the move takes {extra:.2f} µs a tensor more")
    print(Table("bench_moving", ("case", "baseline", "ours", "ratio", "target"), rows, notes))


if __name__ == "__main__":
    main()
