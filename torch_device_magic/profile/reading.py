"""What a capture's recording says before any advice: its events on one clock, their
analysis (`kineto.analysis`) over every step the tracer timed, the notes on what the
profile lacks, the trace file and the memory timeline (`read`)."""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from ..errors import first_sentence
from ..kineto.analysis import Analysis, analyse
from ..kineto.events import Event
from ..probes import cuda_built, nvml_gpu_count, runtime_up
from ..units import fmt_seconds, plural
from .capture import Options, Recorded
from .lines import SAMPLE_S, LineTracer
from .recording import ALL_THREADS, Pieces
from .stderr import quiet_stderr
from .traces import TraceFiles

_log = logging.getLogger(__name__)


@dataclass
class Read:
    """A capture's recording, read: what the report and the advice are made of."""

    events: list[Event]
    sessions: list[list[Event]]  # each profiler session's events
    analysis: Analysis
    wall_s: float
    notes: list[str] = field(default_factory=list)
    trace_path: str | None = None
    trace_bytes: int = 0
    timeline: Any = None  # --memory's


def read(
    recorded: Recorded, options: Options, cell_file: str, source: str, label: str,
    traces: TraceFiles,
) -> Read:
    """Read `recorded`: the events, their analysis, the notes, the trace written (to
    `options.trace`, else `traces`' one kept file), the memory timeline with --memory."""
    tracer, measured, cuda = recorded.tracer, recorded.measured, recorded.cuda
    pieces = Pieces(recorded.recording.pieces, recorded.recording.to_end)
    sessions = pieces.events()
    events = [e for session in sessions for e in session]
    names = tracer.names if tracer is not None else {}
    in_use = cuda or (measured is not None and measured.device is not None)
    analysis = analyse(events, names, runs=options.runs, sort=options.sort, top=options.top,
                       device_in_use=in_use)
    wall = measured.wall_s if measured is not None else max(
        (e.end_ns for e in events), default=0) / 1e9
    if tracer is not None and tracer.windowed:
        analysis.lines = tracer.rows(analysis.lines)
    if tracer is not None and tracer.left_out:
        # what the events cover: the wall less the pauses and the profiler's switches
        analysis.recorded_s = max(wall - (tracer.paused_ns + tracer.switch_ns) / 1e9, 0.0)
    notes = _device_notes(analysis, events, recorded.heard, cuda)
    if tracer is not None and tracer.samples is not None:
        notes.append(_sampled(tracer.samples))
    notes.extend(_first_start(recorded.recording.first_start_s))
    if not cuda and runtime_up("cuda"):
        notes.append("CUDA started in this cell, after recording began: its device "
                     "activity is not in this profile (run the cell again, or --warmup 1, "
                     "which runs it once more first: either way a training cell trains once "
                     "more)")
    if options.sort == "device" and not analysis.device_recorded:
        notes.append("--sort device: no device activity was recorded, so by self CPU time")
    notes.extend(_thread_notes(events, tracer, options.threads))
    if recorded.plain_wall_s is None and recorded.plain_from and recorded.partial is None:
        notes.append(recorded.plain_from)
    out = Read(events, sessions, analysis, wall, notes)
    out.trace_path, out.trace_bytes = _write_trace(pieces, options.trace, label, traces, notes)
    if options.memory:
        out.timeline = _timeline(pieces, recorded.recorder, cell_file, source, notes)
    return out


def _timeline(prof: Any, recorder: Any, cell_file: str, source: str, notes: list[str]) -> Any:
    """The memory timeline: the CUDA allocator's history where CUDA was used, else the
    profiler's memory events."""
    from . import memtimeline

    try:
        timeline = recorder.timeline() if recorder is not None else None
        if timeline is None:
            timeline = memtimeline.from_profiler(prof, cell_file, source)
    except Exception as err:  # ours: the profile itself is still shown
        _log.debug("the memory timeline failed", exc_info=True)
        notes.append(f"the memory timeline could not be drawn: {first_sentence(err, True)}")
        return None
    return timeline


def _write_trace(
    prof: Pieces, asked: str | None, label: str, traces: TraceFiles, notes: list[str]
) -> tuple[str | None, int]:
    """Write the trace: the path and its size. kineto says a failure only on stderr, so
    the file is opened here first, and kineto's lines are caught like its others. An
    unnamed trace goes to the session's one kept file (`traces`)."""
    path = asked
    try:
        path = traces.new(label) if path is None else os.path.expanduser(path)
        with open(path, "w"):
            pass
        with quiet_stderr([]):
            prof.export_chrome_trace(path)
        size = os.path.getsize(path)
        if not size:
            raise OSError("kineto wrote nothing")
    except (OSError, RuntimeError, ValueError) as err:
        if asked is None:
            traces.clear()
        why = getattr(err, "strerror", None) or err
        notes.append(f"the trace could not be written to {path}: {why}")
        return None, 0
    return path, size


FIRST_START_S = 0.1  # a first start that took less says nothing worth a line


def _first_start(seconds: float | None) -> list[str]:
    """The line that says the one-time start of torch's profiler, where this capture made it
    (the per-cell time says "(profiled)" and includes it; the wall above does not)."""
    if seconds is None or seconds < FIRST_START_S:
        return []
    where = "kernel" if "ipykernel" in sys.modules else "session"
    return [f"{fmt_seconds(seconds)} of this cell's time was torch's profiler starting for the "
            f"first time in this {where} (once: its imports)"]


def _sampled(taken: int) -> str:
    """What the line table's wall is past the steps window: how it was had."""
    if not taken:
        how = "shared out as in the timed steps (no sample fell there)"
    else:
        how = (f"from {plural(taken, 'sample')} of the main thread, one every "
               f"{SAMPLE_S * 1e3:.0f} ms (a line's share of that time to about "
               f"±{50 / math.sqrt(taken):.0f}%)")
    return f"lines' wall past the recorded steps (their hits counted there): {how}"


def _thread_notes(events: list[Event], tracer: LineTracer | None, threads: bool) -> list[str]:
    """What the profile lacks for threads: their ops (without --threads), or memory (with)."""
    if threads:
        if any(e.kind == "memory" for e in events):
            return []
        return ["--threads: this torch records no memory allocations when it records every "
                "thread (pytorch issue 166121)"]
    started = tracer.threads_started if tracer is not None else 0
    if not started:
        return []
    how = ("--threads records them, without memory allocations" if ALL_THREADS is not None
           else "this torch cannot record them: its profiler has no profile_all_threads")
    return [f"the cell started {plural(started, 'thread')}: their ops are not in this "
            f"profile ({how})"]


# torch.profiler's start asks `at::hasCUDA()`, whatever it records: cudaGetDeviceCount,
# which initialises the CUDA driver (cuInit), and a forked child cannot use CUDA after that.
_DRIVER_STARTED = (
    "no kernel recorded: CUDA was not up when recording began; torch's profiler initialised "
    "the CUDA driver as it started, so a process forked from this kernel can no longer use "
    "CUDA (notebook_launcher, ddp_notebook: launch before %%profile, or use spawn)"
)


def _device_notes(
    analysis: Analysis, events: list[Event], heard: list[str], cuda: bool
) -> list[str]:
    """One line where CUDA was up but its activity could not be recorded, or where it was
    not, on a GPU, and the cell did not start it: torch's profiler started the driver."""
    if not cuda:
        driver = not runtime_up("cuda") and cuda_built() and (nvml_gpu_count() or 0) > 0
        return [_DRIVER_STARTED] if driver else []
    if analysis.device_recorded:
        return []
    said = "\n".join(heard)
    on_device = any(e.kind == "memory" and e.on_device for e in events)
    if "CUPTI" in said or "disabling CUDA profiling" in said or on_device:
        why = ("CUPTI_ERROR_INSUFFICIENT_PRIVILEGES" if "INSUFFICIENT_PRIVILEGES" in said
               else "this torch cannot profile CUDA" if "disabling CUDA profiling" in said
               else "CUPTI missing or refused")
        return [f"the device's activity could not be recorded ({why}): the CPU side only"]
    return []
