"""`%%profile --memory`: the allocated bytes over one cell's time, and which line made them.

Two sources, one result (`Timeline`):

- **CUDA**: `recording(cell_filename)` records the caching allocator's history
  (`torch.cuda.memory._record_memory_history(max_entries=..., context="alloc",
  stacks="python")`) for the block alone and takes `torch.cuda.memory._snapshot()`
  as the block ends; `Recorder.timeline()` slices the block's entries out of it by
  their `time_us` and saves that slice as a snapshot pickle for
  pytorch.org/memory_viz. CUDA is never started here: recording starts at once
  where CUDA is already initialised, and where the block initialises it, at its
  initialisation (queued with `torch.cuda._lazy_call`, as torch queues its own
  calls), so the cell's first allocation is recorded too. A recording the user
  started is kept as it is: the timeline is its part during the block, and it is
  not stopped.
- **Any device** (the CPU, an accelerator whose allocator reports to the profiler):
  `from_profiler(prof, ...)` reads the `[memory]` events of a
  `torch.profiler.profile(profile_memory=True, with_stack=True)` run, each with its
  Python caller, or with the per-line `record_function` ranges `%%profile`'s line
  tracer opens.

An allocation is attributed to the innermost frame of the cell's own file (so the
lines of functions defined in the cell count; frames of other files are skipped).
One with no such frame (backward in autograd's device thread on a GPU) goes, from
the profiler, to the innermost call of the cell running at that moment; from the
CUDA history, which has no spans, to the line the cell was last seen on, marked
`12*`.
The timeline draws as an SVG of our own (no matplotlib, nothing loaded from a
CDN: torch's `_memory_viz` page shows nothing offline) and as a one-line sparkline
with a table in the terminal.
"""

from __future__ import annotations

import bisect
import contextlib
import html
import linecache
import logging
import math
import os
import pickle
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import probes
from ..errors import first_sentence
from ..reports import Table
from ..units import fmt_bytes, fmt_seconds, plural

_log = logging.getLogger(__name__)

CUDA_SOURCE = "CUDA allocator history"
PROFILER_SOURCE = "profiler memory events"
LARGEST = 5  # allocations listed in the table
LABELLED = 3  # of which labelled on the chart
MAX_DRAWN = 300  # time buckets drawn (each keeps its low and its high)
SPARK_WIDTH = 60
SOURCE_WIDTH = 60  # of a line's source in the table (the chart's hover shows all of it)
_SLACK_US = 1000  # the allocator's clock is converted from TSC ticks: allow for its error
_BARS = "▁▂▃▄▅▆▇█"
LINE_RANGE_PREFIX = "tdm:"  # the names of %%profile's line ranges start with it
_LINE_RANGE = re.compile(r"tdm:\S+ (\d+): ")


@dataclass(frozen=True)
class Allocation:
    """One allocation of the cell: its size, the cell's line that made it, and when."""

    bytes: int
    line: int | None  # None where no frame of the cell was on the stack
    text: str  # that line's source, stripped ("" where unknown)
    at_s: float  # seconds since the timeline's start
    after_bytes: int  # allocated right after it (where the chart marks it)
    count: int = 1  # how many allocations its line made in the cell
    inferred: bool = False  # made with no frame of the cell (another thread): see `line_label`

    @property
    def line_label(self) -> str:
        """`12`, `12*` where the line is the one the cell was last seen on, or `?`."""
        return "?" if self.line is None else f"{self.line}{'*' if self.inferred else ''}"


@dataclass
class Timeline:
    """Allocated bytes over a cell's time on one device, with its largest allocations."""

    device: str
    points: list[tuple[float, int]]  # (seconds since the start, bytes allocated), in time order
    largest: list[Allocation]  # the largest of each line, largest first (LARGEST at most)
    source: str  # CUDA_SOURCE or PROFILER_SOURCE
    duration_s: float
    allocations: int  # how many allocations the cell made on `device`
    snapshot_path: str | None = None
    notes: list[str] = field(default_factory=list)
    # of `end_bytes`, those allocated before steps the recording left out and not seen freed
    unseen_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        return max((b for _, b in self.points), default=0)

    @property
    def start_bytes(self) -> int:
        return self.points[0][1] if self.points else 0

    @property
    def end_bytes(self) -> int:
        return self.points[-1][1] if self.points else 0

    @property
    def peak_at_s(self) -> float:
        return max(self.points, key=lambda p: p[1], default=(0.0, 0))[0]

    def headline(self) -> str:
        if not self.allocations:
            return f"memory timeline of {self.device} ({self.source}): no allocations recorded"
        return (
            f"memory timeline of {self.device} ({self.source}): peak {fmt_bytes(self.peak_bytes)}"
            f" at {fmt_seconds(self.peak_at_s)}, {fmt_bytes(self.start_bytes)} ->"
            f" {fmt_bytes(self.end_bytes)}{self._unseen()},"
            f" {plural(self.allocations, 'allocation')}"
            f" in {fmt_seconds(self.duration_s)}"
        )

    def _unseen(self) -> str:
        if not self.unseen_bytes:
            return ""
        return f" ({fmt_bytes(self.unseen_bytes)} of it maybe freed in the steps left out)"

    def table(self) -> Table:
        def short(text: str) -> str:
            return text if len(text) <= SOURCE_WIDTH else text[:SOURCE_WIDTH - 1] + "…"

        rows = [
            [fmt_bytes(a.bytes), a.line_label, fmt_seconds(a.at_s),
             f"{a.count:,}", short(a.text)]
            for a in self.largest
        ]
        notes = list(self.notes)
        if any(a.inferred for a in self.largest):
            notes.append("*: made with no frame of the cell on its stack (another thread: "
                         "backward runs in autograd's device thread): the line the cell was "
                         "last seen on")
        if self.snapshot_path:
            notes.append(f"snapshot for pytorch.org/memory_viz: {self.snapshot_path}")
        title = "largest allocations (the largest of each line)" if rows else ""
        return Table(title, ["size", "line", "at", "allocations", "source"], rows, notes)

    def sparkline(self, width: int = SPARK_WIDTH) -> str:
        """The allocated bytes as one line of block characters, each the high of its slice."""
        if not self.allocations:
            return ""
        highs = _bucket_highs(self.points, self.duration_s, width)
        top = max(highs) or 1
        bars = "".join(_BARS[min(len(_BARS) - 1, int(h / top * (len(_BARS) - 1) + 0.5))]
                       for h in highs)
        return f"{bars}  0 B .. {fmt_bytes(top)}"

    def text(self) -> str:
        parts = [self.headline(), self.sparkline()]
        parts.append(self.table().text())
        return "\n".join(p for p in parts if p)

    def svg(self) -> str:
        return render_svg(self)

    def html(self) -> str:
        chart = self.svg() if self.allocations else ""
        return (
            f'<div class="tdm-memory"><div><b>{html.escape(self.headline())}</b></div>'
            f"{chart}{self.table().html()}</div>"
        )

    def __str__(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self.html()}


# --- building a timeline from (time, change, line) events -------------------------------


@dataclass(frozen=True)
class _Change:
    t_s: float
    delta: int  # + allocated, - freed
    total: int  # allocated after it
    line: int | None
    inferred: bool = False  # the line the cell was last seen on, not a frame of it


def _timeline(
    device: str, changes: Sequence[_Change], start: int, duration_s: float, source: str,
    lines: Callable[[int], str], notes: list[str],
) -> Timeline:
    points = [(0.0, start)] + [(c.t_s, c.total) for c in changes]
    points.append((duration_s, points[-1][1]))
    allocs = [c for c in changes if c.delta > 0]
    by_line: dict[int | None, list[_Change]] = {}
    for c in allocs:
        by_line.setdefault(c.line, []).append(c)
    tops = [(min(cs, key=lambda c: (-c.delta, c.t_s)), len(cs)) for cs in by_line.values()]
    tops.sort(key=lambda tc: (-tc[0].delta, tc[0].t_s))
    largest = [
        Allocation(c.delta, c.line, "" if c.line is None else lines(c.line), c.t_s, c.total, n,
                   c.inferred)
        for c, n in tops[:LARGEST]
    ]
    return Timeline(device, points, largest, source, duration_s, len(allocs), notes=notes)


def _source_lines(cell_filename: str, cell_source: str | None) -> Callable[[int], str]:
    """Line number -> its stripped text, from the cell's source or from linecache
    (IPython registers every cell's source there under its filename)."""
    given = cell_source.splitlines() if cell_source is not None else None

    def line(n: int) -> str:
        if given is not None:
            return given[n - 1].strip() if 0 < n <= len(given) else ""
        return linecache.getline(cell_filename, n).strip()

    return line


def _cell_names(cell_filename: str) -> frozenset[str]:
    """The names a frame of the cell can carry: the profiler's Python tracer strips the
    longest `sys.path`/site-packages prefix from a filename (`python_tracer._prefix_regex`)."""
    names = {cell_filename}
    try:
        from torch.profiler.python_tracer import _prefix_regex

        full = os.path.abspath(cell_filename)
        for prefix in _prefix_regex():  # longest first, as the tracer tries them
            if full.startswith(prefix):
                names.add(full[len(prefix):])
                break
    except Exception:  # an older torch: the names as given
        _log.debug("profiler prefixes unread", exc_info=True)
    return frozenset(names)


# --- the profiler's memory events (any device) ------------------------------------------


def from_profiler(prof: Any, cell_filename: str, cell_source: str) -> Timeline:
    """The timeline of a `torch.profiler.profile(profile_memory=True, with_stack=True)` run.

    An allocation goes to the cell's line innermost on its stack: the line of a call
    made from the cell's code (its top level or a function it defines), or the line
    range `%%profile`'s line tracer opened (`tdm:In[5] 3: ...`), which also covers
    an operator at the top level (`a + b` calls no function the stack would show).
    The cell's time is the span of its own frames or line ranges (run once or `-n`
    times); without either, the span of the memory events. The device is the
    accelerator that allocated the most, else the CPU; the others are named in a
    note. Times are seconds since the cell's first frame started.

    The CPU's bytes are counted from the cell's start, block by block (the profiler's own
    CPU count keeps, for the rest of the process, every block whose free it did not see).
    Where `prof` is %%profile's sessions (`recording.Pieces`), a loop's steps past the
    window were not recorded: the timeline says so, and how much of its end was allocated
    before them and not seen freed.
    """
    try:
        return _from_profiler(prof, cell_filename, cell_source)
    except Exception as exc:  # a torch whose profiler events read otherwise
        _log.debug("profiler memory events unread", exc_info=True)
        return Timeline("cpu", [], [], PROFILER_SOURCE, 0.0, 0, notes=[
            f"the profiler's memory events could not be read: {first_sentence(exc, named=True)}"])


def _from_profiler(prof: Any, cell_filename: str, cell_source: str) -> Timeline:
    names = _cell_names(cell_filename)
    trees, to_end = _sessions(prof)
    allocations, span = _walk(trees, names)
    notes: list[str] = []
    if span:
        t0, t1 = span
    elif allocations:
        t0, t1 = allocations[0].start_ns, allocations[-1].start_ns
        notes.append("no frames of the cell were recorded (profile with with_stack=True): "
                     "lines are unknown")
    else:
        t0 = t1 = 0
    if not allocations:
        notes.append("no memory events were recorded (profile with profile_memory=True)")
    by_device: dict[str, list[_Memory]] = {}
    for m in allocations:
        if t0 <= m.start_ns <= t1:
            by_device.setdefault(m.device, []).append(m)
    device = _main_device(by_device)
    for other, ms in sorted(by_device.items()):
        if other != device:
            made = [m.size for m in ms if m.size > 0]
            notes.append(f"{other} also allocated {fmt_bytes(sum(made))} in "
                         f"{plural(len(made), 'allocation')}")
    mine = by_device.get(device, [])
    unseen = 0
    if device == "cpu":
        mine, unseen = _cell_blocks(mine, len(trees) - 1 if to_end else len(trees))
    if len(trees) > 1 or not to_end:
        notes.append("a loop's steps past --steps were not recorded: what they allocated and "
                     "freed is not drawn (--steps 0 records every step)")
    lines = [_profiler_line(m.event, names) if m.size > 0 else None for m in mine]
    orphans = [i for i, line in enumerate(lines) if line is None and mine[i].size > 0]
    if orphans and span:  # made on another thread (backward on a GPU), or by an operator
        found = _open_line([mine[i].start_ns for i in orphans], _call_spans(
            [node for tree in trees for node in tree], names))
        for i, line in zip(orphans, found):
            lines[i] = line
    changes = [_Change((m.start_ns - t0) / 1e9, m.size, m.total, line)
               for m, line in zip(mine, lines)]
    start = changes[0].total - changes[0].delta if changes else 0
    timeline = _timeline(device, changes, start, (t1 - t0) / 1e9, PROFILER_SOURCE,
                         _source_lines(cell_filename, cell_source), notes)
    timeline.unseen_bytes = unseen
    if span and any(a.line is None for a in timeline.largest):
        notes.append("line ?: made while no call of the cell's own was running (an operator "
                     "such as a + b at the top level); the CUDA history has its line")
    return timeline


@dataclass(frozen=True)
class _Memory:
    """One `[memory]` event, read once (each attribute read of an event crosses pybind)."""

    start_ns: int
    size: int  # + allocated, - freed
    total: int  # the allocator's bytes allocated after it
    device: str
    event: Any
    ptr: int
    session: int  # the recording session's index (%%profile's sessions: see `_sessions`)


def _cell_blocks(memory: list[_Memory], sessions_seen: int) -> tuple[list[_Memory], int]:
    """The CPU's events with its bytes allocated counted from the cell's start, of the
    blocks the cell made (a free of an older block is left out), and the bytes of those not
    seen freed that were made in the first `sessions_seen` sessions, each followed by steps
    left out (where they may have been freed)."""
    held: dict[int, _Memory] = {}
    total, out = 0, []
    for m in memory:
        if m.size > 0:
            gone = held.pop(m.ptr, None)  # its address again: freed where nothing recorded
            total += m.size - (gone.size if gone is not None else 0)
            held[m.ptr] = m
        elif (gone := held.pop(m.ptr, None)) is not None:
            total -= gone.size
        else:
            continue
        out.append(replace(m, total=total))
    return out, sum(m.size for m in held.values() if m.session < sessions_seen)


def _walk(
    trees: list[list[Any]], names: frozenset[str]
) -> tuple[list[_Memory], tuple[int, int] | None]:
    """The memory events of each session's tree in time order, and the span from the first
    of the cell's frames or line ranges to start to the last to end (None where none)."""
    from torch._C._profiler import _EventType

    allocation, pycall, op = _EventType.Allocation, _EventType.PyCall, _EventType.TorchOp
    heads = tuple(f"{n}(" for n in names)  # a Python frame's event is named `file(line): name`
    memory: list[_Memory] = []
    first, last = None, None
    stack = [(ev, i) for i, tree in enumerate(trees) for ev in tree]
    while stack:
        ev, session = stack.pop()
        tag = ev.tag
        if tag == allocation:
            f = ev.extra_fields
            memory.append(_Memory(ev.start_time_ns, int(f.alloc_size), int(f.total_allocated),
                                  str(f.device), ev, int(f.ptr), session))
            continue
        if (tag == pycall and ev.name.startswith(heads)) or (
                tag == op and _range_line(ev) is not None):
            start, end = ev.start_time_ns, ev.end_time_ns
            first = start if first is None else min(first, start)
            last = end if last is None else max(last, end)
        stack.extend((child, session) for child in ev.children)
    memory.sort(key=lambda m: m.start_ns)
    return memory, None if first is None or last is None else (first, last)


def _sessions(prof: Any) -> tuple[list[list[Any]], bool]:
    """Each recording session's event tree, and whether the last one recorded to the
    cell's end: %%profile's sessions (`recording.Pieces`: a loop's steps past the window
    left out after each but the last), else a profiler's one."""
    trees = getattr(prof, "trees", None)
    if trees is not None:
        return trees(), prof.to_end
    results = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    return ([] if results is None else [list(results.experimental_event_tree())]), True


def _main_device(by_device: dict[str, list[_Memory]]) -> str:
    def allocated(dev: str) -> int:
        return sum(max(0, m.size) for m in by_device[dev])

    accelerators = [d for d in by_device if not d.startswith("cpu")]
    if accelerators:
        return max(sorted(accelerators), key=allocated)
    return "cpu"


def _profiler_line(ev: Any, names: frozenset[str]) -> int | None:
    """The cell's line innermost above `ev`: a line range of `%%profile`'s tracer, or
    the line of a call made from the cell's own code."""
    from torch._C._profiler import _EventType

    calls, op = (_EventType.PyCall, _EventType.PyCCall), _EventType.TorchOp
    node = ev.parent
    while node is not None:
        tag = node.tag
        if tag == op:
            line = _range_line(node)
            if line is not None:
                return line
        elif tag in calls:
            caller = node.extra_fields.caller
            if caller.file_name in names:
                return int(caller.line_number)
        node = node.parent
    return None


def _call_spans(tree: list[Any], names: frozenset[str]) -> list[tuple[int, int, int]]:
    """(start, end, line) of every call made from the cell's code and of every line
    range, in the order they start."""
    from torch._C._profiler import _EventType

    calls, op = (_EventType.PyCall, _EventType.PyCCall), _EventType.TorchOp
    out: list[tuple[int, int, int]] = []
    stack = list(tree)
    while stack:
        ev = stack.pop()
        tag = ev.tag
        line: int | None = None
        if tag in calls:
            caller = ev.extra_fields.caller
            if caller.file_name in names:
                line = int(caller.line_number)
        elif tag == op:
            line = _range_line(ev)
        if line is not None:
            out.append((ev.start_time_ns, ev.end_time_ns, line))
        stack.extend(ev.children)
    out.sort(key=lambda s: (s[0], -s[1]))
    return out


def _open_line(times: list[int], spans: list[tuple[int, int, int]]) -> list[int | None]:
    """For each time (ascending), the line of the innermost span open then: spans of one
    thread nest, so a sweep with a stack of the open ones finds it."""
    out: list[int | None] = []
    open_: list[tuple[int, int, int]] = []
    k = 0
    for t in times:
        while k < len(spans) and spans[k][0] <= t:
            while open_ and open_[-1][1] < spans[k][0]:
                open_.pop()
            open_.append(spans[k])
            k += 1
        while open_ and open_[-1][1] < t:
            open_.pop()
        out.append(open_[-1][2] if open_ else None)
    return out


def _range_line(ev: Any) -> int | None:
    """The cell's line a `record_function` range stands for, where it is one of the line
    ranges `%%profile`'s tracer opens (`tdm:In[5] 3: text`; a `-f` function's lines,
    `tdm:In[5] name 12: ...`, are not the cell's)."""
    name = ev.name
    if not name.startswith(LINE_RANGE_PREFIX):
        return None
    match = _LINE_RANGE.match(name)
    return int(match.group(1)) if match else None


# --- the CUDA allocator's history ---------------------------------------------------------


def from_snapshot(
    snapshot: dict[str, Any], cell_filename: str, start_us: int, end_us: int,
    *, max_entries: int | None = None, cell_source: str | None = None,
) -> tuple[Timeline, dict[str, Any]] | None:
    """The timeline of the entries of `snapshot` between `start_us` and `end_us` (the
    allocator's `time_us`, microseconds since the epoch), on the device that allocated
    most there, and the snapshot with only those entries (for memory_viz); None where
    no device allocated. The allocated bytes before the first entry are the blocks in
    use at the snapshot less what the entries from then on changed."""
    names = _cell_names(cell_filename)
    traces: list[list[dict[str, Any]]] = snapshot.get("device_traces") or []
    lo, hi = start_us - _SLACK_US, end_us + _SLACK_US
    sliced = [[e for e in trace if lo <= e.get("time_us", 0) <= hi] for trace in traces]
    sizes = [sum(e["size"] for e in trace if e["action"] == "alloc") for trace in sliced]
    if not any(sizes):
        return None
    index = max(range(len(sizes)), key=lambda i: sizes[i])
    in_use = sum(
        b["size"] for seg in snapshot.get("segments", []) if seg.get("device", 0) == index
        for b in seg.get("blocks", []) if b.get("state") == "active_allocated"
    )
    trace = traces[index]
    first = next(i for i, e in enumerate(trace) if e.get("time_us", 0) >= lo)
    deltas = _deltas(trace)
    start = in_use - sum(deltas[first:])
    changes: list[_Change] = []
    total = start
    notes: list[str] = []
    seen: int | None = None  # the cell's line of the latest allocation with its frame
    for entry, delta in zip(trace[first:], deltas[first:]):
        if entry.get("time_us", 0) > hi:
            break
        if entry["action"] == "oom":
            notes.append(f"out of memory: {fmt_bytes(entry.get('size'))} could not be allocated "
                         f"(line {_frame_line(entry, names) or '?'})")
        if not delta:
            continue
        total += delta
        line = _frame_line(entry, names) if delta > 0 else None
        inferred = delta > 0 and line is None and seen is not None
        if inferred:
            line = seen
        elif line is not None:
            seen = line
        changes.append(_Change(max(0.0, (entry["time_us"] - start_us) / 1e6), delta, total,
                               line, inferred))
    if changes and all(c.line is None or c.inferred for c in changes if c.delta > 0):
        notes.append("no allocation has a frame of the cell: lines are unknown (a recording "
                     "without Python stacks?)")
    if max_entries is not None and len(trace) >= max_entries and trace[0].get("time_us", 0) > lo:
        notes.append(f"the history keeps {max_entries:,} entries: the start of the cell is "
                     "missing (record with a larger max_entries)")
    timeline = _timeline(f"cuda:{index}", changes, start, max(0.0, (end_us - start_us) / 1e6),
                         CUDA_SOURCE, _source_lines(cell_filename, cell_source), notes)
    return timeline, {**snapshot, "device_traces": sliced}


def _deltas(trace: Sequence[dict[str, Any]]) -> list[int]:
    """What each entry changed in the allocated bytes: +size at `alloc`, -size at a
    block's `free_requested` (or its `free_completed` where no request was recorded)."""
    requested: set[int | None] = set()
    out = []
    for e in trace:
        action, addr = e["action"], e.get("addr")
        delta = 0
        if action == "alloc":
            requested.discard(addr)
            delta = e["size"]
        elif action == "free_requested":
            requested.add(addr)
            delta = -e["size"]
        elif action == "free_completed":
            if addr in requested:
                requested.discard(addr)
            else:
                delta = -e["size"]
        out.append(delta)
    return out


def _frame_line(entry: dict[str, Any], names: frozenset[str]) -> int | None:
    """The line of the innermost frame of the cell (frames come innermost first)."""
    for frame in entry.get("frames") or ():
        if frame.get("filename") in names:
            return int(frame["line"])
    return None


class Recorder:
    """What `recording` started; `timeline()` after the block reads what it recorded."""

    def __init__(self, cell_filename: str, max_entries: int) -> None:
        self.cell_filename, self.max_entries = cell_filename, max_entries
        self.owned = False  # we started the recording (and stop it)
        self.kept = False  # the user's own recording was running: left as it was
        self.start_us = self.end_us = 0
        self.why: str | None = None  # why nothing is recorded
        self._done = self._read_once = False
        self._result: Timeline | None = None
        self._snapshot: dict[str, Any] | None = None

    def _start(self) -> None:
        """Start recording (called with CUDA initialised); never raises."""
        try:
            if getattr(torch._C, "_cuda_isHistoryEnabled", bool)():
                self.kept = True
                return
            # Python stacks of allocations only: a free's stack would double the cost
            torch.cuda.memory._record_memory_history(
                "all", context="alloc", stacks="python", max_entries=self.max_entries)
            self.owned = True
        except Exception as exc:
            _log.debug("memory history not started", exc_info=True)
            self.why = f"the allocator's history could not be recorded: {first_sentence(exc)}"

    def _stop(self) -> None:
        if self.owned:
            try:
                torch.cuda.memory._record_memory_history(None)
            except Exception:
                _log.debug("memory history not stopped", exc_info=True)

    def timeline(self) -> Timeline | None:
        """After the block: its timeline on CUDA, or None where nothing was recorded."""
        if not self._done or not (self.owned or self.kept):
            return None
        if not self._read_once:
            self._read_once = True
            try:
                self._result = self._read()
            except Exception as exc:  # a snapshot in a format this code does not know
                _log.debug("memory snapshot unread", exc_info=True)
                why = first_sentence(exc, named=True)
                self.why = f"the allocator's snapshot could not be read: {why}"
        return self._result

    def _take(self) -> None:
        """The snapshot, as the block ends: the blocks in use then match the entries."""
        try:
            self._snapshot = torch.cuda.memory._snapshot()
        except Exception as exc:
            _log.debug("memory snapshot failed", exc_info=True)
            self.why = f"the allocator's snapshot could not be taken: {first_sentence(exc)}"

    def _read(self) -> Timeline | None:
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None:
            return None
        found = from_snapshot(snapshot, self.cell_filename, self.start_us, self.end_us,
                              max_entries=None if self.kept else self.max_entries)
        if found is None:
            self.why = "the cell made no CUDA allocation"
            return None
        timeline, sliced = found
        if self.kept:
            timeline.notes.append("your own memory recording was running: it is left running; "
                                  "this is its part during the cell")
        timeline.snapshot_path = _save(sliced)
        return timeline


def _save(snapshot: dict[str, Any]) -> str | None:
    try:
        fd, path = tempfile.mkstemp(prefix="tdm-memory-", suffix=".pickle")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(snapshot, f)
        return path
    except Exception:
        _log.debug("snapshot not saved", exc_info=True)
        return None


@contextlib.contextmanager
def recording(cell_filename: str, *, max_entries: int = 100_000) -> Iterator[Recorder]:
    """Record the CUDA allocator's history during the block (see the module's docstring).

    Never starts CUDA. Where CUDA is up, recording starts now; where the block starts
    CUDA, at its initialisation. Stopped however the block ends, unless it was the
    user's own recording. On a build without CUDA, or where the block never starts it,
    nothing is recorded and `timeline()` is None.
    """
    rec = Recorder(cell_filename, max_entries)
    queued: Callable[[], None] | None = None
    if not probes.cuda_built():
        rec.why = "this torch has no CUDA"
    elif torch.cuda.is_initialized():
        rec._start()
    else:
        queued = rec._start
        _queue_at_init(queued)
    rec.start_us = time.time_ns() // 1000
    try:
        yield rec
    finally:
        rec.end_us = time.time_ns() // 1000
        rec._done = True
        if queued is not None:
            _unqueue(queued)
            if not (rec.owned or rec.kept or rec.why):
                rec.why = "the cell did not use CUDA"
        try:
            if rec.owned or rec.kept:
                rec._take()
        finally:  # a second Ctrl-C during the snapshot still stops the recording
            rec._stop()


def _queue_at_init(call: Callable[[], None]) -> None:
    """Run `call` as CUDA initialises (torch's own queue for calls made before it)."""
    lazy = getattr(torch.cuda, "_lazy_call", None)
    if lazy is not None:
        lazy(call)


def _unqueue(call: Callable[[], None]) -> None:
    queue = getattr(torch.cuda, "_queued_calls", None)
    if isinstance(queue, list):
        queue[:] = [q for q in queue if not (isinstance(q, tuple) and q and q[0] is call)]


# --- drawing ------------------------------------------------------------------------------


def _bucket_highs(points: Sequence[tuple[float, int]], duration: float, n: int) -> list[int]:
    """The highest allocated value in each of `n` equal slices of the time (held values
    count in the slices they span)."""
    highs = [0] * n
    span = duration or 1.0
    times = [t for t, _ in points]
    for i in range(n):
        a, b = span * i / n, span * (i + 1) / n
        lo = max(0, bisect.bisect_right(times, a) - 1)  # the value held at a
        hi = bisect.bisect_right(times, b)
        highs[i] = max((v for _, v in points[lo:max(hi, lo + 1)]), default=0)
    return highs


def downsample(
    points: Sequence[tuple[float, int]], limit: int = MAX_DRAWN
) -> list[tuple[float, int]]:
    """At most about `2 * limit` points: in each of `limit` slices of time, the value
    entering it, its low and its high in time order, so that every peak is kept."""
    if len(points) <= 2 * limit:
        return list(points)
    t0, t1 = points[0][0], points[-1][0]
    width = (t1 - t0) / limit or 1.0
    out = [points[0]]
    bucket: list[tuple[float, int]] = []
    current = 0
    for p in points[1:-1]:
        k = min(limit - 1, int((p[0] - t0) / width))
        if k != current and bucket:
            out.extend(_extremes(bucket))
            bucket = []
        current = k
        bucket.append(p)
    out.extend(_extremes(bucket))
    out.append(points[-1])
    return out


def _extremes(bucket: list[tuple[float, int]]) -> list[tuple[float, int]]:
    if not bucket:
        return []
    low = min(bucket, key=lambda p: p[1])
    high = max(bucket, key=lambda p: p[1])
    last = bucket[-1]  # the value the slice hands on
    return sorted({low, high, last}, key=lambda p: p[0])


def _nice(step: float, bases: Iterable[float]) -> float:
    for b in bases:
        if b >= step:
            return b
    return step


def _byte_step(top: int) -> float:
    """A round step for about four byte ticks: 1, 2, 4 ... 512 of a binary unit."""
    raw = max(top / 4, 1)
    unit = 1024 ** max(0, min(4, int(_log1024(raw))))
    return _nice(raw, [unit * 2**k for k in range(11)])


def _log1024(x: float) -> float:
    return math.log(x, 1024) if x >= 1 else 0.0


def _time_step(duration: float) -> float:
    """A round step for about five time ticks: 1, 2, 5 times a power of ten."""
    raw = max(duration / 5, 1e-9)
    power = 10 ** math.floor(math.log10(raw))
    return _nice(raw, [power * m for m in (1, 2, 5, 10)])


_W, _H = 640, 220
_LEFT, _RIGHT, _TOP, _BOTTOM = 72, 16, 14, 30


def render_svg(tl: Timeline) -> str:
    """The timeline as a standalone SVG: a step line of the allocated bytes (downsampled
    to at most a few hundred points, peaks kept), axes in bytes and seconds, and the
    largest allocations marked with their line and size (the line's source on hover)."""
    esc = html.escape
    duration = tl.duration_s or max((t for t, _ in tl.points), default=0.0) or 1.0
    step_y = _byte_step(tl.peak_bytes or 1)
    top = step_y * max(1, -(-max(tl.peak_bytes, 1) // step_y))  # ceil to a tick
    plot_w, plot_h = _W - _LEFT - _RIGHT, _H - _TOP - _BOTTOM

    def x(t: float) -> float:
        return _LEFT + min(max(t / duration, 0.0), 1.0) * plot_w

    def y(v: float) -> float:
        return _TOP + (1 - v / top) * plot_h

    pts = downsample(tl.points)
    path = [f"M{x(pts[0][0]):.1f},{y(pts[0][1]):.1f}"]
    for t, v in pts[1:]:
        path.append(f"H{x(t):.1f}V{y(v):.1f}")
    line = "".join(path)
    area = f"{line}V{y(0):.1f}H{x(pts[0][0]):.1f}Z"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}" style="max-width:100%;height:auto" font-family="sans-serif" '
        f'font-size="11" role="img">',
        f"<title>{esc(tl.headline())}</title>",
    ]
    ticks_y = [step_y * k for k in range(int(top // step_y) + 1)]
    for tick in ticks_y:
        out.append(f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y(tick):.1f}" '
                   f'y2="{y(tick):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{_LEFT - 4}" y="{y(tick) + 4:.1f}" text-anchor="end">'
                   f"{esc(fmt_bytes(tick))}</text>")
    step_x = _time_step(duration)
    k = 0
    while step_x * k <= duration * 1.0001:
        t = step_x * k
        out.append(f'<text x="{x(t):.1f}" y="{_H - _BOTTOM + 14}" text-anchor="middle">'
                   f"{esc(fmt_seconds(t))}</text>")
        k += 1
    out.append(f'<path d="{area}" fill="#1f77b4" fill-opacity="0.15" stroke="none"/>')
    out.append(f'<path d="{line}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>')
    out.append(f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y(0):.1f}" y2="{y(0):.1f}" '
               f'stroke="#888"/>')
    placed: list[tuple[float, float]] = []
    for a in tl.largest[:LABELLED]:
        cx, cy = x(a.at_s), y(a.after_bytes)
        where = a.line_label
        label = f"line {where}: {fmt_bytes(a.bytes)}"
        ty = max(cy - 6, _TOP + 10)
        while any(abs(ty - py) < 12 and abs(cx - px) < 160 for px, py in placed):
            ty += 12
        placed.append((cx, ty))
        anchor = "end" if cx > _LEFT + plot_w * 0.6 else "start"
        dx = -5 if anchor == "end" else 5
        hover = f"line {where}: {a.text}" if a.text else label
        out.append(f'<g class="tdm-alloc"><title>{esc(hover)}</title>'
                   f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="3" fill="#d62728"/>'
                   f'<text x="{cx + dx:.1f}" y="{ty:.1f}" text-anchor="{anchor}" fill="#d62728" '
                   f'stroke="#fff" stroke-width="3" paint-order="stroke">'
                   f"{esc(label)}</text></g>")
    out.append("</svg>")
    return "".join(out)
