"""What a rank recorded, in figures (`figures`, in the rank), its summary file, and what
the launching process makes of them (`RankRecord`, `read_ranks`, `straggler`, `table`).

A step is one step of the rank's outer loop (`ProfilerStep#N` in its trace). Its
collective share is the part of the step during which a collective (all_reduce,
all_gather, broadcast, …: torch's `c10d::` ops, gloo's and NCCL's own ranges and kernels)
was in flight or waited for; what is left is the rank's own work."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from ...advice.thresholds import (
    STRAGGLER_LATE_S,
    STRAGGLER_LATE_STEPS,
    STRAGGLER_MIN_S,
    STRAGGLER_RATIO,
    STRAGGLER_STEPS_SHARE,
)
from ...reports import Table
from ...units import fmt_bytes, fmt_seconds

COLLECTIVES = ("c10d::", "gloo:", "nccl:", "nccl", "record_param_comms")  # name prefixes
_SUFFIX = ".tdm-summary"  # not .json: HTA reads every .json of the folder as a trace


def figures(pieces: Any) -> dict[str, Any]:
    """The recorded steps' figures from the rank's sessions (`recording.Pieces`): their
    collective share, each step's own work (outside collectives) and, where the device
    was recorded, its busy share."""
    sessions = pieces.events()
    events = [e for s in sessions for e in s]
    steps = sorted((e.start_ns, e.end_ns) for e in events
                    if e.kind == "op" and e.name.startswith("ProfilerStep#"))
    comms = [(e.start_ns, e.end_ns) for e in events if e.kind in ("op", "kernel")
             and e.name.startswith(COLLECTIVES)]
    comms += _async_collectives(pieces)  # gloo's ranges are async: not in `events`
    device = [(e.start_ns, e.end_ns) for e in events if e.kind in ("kernel", "memcpy", "memset")]
    total = sum(b - a for a, b in steps)
    waits = [_covered(comms, a, b) for a, b in steps]
    busy = sum(_covered(device, a, b) for a, b in steps)
    return {
        "recorded_steps": len(steps),
        "collective_share": sum(waits) / total if total else None,
        "own_times": [(b - a - w) / 1e9 for (a, b), w in zip(steps, waits)],
        "device_busy": busy / total if total and device else None,
    }


def _async_collectives(pieces: Any) -> list[tuple[int, int]]:
    """The collectives' async ranges (gloo's `gloo:all_reduce`, on its own threads), on
    the first session's clock as `Pieces.events` puts the rest."""
    if not pieces.pieces:
        return []
    origin = pieces.pieces[0].kineto_results.trace_start_ns()
    return [(e.start_ns() - origin, e.end_ns() - origin)
            for piece in pieces.pieces for e in piece.kineto_results.events()
            if e.is_async() and e.name().startswith(COLLECTIVES)]


def _covered(spans: list[tuple[int, int]], start: int, end: int) -> int:
    """How much of [start, end) the spans cover, overlaps counted once."""
    covered, reach = 0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans if b > start and a < end):
        if b > reach:
            covered += b - max(a, reach)
            reach = b
    return covered


def write(folder: str, rank: int, record: dict[str, Any]) -> None:
    with open(os.path.join(folder, f"rank{rank}{_SUFFIX}"), "w") as f:
        json.dump(record, f)


@dataclass
class RankRecord:
    """One rank, as the report shows it (`-o`: `report.ranks`)."""

    rank: int
    steps: int  # the steps of its outer loop that ran (each timed)
    step_times: list[float]  # each step's wall, s
    collective_share: float | None  # of the recorded steps, in collectives or waiting
    peak: int | None  # bytes: the device's peak allocated on a GPU, else the host's RSS
    trace: str | None  # its trace file
    recorded_steps: int = 0  # the steps recorded in full (the window's)
    device_busy: float | None = None  # on a GPU: the device's busy share of the steps
    ended: str | None = None  # how it ended where it did not return: its exception's name
    world_size: int = 1
    backend: str = "none"
    own_times: list[float] = field(default_factory=list)  # recorded steps less collectives
    first_step_at: float | None = None  # time.time() as its first step began

    @property
    def median_s(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None

    @property
    def slowest_s(self) -> float | None:
        return max(self.step_times, default=None)


def read_ranks(folder: str) -> list[RankRecord]:
    """The summaries the ranks wrote in `folder`, by rank."""
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(_SUFFIX):
            continue
        with open(os.path.join(folder, name)) as f:
            r = json.load(f)
        device = r.get("peak_device")
        out.append(RankRecord(
            rank=r["rank"], steps=len(r["step_times"]), step_times=r["step_times"],
            collective_share=r["collective_share"],
            peak=device if device is not None else r["peak_host"], trace=r["trace"] or None,
            recorded_steps=r["recorded_steps"], device_busy=r["device_busy"], ended=r["ended"],
            world_size=r["world_size"], backend=r["backend"], own_times=r["own_times"],
            first_step_at=r["first_step_at"]))
    return sorted(out, key=lambda r: r.rank)


@dataclass(frozen=True)
class Straggler:
    """The rank the others wait for: by its own work in a step (`late` False: `own_s`
    against the other ranks' median `others_s`) or by its first step starting `lag_s` after
    the others' (`late` True)."""

    rank: int
    late: bool
    own_s: float = 0.0
    others_s: float = 0.0
    lag_s: float = 0.0

    @property
    def line(self) -> str:
        if self.late:
            return (f"straggler: rank {self.rank} starts its steps {fmt_seconds(self.lag_s)} "
                    "after the other ranks")
        return (f"straggler: rank {self.rank}, its own work in a step (outside collectives) "
                f"{fmt_seconds(self.own_s)}, {self.own_s / max(self.others_s, 1e-9):.1f}x the "
                f"other ranks' {fmt_seconds(self.others_s)}: they wait for it")


def straggler(ranks: list[RankRecord]) -> Straggler | None:
    """The rank whose steps are consistently slower (its own work, outside collectives:
    in data parallel the others wait for it in theirs, so every rank's wall is alike) or
    that starts its steps later; None where the ranks are even."""
    timed = [r for r in ranks if r.own_times]
    if len(timed) >= 2:
        # the first step aside: its one-time costs (DDP's buckets) are no rank's pace
        own = {r.rank: statistics.median(r.own_times[1:] or r.own_times) for r in timed}
        slow = max(own, key=lambda k: own[k])
        others = statistics.median(v for k, v in own.items() if k != slow)
        step = statistics.median(t for r in timed for t in r.step_times) if all(
            r.step_times for r in timed) else 0.0
        if (own[slow] >= STRAGGLER_RATIO * others
                and own[slow] - others >= max(STRAGGLER_MIN_S, step / 4)
                and _slowest_share(timed, slow) >= STRAGGLER_STEPS_SHARE):
            return Straggler(slow, False, own_s=own[slow], others_s=others)
    started = [r for r in ranks if r.first_step_at is not None and r.step_times]
    if len(started) >= 2:
        late = max(started, key=lambda r: r.first_step_at or 0.0)
        rest = statistics.median(r.first_step_at or 0.0 for r in started if r is not late)
        lag = (late.first_step_at or 0.0) - rest
        step = statistics.median(t for r in started for t in r.step_times)
        if lag >= max(STRAGGLER_LATE_STEPS * step, STRAGGLER_LATE_S):
            return Straggler(late.rank, True, lag_s=lag)
    return None


def _slowest_share(ranks: list[RankRecord], slow: int) -> float:
    """In how many of the recorded steps (after the first) rank `slow`'s own work was the
    slowest of all ranks': 'consistently slower', not a few steps a busy machine stretched."""
    by_rank = {r.rank: r.own_times[1:] for r in ranks}
    steps = min(len(t) for t in by_rank.values())
    if not steps:
        return 1.0  # one recorded step: its median is all there is
    slowest = sum(max(by_rank, key=lambda k: by_rank[k][i]) == slow for i in range(steps))
    return slowest / steps


def table(ranks: list[RankRecord], expected: list[int], folder: str,
          slow: Straggler | None) -> Table:
    """A row per rank; under it the straggler (or that the ranks are even), the ranks that
    did not come back, and the folder of the traces."""
    device = any(r.device_busy is not None for r in ranks)
    head = ["rank", "steps", "median step", "slowest step", "collectives", "peak memory",
            *(["device busy"] if device else [])]
    rows = [[r.rank, f"{r.steps:,}", fmt_seconds(r.median_s), fmt_seconds(r.slowest_s),
             _share(r.collective_share), fmt_bytes(r.peak) if r.peak else "-",
             *([_share(r.device_busy)] if device else [])]
            for r in ranks]
    notes = [slow.line if slow is not None else "the ranks are even"]
    back = {r.rank for r in ranks}
    missing = [k for k in expected if k not in back]
    ended = [f"rank {r.rank} ({r.ended})" for r in ranks if r.ended]
    if missing:
        notes.append("did not come back: " + ", ".join(f"rank {k}" for k in missing)
                     + " (no summary: killed, or ended before its profiler stopped)")
    if ended:
        notes.append("came back but did not finish: " + ", ".join(ended))
    peak = "the device's peak allocated" if device else "the host's peak RSS"
    notes.append(f"steps: each rank's outer loop; collectives: the share of its recorded "
                 f"steps in collectives or waiting for them; peak memory: {peak}")
    notes.append(f"traces: {folder} (one per rank: HTA's TraceAnalysis(trace_dir=...))")
    world = max((r.world_size for r in ranks), default=len(expected))
    title = f"ranks: {len(ranks)} of {max(len(expected), world, len(ranks))} came back"
    return Table(title, head, rows, notes)


def _share(x: float | None) -> str:
    return f"{x:.0%}" if x is not None else "-"
