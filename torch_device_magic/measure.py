"""Measuring one stretch of code: a `Meter` started before it and stopped after.

    meter = Meter()
    meter.start(); x = torch.ones(2**27); del x; m = meter.stop()
    m.host_peak_bytes      # about 512 MiB: the tensor came and went inside
    m.device_delta_bytes   # None: no accelerator was in use

The per-cell report and `%%gpumem` both measure with a `Meter` and read the same
`Measurement` fields. A peak is the most memory above the starting level at any
moment between start and stop.
"""

from __future__ import annotations

import functools
import html
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from threading import get_ident
from typing import Any

import torch

from .probes import (
    PAGE_BYTES,
    Accelerator,
    Counters,
    HostProbe,
    active_accelerator,
    built_kinds,
    clock,
    cuda_built,
    devices_in_use,
    guarded,
    host_probe,
    malloc_free_reader,
    nvml_process_bytes,
)
from .units import fmt_bytes, fmt_seconds
from .workers import NONE, CellWorkers, ChildWatch, Workers, with_device_memory


@dataclass(slots=True)
class Measurement:
    """What one cell did to time and memory; a field that could not be measured is None."""

    wall_s: float
    device_s: float | None = None  # None where no accelerator work ran
    device_delta_bytes: int | None = None
    device_peak_bytes: int | None = None
    device_reserved_delta_bytes: int | None = None
    host_delta_bytes: int | None = None
    host_peak_bytes: int | None = None
    device: str | None = None  # the accelerator measured ('cuda:0'); None without one
    device_allocated_bytes: int | None = None  # allocated at the end
    cell: int | None = None  # the cell number, in the per-cell history
    other_devices: str | None = None  # 'cuda:1 cuda:2': also changed, synchronised, not shown
    device_error: str | None = None  # an accelerator error that surfaced at the end-of-cell sync
    # The cell's child processes (workers.py); None: none seen (or not looked for).
    workers: CellWorkers | None = None
    # The share of the cell in which a kernel ran on its CUDA device, in percent (NVML's
    # samples; the report's notes read it for cells of 0.5 s and more); None where not read.
    gpu_busy: float | None = None
    # What to act on, each shown by str(): the report asks advice.notes, passing this
    # record, and keeps its answer here; () for an ordinary cell.
    notes: tuple[object, ...] = ()

    @staticmethod
    def field_names() -> list[str]:
        """The record's columns in order, as `%devhistory --csv` writes them: the workers'
        figures each in a column of their own (`workers_count`, `workers_peak_bytes`, ...)."""
        return [f.name for f in fields(Measurement) if f.name != "workers"] + [
            f"workers_{f.name}" for f in fields(CellWorkers)
        ]

    def row(self) -> list[Any]:
        """The values of `field_names()`, in order (None where not measured)."""
        own = [getattr(self, f.name) for f in fields(Measurement) if f.name != "workers"]
        workers = self.workers
        return own + [
            None if workers is None else getattr(workers, f.name) for f in fields(CellWorkers)
        ]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def device_top_bytes(self) -> int | None:
        """The device's allocated bytes at the cell's peak: what it held at the start plus
        the peak over that (the near-capacity note's and %%profile's figure)."""
        if None in (self.device_peak_bytes, self.device_allocated_bytes,
                    self.device_delta_bytes):
            return None
        return (self.device_allocated_bytes - self.device_delta_bytes  # type: ignore[operator]
                + self.device_peak_bytes)

    def largest_bytes(self) -> int:
        """The biggest memory figure of the cell (peaks, and changes either way)."""
        figures = (
            self.device_peak_bytes,
            self.device_delta_bytes,
            self.host_peak_bytes,
            self.host_delta_bytes,
        )
        return max((abs(b) for b in figures if b is not None), default=0)

    def summary(self, note: str = "") -> str:
        """The compact line: time (and `note`: ' (profiled)'), then device and host memory
        (`n/a` where not measured), and the cell's workers where it had any."""
        host = _host_text(self.host_delta_bytes, self.host_peak_bytes)
        if self.workers is not None:
            host += f", workers {self.workers.summary()}"
        if self.device is None:
            return f"time {fmt_seconds(self.wall_s)}{note} | {host}"
        # Events time the device's current stream only: work on other streams is not in it.
        gpu_time = "" if self.device_s is None else f" {fmt_seconds(self.device_s)} current stream,"
        others = "" if self.other_devices is None else f" (also used: {self.other_devices})"
        line = (
            f"time {fmt_seconds(self.wall_s)}{note} | {self.device}{others}{gpu_time}"
            f" {fmt_bytes(self.device_delta_bytes, signed=True)}"
            f" (peak {fmt_bytes(self.device_peak_bytes)}) | {host}"
        )
        if self.device_error is not None:
            kind = self.device.split(":")[0].upper()
            line += f" | a {kind} error surfaced at the end of the cell: {self.device_error}"
        return line

    def text(self, note: str = "") -> str:
        """The line, and under it the cell's notes, one a line."""
        line = self.summary(note)
        return "\n".join((line, *map(str, self.notes))) if self.notes else line

    def __str__(self) -> str:
        return self.summary()

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        return self.bundle()

    def bundle(self, note: str = "") -> dict[str, str]:
        """The line (and the notes under it) as text and as small grey HTML lines."""
        text = self.summary(note)
        notes = "".join(f"<div>{html.escape(str(n))}</div>" for n in self.notes)
        return {
            "text/plain": self.text(note) if self.notes else text,
            "text/html": f'<div class="tdm-report" style="font-size:smaller;opacity:.7">'
            f"{html.escape(text)}{notes}</div>",
        }


@functools.lru_cache(maxsize=256)
def _host_text(delta: int | None, peak: int | None) -> str:
    """The line's host part. Most cells repeat the last few (`host 0 B (peak 0 B)`):
    formatted once each, not once a cell."""
    if delta is None and peak is None:
        return "host n/a"
    return f"host {fmt_bytes(delta, signed=True)} (peak {fmt_bytes(peak)})"


def _sub(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


_NOTHING = Counters(0, 0, 0, 0)  # a device without a context has allocated nothing
_NONE: dict[str, Any] = {}  # no device timed (never written to)
_NO_DEVICES: list[Any] = []  # no device watched (never written to): no comprehension run


def _changed(before: Counters, after: Counters) -> bool:
    """Whether the allocator moved: bytes or requests, or a peak above the start."""
    return (
        (after.allocated_bytes, after.reserved_bytes, after.allocations)
        != (before.allocated_bytes, before.reserved_bytes, before.allocations)
    ) or (_sub(after.peak_bytes, before.allocated_bytes) or 0) > 0


_CHEAP_CHUNKS = 1000  # a walk of this many: 2–7 µs in cache, up to ~100 µs out of it
_WALK_SHARE = 0.01  # a walk of more (a fragmented heap) only in cells it costs 1% of


class FreeHeap:
    """What the cell itself freed to malloc's free lists: the host change is the RSS change
    less what the free heap grew by, and a fall in RSS that only the free heap shrinking
    explains (glibc trimmed what an earlier cell freed) counts for nothing: memory freed
    is credited to the cell that freed it, not to the cell glibc gave it back in.

    The free heap is read (a walk of every free chunk, see `malloc_free_reader`) after
    every cell, however short, while the last reading walked at most 1,000 free chunks
    (a few µs, up to ~100 µs where they have left the CPU's caches): a quick cell can
    free hundreds of MiB of large heap blocks without RSS moving. On a heap with more
    (a fragmented one), a reading is taken only after a cell that kept its thread
    busy (its CPU time, as getrusage read it for the peak, since the last cell on that
    thread; the wall time where there is none) 100 times as long as the last reading
    took; the cells between read their RSS change as it is. Each figure spans one cell:
    a cell not read ends the count, and the next one read starts it again.
    """

    def __init__(self, read: Callable[[], tuple[int, int]]) -> None:
        self._read = read
        self.free_bytes: int | None = None  # at the last reading, if that is still current
        self._chunks = 0  # how many free chunks the last reading walked
        self._cost_s = 0.0  # and what it took

    def _walk(self) -> int | None:
        """The free bytes now (None where the reading failed), noting what it cost."""
        t0 = clock()
        found = guarded(self._read)
        self._cost_s = clock() - t0
        self.free_bytes, self._chunks = (None, 0) if found is None else found
        return self.free_bytes

    def start(self) -> None:
        """Read the free heap before a cell, where no reading is current and one is cheap."""
        if self.free_bytes is None and self._chunks <= _CHEAP_CHUNKS:
            self._walk()

    def correction(self, rss_delta: int, busy_s: float) -> int:
        """What to take from `rss_delta`: the free heap's change during the cell."""
        before, self.free_bytes = self.free_bytes, None
        if self._chunks > _CHEAP_CHUNKS and self._cost_s > _WALK_SHARE * busy_s:
            return 0  # not read: the next reading starts the count again
        after = self._walk()
        if before is None or after is None:
            return 0
        change = after - before
        if change > 0:  # the cell freed to the heap: it gave that up, whatever RSS says
            return change
        # A heap that shrank and RSS that fell: the allocator gave back what it held free.
        # One that shrank while RSS did not fall is memory the cell took from the free
        # lists: RSS says what that cost (nothing where the pages were still resident,
        # everything where malloc_trim or swap had released them), so it stands.
        return max(change, rss_delta) if rss_delta < 0 else 0


class Meter:
    """Measures one stretch of code at a time: `start()` before it, `stop()` after.

    Every device of the measured kind that work may have run on (for CUDA: each
    with a context, one never used is not touched, so gets no context; for XPU
    and a PrivateUse1 backend: each of its devices) is watched and synchronised
    before the clock stops, so in-place work on another device counts too. The
    figures are those of the session's device (`start`'s `device`, else the
    torch default, else the current device) unless only
    another device's allocator changed; the others that changed are named in
    `other_devices`.
    """

    def __init__(self, host: HostProbe | None = None, sync: bool = True,
                 carry: bool = False) -> None:
        self.host = host if host is not None else host_probe()
        self.children = ChildWatch()
        self.workers: Workers = NONE  # the last stop's, process by process (for %%gpumem)
        self.sync = sync
        self._kinds = built_kinds()
        self._device: str | torch.device | None = None
        self._before: dict[str, Counters] = {}
        self._starts: list[tuple[Accelerator, Any]] = []  # each device timed, its start event
        # The last stop's device, devices and readings: the next start's, if it is the same.
        # Only where stops and starts are back to back (the per-cell reporter's): the peak
        # window restarts at the stop, which would wipe the peak of a Meter around this one.
        self.carry = carry
        self._carried: tuple[Any, list[Accelerator], dict[str, Counters]] | None = None
        self.started_s = clock()  # the clock at the last start (the live line's too)
        read = malloc_free_reader() if host is None else None
        self._heap = None if read is None else FreeHeap(read)
        # The host probe's CPU time at the last stop, and the thread that read it.
        self._cpu_s: tuple[int, float] | None = None

    def start(self, device: str | torch.device | None = None) -> None:
        """Begin measuring; `device` picks the accelerator (default: the session's)."""
        self._device = device
        # Every cell starts here: with no accelerator up, nothing but the host is read.
        carried, self._carried = self._carried, None
        if carried is not None and carried[0] == device:
            # The last stop's reading is this start's, its peak window restarted there
            # (one reading of the allocator per boundary): what ran on the device between
            # (another thread, a later post-cell hook) counts in this stretch. Where code
            # of ours ran in between, `forget_stop` dropped the reading.
            _, watched, self._before = carried
        else:
            main = active_accelerator(device, self._kinds)
            watched = _NO_DEVICES if main is None else devices_in_use(main)
            self._before = {a.name: a.counters() for a in watched} if watched else _NONE
            for accel in watched:
                accel.start_peak()
        self.children.start()
        if self._heap is not None and self._heap.free_bytes is None:
            self._heap.start()
        self.host.start()
        # The device's window lies inside the wall clock's by construction: its start
        # events are recorded after the clock starts, and its end events before the
        # clock stops (after the synchronise that waits for them).
        self.started_s = clock()
        # Without the synchronise no end event is done at the stop: none is recorded.
        self._starts = [(a, a.record_event()) for a in watched
                        if self.sync and a.has_context()] if watched else _NO_DEVICES

    def stop(self) -> Measurement:
        """End measuring: synchronise what the cell used (if `sync`), read every counter.

        An error the synchronise raised (a sticky CUDA error from the cell's kernels)
        is kept in `device_error`, never dropped.
        """
        # The end events first, before anything of ours queues behind the cell; without
        # the synchronise they would not be done, so there is no device time.
        ends = {a.name: (start, a.record_event()) for a, start in self._starts
                if start is not None} if self.sync and self._starts else _NONE
        main = active_accelerator(self._device, self._kinds)
        if main is None:  # the CPU-only path: the host's figures alone
            wall_s = clock() - self.started_s
            host_delta, host_peak = self.host.stop()
            host_delta, host_peak = self._credit(host_delta, host_peak, wall_s)
            return self._workers(Measurement(wall_s, None, None, None, None, host_delta, host_peak))
        watched = devices_in_use(main)
        error = None
        if self.sync:  # the cell's queued work is part of its time
            for accel in watched:  # a device with a context: waiting on it creates none
                if accel.has_context():
                    error = accel.synchronize() or error
        wall_s = clock() - self.started_s
        host_delta, host_peak = self.host.stop()
        host_delta, host_peak = self._credit(host_delta, host_peak, wall_s)
        after = {a.name: a.counters() for a in watched}
        before = {a.name: self._before.get(a.name, _NOTHING) for a in watched}
        used = [a for a in watched if _changed(before[a.name], after[a.name])]
        shown = main if main in used or not used else used[0]
        others = " ".join(a.name for a in used if a is not shown) or None
        old, new = before[shown.name], after[shown.name]
        sampled = shown.sampled_peak_bytes()
        peak = _sub(new.peak_bytes, old.allocated_bytes) if sampled is None else sampled
        if self.carry and all(a.kind != "mps" for a in watched):  # MPS's: sampled from a start
            for accel in watched:
                accel.start_peak()
            self._carried = (self._device, watched, after)
        return self._workers(Measurement(
            wall_s,
            device_s=Accelerator.elapsed_s(*ends.get(shown.name, (None, None))),
            device_delta_bytes=_sub(new.allocated_bytes, old.allocated_bytes),
            device_peak_bytes=None if peak is None else max(0, peak),
            device_reserved_delta_bytes=_sub(new.reserved_bytes, old.reserved_bytes),
            host_delta_bytes=host_delta,
            host_peak_bytes=host_peak,
            device=shown.name,
            device_allocated_bytes=new.allocated_bytes,
            other_devices=others,
            device_error=error,
        ))

    def forget_stop(self) -> None:
        """Read the allocator afresh at the next start, not from the last stop: code of
        ours ran after the stop that can free or allocate device memory (the hint that
        released a failing cell's frames), which is no cell's."""
        self._carried = None

    def _workers(self, m: Measurement) -> Measurement:
        """`m` with the cell's workers (read after the clock stopped)."""
        found = self.workers = self.children.stop(m.wall_s)
        if found is NONE:  # the usual: no child
            return m
        if cuda_built() and any(not w.exited for w in found.processes):
            per_pid = nvml_process_bytes()[0]
            if per_pid is not None:
                found = self.workers = with_device_memory(found, per_pid)
        m.workers = found.figures()  # None where only children idle in the cell were seen
        return m

    def _credit(
        self, delta: int | None, peak: int | None, wall_s: float
    ) -> tuple[int | None, int | None]:
        """The host change as the cell made it (RSS, less what it left in or took from
        malloc's free lists), and the RSS peak above the start, at least that change."""
        if self._heap is None:
            return delta, peak
        if delta is None:  # RSS unread: no figure to correct, and the count starts again
            self._heap.free_bytes = None
            return delta, peak
        # The thread's CPU time since the last stop (getrusage's, read for the peak), or
        # `wall_s` where the probe reads none or the last stop ran on another thread (a
        # kernel's subshell): a cell waiting for a loaded CPU did no work.
        cpu, before = getattr(self.host, "cpu_s", None), self._cpu_s
        thread = get_ident()
        self._cpu_s = None if cpu is None else (thread, cpu)
        busy_s = wall_s
        if cpu is not None and before is not None and before[0] == thread:
            busy_s = cpu - before[1]
        delta -= self._heap.correction(delta, busy_s)
        if abs(delta) < PAGE_BYTES:  # RSS moves by pages: less than one was not measured
            delta = 0
        return delta, None if peak is None else max(peak, delta)

    def close(self) -> None:
        self.host.close()
        self.children.close()
