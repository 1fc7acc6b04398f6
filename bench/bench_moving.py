"""Benchmark of `%%ondevice`'s move path; each figure is a ratio to a baseline timed in this run.

    python bench/bench_moving.py

1. A cell naming one tensor, with 10,000 unrelated tensors in the namespace,
   against the same cell in an otherwise empty namespace (target: <= 1.2x).
2. Moving a dict of 10,000 small tensors against a plain `{k: v.to(dev)}` loop
   (target: <= 1.5x). The target is `meta`, so that no GPU is needed: nothing
   is copied there, so the per-tensor bookkeeping is all that is compared.
   With CUDA, the same to `cuda` too.
3. On CUDA: moving a model of about 1 GiB host -> device against one flat
   `tensor.to("cuda")` of the same size (target: >= 80% of its bandwidth, that
   is a time ratio <= 1.25x).

CPU-only cases are timed in process CPU time (the machine may be shared);
GPU cases in wall time, synchronised.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch_device_magic.moving import cell_names, move
from torch_device_magic.reports import Table
from torch_device_magic.units import fmt_seconds

META = torch.device("meta")
CELL = "y = x * 2\ny.sum()"
REPEATS = 21


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


def compare(
    baseline: tuple, ours: tuple, clock: Callable[[], float] = time.process_time
) -> tuple[float, float]:
    """Median seconds of the baseline and of ours, timed alternately so drift hits both,
    with the garbage collector off (what is freed is freed by reference counting)."""
    base, mine = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(REPEATS):
            base.append(timed(*baseline, clock))
            mine.append(timed(*ours, clock))
    finally:
        gc.enable()
    return statistics.median(base), statistics.median(mine)


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
    return {f"t{i}": torch.zeros(4) for i in range(10_000)}


def names_cost() -> tuple[str, float, float, str]:
    empty, full = compare((namespace(0), ondevice_path), (namespace(10_000), ondevice_path))
    return "cell naming 1 tensor: 10,000 others vs none", empty, full, "<= 1.2x"


def dict_cost(dev: torch.device, clock: Callable[[], float]) -> tuple[str, float, float, str]:
    base, ours = compare(
        (small_tensors, synced(lambda d: {k: v.to(dev) for k, v in d.items()})),
        (small_tensors, synced(lambda d: move({"d": d}, ["d"], dev))),
        clock,
    )
    return f"dict of 10,000 tensors to {dev.type}: move vs {{k: v.to(dev)}}", base, ours, "<= 1.5x"


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
        time.perf_counter,
    )
    return "1 GiB model host->device vs one flat .to", flat_s, model_s, "<= 1.25x"


def figures() -> tuple[list, list[str]]:
    found = [names_cost(), dict_cost(META, time.process_time)]
    if not torch.cuda.is_available():
        return found, ["GPU cases: skipped, CUDA is not available on this machine"]
    cuda = torch.device("cuda", torch.cuda.current_device())
    return [*found, dict_cost(cuda, time.perf_counter), bandwidth(cuda)], []


def main() -> None:
    found, notes = figures()
    notes.insert(0, f"median of {REPEATS} alternating runs; torch {torch.__version__}")
    rows = []
    for what, base, ours, target in found:
        rows.append((what, fmt_seconds(base), fmt_seconds(ours), f"{ours / base:.2f}x", target))
    print(Table("bench_moving", ("case", "baseline", "ours", "ratio", "target"), rows, notes))


if __name__ == "__main__":
    main()
