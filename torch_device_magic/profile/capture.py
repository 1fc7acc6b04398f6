"""One `%%profile` capture: the cell run under the recording and the line tracer, Ctrl-C
held while they start and stop. It returns what it recorded (`Recorded`); the analysis,
the advice and the report come after it (`compose`).

    In [5]: %%profile
       ...: loss = loss_fn(model(x), y)
       ...: loss.backward()
    %%profile In[5]: 1 run, wall 3.1 ms | 64 op calls | trace /tmp/tdm-profile-In5-....json
    by line (each event goes to the innermost line of the cell running)
    line  hits    wall  torch CPU  allocated  code
    ...

Attribution. While the profiler records, a line tracer (`line_events`:
`sys.monitoring` on Python 3.12+, `sys.settrace` before; it hears only frames of
the cell's own code and of the functions `-f` names) opens a `record_function`
range for each line as it starts and closes it when the next line starts or the
frame returns. The
ranges nest as the frames do, so the innermost range open at any moment is the
innermost line of the cell running then; an event (an op, an allocation,
backward work on another thread, with `--threads` an op of a thread the cell
started) goes to the line whose range was innermost when it started, a kernel
to the line of the op that launched it. The tracer also counts the threads the
cell starts (`threading.settrace`, once a thread), so that without `--threads`
the overview says their ops are missing. The ranges
are in the trace too, named by their line. A traced line costs about a µs
past the steps window, where no range is opened (docs/profile.md, "How lines are
timed over every step"; `bench/bench_profile_shapes.py` measures it); frames of
other code pay one call of the tracer each under `sys.settrace`, and under
`sys.monitoring` one per place in their code, the first time it runs.

A long loop. Where the cell has loops at its top level, the tracer counts each
loop's steps, each time it is entered, and pauses the profiler (its session stopped
and kept) as a loop's 7th step begins (`--steps`), resuming it (a new session) where
the code outside the loop runs, and for a line's first run wherever it falls; it
times every line of every step itself. So the capture (kineto's record, the events
read, the trace) is bounded whatever the number of steps, the code outside the loops
is recorded in full, and the lines' hits and wall still cover every step. The report
reads every session on one clock; the pauses and resumes are charged to no line.

Figures are read from kineto's own events (`kineto_results.events()`), not
from torch's `key_averages()`, which builds a Python object per event; the raw
profiler stays available for that (`-o`). Nothing here keeps a user's tensor:
the events hold shapes and names only.

The profiler records CUDA only where CUDA was already up when recording began
(a warm-up that starts it counts), so a cell that never touched CUDA starts no
context. torch's profiler initialises the CUDA driver as it starts, whatever it
records, and no forked child can use CUDA after that: on a GPU where CUDA was
not up, the profile says so. Where CUDA ran but no device event came (CUPTI
missing or refused), the overview says so and the device columns are left out,
never zeros.
kineto writes `profiler_start` / `profiler_stop` lines to the process's stderr:
descriptor 2 is caught only while we call torch to start and to stop, those
lines dropped and whatever else was written there passed on. The cell runs with
the real stderr, so a child it forks or spawns keeps it, and a fatal error's
last words reach it. torch's allocator warns there once per 1,000 frees of a
block made before the start; that warning is spent while the start is caught.

The cell's own torch.profiler (or a library's) ends our kineto session, and a
session something else ended must be neither stopped nor read (exporting one
crashed the process): the cell then runs as without us and gets no profile,
said in one line. Ctrl-C reaches the cell's run only; one while the profiler
starts or stops waits until that is done.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import DeviceMagicError
from ..measure import Measurement, Meter
from ..probes import clock, runtime_up
from .ctrl_c import ctrl_c_held
from .lines import LineTracer, first_line
from .recording import ALL_THREADS, Recording, _profiler, sync

_log = logging.getLogger(__name__)

SORTS = ("self", "total", "device", "memory")


@dataclass(slots=True)
class Options:
    """What `%%profile`'s line asked for, checked."""

    runs: int = 1
    warmup: int = 0
    sort: str = "self"
    top: int = 10
    trace: str | None = None
    memory: bool = False  # the memory timeline (memtimeline)
    threads: bool = False  # record every thread (the threads the cell starts), not memory
    lines: bool = True  # the line table (off only to measure its cost)
    steps: int = 5  # the cell's outer loop: steps recorded in full after the first (0: all)

    def check(self) -> None:
        if self.runs < 1 or self.warmup < 0:
            raise DeviceMagicError("%%profile needs -n 1 or more and --warmup 0 or more")
        if self.sort not in SORTS:
            raise DeviceMagicError(
                f"%%profile --sort takes {', '.join(SORTS)}, not {self.sort!r}"
            )
        if self.top < 1:
            raise DeviceMagicError("%%profile --top needs 1 or more")
        if self.threads and ALL_THREADS is None:
            raise DeviceMagicError(
                f"%%profile --threads: torch {torch.__version__} cannot record other threads "
                "(its profiler has no profile_all_threads)"
            )
        if self.threads and self.memory:
            raise DeviceMagicError(
                "%%profile --threads --memory: torch records no memory allocations while it "
                "records every thread (pytorch issue 166121); profile the memory without "
                "--threads, the other threads' ops without --memory"
            )
        if self.steps < 0:
            raise DeviceMagicError("%%profile --steps needs 1 or more (or 0: every step)")
        if self.trace is not None:
            _check_trace(self.trace)


def trace_folder(trace: str | None) -> str | None:
    """Where `--trace` names a folder that exists: that folder, for the traces of the ranks
    a launcher starts in the cell (the cell's own goes to the session's temporary file),
    checked writable before the cell runs; None where it names a file (or nothing)."""
    path = os.path.expanduser(trace or "")
    if not trace or not os.path.isdir(path):
        return None
    if not os.access(path, os.W_OK | os.X_OK):
        raise DeviceMagicError(f"%%profile --trace {trace}: that folder cannot be written "
                               "(no permission)")
    return path


def _check_trace(trace: str) -> None:
    """A trace file's path, checked before the cell runs: a file name in a folder that
    exists and that we may write in (a folder itself is `trace_folder`'s)."""
    if not trace.strip():
        raise DeviceMagicError("--trace needs a file name, e.g. --trace step.json")
    path = os.path.expanduser(trace)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise DeviceMagicError(f"%%profile --trace {trace}: there is no folder {folder} "
                               "(make it first)")
    if not os.access(folder, os.W_OK | os.X_OK) or (
            os.path.exists(path) and not os.access(path, os.W_OK)):
        raise DeviceMagicError(f"%%profile --trace {trace}: it cannot be written "
                               "(no permission)")


@dataclass
class Recorded:
    """What one capture recorded, for the analysis: the profiler's sessions (`recording`),
    the line tracer, the measurement (None where the cell did not finish), what kineto
    and torch said (`heard`), and the plain run the warm-ups timed."""

    recording: Recording
    tracer: LineTracer | None
    measured: Measurement | None
    heard: list[str]
    cuda: bool  # CUDA was up as recording began: its activity is recorded
    recorder: Any = None  # --memory's CUDA allocator history
    partial: BaseException | None = None  # the cell raised (or Ctrl-C): recorded up to there
    plain_wall_s: float | None = None
    plain_from: str | None = None
    mark: Any = None  # what `Capture.mark` returned just before recording began


@dataclass
class Capture:
    """One `%%profile`: the settings, the cell, and where its lines are."""

    run: Callable[[], Any]
    cell_file: str
    label: str
    options: Options = field(default_factory=Options)
    functions: Sequence[tuple[Any, str]] = ()  # -f: (function, its label)
    plain_wall_s: float | None = None  # a plain run of the same code, where one is known
    plain_from: str | None = None  # where that figure comes from; without one, why none
    source: str = ""  # the cell's code, for the memory timeline's labels
    loops: dict[int, range] = field(default_factory=dict)  # outer_loops(the cell's code)
    # called after the warm-ups, as recording begins (torch.compile's records so far)
    mark: Callable[[], Any] | None = None

    def __call__(
        self, on_partial: Callable[[Recorded], None]
    ) -> tuple[Recorded | None, Any]:
        """Run the cell profiled; what was recorded (None, said in one line, where there
        is nothing to read) and the last run's value. If the cell raises (or Ctrl-C), what
        was recorded up to there goes to `on_partial` before the error propagates; the
        profiler is stopped either way."""
        __tracebackhide__ = True
        opts = self.options
        for i in range(opts.warmup):
            t0 = clock()
            self.run()
            if i == opts.warmup - 1:  # the best plain figure: just now, same code
                sync()
                if i or self.plain_from is not None:  # warm: a run of this code came before
                    self.plain_wall_s, self.plain_from = clock() - t0, "the last warm-up"
                else:  # maybe the code's first run, whose one-time costs would mislead
                    self.plain_from = ("no plain run to compare with: the one warm-up may have "
                                       "been this code's first run (--warmup 2 compares, "
                                       "running the cell twice more: side effects too)")
        cuda = runtime_up("cuda")  # read after the warm-ups: one may have started it
        mark = self.mark() if self.mark is not None else None  # the cell's come after
        heard: list[str] = []
        prof = _profiler(cuda, opts.threads)
        recording = Recording(prof, heard, cuda)
        tracer = LineTracer(
            self.cell_file, self.label, self.functions, self.loops,
            opts.steps if self.loops else 0, recording, first_line(self.source),
        ) if opts.lines else None
        recording.stop_tracer = tracer.stop if tracer is not None else None
        meter = Meter(sync=True)
        value = measured = recorder = None

        def recorded(partial: BaseException | None = None) -> Recorded:
            return Recorded(recording, tracer, measured, heard, cuda, recorder, partial,
                            self.plain_wall_s, self.plain_from, mark)

        # Ctrl-C ends the cell's run only: starting and stopping the profiler (and the
        # tracer) are never cut in half, and a press there is delivered once they are done.
        with ctrl_c_held() as ctrl_c:
            recording.start()
            try:
                prof.add_metadata_json("distributedInfo", json.dumps(
                    {"backend": "none", "rank": 0, "world_size": 1}))
                # --memory's setup (its first import) and its snapshot stay out of the wall
                with _memory(self.cell_file, opts.memory) as recorder:
                    meter.start()
                    if tracer is not None:
                        tracer.start()
                    try:
                        with ctrl_c.let_through():
                            for _ in range(opts.runs):
                                value = self.run()
                    finally:
                        if tracer is not None and not recording.paused:
                            tracer.stop()
                    measured = meter.stop()
            except BaseException as err:
                ended = recording.stop()
                meter.close()
                if ended is not None:
                    print(ended)
                    raise
                try:  # a second Ctrl-C may cut the partial report short
                    with ctrl_c.let_through():
                        on_partial(recorded(err))
                except Exception:  # ours: the cell's own error is the one to see
                    _log.debug("the partial profile could not be made", exc_info=True)
                # the traceback keeps this frame, not the record
                prof = tracer = recorder = recording = None  # type: ignore[assignment]
                raise
            ended = recording.stop()
            meter.close()
        if ended is not None:
            print(ended)
            return None, value
        return recorded(), value


@contextlib.contextmanager
def _memory(cell_file: str, on: bool) -> Iterator[Any]:
    """With --memory, the CUDA allocator's history for the block (None where not asked)."""
    if not on:
        yield None
        return
    from . import memtimeline

    with memtimeline.recording(cell_file) as recorder:
        yield recorder
