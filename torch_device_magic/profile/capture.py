"""Where a cell spends its time and memory: the engine of `%%profile`.

    In [5]: %%profile
       ...: loss = loss_fn(model(x), y)
       ...: loss.backward()
    %%profile In[5]: 1 run, wall 3.1 ms | 64 op calls | trace /tmp/tdm-profile-In5-....json
    by line (each event goes to the innermost line of the cell running)
    line  hits    wall  torch CPU  allocated  code
    ...

Attribution. While the profiler records, a line tracer (`sys.settrace`, its
local function installed only in frames of the cell's own code and of the
functions `-f` names) opens a `record_function` range for each line as it
starts and closes it when the next line starts or the frame returns. The
ranges nest as the frames do, so the innermost range open at any moment is the
innermost line of the cell running then; an event (an op, an allocation,
backward work on another thread, with `--threads` an op of a thread the cell
started) goes to the line whose range was innermost when it started, a kernel
to the line of the op that launched it. The tracer also counts the threads the
cell starts (`threading.settrace`, once a thread), so that without `--threads`
the overview says their ops are missing. The ranges
are in the trace too, named by their line. A traced line costs a few µs
(`bench/bench_profile.py` measures it); frames of other code pay one call of
the tracer each.

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

import ast
import contextlib
import gzip
import json
import linecache
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any

import torch

from ..advice import compiles
from ..advice.profile_rules import Advice, advise, data_parallel, read_setting
from ..errors import DeviceMagicError, first_sentence
from ..measure import Measurement, Meter
from ..probes import clock, cuda_built, nvml_gpu_count, runtime_up
from ..units import plural
from .events import LINE_PREFIX, Analysis, Event, LineRow, analyse, from_kineto
from .tables import LoopSteps, ProfileReport
from .traces import TraceFiles

SORTS = ("self", "total", "device", "memory")
_log = logging.getLogger(__name__)
_NOISE = ("profiler_start", "profiler_stop", "Completed Stage:", "ActivityProfilerController",
          "Memory block of unknown size was allocated before the profiling started")


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
        if self.threads and _ALL_THREADS is None:
            raise DeviceMagicError(
                f"%%profile --threads: torch {torch.__version__} cannot record other threads "
                "(its profiler has no profile_all_threads)"
            )
        if self.steps < 0:
            raise DeviceMagicError("%%profile --steps needs 1 or more (or 0: every step)")
        if self.trace is not None and not self.trace.strip():
            raise DeviceMagicError("--trace needs a file name, e.g. --trace step.json")


# --- recording ----------------------------------------------------------------------------


class LineTracer:
    """Opens a profiler range per executed line of the watched code (see the module's
    docstring); `names` maps each range's name to the line's (where, code).

    With `loops` (`outer_loops` of the cell) and a `window`, it also counts the steps of
    each of the cell's outer loops (an iteration begins where a line of its body follows
    its header), each time the loop is entered (`loop_steps`), and keeps the profiler
    recording only where the steps are: it `window.pause()`s the recording as the
    `full_steps + 2`-th step of a loop begins, records a line's first run wherever it
    falls (from its start to the start of the next line of its frame or an outer one),
    and `window.resume()`s where the code outside the loop's steps runs. The profiler's
    own pauses and resumes are charged to no line (`switch_ns`). So that the lines keep
    their figures over every step, it times each line itself too (`hits`, `wall_ns`:
    the time each was the innermost line)."""

    def __init__(
        self, cell_file: str, cell_label: str, functions: Sequence[tuple[Any, str]] = (),
        loops: dict[int, range] | None = None, full_steps: int = 0,
        window: _Recording | None = None, first_line: int = 1,
    ) -> None:
        self.cell_file = cell_file
        self.cell_label = cell_label
        self.codes: dict[CodeType, str] = {}  # -f functions' code objects -> their label
        for fn, label in functions:
            for code in _codes(fn.__code__):
                self.codes[code] = label
        self.names: dict[str, tuple[str, str]] = {}
        self._keys: dict[tuple[str, int], str] = {}
        self._previous: Any = None
        self._previous_threads: Any = None
        self._started: list[int] = []  # one entry per thread started while tracing
        self._range = _range_type()
        self.shift = first_line - 1  # the cell's leading blank lines, which IPython drops
        self.loops = loops or {}
        self.full_steps = full_steps
        self.loop_steps: dict[int, list[int]] = {}  # a loop's header -> steps, each entry
        self.hits: Counter[str] = Counter()
        self.wall_ns: Counter[str] = Counter()
        self._window = window if full_steps else None
        self._recording = True  # the profiler records, and ranges are opened
        self._past = False  # in a loop's steps past the window
        self._first: int | None = None  # the depth of a line's first run being recorded
        self.switch_ns = 0  # the profiler's own pauses and resumes
        self.paused_ns = 0  # the time it did not record
        self._paused_at = 0
        self.left_out = False  # the profiler was paused at least once
        self.cuts: list[int | None] = []  # per pause, the outer loop whose steps ran then
        self._innermost: list[str | None] = []  # per traced frame, its line running
        self._since = 0
        self._header: int | None = None
        self._loop: int | None = None  # the outer loop whose steps run

    @property
    def windowed(self) -> bool:
        """Whether steps were left out of the recording."""
        return self.left_out and any(
            n > self.full_steps + 1 for steps in self.loop_steps.values() for n in steps)

    def loops_run(self) -> list[LoopSteps]:
        """Each outer loop that ran: its header's line and its steps, each time entered."""
        return [LoopSteps(str(line + self.shift), steps)
                for line, steps in sorted(self.loop_steps.items())]

    def loop_lines(self) -> list[tuple[range, int]]:
        """Each outer loop that ran: its lines as the line table numbers them (its header
        to its body's end) and its steps, every entry's together (the advice's)."""
        return [(range(line + self.shift, self.loops[line].stop + self.shift), sum(steps))
                for line, steps in self.loop_steps.items()]

    def step_events(self, pieces: list[list[Event]]) -> int:
        """How many of the events read are of the loops' steps the window recorded in
        full: in each of the profiler's sessions (`pieces`) that a pause ended in a loop's
        steps, its events from that loop's first recorded step on (a session that a
        line's first run past the window ends holds no header of the loop: none)."""
        total = 0
        for piece, loop in zip(pieces, self.cuts):
            header = self._keys.get((self.cell_file, loop)) if loop is not None else None
            starts = [e.start_ns for e in piece if e.kind == "line" and e.name == header]
            if starts:
                first = min(starts)
                total += sum(1 for e in piece if e.start_ns >= first)
        return total

    def rows(self, recorded: list[LineRow]) -> list[LineRow]:
        """The line rows over every step: hits and wall from this tracer, the rest from
        the `recorded` rows (of what the profiler recorded)."""
        by_where = {(r.where, r.code): r for r in recorded}
        out = []
        for name, (where, code) in self.names.items():
            if not self.hits[name]:
                continue
            row = by_where.get((where, code))
            out.append(LineRow(
                where=where, code=code, hits=self.hits[name], wall_s=self.wall_ns[name] / 1e9,
                cpu_s=row.cpu_s if row else 0.0, device_s=row.device_s if row else None,
                allocated_bytes=row.allocated_bytes if row else 0,
            ))
        return out

    def _charge(self) -> None:
        """The time since the last event, to the line that was innermost."""
        now = time.perf_counter_ns()
        if self._innermost and self._innermost[-1] is not None:
            self.wall_ns[self._innermost[-1]] += now - self._since
        self._since = now

    def _count(self, lineno: int) -> None:
        """A line of the cell's top level ran: a step begins where an outer loop's body
        follows the loop's header; a header past the window leaves the steps unrecorded
        from there, and a line outside the loop's steps ends them."""
        if lineno in self.loops:
            if self._loop != lineno:  # entered (again)
                self._loop, self._past = lineno, False
                self.loop_steps.setdefault(lineno, []).append(0)
            elif self.loop_steps[lineno][-1] > self.full_steps:
                self._past = True
            self._header = lineno
            return
        header, self._header = self._header, None
        if self._loop is not None and lineno in self.loops[self._loop]:
            if header == self._loop:
                self.loop_steps[header][-1] += 1
            return
        self._loop, self._past = None, False

    def _switch(self, depth: int, first: bool) -> None:
        """Pause or resume the profiler where the line starting at `depth` asks for it."""
        if first and self._past:
            if self._first is None or depth <= self._first:
                self._first = depth
        elif self._first is not None and depth <= self._first:
            self._first = None
        record = not self._past or self._first is not None
        if record == self._recording or self._window is None:
            return
        t0 = time.perf_counter_ns()
        try:
            with warnings.catch_warnings():  # "Profiler clears events…": as we meant
                warnings.simplefilter("ignore")
                (self._window.resume if record else self._window.pause)()
        except Exception:  # ours: the cell runs on, recorded as far as it was
            _log.debug("the profiler's pause or resume failed", exc_info=True)
            self._window = None
            return
        finally:
            now = time.perf_counter_ns()
            self.switch_ns += now - t0
            self._since = now  # the switch is no line's
        self._recording = record
        if record:
            self.paused_ns += t0 - self._paused_at
        else:
            self._paused_at, self.left_out = now, True
            self.cuts.append(self._loop)

    def _name(self, code: CodeType, lineno: int) -> str:
        key = (code.co_filename, lineno)
        name = self._keys.get(key)
        if name is None:
            if code.co_filename == self.cell_file:
                where = str(lineno + self.shift)
            else:
                where = f"{self.codes.get(code, code.co_name)} {lineno}"
            text = linecache.getline(code.co_filename, lineno).strip()
            name = f"{LINE_PREFIX}{self.cell_label} {where}: {text[:80]}"
            self._keys[key] = name
            self.names[name] = (where, text)
        return name

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code.co_filename != self.cell_file and code not in self.codes:
            return None
        opened: list[Any] = []
        enter, name_of, innermost, hits = self._range, self._name, self._innermost, self.hits
        top = bool(self.loops) and code.co_name == "<module>" and code.co_filename == self.cell_file
        if top:
            self._loop, self._past = None, False  # a run of the cell begins
        self._charge()
        innermost.append(None)

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line" and frame.f_lineno:  # not line 0: a one-expression cell
                name = name_of(frame.f_code, frame.f_lineno)
                self._charge()
                innermost[-1] = name
                ran = hits[name]
                hits[name] = ran + 1
                if opened:
                    opened.pop().__exit__(None, None, None)
                if top:
                    self._count(frame.f_lineno)
                if self._window is not None and (  # a switch is due, or may be
                        not ran or self._first is not None or self._past == self._recording):
                    self._switch(len(innermost), not ran)
                if self._recording:
                    span = enter(name)
                    span.__enter__()
                    opened.append(span)
            elif event == "return":
                self._charge()
                innermost.pop()
                if opened:
                    opened.pop().__exit__(None, None, None)
            return local

        return local

    def start(self) -> None:
        self._previous = sys.gettrace()
        self._previous_threads = threading.gettrace()
        self._since = time.perf_counter_ns()
        sys.settrace(self._call)
        threading.settrace(self._thread)

    def stop(self) -> None:
        if not self._recording:  # paused to the end
            self.paused_ns += time.perf_counter_ns() - self._paused_at
            self._recording = True
        sys.settrace(self._previous)
        threading.settrace(self._previous_threads)
        self._previous = self._previous_threads = None

    def _thread(self, frame: FrameType, event: str, arg: Any) -> Any:
        """A thread the cell started, at its first call: counted (for the overview's note),
        then handed to whatever traced threads before, so it is not traced by us."""
        self._started.append(1)  # list.append: atomic, whatever thread runs this
        previous = self._previous_threads
        sys.settrace(previous)
        return previous(frame, event, arg) if previous is not None else None

    @property
    def threads_started(self) -> int:
        return len(self._started)


def outer_loops(source: str) -> dict[int, range]:
    """The cell's outer loops (`for`, `while` not inside another loop or a function): each
    header's line and its body's lines. None where the code does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    found: dict[int, range] = {}
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.For, ast.AsyncFor, ast.While)):
                found[child.lineno] = range(child.body[0].lineno,
                                            (child.body[-1].end_lineno or child.lineno) + 1)
            elif isinstance(child, ast.stmt) and not isinstance(
                    child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                todo.append(child)
    return found


def _range_type() -> Callable[[str], Any]:
    fast = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)
    return fast if fast is not None else torch.autograd.profiler.record_function


def _codes(code: CodeType) -> Iterator[CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _codes(const)


def function_label(fn: Any, cell: str | None) -> str:
    """`train (In[3])`: a function and the cell (else the file) that defines it."""
    return f"{fn.__qualname__} ({cell or os.path.basename(fn.__code__.co_filename)})"


def functions(
    namespace: dict[str, Any], names: Sequence[str], cell_of: Callable[[str], str | None]
) -> list[tuple[Any, str]]:
    """`-f NAME...`: each function and its label; `cell_of(filename)` names a cell."""
    found = [resolve_function(namespace, name) for name in names]
    return [(fn, function_label(fn, cell_of(fn.__code__.co_filename))) for fn in found]


def resolve_function(namespace: dict[str, Any], name: str) -> Any:
    """The Python function `name` (an expression: `train`, `model.forward`) names."""
    try:
        obj = eval(name, namespace)  # the user's own expression, in their namespace
    except Exception as err:
        raise DeviceMagicError(
            f"-f {name}: cannot find it ({type(err).__name__}: {err})"
        ) from None
    if isinstance(obj, torch.nn.Module):
        obj = type(obj).forward
    obj = getattr(obj, "__func__", obj)
    while hasattr(obj, "__wrapped__"):
        obj = obj.__wrapped__
    if not hasattr(obj, "__code__"):
        raise DeviceMagicError(
            f"-f {name}: {type(obj).__name__} is not a Python function (give a function, a "
            "method or a module, whose forward is taken)"
        )
    return obj


@contextlib.contextmanager
def quiet_stderr(heard: list[str]) -> Iterator[bool]:
    """Keep kineto's start/stop lines, which go straight to file descriptor 2, out of the
    user's output: the block's writes there are caught, what else was written comes
    back on `sys.stderr`, and all of it is appended to `heard`. Yields whether they are
    caught.

    Only for our short calls into torch, never around the cell: a child it forks or
    spawns, or a fatal error's last words (faulthandler's, a C++ abort's), must reach
    the real stderr. Ctrl-C waits until descriptor 2 is back."""
    with _ctrl_c_held():
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):  # no descriptor 2 to catch: let it be
            yield False
            return
        with tempfile.TemporaryFile() as caught:
            os.dup2(caught.fileno(), 2)
            try:
                yield True
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                caught.seek(0)
                text = caught.read().decode(errors="replace")
                heard.append(text)
                kept = [ln for ln in text.splitlines()
                        if ln.strip() and not any(n in ln for n in _NOISE) and "CUPTI" not in ln]
                if kept:
                    sys.stderr.write("\n".join(kept) + "\n")


def refuse_if_recording(active: bool) -> None:
    """`%%profile` under `%%profile`, or under a torch.profiler the user started, is refused."""
    if active:
        raise DeviceMagicError("%%profile cannot run inside %%profile: profile the outer cell")
    if torch.autograd.profiler._is_profiler_enabled or torch.autograd._profiler_enabled():
        raise DeviceMagicError(
            "%%profile: a torch.profiler is already recording; stop it first (prof.stop(), or "
            "leave its `with` block)"
        )


# --- one capture ----------------------------------------------------------------------------


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
    traces: TraceFiles = field(default_factory=TraceFiles)  # where an unnamed trace goes
    namespace: Mapping[str, Any] = field(default_factory=dict)  # the user's, for the advice
    reads: Collection[str] = ()  # the namespace's names the cell and the code it calls read
    _compiled: list[Any] = field(default_factory=list, init=False, repr=False)  # compiles.records()

    def __call__(
        self, show_partial: Callable[[ProfileReport], None]
    ) -> tuple[ProfileReport | None, Any]:
        """Run the cell profiled; the report (None, said in one line, where reading the
        profile failed) and the last run's value. If the cell raises (or Ctrl-C), the
        partial report goes to `show_partial` before the error propagates; the profiler
        is stopped either way."""
        __tracebackhide__ = True
        opts = self.options
        for i in range(opts.warmup):
            t0 = clock()
            self.run()
            if i == opts.warmup - 1:  # the best plain figure: just now, same code
                _sync()
                if i or self.plain_from is not None:  # warm: a run of this code came before
                    self.plain_wall_s, self.plain_from = clock() - t0, "the last warm-up"
                else:  # maybe the code's first run, whose one-time costs would mislead
                    self.plain_from = ("no plain run to compare with: the one warm-up may have "
                                       "been this code's first run (--warmup 2 compares, "
                                       "running the cell twice more: side effects too)")
        cuda = runtime_up("cuda")  # read after the warm-ups: one may have started it
        self._compiled = compiles.records()  # torch.compile's record so far: the cell's come after
        heard: list[str] = []
        prof = _profiler(cuda, opts.threads)
        recording = _Recording(prof, heard, cuda)
        tracer = LineTracer(
            self.cell_file, self.label, self.functions, self.loops,
            opts.steps if self.loops else 0, recording, _first_line(self.source),
        ) if opts.lines else None
        recording.stop_tracer = tracer.stop if tracer is not None else None
        meter = Meter(sync=True)
        value = measured = recorder = None
        # Ctrl-C ends the cell's run only: starting and stopping the profiler (and the
        # tracer) are never cut in half, and a press there is delivered once they are done.
        with _ctrl_c_held() as ctrl_c:
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
                        show_partial(self._report(recording, tracer, None, heard, cuda,
                                                  recorder, partial=err))
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
        try:
            return self._report(recording, tracer, measured, heard, cuda, recorder), value
        except Exception as err:  # the cell ran: its value is kept, and our fault said
            _log.debug("the profile could not be made", exc_info=True)
            print(f"%%profile could not read the profile: {first_sentence(err, named=True)}")
            return None, value

    def _report(
        self, recording: _Recording, tracer: LineTracer | None, measured: Measurement | None,
        heard: list[str], cuda: bool, recorder: Any = None,
        partial: BaseException | None = None,
    ) -> ProfileReport:
        opts = self.options
        pieces = _Pieces(recording.pieces)
        sessions = pieces.events()
        events = [e for session in sessions for e in session]
        names = tracer.names if tracer is not None else {}
        in_use = cuda or (measured is not None and measured.device is not None)
        analysis = analyse(events, names, runs=opts.runs, sort=opts.sort, top=opts.top,
                           device_in_use=in_use)
        windowed = tracer is not None and tracer.windowed
        wall = measured.wall_s if measured is not None else max(
            (e.end_ns for e in events), default=0) / 1e9
        if tracer is not None and windowed:
            analysis.lines = tracer.rows(analysis.lines)
        if tracer is not None and tracer.left_out:
            # what the events cover: the wall less the pauses and the profiler's switches
            analysis.recorded_s = max(wall - (tracer.paused_ns + tracer.switch_ns) / 1e9, 0.0)
        notes = _device_notes(analysis, events, heard, cuda)
        if not cuda and runtime_up("cuda"):
            notes.append("CUDA started in this cell, after recording began: its device "
                         "activity is not in this profile (run the cell again, or --warmup 1, "
                         "which runs it once more first: a training cell trains once more)")
        if opts.sort == "device" and not analysis.device_recorded:
            notes.append("--sort device: no device activity was recorded, so by self CPU time")
        notes.extend(_thread_notes(events, tracer, opts.threads))
        if self.plain_wall_s is None and self.plain_from and partial is None:
            notes.append(self.plain_from)
        trace, trace_bytes = self._write_trace(pieces, notes)
        timeline = self._timeline(pieces, recorder, notes) if opts.memory else None
        loops = tracer.loop_lines() if tracer is not None else []
        advice = self._advice(events, analysis, names, wall, cuda, measured, timeline, notes,
                              loops)
        why = None
        if partial is not None:
            what = "interrupted" if isinstance(partial, KeyboardInterrupt) else (
                f"the cell raised {type(partial).__name__}")
            why = f"{what}; the profile covers the cell up to there"
        return ProfileReport(
            label=self.label, runs=opts.runs, wall_s=wall, measurement=measured,
            analysis=analysis, trace_path=trace, plain_wall_s=None if why else self.plain_wall_s,
            plain_from=self.plain_from if self.plain_wall_s else None, partial=why,
            notes=notes, profiler=recording.prof, sort=opts.sort,
            timeline=timeline,
            trace_bytes=trace_bytes, trace_temporary=opts.trace is None,
            loops=tracer.loops_run() if tracer is not None else [],
            full_steps=opts.steps if windowed else 0, events=len(events),
            step_events=tracer.step_events(sessions) if tracer is not None else 0, advice=advice,
        )

    def _advice(
        self, events: list[Event], analysis: Analysis, names: dict[str, tuple[str, str]],
        wall: float, cuda: bool, measured: Measurement | None, timeline: Any,
        notes: list[str], loops: list[tuple[range, int]],
    ) -> list[Advice]:
        peak = measured.device_top_bytes() if measured is not None else None
        try:
            setting = read_setting(wall, cuda, peak, self._compiled)
            setting.loops = loops
            top = timeline.largest[0] if timeline is not None and timeline.largest else None
            if top is not None and top.line is not None:  # --memory: the peak's top line
                setting.largest = (str(top.line), top.bytes, top.text)
            # read after the run: the cell may have made the model
            setting.data_parallel = data_parallel(
                (n, self.namespace[n]) for n in sorted(self.reads) if n in self.namespace)
            return advise(events, analysis, names, setting)
        except Exception as err:  # ours: the profile itself is still shown
            _log.debug("the advice failed", exc_info=True)
            notes.append(f"the advice could not be made: {first_sentence(err, True)}")
            return []

    def _timeline(self, prof: Any, recorder: Any, notes: list[str]) -> Any:
        """The memory timeline: the CUDA allocator's history where CUDA was used, else the
        profiler's memory events."""
        from . import memtimeline

        try:
            timeline = recorder.timeline() if recorder is not None else None
            if timeline is None:
                timeline = memtimeline.from_profiler(prof, self.cell_file, self.source)
        except Exception as err:  # ours: the profile itself is still shown
            _log.debug("the memory timeline failed", exc_info=True)
            notes.append(f"the memory timeline could not be drawn: {first_sentence(err, True)}")
            return None
        return timeline

    def _write_trace(self, prof: _Pieces, notes: list[str]) -> tuple[str | None, int]:
        """Write the trace: the path and its size. kineto says a failure only on stderr, so
        the file is opened here first, and kineto's lines are caught like its others. An
        unnamed trace goes to the session's one kept file (`traces`)."""
        path = self.options.trace
        try:
            path = self.traces.new(self.label) if path is None else os.path.expanduser(path)
            with open(path, "w"):
                pass
            with quiet_stderr([]):
                prof.export_chrome_trace(path)
            size = os.path.getsize(path)
            if not size:
                raise OSError("kineto wrote nothing")
        except (OSError, RuntimeError, ValueError) as err:
            if self.options.trace is None:
                self.traces.clear()
            why = getattr(err, "strerror", None) or err
            notes.append(f"the trace could not be written to {path}: {why}")
            return None, 0
        return path, size


class _Pieces:
    """The sessions of one capture (`_Recording.pieces`) read as one: their events on the
    first one's clock, one trace, one event tree."""

    def __init__(self, pieces: list[Any]) -> None:
        self.pieces = pieces

    def events(self) -> list[list[Event]]:
        """Each session's events, on the first one's clock."""
        if not self.pieces:
            return []
        origin = self.pieces[0].kineto_results.trace_start_ns()
        return [from_kineto(piece.kineto_results, origin) for piece in self.pieces]

    def export_chrome_trace(self, path: str) -> None:
        """One trace file (gzipped where `path` ends in .gz, as torch's): the sessions'
        events together (kineto stamps them all from one base time)."""
        if not self.pieces:
            raise RuntimeError("nothing was recorded")
        with tempfile.TemporaryDirectory() as folder:
            parts = [os.path.join(folder, f"{i}.json") for i in range(len(self.pieces))]
            for piece, part in zip(self.pieces, parts):
                piece.export_chrome_trace(part)  # kineto's JSON, whatever the name
            opener: Any = gzip.open if path.endswith(".gz") else open
            with opener(path, "wb") as out:
                if len(parts) == 1:
                    with open(parts[0], "rb") as f:
                        shutil.copyfileobj(f, out)
                    return
                with open(parts[0]) as f:
                    trace = json.load(f)
                for part in parts[1:]:
                    with open(part) as f:
                        events = json.load(f)["traceEvents"]
                    trace["traceEvents"] += [e for e in events if e.get("ph") != "M"]  # not
                    # the metadata, the first session's
                out.write(json.dumps(trace, separators=(",", ":")).encode())

    # memtimeline reads prof.profiler.kineto_results.experimental_event_tree()
    @property
    def profiler(self) -> _Pieces:
        return self

    @property
    def kineto_results(self) -> _Pieces:
        return self

    def experimental_event_tree(self) -> list[Any]:
        return [n for p in self.pieces for n in p.kineto_results.experimental_event_tree()]


def _first_line(source: str) -> int:
    """The cell's line that IPython's code starts at: its leading blank lines dropped."""
    lines = source.split("\n")
    return next((i for i, line in enumerate(lines, 1) if line.strip()), 1)


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
    how = ("--threads records them, without memory allocations" if _ALL_THREADS is not None
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


@contextlib.contextmanager
def _memory(cell_file: str, on: bool) -> Iterator[Any]:
    """With --memory, the CUDA allocator's history for the block (None where not asked)."""
    if not on:
        yield None
        return
    from . import memtimeline

    with memtimeline.recording(cell_file) as recorder:
        yield recorder


def _sync() -> None:
    from ..probes import active_accelerator

    accel = active_accelerator()
    if accel is not None:
        accel.synchronize()


def _profiler(cuda: bool, threads: bool = False) -> Any:
    """torch's profiler, recording CUDA only where asked, and every thread of the process
    with `threads` (else the cell's own thread, and autograd's for its backward). Each
    `start()` after a `stop()` begins a session of its own (`_Recording` keeps each)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    extra = {"experimental_config": _ALL_THREADS} if threads else {}
    prof = profile(activities=activities, record_shapes=True, profile_memory=True, **extra)
    prof.record_steps = False  # its ProfilerStep ranges would be rows of the op table
    return prof


def _release(prof: Any) -> None:
    """Break torch.profiler.profile's reference cycle (its `action_map` holds its own bound
    methods), so that kineto's record goes with the last reference to the profiler (the
    report's, with -o) instead of waiting for a full garbage collection."""
    prof.action_map = {}


def _all_threads_config() -> Any:
    """torch's experimental config that records every thread; None where it has none.

    In torch 2.13 a profiler so configured records no memory events at all (pytorch
    issue 166121), so it is used only where asked (`--threads`)."""
    try:
        return torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # an older torch: the option is not there
        return None


_ALL_THREADS = _all_threads_config()


class _Recording:
    """Our kineto sessions, from the first start to the last stop.

    The line tracer pauses the recording (a session stopped, kept in `pieces`) where a
    loop's steps run past the window, and resumes it (a new session) where the code
    outside them runs; the report reads every piece.

    torch records one profile at a time: a profiler the cell prepares or starts (its own
    `with torch.profiler.profile()`, a library's) ends ours, and reading or exporting a
    session something else ended crashes the process. So torch's entry points are
    watched while we record, or pause; where another profiler came, ours is neither
    stopped, resumed nor read (one that still records is the cell's, and keeps
    recording), and `stop` says why there is no profile."""

    _ENTRIES = ("_prepare_profiler", "_enable_profiler")  # torch.autograd.profiler's

    def __init__(self, prof: Any, heard: list[str], cuda: bool = False) -> None:
        self.prof, self.heard = prof, heard
        self.cuda = cuda  # the profiler records CUDA: a pause waits for its queued work
        self.other = False  # another profiler was prepared or started while we recorded
        # stops our line tracer, whose ranges would land in the cell's profile
        self.stop_tracer: Callable[[], None] | None = None
        self.paused = False  # the tracer stopped, as another profiler came
        self.thread = threading.get_ident()  # the cell's: where `stop_tracer` works
        self.real: dict[str, Any] = {}
        self.spare: list[torch.Tensor] = []
        self.flagged = True
        self.own = False  # we are pausing or resuming our own recording
        self.running = False  # a session of ours records
        self.pieces: list[Any] = []  # each session's torch.autograd.profiler.profile, stopped

    def start(self) -> None:
        """Start recording (DeviceMagicError where torch refuses; nothing is left on then);
        what torch warned goes to `heard` ('CUDA is not available, disabling CUDA
        profiling'), not to the user."""
        # blocks of their own, made in one call (a Python loop takes several times longer)
        blocks = list(torch._foreach_neg([torch.zeros(1, device="cpu")] * _WARN_EVERY))
        try:
            self._start(blocks)
        except RuntimeError as err:  # kineto refused (another profiler, a broken build)
            raise DeviceMagicError(
                f"%%profile could not start torch.profiler: {first_sentence(err)}"
            ) from None
        # torch's flag, as the start left it: a profiler of every thread (--threads) keeps
        # its state process-wide and leaves the flag off
        self.flagged = torch.autograd._profiler_enabled()
        module = torch.autograd.profiler
        for name in self._ENTRIES:
            real = getattr(module, name, None)
            if real is not None:
                self.real[name] = real
                setattr(module, name, self._watched(real))

    def _start(self, blocks: list[torch.Tensor]) -> None:
        """A session of ours begins; where `blocks`, torch's warning is spent on them. Where
        torch refuses, its flag is put back off (it sets it before kineto starts): the first
        start and a resume mid-cell alike, or every later %%profile is refused."""
        with warnings.catch_warnings(record=True) as warned, quiet_stderr(self.heard) as caught:
            warnings.simplefilter("always")
            try:
                self.prof.start()
            except BaseException:
                if not torch.autograd._profiler_enabled():
                    torch.autograd.profiler._is_profiler_enabled = False
                raise
            self.running = True
            if caught and blocks:
                self.spare = _spend_unknown_block_warning(blocks)
        self.heard.extend(str(w.message) for w in warned)

    def pause(self) -> None:
        """Stop our session mid-cell and keep it (the tracer's: past a loop's window)."""
        if self.other or not self.running:
            return
        self.own = True
        try:
            if self.cuda:  # so that the kernels the session launched end in its record
                _sync()
            with quiet_stderr(self.heard):  # a Ctrl-C held comes after the state is set
                self.prof.stop()
                self.running = False
                self.pieces.append(self.prof.profiler)
        finally:
            self.own = False

    def resume(self) -> None:
        """Begin a new session of ours (the tracer's: where code outside the steps runs).
        torch's warning is not spent again (a thousand frees, milliseconds): the first
        start left it 999 frees of blocks it cannot size away, and only the frees while
        we record count."""
        if self.other or self.running:
            return
        self.own = True
        try:
            self._start([])
        finally:
            self.own = False

    def _watched(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def entry(*args: Any, **kwargs: Any) -> Any:
            if self.own:
                return real(*args, **kwargs)
            if (self.stop_tracer is not None and not self.paused
                    and threading.get_ident() == self.thread):
                self.stop_tracer()
                self.paused = True
            self.other = True
            return real(*args, **kwargs)

        return entry

    def stop(self) -> str | None:
        """Stop recording; None, or the sentence that says why there is nothing to read."""
        module = torch.autograd.profiler
        for name, real in self.real.items():
            setattr(module, name, real)
        self.real.clear()
        try:
            # off: as the start left it (--threads), or paused by us
            on = torch.autograd._profiler_enabled() or not self.flagged or not self.running
            if self.other or not on:
                if not on:  # ended, by the cell's profiler or by torch: its flag too
                    module._is_profiler_enabled = False
                self.pieces.clear()
                return ("%%profile: the cell's own torch.profiler ended this recording "
                        "(torch runs one at a time), so there is no profile of this cell; "
                        "its own profiler works as without %%profile")
            if self.running:
                with quiet_stderr(self.heard):
                    self.prof.stop()
                    self.running = False
                    self.pieces.append(self.prof.profiler)
            return None
        finally:
            _release(self.prof)
            self.spare.clear()  # freed once nothing records: they count no more


_WARN_EVERY = 1000  # torch's CPU allocator warns once per this many frees it cannot size


def _spend_unknown_block_warning(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Free `blocks` (made before the start) one by one while descriptor 2 is caught,
    until torch's allocator has said "Memory block of unknown size was allocated before
    the profiling started": it says so once per `_WARN_EVERY` such frees, and a cell
    rebinding a tensor made earlier frees one, while descriptor 2 is the user's again.
    The rest are returned, to be freed after the stop."""
    size = os.fstat(2).st_size
    while blocks:
        blocks.pop()
        if os.fstat(2).st_size != size:
            break
    return blocks


class _CtrlC:
    """The SIGINTs that came while held (see `_ctrl_c_held`)."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler  # the one in force before; None: none of ours installed
        self.held = 0
        self.through = False

    def on_sigint(self, signum: int, frame: Any) -> None:
        if not self.through:
            self.held += 1
            return
        self.through = False  # what its KeyboardInterrupt unwinds is not cut in turn
        self.handler(signum, frame)
        self.through = True  # a handler of the user's own that did not raise

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Ctrl-C waits for the block, also inside `let_through` (a press held then comes
        at its end)."""
        through, self.through = self.through, False
        try:
            yield
        finally:
            self.through = through
            if through and self.held:
                self.held -= 1
                self.on_sigint(signal.SIGINT, None)

    @contextlib.contextmanager
    def let_through(self) -> Iterator[None]:
        """Ctrl-C reaches the handler for the block (a press held so far, at once)."""
        if self.handler is None:
            yield
            return
        self.through = True
        try:
            if self.held:
                self.held -= 1
                self.on_sigint(signal.SIGINT, None)
            yield
        finally:
            self.through = False


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[_CtrlC]:
    """Hold SIGINT (Ctrl-C, a notebook's stop button) in the block but where `let_through`,
    then hand each press held to the handler in force before (Python's raises
    KeyboardInterrupt). Only in the main thread, where a Python handler is in force."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main else None
    ctrl_c = _CtrlC(handler if callable(handler) else None)
    if ctrl_c.handler is None:
        yield ctrl_c
        return
    signal.signal(signal.SIGINT, ctrl_c.on_sigint)
    try:
        yield ctrl_c
    finally:
        if signal.getsignal(signal.SIGINT) == ctrl_c.on_sigint:  # else the cell set its own
            signal.signal(signal.SIGINT, ctrl_c.handler)
    for _ in range(ctrl_c.held):
        ctrl_c.handler(signal.SIGINT, None)
