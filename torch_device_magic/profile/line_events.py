"""How the line tracer hears a watched frame start, run a line and end, on the thread that
starts it: `sys.monitoring` (PEP 669) on Python 3.12 and later, `sys.settrace` before.

    events = line_events(watched, Frames(enter, line, leave))
    events.start(); ...; events.stop()

`watched(code)` says whether a code object is one of the tracer's (the cell's own code
and the functions `-f` names); the tracer's `enter(code)`, `line(code, lineno)` and
`leave()` run for those frames only.

- `sys.settrace` calls its global function once a frame of every code on that thread:
  the tracer's code gets the local function, any other none (no line events there), but
  each call of any Python function still pays that one call.
- `sys.monitoring` (a tool id of its own, the first free of 3, 4 and the profiler's) turns
  off, at its first event, each start, line and return of code that is not watched
  (`DISABLE`): past that, the rest of the process's code (torch's modules, the optimizer)
  runs at its own pace. A jump back to the line it is in (a comprehension, a one-line
  loop) is a line event, as `sys.settrace` makes it in 3.12, so that the lines' hits are
  the same by both means. The events come from every thread: the tracer's thread only is
  heard. What is turned off stays off for the tool until `sys.monitoring.restart_events()`,
  which `start` calls (it turns them on again for every tool, which turn them off again at
  their next event). A user's `sys.settrace` (a debugger, coverage) stays on beside it.
  Where no tool id is free, `sys.settrace` is used.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, Protocol

MONITORING = getattr(sys, "monitoring", None)
TOOL_IDS = (3, 4, 2)  # unnamed ones first; 2 is the profiler's (cProfile's in 3.12)
TOOL_NAME = "torch_device_magic %%profile"


@dataclass(frozen=True, slots=True)
class Frames:
    """The tracer's side: a watched frame starts (or resumes), one of its lines starts,
    it ends (returns, yields or unwinds)."""

    enter: Callable[[CodeType], None]
    line: Callable[[CodeType, int], None]
    leave: Callable[[], None]


class LineEvents(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...


def line_events(watched: Callable[[CodeType], bool], frames: Frames) -> LineEvents:
    """The events of `watched` frames on this thread, by the cheapest means there is."""
    if MONITORING is not None:
        tool = next((t for t in TOOL_IDS if MONITORING.get_tool(t) is None), None)
        if tool is not None:
            return Monitoring(watched, frames, tool)
    return SetTrace(watched, frames)


class SetTrace:
    """`sys.settrace` on this thread, the one there before put back at `stop`."""

    def __init__(self, watched: Callable[[CodeType], bool], frames: Frames) -> None:
        self._watched, self._frames = watched, frames
        self._previous: Any = None

    def start(self) -> None:
        self._previous = sys.gettrace()
        sys.settrace(self._call)

    def stop(self) -> None:
        sys.settrace(self._previous)
        self._previous = None

    def _call(self, frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if not self._watched(code):
            return None
        self._frames.enter(code)
        line, leave = self._frames.line, self._frames.leave

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "line":
                line(frame.f_code, frame.f_lineno)
            elif event == "return":
                leave()
            # itself, read from the frame: a closure naming itself would be a reference
            # cycle holding the tracer (and the recording) until a full collection
            return frame.f_trace

        return local


class Monitoring:
    """`sys.monitoring` under tool id `tool`: starts, lines and returns of every code,
    each turned off at its first event where the code is not watched."""

    def __init__(self, watched: Callable[[CodeType], bool], frames: Frames, tool: int) -> None:
        self._watched, self._frames, self._tool = watched, frames, tool
        self._events: list[int] = []  # those registered, while started

    def start(self) -> None:
        mon = MONITORING
        assert mon is not None
        tool, ev = self._tool, mon.events
        thread = threading.get_ident()
        watched, ident, disable = self._watched, threading.get_ident, mon.DISABLE
        enter, line, leave = self._frames.enter, self._frames.line, self._frames.leave
        # The watched frames running on the thread, innermost last: an event of the
        # innermost one is the tracer's at the cost of an identity check (a code object's
        # hash is computed from its contents at every call: never on this path).
        codes: list[CodeType] = []

        def started(code: CodeType, offset: int, *exc: Any) -> Any:
            if not watched(code):
                return None if exc else disable  # a throw cannot be turned off
            if ident() == thread:
                codes.append(code)
                enter(code)
            return None

        def lined(code: CodeType, lineno: int) -> Any:
            if codes and code is codes[-1] and ident() == thread:
                line(code, lineno)
                return None
            return None if watched(code) else disable

        # a jump back within a line, by its code's id and offset -> (the code, the line)
        loops: dict[tuple[int, int], tuple[CodeType, int]] = {}

        def jumped(code: CodeType, offset: int, target: int) -> Any:
            # as sys.settrace says it: a jump back to the line it is in runs the line again
            # (a comprehension's next item, a one-line loop's next pass); LINE says the rest
            seen = loops.get((id(code), offset))
            if seen is None or seen[0] is not code:
                if target > offset or not watched(code):
                    return disable
                lineno = _line_at(code, target)
                if lineno is None or lineno != _line_at(code, offset):
                    return disable
                seen = loops[(id(code), offset)] = (code, lineno)
            if codes and code is codes[-1] and ident() == thread:
                line(code, seen[1])
            return None

        def ended(code: CodeType, offset: int, value: Any) -> Any:
            if codes and code is codes[-1] and ident() == thread:
                codes.pop()
                leave()
                return None
            return None if watched(code) else disable

        def unwound(code: CodeType, offset: int, exc: BaseException) -> Any:
            if codes and code is codes[-1] and ident() == thread:  # cannot be turned off
                codes.pop()
                leave()
            return None

        callbacks = {
            ev.PY_START: started, ev.PY_RESUME: started, ev.PY_THROW: started,
            ev.LINE: lined, ev.JUMP: jumped,
            ev.PY_RETURN: ended, ev.PY_YIELD: ended, ev.PY_UNWIND: unwound,
        }
        mon.use_tool_id(tool, TOOL_NAME)
        self._events = list(callbacks)
        for event, callback in callbacks.items():
            mon.register_callback(tool, event, callback)
        mon.restart_events()  # what an earlier capture turned off is watched again
        mon.set_events(tool, sum(callbacks))

    def stop(self) -> None:
        mon = MONITORING
        if mon is None or not self._events:
            return
        mon.set_events(self._tool, 0)
        for event in self._events:
            mon.register_callback(self._tool, event, None)
        self._events = []
        mon.free_tool_id(self._tool)


def _line_at(code: CodeType, offset: int) -> int | None:
    """The line of `code`'s instruction at byte `offset`."""
    return next((line for start, end, line in code.co_lines() if start <= offset < end), None)
