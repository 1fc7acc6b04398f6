"""A rank's side: its function run under its own profiler, its outer loop's steps timed
and windowed as the cell's are, its trace and summary written however it ends (`Rank`).

Everything here is process-local: the launchers' patches a forked rank inherits are
undone before its function runs, and the profiler starts and stops in the rank itself
(in a `finally`: a rank that raises writes what it recorded). A signal that ends a rank
(a launcher's SIGTERM to the others once one failed, a kill) ends it as without us: no
handler of ours is installed (a Python handler would wait for a rank blocked in a
collective), so that rank writes nothing and the report says it did not come back."""

from __future__ import annotations

import ast
import inspect
import json
import logging
import os
import sys
import textwrap
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from ...probes import rss_and_high_water, runtime_up
from ..capture import Options
from ..lines import loops_in
from ..recording import Pieces, Recording, _profiler
from . import summary

_log = logging.getLogger(__name__)
CELL_ENDED = ".tdm-cell-ended"  # in the folder: the launching cell has ended (launchers)


class Rank:
    """The function a launcher runs in each rank, wrapped: picklable (spawn sends it) where
    the function is. `index` is the rank where the launcher says (start_processes' first
    argument), else None (torch elastic's RANK, or the process group's, is read then)."""

    def __init__(self, fn: Callable[..., Any], options: Options, folder: str,
                 indexed: bool, undo: Callable[[], None] | None = None) -> None:
        self.fn, self.options, self.folder, self.indexed = fn, options, folder, indexed
        self.undo = undo  # the launchers' patches, inherited by a forked rank
        # elastic names its run and its events by them
        self.__name__ = getattr(fn, "__name__", "rank")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "undo": None}  # a spawned rank inherits no patch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if self.undo is not None:
            self.undo()
        hint = args[0] if self.indexed and args and isinstance(args[0], int) else None
        if hint is None and os.environ.get("RANK", "").isdigit():
            hint = int(os.environ["RANK"])
        run = _Run(self.fn, self.options, self.folder, hint)
        return run(*args, **kwargs)


class _Run:
    """One rank's profiled run."""

    def __init__(self, fn: Callable[..., Any], options: Options, folder: str,
                 hint: int | None) -> None:
        self.fn, self.options, self.folder = fn, options, folder
        self.info: dict[str, Any] = {"backend": "none", "rank": hint if hint is not None else 0,
                     "world_size": 1}
        self.hinted = hint is not None
        self.seen = False  # a process group was seen: this process is a rank
        self.code = getattr(fn, "__code__", None)
        self.loops = _outer_loops(fn)
        self.steps: dict[int, list[int]] = {}  # a loop's header -> its steps' wall (ns)
        self.starts: dict[int, float] = {}  # a loop's header -> its first step's start
        self.cuda = runtime_up("cuda")
        self.recording = Recording(_profiler(self.cuda), [], self.cuda)
        self.marks: list[Any] = []  # the open ProfilerStep range
        self.done = False
        self.cell_ended = os.path.join(folder, CELL_ENDED)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        ended: BaseException | None = None
        self.recording.start()
        tracing = self.code is not None and bool(self.loops)
        before = sys.gettrace()
        if tracing:
            sys.settrace(self._global)
        try:
            return self.fn(*args, **kwargs)
        except BaseException as err:
            ended = err
            raise
        finally:
            if tracing:
                sys.settrace(before)
            self._finish(ended)

    # --- the steps of the function's outer loops ---------------------------------------

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not self.code or self.done:
            return None
        header: list[int | None] = [None]  # the loop whose header ran last
        running: list[int | None] = [None]  # the loop whose step runs
        began = [0]

        def local(frame: FrameType, event: str, arg: Any) -> Any:
            if self.done:  # the cell ended while this rank ran on: its steps go untimed
                if event == "return":
                    _yield_to_collectives()
                return local
            now = time.perf_counter_ns()
            line = frame.f_lineno
            if event == "line" and line in self.loops:
                if running[0] is not None:
                    self._step_end(running[0], now - began[0])
                    running[0] = None
                header[0] = line
            elif event == "line" and header[0] is not None and line in self.loops[header[0]]:
                loop = running[0] = header[0]
                header[0], began[0] = None, now
                self._step_begin(loop)
            elif event == "line" and running[0] is not None and line in self.loops[running[0]]:
                pass
            elif running[0] is not None:  # a line past the loop, or the function returns
                self._step_end(running[0], now - began[0])
                running[0] = header[0] = None
            if event == "return":
                _yield_to_collectives()
            return local

        return local

    def _step_begin(self, loop: int) -> None:
        if os.path.exists(self.cell_ended):  # one stat a step: a few µs
            self._finish(None)
            return
        done = self.steps.setdefault(loop, [])
        if not done:
            self.starts[loop] = time.time()
            self._read_group()
        full = self.options.steps
        if full and len(done) == full + 1:  # past the window: recorded no more
            self.recording.pause()
        if self.recording.running:
            mark = torch.autograd.profiler.record_function(f"ProfilerStep#{len(done)}")
            mark.__enter__()
            self.marks.append(mark)

    def _step_end(self, loop: int, wall_ns: int) -> None:
        self.steps[loop].append(wall_ns)
        if self.marks:
            self.marks.pop().__exit__(None, None, None)

    def _read_group(self) -> None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            self.seen = True
            self.info = {"backend": str(dist.get_backend()), "rank": dist.get_rank(),
                         "world_size": dist.get_world_size()}

    # --- the end, however it comes -----------------------------------------------------

    def _finish(self, ended: BaseException | None) -> None:
        if self.done:
            return
        self.done = True
        try:
            while self.marks:
                self.marks.pop().__exit__(None, None, None)
            if not self.seen:
                self._read_group()
            self.recording.stop()
            if not (self.seen or self.hinted):  # a process that is no rank: nothing to say
                return
            self._write(ended)
        except Exception:  # ours: the rank ends as it would have
            _log.debug("the rank's profile could not be written", exc_info=True)

    def _write(self, ended: BaseException | None) -> None:
        rank = int(self.info["rank"])
        pieces = Pieces(self.recording.pieces, self.recording.to_end)
        trace = os.path.join(self.folder, f"rank{rank}.pt.trace.json")
        figures = summary.figures(pieces)
        if self.recording.pieces:
            pieces.export_chrome_trace(trace)
            _stamp(trace, self.info)
        else:
            trace = ""
        loop = max(self.steps, key=lambda k: len(self.steps[k]), default=None)
        peak_host = rss_and_high_water()
        record = {
            **self.info, "pid": os.getpid(), "trace": trace,
            "step_times": [ns / 1e9 for ns in self.steps.get(loop, [])] if loop else [],
            "first_step_at": self.starts.get(loop) if loop else None,
            "ended": type(ended).__name__ if ended else None,
            "peak_host": peak_host[1] if peak_host else None,
            "peak_device": torch.cuda.max_memory_allocated() if self.cuda else None,
            **figures,
        }
        summary.write(self.folder, rank, record)


def _yield_to_collectives() -> None:
    """The GIL let go a moment as the rank's function returns, before its locals (a DDP
    model) go: with a profiler on, gloo's worker thread frees each collective's captured
    thread state (a Python object: backward's context) under the GIL after the collective
    completes, and the last reference to the process group, dropped with the GIL held,
    joins that thread: a deadlock (torch 2.13; the same with a bare torch.profiler in the
    rank) where the function returns within the ~5 ms that thread waits for the GIL."""
    time.sleep(0.01)


def _stamp(trace: str, info: dict[str, Any]) -> None:
    """The rank's `distributedInfo` in its trace, as HTA reads it (ours, stamped rank 0 at
    the start, or torch's where the group existed then)."""
    with open(trace) as f:
        data = json.load(f)
    data.pop("distributedInfo", None)
    data = {"distributedInfo": info, **data}  # first: HTA reads it from the file's head
    with open(trace, "w") as f:
        json.dump(data, f)  # '"rank": 0', with its space: HTA's pattern wants one


def _outer_loops(fn: Callable[..., Any]) -> dict[int, range]:
    """The function's outer loops (not inside another loop or a nested function), by the
    file's line numbers: each header's line and its body's lines."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        return loops_in(node, fn.__code__.co_firstlineno - 1)
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return {}
