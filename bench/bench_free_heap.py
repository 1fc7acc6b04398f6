"""What crediting freed heap memory to the right cell costs, on a compact and a fragmented heap.

    python bench/bench_free_heap.py            # about a minute; --quick

The host figure is the RSS change less the change in glibc's free heap
(`measure.FreeHeap`), read by walking every free chunk (`mallinfo2`). Three heaps,
in one process, in turn:

- compact: as after importing torch;
- just freed: 200,000 small tensors (`torch.randn(256)`, about 280 MiB) made and
  deleted, so glibc holds them in ~680,000 free chunks, the fast bins included;
- fragmented: 200,000 made and every other one deleted, so that 100,000 free
  chunks stay between live ones, whatever glibc consolidates.

For each: what one `mallinfo2` walk costs as it is, what `malloc_trim(0)` costs
(a fresh heap in that state each time), and the µs that a Meter's `start()` and
`stop()` add per cell over the same Meter without the free heap (the figure as
of af6fdaa), for a quick cell (nothing runs) and a 6 ms cell (busy: the free heap is
read where affordable); medians over cells, both Meters alternating.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from torch_device_magic.measure import Meter
from torch_device_magic.probes import clock

LIBC = ctypes.CDLL(None)
N = 200_000


class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


LIBC.mallinfo2.restype = Info


def heap(state: str) -> list[torch.Tensor]:
    """Put the heap in `state`; returns what must stay alive."""
    LIBC.malloc_trim(0)
    if state == "compact":
        return []
    made = [torch.randn(256) for _ in range(N)]
    kept = made[::2] if state == "fragmented" else []
    del made
    return kept


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def spin(seconds: float) -> None:
    end = clock() + seconds
    while clock() < end:
        pass


def added_per_cell(cells: int, body_s: float) -> tuple[float, float]:
    """Median µs per cell of start()+stop(): with the free heap, and without."""
    ours, without = Meter(), Meter()
    without._heap = None
    found: dict[int, list[float]] = {0: [], 1: []}
    for n in range(cells):
        for which in (n % 2, 1 - n % 2):
            meter = (ours, without)[which]
            t0 = clock()
            meter.start()
            t1 = clock()
            spin(body_s)
            t2 = clock()
            meter.stop()
            found[which].append(clock() - t2 + t1 - t0)
    ours.close()
    without.close()
    return tuple(statistics.median(found[w]) * 1e6 for w in (0, 1))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cells")
    args = parser.parse_args()
    cells = 200 if args.quick else 2000
    gc.disable()
    print(f"{'heap':<11} {'free chunks':>11} {'mallinfo2':>10} {'malloc_trim':>11} "
          f"{'quick cell: ours / without':>27} {'6 ms cell: ours / without':>26}")
    for state in ("compact", "just freed", "fragmented"):
        kept = heap(state)
        info = LIBC.mallinfo2()
        walk = timed(LIBC.mallinfo2)
        kept = heap(state)  # the trim is timed on a fresh heap in the same state
        trim = timed(lambda: LIBC.malloc_trim(0))
        kept = heap(state)
        quick = added_per_cell(cells, 0.0)
        kept = heap(state)
        slow = added_per_cell(cells // 4, 6e-3)
        print(f"{state:<11} {info.ordblks + info.smblks:>11,} {walk * 1e3:>8.2f}ms "
              f"{trim * 1e3:>9.2f}ms {quick[0]:>12.2f} / {quick[1]:.2f} µs "
              f"{slow[0]:>12.2f} / {slow[1]:.2f} µs")
        del kept


if __name__ == "__main__":
    main()
