"""The line tracer: which line of the cell (and of the functions `-f` names) each event
belongs to, the steps of the cell's outer loops, and the steps window (`LineTracer`)."""

from __future__ import annotations

import ast
import linecache
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

import torch

from ..errors import DeviceMagicError
from ..kineto.analysis import LineRow
from ..kineto.events import LINE_PREFIX, Event
from .line_events import Frames, LineEvents, line_events
from .recording import Recording

_log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoopSteps:
    """One outer loop of the cell: its header's line and its steps, each time it was entered
    (a run of `-n` enters it again)."""

    line: str
    steps: list[int]


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
        window: Recording | None = None, first_line: int = 1,
    ) -> None:
        self.cell_file = cell_file
        self.cell_label = cell_label
        self.codes: dict[CodeType, str] = {}  # -f functions' code objects -> their label
        for fn, label in functions:
            for code in _codes(fn.__code__):
                self.codes[code] = label
        self._code_ids = {id(code) for code in self.codes}
        self.names: dict[str, tuple[str, str]] = {}
        self._keys: dict[tuple[str, int], str] = {}
        self._events: LineEvents | None = None  # while started
        self._previous_threads: Any = None
        self._started: list[int] = []  # one entry per thread started while tracing
        self._range = _range_type()
        self.shift = first_line - 1  # the cell's leading blank lines, which IPython drops
        self.loops = loops or {}
        self.full_steps = full_steps
        self.loop_steps: dict[int, list[int]] = {}  # a loop's header -> steps, each entry
        # per line seen, by its number (0: no line; the tracer's hot path indexes lists):
        self._line_names: list[str] = [""]  # its range's name
        self._hits: list[int] = [0]
        self._wall: list[int] = [0]  # ns it was the innermost line
        # by a code's id: its code, and its lines -> their numbers (the code kept, so that
        # no other one takes its id)
        self._ids: dict[int, tuple[CodeType, dict[int, int]]] = {}
        self._key_ids: dict[tuple[str, int], int] = {}  # (file, line) -> number
        # an outer loop's body lines -> its header; its header -> -1 (never a loop's)
        self._loop_of: dict[int, int] = {n: h for h, body in self.loops.items() for n in body}
        self._loop_of.update(dict.fromkeys(self.loops, -1))
        self._window = window if full_steps else None
        self._recording = True  # the profiler records, and ranges are opened
        self._past = False  # in a loop's steps past the window
        self._first: int | None = None  # the depth of a line's first run being recorded
        self.switch_ns = 0  # the profiler's own pauses and resumes
        self.paused_ns = 0  # the time it did not record
        self._paused_at = 0
        self.left_out = False  # the profiler was paused at least once
        self.cuts: list[int | None] = []  # per pause, the outer loop whose steps ran then
        self._innermost: list[int] = []  # per traced frame, the number of its line running
        # per traced frame: its code's lines -> their numbers, its loops (None: not the
        # cell's top level), the range of its line open
        self._frames: list[tuple[dict[int, int], dict[int, int] | None, list[Any]]] = []
        self._since = [0]  # when the last event came (a list: the hot path's closures share it)
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
        for i, name in enumerate(self._line_names):
            if not self._hits[i]:
                continue
            where, code = self.names[name]
            row = by_where.get((where, code))
            out.append(LineRow(
                where=where, code=code, hits=self._hits[i], wall_s=self._wall[i] / 1e9,
                cpu_s=row.cpu_s if row else 0.0, device_s=row.device_s if row else None,
                allocated_bytes=row.allocated_bytes if row else 0, flops=row.flops if row else 0,
            ))
        return out

    def _charge(self) -> None:
        """The time since the last event, to the line that was innermost."""
        now = time.perf_counter_ns()
        if self._innermost:
            self._wall[self._innermost[-1]] += now - self._since[0]
        self._since[0] = now

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
            self._since[0] = now  # the switch is no line's
        self._recording = record
        if record:
            self.paused_ns += t0 - self._paused_at
        else:
            self._paused_at, self.left_out = now, True
            self.cuts.append(self._loop)

    def _line(self, code: CodeType, lineno: int) -> int:
        """The number of `code`'s line `lineno` (a line's first event: named here)."""
        key = (code.co_filename, lineno)
        i = self._key_ids.get(key)
        if i is None:
            if code.co_filename == self.cell_file:
                where = str(lineno + self.shift)
            else:
                where = f"{self.codes.get(code, code.co_name)} {lineno}"
            text = linecache.getline(code.co_filename, lineno).strip()
            name = f"{LINE_PREFIX}{self.cell_label} {where}: {text[:80]}"
            self._keys[key] = name
            self.names[name] = (where, text)
            i = self._key_ids[key] = len(self._line_names)
            self._line_names.append(name)
            self._hits.append(0)
            self._wall.append(0)
        self._ids[id(code)][1][lineno] = i
        return i

    def _watched(self, code: CodeType) -> bool:
        # by id, not by the code (whose hash is computed from its contents at every call):
        # `codes` keeps the -f functions' code objects, so no other one has their ids
        return code.co_filename == self.cell_file or id(code) in self._code_ids

    def _enter(self, code: CodeType) -> None:
        """A frame of the watched code starts (or resumes): no line of it runs yet."""
        top = bool(self.loops) and code.co_name == "<module>" and code.co_filename == self.cell_file
        if top:
            self._loop, self._past = None, False  # a run of the cell begins
        self._charge()
        self._innermost.append(0)
        known = self._ids.get(id(code))
        if known is None or known[0] is not code:
            known = self._ids[id(code)] = (code, {})
        self._frames.append((known[1], self._loop_of if top else None, []))

    def _hot_path(self) -> Frames:
        """What runs on every line of every step, and as a frame ends: locals, lists
        indexed by the line's number, no call but the clock's where nothing is due."""
        enter, names, innermost, hits, wall, frames = (
            self._range, self._line_names, self._innermost, self._hits, self._wall, self._frames)
        since, clock, line_of = self._since, time.perf_counter_ns, self._line

        def line(code: CodeType, lineno: int) -> None:
            ids, loop_of, opened = frames[-1]
            try:
                i = ids[lineno]
            except KeyError:
                if not lineno:  # line 0: a one-expression cell
                    return
                i = line_of(code, lineno)
            now = clock()
            wall[innermost[-1]] += now - since[0]
            since[0] = now
            innermost[-1] = i
            ran = hits[i]
            hits[i] = ran + 1
            if opened:
                opened.pop().__exit__(None, None, None)
            # a step's line: its loop's, where no header came before it
            if loop_of is not None and (
                    self._header is not None or loop_of.get(lineno) != self._loop):
                self._count(lineno)
            if self._window is not None and (  # a switch is due, or may be
                    not ran or self._first is not None or self._past == self._recording):
                self._switch(len(innermost), not ran)
            if self._recording:
                span = enter(names[i])
                span.__enter__()
                opened.append(span)

        def leave() -> None:
            opened = frames.pop()[2]
            now = clock()
            wall[innermost.pop()] += now - since[0]
            since[0] = now
            if opened:
                opened.pop().__exit__(None, None, None)

        return Frames(self._enter, line, leave)

    def start(self) -> None:
        self._previous_threads = threading.gettrace()
        self._since[0] = time.perf_counter_ns()
        self._events = line_events(self._watched, self._hot_path())
        self._events.start()
        threading.settrace(self._thread)

    def stop(self) -> None:
        if not self._recording:  # paused to the end
            self.paused_ns += time.perf_counter_ns() - self._paused_at
            self._recording = True
        if self._events is not None:
            self._events.stop()
            self._events = None  # its callbacks hold this tracer
        threading.settrace(self._previous_threads)
        self._previous_threads = None
        # a traceback's frames keep their trace function, and so this tracer: not the record
        self._window = None

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
    return loops_in(tree)


def loops_in(node: ast.AST, offset: int = 0) -> dict[int, range]:
    """The outer loops under `node` (not inside another loop or a nested function), each
    header's line and its body's lines, `offset` added (a function's source parsed alone)."""
    found: dict[int, range] = {}
    todo: list[ast.AST] = [node]
    while todo:
        for child in ast.iter_child_nodes(todo.pop()):
            if isinstance(child, (ast.For, ast.AsyncFor, ast.While)):
                found[child.lineno + offset] = range(
                    child.body[0].lineno + offset,
                    (child.body[-1].end_lineno or child.lineno) + offset + 1)
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


def first_line(source: str) -> int:
    """The cell's line that IPython's code starts at: its leading blank lines dropped."""
    lines = source.split("\n")
    return next((i for i, line in enumerate(lines, 1) if line.strip()), 1)
