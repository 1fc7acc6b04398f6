"""What a capture's events say, in figures: `analyse` nests them, attributes them to the
cell's lines and sums the op, kernel and line rows, the device's busy time and the syncs in
a loop (`Analysis`)."""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from ..units import plural
from . import flops, names
from .events import Event

# torch.compile's own code, whose work no aten op records: Inductor's Triton kernels, and
# the range around each call of a compiled graph (its C++ kernels on the CPU)
COMPILED_KERNELS = "triton_"
COMPILED_CALLS = "## Call CompiledFxGraph"


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
    flops: int = 0  # its counted floating-point operations (kineto.flops; 0: none counted)


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
    flops: int = 0  # the counted floating-point operations of its ops (0: none)

    @property
    def flops_per_second(self) -> float | None:
        """Its FLOPs over its ops' device time, where recorded, else their CPU time: both
        of the events recorded, as the FLOPs are. None where it did no counted work."""
        took = self.device_s if self.device_s else self.cpu_s
        return self.flops / took if self.flops and took else None


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
    work: flops.Work = field(default_factory=flops.Work)  # the counted floating-point work
    compiled_kernels: int = 0  # Triton kernels that ran (torch.compile's): not counted
    compiled_calls: int = 0  # calls of torch.compile's graphs


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
    work = flops.count(ops)
    lines = _line_rows(timeline, ops, device, memory, line_names, recorded)
    by_line = {line_names[name]: n for name, n in work.by_line.items() if name in line_names}
    for row in lines:
        row.flops = by_line.get((row.where, row.code), 0)
    op_rows = _op_rows(ops, recorded, sort, top)
    for op in op_rows:
        op.flops = work.by_op[op.name]
    return Analysis(
        ops=op_rows,
        kernels=_kernel_rows(device, by_id, top),
        lines=lines,
        op_calls=len(ops),
        device_recorded=recorded,
        device_busy_s=_union_ns(device) / 1e9 if recorded else None,
        launches=sum(1 for d in device if d.kind == "kernel"),
        copies=len(copies := [d for d in device if d.kind == "memcpy" and "DtoD" not in d.name]),
        copy_bytes=sum(d.nbytes for d in copies) if any(d.nbytes for d in copies)
        or not copies else None,
        copies_unsized=sum(1 for d in copies if not d.nbytes),
        syncs=sum(1 for e in events if e.kind == "runtime" and e.name in names.SYNC_CALLS),
        stalls=_stalls(events, by_id, line_names, runs) if device_in_use else [],
        line_at=timeline.at,
        work=work,
        compiled_kernels=sum(1 for d in device
                             if d.kind == "kernel" and d.name.startswith(COMPILED_KERNELS)),
        compiled_calls=sum(1 for e in ops if e.name.startswith(COMPILED_CALLS)),
    )


def _size_copies(device: list[Event], by_id: dict[int, Event]) -> None:
    """Give each memcpy kineto left at 0 bytes (torch 2.11's, all of them) the bytes of
    the tensor its launching op copied, where that op recorded its shape and dtype."""
    for d in device:
        if d.kind != "memcpy" or d.nbytes:
            continue
        op = by_id.get(d.linked)
        while op is not None and op.name not in names.COPY_SOURCE:
            op = op.parent
        if op is None:
            continue
        i = names.COPY_SOURCE[op.name]
        if i < len(op.shapes) and i < len(op.dtypes):
            numel = 1
            for n in op.shapes[i]:
                numel *= n
            d.nbytes = numel * names.ITEMSIZE.get(op.dtypes[i], 0)


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
    syncs = [e for e in events if e.kind == "runtime" and e.name in names.SYNC_CALLS]
    if syncs:
        starts = [by_id.get(e.linked) for e in syncs]
    else:
        starts = [e for e in events if e.kind == "op" and e.name in names.ITEM]
    for op in starts:
        outermost = None
        while op is not None:
            if op.name in names.READS:
                outermost = op
            op = op.parent
        if outermost is not None and outermost.line is not None and id(outermost) not in found:
            found.add(id(outermost))
            reads[(outermost.line, names.READS[outermost.name])] += 1
    out = []
    for (line, what), n in reads.most_common():
        if n > runs:
            where = line_names.get(line, (line, ""))[0]
            where = f"line {where}" if where.isdigit() else where
            per_run = "" if runs == 1 else f" in {plural(runs, 'run')}"
            out.append(f"{what} {plural(n, 'time')} on {where}{per_run} (a loop: each waits "
                       "for the device)")
    return out
