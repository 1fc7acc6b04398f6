"""What crediting freed heap memory to the right cell costs, on a compact and a fragmented heap.

    python bench/bench_free_heap.py            # about two minutes; --quick

The host figure is the RSS change less the change in glibc's free heap
(`measure.FreeHeap`), read by walking every free chunk (`mallinfo2`) after every
cell while the last walk saw at most 1,000 free chunks. Three heaps, in one
process, in turn:

- compact: as after importing torch;
- just freed: 200,000 small tensors (`torch.randn(256)`, about 280 MiB) made and
  deleted, so glibc holds them in ~680,000 free chunks, the fast bins included;
- fragmented: 200,000 made and every other one deleted, so that 100,000 free
  chunks stay between live ones, whatever glibc consolidates.

For each: what one `mallinfo2` walk costs as it is, what `malloc_trim(0)` costs
(a fresh heap in that state each time), what one reading costs as the Meter
takes it (`malloc_free_reader`: consolidate, then walk) and as ba9f480 took it
(a 4 KiB malloc and free, then the walk, with the program break read on either
side), and the µs that a Meter's `start()` and `stop()` add per cell over the
same Meter without the free heap, for a quick cell (nothing runs) and a 6 ms
cell; medians over cells, both Meters alternating.

Then the same in an IPython shell, as a notebook pays it: `x = 1` cells with
the report on, in alternating blocks with the free heap read and not read
(thread CPU time; the median of the paired differences).
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
from torch_device_magic.probes import clock, malloc_free_reader

LIBC = ctypes.CDLL(None)
N = 200_000


class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


LIBC.mallinfo2.restype = Info
LIBC.malloc.restype, LIBC.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
LIBC.free.restype, LIBC.free.argtypes = None, [ctypes.c_void_p]
LIBC.sbrk.restype, LIBC.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]


def read_as_at_ba9f480() -> tuple[int, int]:
    """The reading before: a 4 KiB malloc and free to consolidate (which can trim the
    heap's top), the program break on either side to see what that gave back."""
    top = LIBC.sbrk(0) or 0
    LIBC.free(LIBC.malloc(4096))
    trimmed = top - (LIBC.sbrk(0) or 0)
    return int(LIBC.mallinfo2().fordblks), max(0, trimmed)


def per_reading(read, n: int = 200) -> float:
    """Median µs of one reading, the thread's CPU time."""
    found = []
    for _ in range(n):
        t0 = time.thread_time()
        read()
        found.append(time.thread_time() - t0)
    return statistics.median(found) * 1e6


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


def in_a_shell(rounds: int, cells: int = 200) -> tuple[int, float, float, float]:
    """The shell's free chunks, and µs per `x = 1` cell with the report on: the free heap
    read, not read, and the median paired difference (thread CPU time)."""
    import contextlib
    import os

    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    ip = InteractiveShell.instance(config=config)
    ip.run_cell("import torch", store_history=True)
    ip.run_cell("%load_ext torch_device_magic", store_history=True)
    meter = ip.magics_manager.registry["TorchDeviceMagics"].reporter._meter
    heap = meter._heap
    found: dict[bool, list[float]] = {True: [], False: []}
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        for n in range(-2, rounds):  # two rounds to warm up
            for on in (n % 2 == 0, n % 2 != 0):
                heap.free_bytes = None  # no count across the block without it
                meter._heap = heap if on else None
                t0 = time.thread_time()
                for _ in range(cells):
                    ip.run_cell("x = 1", store_history=True)
                if n >= 0:
                    found[on].append((time.thread_time() - t0) / cells * 1e6)
    meter._heap = heap
    chunks = malloc_free_reader()()[1]  # type: ignore[misc]
    diff = [a - b for a, b in zip(found[True], found[False])]
    return (chunks, statistics.median(found[True]), statistics.median(found[False]),
            statistics.median(diff))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer cells")
    args = parser.parse_args()
    cells = 200 if args.quick else 2000
    read = malloc_free_reader()
    gc.disable()
    print(f"{'heap':<11} {'free chunks':>11} {'mallinfo2':>10} {'malloc_trim':>11} "
          f"{'reading: now / ba9f480':>22} "
          f"{'quick cell: ours / without':>27} {'6 ms cell: ours / without':>26}")
    for state in ("compact", "just freed", "fragmented"):
        kept = heap(state)
        info = LIBC.mallinfo2()
        walk = timed(LIBC.mallinfo2)
        kept = heap(state)  # the trim is timed on a fresh heap in the same state
        trim = timed(lambda: LIBC.malloc_trim(0))
        kept = heap(state)
        now, then = per_reading(read), per_reading(read_as_at_ba9f480)
        kept = heap(state)
        quick = added_per_cell(cells, 0.0)
        kept = heap(state)
        slow = added_per_cell(cells // 4, 6e-3)
        print(f"{state:<11} {info.ordblks + info.smblks:>11,} {walk * 1e3:>8.2f}ms "
              f"{trim * 1e3:>9.2f}ms {now:>11.2f} / {then:.2f} µs "
              f"{quick[0]:>12.2f} / {quick[1]:.2f} µs "
              f"{slow[0]:>12.2f} / {slow[1]:.2f} µs")
        del kept
    gc.enable()
    chunks, on, off, diff = in_a_shell(10 if args.quick else 40)
    print(f"\nIPython shell ({chunks:,} free chunks), µs per x = 1 cell with the report: "
          f"free heap read {on:.1f}, not read {off:.1f}; paired difference {diff:+.2f} µs")


if __name__ == "__main__":
    main()
