"""What `%%profile` shows: `ProfileReport`, its overview, tables and advice, as text and HTML."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..advice.profile_rules import Advice
from ..kineto import names, peaks
from ..kineto.analysis import Analysis, KernelRow, LineRow, OpRow
from ..measure import Measurement
from ..reports import Table
from ..units import fmt_bytes, fmt_flops, fmt_seconds, plural
from .lines import LoopSteps
from .traces import LARGE_BYTES

FULL_EVENTS = 2_000_000  # a capture recording more is not offered as --steps 0 (ours: about
# 1 GiB of kineto's record and a trace of several hundred MB)


# --- the report ---------------------------------------------------------------------------


@dataclass
class ProfileReport:
    """What `%%profile` shows, as data: the overview's figures and the three tables.

    `profiler` is torch's own `torch.profiler.profile` object, for `key_averages()`.
    """

    label: str
    runs: int
    wall_s: float
    measurement: Measurement | None
    analysis: Analysis
    trace_path: str | None
    plain_wall_s: float | None = None  # a plain run of the same code, where one is known
    plain_from: str | None = None  # where that figure comes from
    partial: str | None = None  # why the profile is partial (the cell raised)
    notes: list[str] = field(default_factory=list)
    profiler: Any = None
    timeline: Any = None  # the --memory timeline
    sort: str = "self"
    trace_bytes: int = 0
    trace_temporary: bool = False  # the session's file, replaced by the next capture's
    loops: list[LoopSteps] = field(default_factory=list)  # the cell's outer loops that ran
    full_steps: int = 0  # each loop's steps recorded after its first (0: all: nothing left out)
    events: int = 0  # the events read
    step_events: int = 0  # of them, those of the windowed loops' steps recorded in full
    advice: list[Advice] = field(default_factory=list)  # what to change (advice)
    # under the steps window: the counted FLOPs of a recorded step of the windowed loops
    flops_per_step: float | None = None
    claim: peaks.Claim | None = None  # the MFU claimed, or why none (kineto.peaks.claim)
    # --- the ranks a launcher started in the cell (issue 40) ---
    ranks: list[Any] = field(default_factory=list)  # ranks.RankRecord, one per rank back
    straggler: int | None = None  # the rank that the others wait for, if any
    ranks_table: Table | None = None  # a row per rank, the straggler's line, the folder

    @property
    def mfu(self) -> float | None:
        """The counted FLOP/s over the device's dense peak; None where not claimed (the
        CPU, a GPU not in the table, compiled code's uncounted work): the overview says why."""
        return self.claim.mfu if self.claim is not None else None

    @property
    def peak_flops(self) -> peaks.Peak | None:
        """The peak the MFU was claimed against: the table's row (or yours), its precision,
        its figure in FLOP/s, why the row was assumed where the name did not say."""
        return self.claim.peak if self.claim is not None else None

    @property
    def flops(self) -> int:
        """The counted floating-point operations of what was recorded."""
        return self.analysis.work.flops

    @property
    def flops_per_second(self) -> float | None:
        """The counted FLOPs over the wall they were recorded in (the recorded wall where
        a loop's steps were left out); None where nothing was counted."""
        return _rate(self.analysis, self.wall_s)

    @property
    def ops(self) -> list[OpRow]:
        return self.analysis.ops

    @property
    def kernels(self) -> list[KernelRow]:
        return self.analysis.kernels

    @property
    def lines(self) -> list[LineRow]:
        return self.analysis.lines

    def overview(self) -> str:
        a = self.analysis
        runs = plural(self.runs, "run")
        wall = f"wall {fmt_seconds(self.wall_s)}"
        if self.runs > 1:
            wall += f" ({fmt_seconds(self.wall_s / self.runs)} a run)"
        if self.plain_wall_s:
            wall += (f", {self.wall_s / self.runs / self.plain_wall_s:.2f}x the plain run "
                     f"({fmt_seconds(self.plain_wall_s)}, {self.plain_from})")
        parts = [f"%%profile {self.label}: {runs}, {wall}"]
        if self.full_steps:
            parts.append(f"recorded in full (ops, memory, trace): {self._recorded()}, each "
                         "line's first run and the code outside the loops; lines timed over "
                         "every step")
        device = self.measurement.device if self.measurement is not None else None
        if a.device_recorded and a.device_busy_s is not None:
            covered = a.recorded_s or self.wall_s  # the wall the events cover
            of = "the recorded wall" if a.recorded_s else "the wall"
            share = a.device_busy_s / covered if covered else 0.0
            parts.append(f"{device or 'device'} busy {fmt_seconds(a.device_busy_s)} "
                         f"({share:.0%} of {of})")
            parts.append(f"{a.launches:,} kernel launch{'' if a.launches == 1 else 'es'}")
            size = _copies_size(a.copy_bytes, a.copies_unsized)
            parts.append(f"{a.copies:,} host-device cop{'y' if a.copies == 1 else 'ies'}{size}")
            parts.append(plural(a.syncs, "synchronisation"))
        parts.append(plural(a.op_calls, "op call"))
        if self.flops:
            parts.append(self._work())
            if self.claim is not None and self.claim.text:  # the MFU, or why none
                parts.append(self.claim.text)
        if self.trace_path is not None:
            said = [fmt_bytes(self.trace_bytes)] if self.trace_bytes >= LARGE_BYTES else []
            said += ["until the next %%profile"] if self.trace_temporary else []
            parts.append(f"trace {self.trace_path}" + (f" ({', '.join(said)})" if said else ""))
        return " | ".join(parts)

    def _work(self) -> str:
        """'0.67 GFLOP in 20 matmuls, 41.2 GFLOP/s', and under the steps window a step's."""
        work = self.analysis.work
        kinds = {names.FLOP_KINDS.get(name, "counted op") for name in work.by_op}
        kind = kinds.pop() if len(kinds) == 1 else "counted op"
        said = f"{fmt_flops(work.flops)} in {plural(work.ops, kind)}"
        rate = self.flops_per_second
        if self.full_steps:
            step = (f"{fmt_flops(self.flops_per_step)} a step of the loop, "
                    if self.flops_per_step else "")
            return (f"{step}{said} recorded, {fmt_flops(rate or 0, True)} over the recorded "
                    f"wall")
        return f"{said}, {fmt_flops(rate or 0, True)}"

    def tables(self) -> list[Table]:
        a = self.analysis
        device = a.device_recorded
        notes = list(self.notes) + [f"stall: {s}" for s in a.stalls]
        out = [Table(self.overview(), [], [], notes)]
        if self.partial is not None:
            out.insert(0, Table(f"PARTIAL: {self.partial}", [], []))
        if a.lines:
            out.append(self._line_table())
        counted = bool(self.flops)
        head = _timed(["op", "calls", "self CPU", "total CPU"], "device", device,
                      ["allocated", *(["FLOPs"] if counted else []),
                       "input shapes (most frequent)"])
        rows = [_timed([r.name, r.calls, fmt_seconds(r.self_cpu_s), fmt_seconds(r.total_cpu_s)],
                       fmt_seconds(r.device_s), device,
                       [_bytes(r.allocated_bytes),
                        *([fmt_flops(r.flops) if r.flops else ""] if counted else []),
                        r.shapes or "-"])
                for r in a.ops]
        sort = "self" if self.sort == "device" and not device else self.sort  # as sorted
        out.append(Table(f"top ops by {_SORT_WORDS[sort]}", head, rows))
        if a.kernels:
            out.append(Table(
                "top kernels by device time", ["kernel", "calls", "device", "launched by"],
                [[_short(k.name), k.calls, fmt_seconds(k.device_s), k.launched_by]
                 for k in a.kernels],
            ))
        if self.timeline is not None:
            out.append(self.timeline)
        if self.ranks_table is not None:  # the ranks a launcher started (issue 40)
            out.append(self.ranks_table)
        if self.advice:
            out.append(Table("advice", [], [], [a.text for a in self.advice]))
        return out

    def _line_table(self) -> Table:
        a = self.analysis
        device = a.device_recorded
        counted = bool(self.flops)
        head = _timed(["line", "hits", "wall", "torch CPU"], "device", device,
                      ["allocated", *(["FLOP/s"] if counted else []), "code"])
        rows = [_timed([r.where, r.hits, fmt_seconds(r.wall_s), fmt_seconds(r.cpu_s)],
                       fmt_seconds(r.device_s), device,
                       [_bytes(r.allocated_bytes),
                        *([_per_second(r.flops_per_second)] if counted else []), _short(r.code)])
                for r in a.lines]
        notes = []
        if self.full_steps:
            notes.append(f"hits and wall: every step; torch CPU{', device' if device else ''} "
                         f"and allocated: {self._recorded()}, each line's first run and the "
                         f"code outside the loops; {self._more()}")
        if counted:
            notes.append("FLOP/s: a line's counted FLOPs over its ops' "
                         f"{'device' if device else 'CPU'} time, of what was recorded")
        slowest = self.slowest_line()
        if slowest is not None and self.wall_s:
            notes.append(f"slowest: line {slowest.where}, {slowest.wall_s / self.wall_s:.0%} of "
                         f"the wall: {_short(slowest.code)}")
        return Table("by line (each event goes to the innermost line of the cell running)",
                     head, rows, notes)

    @property
    def steps(self) -> int:
        """The steps of the cell's outer loops, all runs together."""
        return sum(sum(loop.steps) for loop in self.loops)

    def _recorded(self) -> str:
        """'steps 1–6 (of 2,000) of the loop on line 5, all 7 of the loop on line 1', and
        with -n 3: '1–6 of each of 3 runs (20 each, 60 in all)'"""
        said = []
        for loop in self.loops:
            total, most = sum(loop.steps), max(loop.steps, default=0)
            if most <= self.full_steps + 1:
                said.append(f"all {total:,} of the loop on line {loop.line}")
                continue
            if len(loop.steps) == 1:
                each, of = "", f"of {total:,}"
            else:  # not "(of 60)" for 3 runs of 20: nobody ran a loop of 60
                each = f" of each of {len(loop.steps)} runs"
                of = (f"{most:,} each, " if min(loop.steps) == most else "") + f"{total:,} in all"
            said.append(f"1–{self.full_steps + 1}{each} ({of}) of the loop on line {loop.line}")
        return "steps " + ", ".join(said)

    def _more(self) -> str:
        """What recording more steps would cost: a step's events (those of the windowed
        loops' steps recorded in full, a step) times the steps left out."""
        windowed = [s for loop in self.loops for s in loop.steps if s > self.full_steps + 1]
        per_step = self.step_events / max(len(windowed) * (self.full_steps + 1), 1)
        left = sum(windowed) - len(windowed) * (self.full_steps + 1)
        every = self.events + per_step * left
        trace = (f", a trace of about {fmt_bytes(int(self.trace_bytes / self.events * every))}"
                 if self.events and self.trace_bytes else "")
        cost = (f"--steps N records the first step and N more (about {per_step:,.0f} events a "
                f"step); every step would be about {every:,.0f} events{trace}")
        if every > FULL_EVENTS:
            rest = self.events - self.step_events  # recorded whatever the steps
            fits = max(int((FULL_EVENTS - rest) / max(per_step, 1) / max(len(windowed), 1)) - 1,
                       self.full_steps)
            return f"{cost}: too many, --steps {fits:,} stays within {FULL_EVENTS:,}"
        return f"{cost}: --steps 0"

    def slowest_line(self) -> LineRow | None:
        return max(self.lines, key=lambda r: r.wall_s, default=None)

    def __str__(self) -> str:
        return "\n\n".join(t.text() for t in self.tables() if hasattr(t, "text"))

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        parts = []
        for t in self.tables():
            bundle = t._repr_mimebundle_()
            parts.append(bundle.get("text/html") or bundle["text/plain"])
        return {"text/plain": str(self), "text/html": "".join(parts)}


_SORT_WORDS = {"self": "self CPU time", "total": "total CPU time", "device": "device time",
               "memory": "memory allocated"}


def _timed(lead: list, device_cell: object, device: bool, rest: list) -> list:
    """A row (or header) of the op and line tables: the device column only where the
    device's activity was recorded."""
    return [*lead, *([device_cell] if device else []), *rest]


def _per_second(per_second: float | None) -> str:
    return fmt_flops(per_second, True) if per_second else ""


def _rate(a: Analysis, wall_s: float) -> float | None:
    """The counted FLOPs over the wall they were recorded in."""
    covered = a.recorded_s or wall_s
    return a.work.flops / covered if a.work.flops and covered else None


def mfu_claim(a: Analysis, wall_s: float, cuda: bool,
              yours: float | dict[str, float] | None = None) -> peaks.Claim:
    """The MFU of a capture's counted work (kineto.peaks.claim), on the device CUDA has now
    where it was in use (nothing starts it), with torch's TF32 switches as the cell left
    them; `yours`: TorchDeviceMagics.peak_flops."""
    import torch

    return peaks.claim(a.work, _rate(a, wall_s), peaks.device() if cuda else None,
                       tf32_matmul=peaks.tf32_matmul(),
                       tf32_conv=bool(torch.backends.cudnn.allow_tf32), yours=yours,
                       compiled_kernels=a.compiled_kernels, compiled_calls=a.compiled_calls)


def _bytes(n: int | None) -> str:
    return fmt_bytes(n) if n else "-"


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _copies_size(known: int | None, unsized: int) -> str:
    """The copies' bytes for the overview, and how many of them are of unknown size."""
    if known is None:
        return " (size unknown)"
    return f" ({fmt_bytes(known)}" + (f"; {unsized:,} of unknown size)" if unsized else ")")
