"""`LiveLine`: the live line of the per-cell report, cell by cell.

`start` (in `pre_run_cell`) keeps the cell's start (the report's own reading of the
clock), its parent message on a kernel and the main thread in attributes, and tells the
session's one sampler (no lock, no allocation); nothing else happens before the delay. The first
tick reads the CPU time from then on (cores busy is said from the second tick) and
chooses where to draw: a display on an ipykernel, a status line where the report
prints and stdout is a terminal, nowhere otherwise. `stop` (in
`post_run_cell`, before the report is shown) ends the ticks and erases the line, and
says what the report must do with it (`Ended`).
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
                 host_start: Callable[[], int | None] = lambda: None) -> None:
        self.delay_s = 1.0
        self.period_s = 1.0  # between two ticks (tests make it shorter)
        self._line_open = line_open  # the cell's output so far ends inside a line (terminal)
        self._host_start = host_start  # RSS at the cell's start, where the report read it
        self.label = DEFAULT_LABEL  # what the cell is doing: a magic sets it ('profiling')
        self._sampler = Sampler(self._tick)
        # The running cell, as `start` keeps it (no allocation): its start on the clock,
        # whether the report prints, its shell, its parent message on a kernel, its thread.
        self._running = False
        self._started = 0.0
        self._printing, self._main_thread = True, 0
        self._shell: Any = None
        self._parent: dict[str, Any] | None = None
        self._cell: _Cell | None = None  # made by the first tick

    @property
    def thread_alive(self) -> bool:
        return self._sampler.alive

    def start(self, shell: Any, printing: bool, started: float) -> None:
        """A cell starts at `started` on the clock (the report's own start): on a kernel
        or where the report prints (a terminal, maybe)."""
        self.label = DEFAULT_LABEL
        if not self.delay_s:
            return
        parent = None if printing else parent_of(shell.display_pub)
        if not printing and parent is None:
            return  # neither a kernel whose IOPub we can queue on nor a terminal
        self._started = started
        self._printing, self._shell, self._parent = printing, shell, parent
        self._main_thread = threading.get_ident()
        self._running = True
        self._sampler.begin(started + self.delay_s, self.period_s)

    def _tick(self) -> bool:
        """One tick (on the sampler's thread); False: nowhere to draw, no more ticks."""
        cell = self._cell
        if cell is None:  # the first: the CPU time is read from here on, not at the start
            reader = Reader(self._started, self._main_thread, self._host_start())
            frontend: KernelDisplay | TerminalLine | None = None
            if self._parent is not None:
                frontend = KernelDisplay(self._shell.display_pub, self._parent)
            elif _is_tty(sys.stdout):
                frontend = TerminalLine(sys.stdout, self._line_open())
            cell = self._cell = _Cell(reader, frontend)
        if cell.frontend is None:
            return False
        cell.frontend.draw(line(self.label, cell.reader.read()))
        return True

    def stop(self) -> Ended | None:
        """The cell ended: no tick after this returns; the terminal's line is erased.
        None where it never ticked."""
        if not self._running:
            return None
        self._running = False
        self._sampler.end()
        cell, self._cell = self._cell, None
        self._shell = self._parent = None
        if cell is None:
            return None  # it never ticked: a short cell
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
        self.stop()
        self._sampler.close()
        self._sampler = Sampler(self._tick)


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:  # a closed or odd stream: no terminal to draw on
        return False
