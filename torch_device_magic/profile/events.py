"""The events `%%profile` reads from kineto, as plain records, and their analysis.

`from_kineto` turns kineto's events into `Event`s (names and shapes, never a tensor);
`analyse` nests them, attributes them to the cell's lines and sums the op, kernel and
line rows, the device's busy time and the syncs in a loop (`Analysis`).
"""

from __future__ import annotations

import bisect
import json
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..advice.profile_rules import MATMULS
from ..units import plural

LINE_PREFIX = "tdm:"  # our ranges' names start with it (and never an op's)
_SYNC_CALLS = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize", "hipMemcpy",
})
_ITEM = frozenset({"aten::item", "aten::_local_scalar_dense"})
# the outermost op around a synchronising call names the read (print(tensor) reads
# by .item() and .cpu(); .tolist() by .cpu())
_READS = {"aten::item": ".item()", "aten::_local_scalar_dense": ".item()",
          "aten::to": ".cpu()/.to()/.tolist()", "aten::_to_copy": ".cpu()/.to()/.tolist()",
          "aten::copy_": ".copy_()", "aten::nonzero": "nonzero()",
          "aten::index": "boolean-mask indexing", "aten::masked_select": "boolean-mask indexing"}


# --- the events, as plain records -------------------------------------------------------


@dataclass(slots=True)
class Event:
    """One kineto event, its times relative to the trace's start.

    kind: "op" (a CPU op or a user's range), "line" (ours), "memory", "runtime" (a
    CUDA runtime or driver call), "kernel", "memcpy", "memset" (device activity),
    "overhead" (the profiler's own rows, CUPTI's: in no table, read by the advice).
    """

    name: str
    kind: str
    start_ns: int
    end_ns: int = 0
    thread: int = 0
    correlation: int = 0  # a CPU op's id; device and runtime events link to it
    linked: int = 0
    shapes: tuple[tuple[int, ...], ...] = ()
    nbytes: int = 0  # memory: + allocated, - freed; memcpy: bytes copied (0: unknown)
    on_device: bool = False  # memory: on an accelerator (else host)
    dtypes: tuple[str, ...] = ()  # an op's inputs', as kineto names them ('float', 'c10::Half')
    # filled by the analysis
    self_ns: int = 0
    alloc_bytes: int = 0
    device_ns: int = 0
    line: str | None = None
    parent: Event | None = None  # the innermost op or range around it, on its thread


def from_kineto(result: Any, origin: int | None = None) -> list[Event]:
    """The events of a finished capture (`prof.profiler.kineto_results`), their times
    from `origin` (the trace's start by default; another session's, to put several on one
    clock); read once, in one pass (tens of thousands of events: every call per event
    counts)."""
    start = result.trace_start_ns() if origin is None else origin
    events = result.events()
    cpu = torch.autograd.DeviceType.CPU
    older = bool(events) and not hasattr(events[0], "activity_type")  # older torch
    linked = bool(events) and hasattr(events[0], "linked_correlation_id")
    out: list[Event] = []
    append = out.append
    for e in events:
        name = e.name()
        activity = "" if older else e.activity_type()
        device = e.device_type() != cpu
        if name == "[memory]":
            append(Event(name, "memory", e.start_ns() - start, e.start_ns() - start,
                         e.start_thread_id(), nbytes=e.nbytes(), on_device=device))
            continue
        if name.startswith(LINE_PREFIX):
            kind = "line"
        elif _profilers_own(name, activity):
            kind = "overhead"  # on either side: no activity of the user's
        elif device:
            kind = ("memcpy" if "memcpy" in activity or name.startswith("Memcpy")
                    else "memset" if "memset" in activity or name.startswith("Memset")
                    else "kernel")
        elif activity in _RUNTIME or _driver_call(name, activity) or (
                older and name.startswith(("cuda", "hip"))):
            kind = "runtime"
        elif name in _FILTERED or e.is_async() or e.start_thread_id() != e.end_thread_id():
            continue
        else:
            kind = "op"
        append(Event(
            name, kind, e.start_ns() - start, e.end_ns() - start, e.start_thread_id(),
            e.correlation_id(), e.linked_correlation_id() if linked else 0,
            tuple(map(tuple, e.shapes())) if kind == "op" else (),
            _copied_bytes(e) if kind == "memcpy" else 0,
            dtypes=tuple(e.dtypes()) if kind == "op" and name in _DTYPES_READ else (),
        ))
    return out


_RUNTIME = frozenset({"cuda_runtime", "cuda_driver", "privateuse1_runtime",
                      "privateuse1_driver", "xpu_runtime", "xpu_driver"})
_FILTERED = frozenset({
    "profiler::_record_function_enter", "profiler::_record_function_enter_new",
    "profiler::_record_function_exit", "aten::is_leaf", "aten::output_nr", "aten::_version",
})


# CUPTI's own rows (seen on an H200, torch 2.11): its buffer requests, CUDA's module
# loading it saw, and an unnamed one; kineto's activity type "overhead" marks the others
_PROFILERS_OWN = frozenset({"Activity Buffer Request", "INVALID", "Lazy Function Loading",
                            "Runtime Triggered Module Loading"})


def _profilers_own(name: str, activity: str) -> bool:
    """A row the profiler made about itself (or CUDA's loading it saw), not an op of the
    user's."""
    return activity == "overhead" or name in _PROFILERS_OWN


def _driver_call(name: str, activity: str) -> bool:
    """A CUDA driver API call (cuLaunchKernelEx), whatever activity kineto gave it; a
    user's range of that look is one of theirs."""
    return (activity != "user_annotation" and name.startswith("cu") and name[2:3].isupper()
            and name.isalnum())


def _copied_bytes(event: Any) -> int:
    """The bytes of a device copy, where kineto put them in the event's metadata."""
    try:
        return int(json.loads("{" + (event.metadata_json() or "") + "}").get("bytes", 0))
    except (ValueError, TypeError, AttributeError):
        return 0


# --- the analysis -------------------------------------------------------------------------


@dataclass(slots=True)
class OpRow:
    """One op name over the capture: on the CPU, its device time where recorded."""

    name: str
    calls: int
    self_cpu_s: float
    total_cpu_s: float
    device_s: float | None  # None: no device activity recorded
    allocated_bytes: int  # allocations made by the op itself (frees not subtracted)
    shapes: str  # the most frequent input shapes, and how often


@dataclass(slots=True)
class KernelRow:
    """One kernel name on the device."""

    name: str
    calls: int
    device_s: float
    launched_by: str  # the op that launched it most often


@dataclass(slots=True)
class LineRow:
    """One line of code: what ran while it was the innermost line running."""

    where: str  # '3' for the cell's line 3, 'train (In[2]) 7' for a line of an -f function
    code: str
    hits: int
    wall_s: float
    cpu_s: float  # torch ops' self CPU time
    device_s: float | None
    allocated_bytes: int


@dataclass(slots=True)
class Analysis:
    """What the events say, in figures."""

    ops: list[OpRow]
    kernels: list[KernelRow]
    lines: list[LineRow]
    op_calls: int
    device_recorded: bool
    device_busy_s: float | None
    launches: int
    copies: int
    copy_bytes: int | None  # of the copies whose size is known; None: of none
    copies_unsized: int  # copies whose size neither kineto nor their op recorded
    syncs: int
    stalls: list[str]  # '.item() 100 times on line 5 (2 runs)'
    line_at: Callable[[int], str | None] | None = field(default=None, repr=False)  # a time's
    # innermost line range (the advice's)
    recorded_s: float | None = None  # the wall the events cover, where the profiler paused
    # (a loop's steps past its window); None: the whole wall


def analyse(
    events: list[Event],
    line_names: dict[str, tuple[str, str]] | None = None,
    *,
    runs: int = 1,
    sort: str = "self",
    top: int = 10,
    device_in_use: bool = False,
) -> Analysis:
    """The tables and counts of a capture's `events`.

    `line_names` maps our range names to (where, code); `device_in_use`: an
    accelerator was in use, so a host read of a value (`.item()`) waits for it.
    """
    line_names = line_names or {}
    cpu = [e for e in events if e.kind in ("op", "line", "runtime", "memory")]
    _nest(cpu)
    timeline = _Timeline([e for e in events if e.kind == "line"])
    ops = [e for e in events if e.kind == "op"]
    for e in ops:
        e.line = timeline.at(e.start_ns)
    by_id = {e.correlation: e for e in ops if e.correlation}
    device = [e for e in events if e.kind in ("kernel", "memcpy", "memset")]
    for d in device:
        launcher = by_id.get(d.linked)
        if launcher is not None:
            launcher.device_ns += d.end_ns - d.start_ns
            d.line = launcher.line
        else:
            d.line = timeline.at(d.start_ns)
    _size_copies(device, by_id)
    recorded = bool(device)
    memory = [e for e in events if e.kind == "memory"]
    for m in memory:
        m.line = timeline.at(m.start_ns)
    return Analysis(
        ops=_op_rows(ops, recorded, sort, top),
        kernels=_kernel_rows(device, by_id, top),
        lines=_line_rows(timeline, ops, device, memory, line_names, recorded),
        op_calls=len(ops),
        device_recorded=recorded,
        device_busy_s=_union_ns(device) / 1e9 if recorded else None,
        launches=sum(1 for d in device if d.kind == "kernel"),
        copies=len(copies := [d for d in device if d.kind == "memcpy" and "DtoD" not in d.name]),
        copy_bytes=sum(d.nbytes for d in copies) if any(d.nbytes for d in copies)
        or not copies else None,
        copies_unsized=sum(1 for d in copies if not d.nbytes),
        syncs=sum(1 for e in events if e.kind == "runtime" and e.name in _SYNC_CALLS),
        stalls=_stalls(events, by_id, line_names, runs) if device_in_use else [],
        line_at=timeline.at,
    )


# where a copy's bytes are among its op's inputs: the source of copy_(self, src), the
# tensor that _to_copy and .item()'s read take
_COPY_SOURCE = {"aten::copy_": 1, "aten::_to_copy": 0, "aten::_local_scalar_dense": 0}
# the ops whose inputs' dtypes from_kineto reads (a copy's size, a matmul's tensor cores):
# asking costs about 3 µs an event, so only theirs
_DTYPES_READ = MATMULS | frozenset(_COPY_SOURCE)
# kineto's names of the dtypes (caffe2's TypeMeta names), and their bytes an element
_ITEMSIZE = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1, "short unsigned int": 2,
    "unsigned int": 4, "long unsigned int": 8, "c10::complex<float>": 8,
    "c10::complex<double>": 16, "c10::complex<c10::Half>": 4, "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1, "c10::Float8_e5m2fnuz": 1,
}


def _size_copies(device: list[Event], by_id: dict[int, Event]) -> None:
    """Give each memcpy kineto left at 0 bytes (torch 2.11's, all of them) the bytes of
    the tensor its launching op copied, where that op recorded its shape and dtype."""
    for d in device:
        if d.kind != "memcpy" or d.nbytes:
            continue
        op = by_id.get(d.linked)
        while op is not None and op.name not in _COPY_SOURCE:
            op = op.parent
        if op is None:
            continue
        i = _COPY_SOURCE[op.name]
        if i < len(op.shapes) and i < len(op.dtypes):
            numel = 1
            for n in op.shapes[i]:
                numel *= n
            d.nbytes = numel * _ITEMSIZE.get(op.dtypes[i], 0)


def _nest(events: list[Event]) -> None:
    """Per thread, each op's self time (its duration less its children's) and the
    allocations made inside it and not inside a child."""
    threads: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        threads[e.thread].append(e)
    for evs in threads.values():
        evs.sort(key=lambda e: (e.start_ns, -e.end_ns, e.kind == "memory"))
        stack: list[Event] = []
        for e in evs:
            point = e.kind == "memory"
            while stack and (stack[-1].end_ns < e.start_ns
                             or (not point and stack[-1].end_ns <= e.start_ns)):
                stack.pop()
            parent = stack[-1] if stack else None
            if point:
                if parent is not None and e.nbytes > 0:
                    parent.alloc_bytes += e.nbytes
                continue
            e.self_ns += e.end_ns - e.start_ns
            e.parent = parent
            if parent is not None:
                parent.self_ns -= e.end_ns - e.start_ns
            stack.append(e)


class _Timeline:
    """Which line range was innermost at each moment: a step function over time."""

    def __init__(self, ranges: list[Event]) -> None:
        self.starts: list[int] = []
        self.names: list[str | None] = []
        self.hits: Counter[str] = Counter(r.name for r in ranges)
        stack: list[Event] = []
        for r in sorted(ranges, key=lambda r: (r.start_ns, -r.end_ns)):
            while stack and stack[-1].end_ns <= r.start_ns:
                ended = stack.pop()
                self._step(ended.end_ns, stack[-1].name if stack else None)
            stack.append(r)
            self._step(r.start_ns, r.name)
        while stack:
            ended = stack.pop()
            self._step(ended.end_ns, stack[-1].name if stack else None)

    def _step(self, at: int, name: str | None) -> None:
        if self.starts and self.starts[-1] == at:
            self.names[-1] = name
        else:
            self.starts.append(at)
            self.names.append(name)

    def at(self, t: int) -> str | None:
        i = bisect.bisect_right(self.starts, t) - 1
        return self.names[i] if i >= 0 else None

    def wall_ns(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for (t0, name), t1 in zip(zip(self.starts, self.names), self.starts[1:]):
            if name is not None:
                out[name] += t1 - t0
        return out


def _shapes(counter: Counter[tuple[tuple[int, ...], ...]]) -> str:
    if not counter:
        return ""
    shapes, n = counter.most_common(1)[0]
    text = ", ".join(str(tuple(s)) if s else "()" for s in shapes) or "-"
    total = sum(counter.values())
    return text if n == total else f"{text} ({n} of {total})"


def _op_rows(ops: list[Event], recorded: bool, sort: str, top: int) -> list[OpRow]:
    groups: dict[str, list[Event]] = defaultdict(list)
    for e in ops:
        groups[e.name].append(e)
    rows = [
        OpRow(
            name=name,
            calls=len(es),
            self_cpu_s=sum(e.self_ns for e in es) / 1e9,
            total_cpu_s=sum(e.end_ns - e.start_ns for e in es) / 1e9,
            device_s=sum(e.device_ns for e in es) / 1e9 if recorded else None,
            allocated_bytes=sum(e.alloc_bytes for e in es),
            shapes=_shapes(Counter(e.shapes for e in es if any(e.shapes))),
        )
        for name, es in groups.items()
    ]
    key: Callable[[OpRow], float] = {
        "self": lambda r: r.self_cpu_s,
        "total": lambda r: r.total_cpu_s,
        "device": lambda r: r.device_s or 0.0 if recorded else r.self_cpu_s,
        "memory": lambda r: r.allocated_bytes,
    }[sort]
    return sorted(rows, key=key, reverse=True)[:top]


def _kernel_rows(device: list[Event], by_id: dict[int, Event], top: int) -> list[KernelRow]:
    groups: dict[str, list[Event]] = defaultdict(list)
    for d in device:
        groups[d.name].append(d)
    rows = []
    for name, ds in groups.items():
        launchers = Counter(by_id[d.linked].name for d in ds if d.linked in by_id)
        rows.append(KernelRow(
            name=name, calls=len(ds), device_s=sum(d.end_ns - d.start_ns for d in ds) / 1e9,
            launched_by=launchers.most_common(1)[0][0] if launchers else "",
        ))
    return sorted(rows, key=lambda r: r.device_s, reverse=True)[:top]


def _line_rows(
    timeline: _Timeline,
    ops: list[Event],
    device: list[Event],
    memory: list[Event],
    line_names: dict[str, tuple[str, str]],
    recorded: bool,
) -> list[LineRow]:
    cpu_ns: Counter[str] = Counter()
    device_ns: Counter[str] = Counter()
    allocated: Counter[str] = Counter()
    for e in ops:
        if e.line is not None:
            cpu_ns[e.line] += e.self_ns
    for d in device:
        if d.line is not None:
            device_ns[d.line] += d.end_ns - d.start_ns
    for m in memory:
        if m.line is not None and m.nbytes > 0:
            allocated[m.line] += m.nbytes
    wall = timeline.wall_ns()
    rows = []
    for name, (where, code) in line_names.items():
        if not timeline.hits[name]:
            continue
        rows.append(LineRow(
            where=where, code=code, hits=timeline.hits[name], wall_s=wall[name] / 1e9,
            cpu_s=cpu_ns[name] / 1e9, device_s=device_ns[name] / 1e9 if recorded else None,
            allocated_bytes=allocated[name],
        ))
    return rows


def _union_ns(device: list[Event]) -> int:
    """How long the device was busy: the union of its activities' intervals."""
    total, end = 0, None
    for d in sorted(device, key=lambda d: d.start_ns):
        if end is None or d.start_ns > end:
            total += d.end_ns - d.start_ns
            end = d.end_ns
        elif d.end_ns > end:
            total += d.end_ns - end
            end = d.end_ns
    return total


def _stalls(
    events: list[Event], by_id: dict[int, Event], line_names: dict[str, tuple[str, str]],
    runs: int,
) -> list[str]:
    """Host reads of device values (`.item()`, `.cpu()`) that a line repeats within a
    run: each one waits for the device.

    Where the runtime's calls were recorded (CUDA), a read is the outermost `.item()` or
    `.to()` op around a synchronising call (a `.to(torch.half)` is none); elsewhere only
    `.item()`, which always waits."""
    reads: Counter[tuple[str, str]] = Counter()
    found: set[int] = set()
    syncs = [e for e in events if e.kind == "runtime" and e.name in _SYNC_CALLS]
    if syncs:
        starts = [by_id.get(e.linked) for e in syncs]
    else:
        starts = [e for e in events if e.kind == "op" and e.name in _ITEM]
    for op in starts:
        outermost = None
        while op is not None:
            if op.name in _READS:
                outermost = op
            op = op.parent
        if outermost is not None and outermost.line is not None and id(outermost) not in found:
            found.add(id(outermost))
            reads[(outermost.line, _READS[outermost.name])] += 1
    out = []
    for (line, what), n in reads.most_common():
        if n > runs:
            where = line_names.get(line, (line, ""))[0]
            where = f"line {where}" if where.isdigit() else where
            per_run = "" if runs == 1 else f" in {plural(runs, 'run')}"
            out.append(f"{what} {plural(n, 'time')} on {where}{per_run} (a loop: each waits "
                       "for the device)")
    return out
