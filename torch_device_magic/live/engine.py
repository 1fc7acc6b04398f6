"""`LiveLine`: the live line of the per-cell report, cell by cell.

A short cell calls nothing of it: the report sets `cell` to the cell's start on the clock
(its own reading) as the cell starts, and to None as it ends (on a kernel it also calls
`on_kernel`, which keeps the cell's parent message, read on the cell's thread: ipykernel 7
keeps it per thread); the session's one sampler looks at
them (sampler.py) and ticks. The first tick reads the CPU time from then on (cores busy
is said from the second tick) and chooses where to draw: a display on an ipykernel, a
status line where the report prints and stdout is a terminal, nowhere otherwise. Where a
tick ran (`touched`), `stop` (in `post_run_cell`, before the report is shown) waits for
a tick running at that moment, erases the line, and says what the report must do with
it (`Ended`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..kernel_publish import parent_of
from . import spark
from .kernel import KernelDisplay
from .reads import Reader
from .sampler import Sampler
from .streams import StreamWatch
from .terminal import TerminalLine
from .text import line

DEFAULT_LABEL = "running"


@dataclass
class Ended:
    """What a cell's live line left: the display the report replaces in place (None:
    none, or the cell wrote under it, so the report comes after and the display is
    emptied), and why a part of the line was dropped."""

    display: KernelDisplay | None = None
    replace: bool = False  # the report takes the display's place
    dropped: list[str] = field(default_factory=list)
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def pictures(self, wall_s: float) -> list[tuple[str, str]]:
        """The memory over the cell (text, HTML), for cells of spark.MIN_CELL_S or more."""
        if wall_s < spark.MIN_CELL_S:
            return []
        drawn = (spark.picture(name, kept) for name, kept in self.samples.items())
        return [p for p in drawn if p is not None]


class _Cell:
    """What the first tick of a cell makes (a short cell makes none of it)."""

    def __init__(self, reader: Reader, frontend: KernelDisplay | TerminalLine | None) -> None:
        self.reader, self.frontend = reader, frontend
        self.watch: StreamWatch | None = None
        if frontend is not None:
            self.watch = StreamWatch(frontend.before_write)
            self.watch.install()


class LiveLine:
    """The session's live line: on when `delay_s` > 0, after that many seconds of a cell."""

    def __init__(self, line_open: Callable[[], bool] = lambda: False,
                 host_start: Callable[[], int | None] = lambda: None,
                 printing: Callable[[], bool] = lambda: True) -> None:
        self._delay_s = 1.0
        self.period_s = 1.0  # between two ticks (tests make it shorter)
        self._line_open = line_open  # the cell's output so far ends inside a line (terminal)
        self._host_start = host_start  # RSS at the cell's start, where the report read it
        self._printing = printing  # the report prints the running cell's line
        # The board (see sampler.py): plain attributes, set without a call or a lock.
        self.cell: float | None = None  # the running cell's start (the report's clock)
        self.touched: float | None = None  # the sampler ticked this cell
        self.idle = True  # the sampler sleeps until `wake` (or is not started)
        self._label: tuple[float | None, str] = (None, DEFAULT_LABEL)  # a cell's own
        self._main_thread = 0  # the cells' thread, as `wake` finds it
        # on a kernel: its display publisher and the running cell's parent header
        self._kernel: tuple[Any, dict[str, Any]] | None = None
        self._sampler = Sampler(self, self._tick)
        self._cell: _Cell | None = None  # made by the first tick

    @property
    def thread_alive(self) -> bool:
        return self._sampler.alive

    @property
    def delay_s(self) -> float:
        return self._delay_s

    @delay_s.setter
    def delay_s(self, value: float) -> None:
        self._delay_s = value
        self._sampler.look()  # a sleep of the old delay ends now

    def wake(self) -> None:
        """A cell began while the sampler sleeps (`idle`): on the cell's thread."""
        self._main_thread = threading.get_ident()
        self._sampler.wake()

    def on_kernel(self, publisher: Any) -> None:
        """A cell starts where the report is not printed (on its thread, before `cell` is
        set): the kernel's IOPub to draw on, None where it is none that we can queue on."""
        parent = parent_of(publisher)
        self._kernel = None if parent is None else (publisher, parent)

    def say(self, label: str) -> None:
        """What the running cell is doing ('profiling'), first in its line."""
        self._label = (self.cell, label)

    def _tick(self, started: float) -> bool:
        """One tick of the cell that started at `started` (on the sampler's thread);
        False: nowhere to draw, no more ticks."""
        cell = self._cell
        if cell is None:  # the first: the CPU time is read from here on, not at the start
            reader = Reader(started, self._main_thread, self._host_start())
            frontend: KernelDisplay | TerminalLine | None = None
            printing, kernel = self._printing(), self._kernel
            if not printing and kernel is not None:
                frontend = KernelDisplay(*kernel)
            elif printing and _is_tty(sys.stdout):
                frontend = TerminalLine(sys.stdout, self._line_open())
            cell = self._cell = _Cell(reader, frontend)
        if cell.frontend is None:
            return False
        said, label = self._label
        cell.frontend.draw(line(label if said is started else DEFAULT_LABEL, cell.reader.read()))
        return True

    def stop(self) -> Ended | None:
        """The cell that a tick `touched` ended (`cell` None already): no tick after this
        returns; the terminal's line is erased. None where it drew nothing."""
        self._sampler.end()
        self.touched = None
        cell, self._cell = self._cell, None
        if cell is None:
            return None
        if cell.watch is not None:
            cell.watch.remove()
        frontend, reader = cell.frontend, cell.reader
        ended = Ended(dropped=reader.why_dropped(), samples=reader.samples)
        if isinstance(frontend, TerminalLine):
            frontend.erase()
        elif isinstance(frontend, KernelDisplay) and frontend.shown:
            ended.display, ended.replace = frontend, not frontend.written_after
        return ended

    def close(self) -> None:
        """Stop the thread (unload, %reload_ext)."""
        self.cell = None
        self.stop()
        self._sampler.close()
        self._sampler = Sampler(self, self._tick)


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:  # a closed or odd stream: no terminal to draw on
        return False
