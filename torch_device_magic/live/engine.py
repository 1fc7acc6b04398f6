"""`LiveLine`: the live line of the per-cell report, cell by cell.

`start` (in `pre_run_cell`) keeps the cell's start, its parent message on a kernel and
the main thread, and tells the session's one sampler; nothing else happens before the
delay. The first tick chooses where to draw: a display on an ipykernel, a status line
where the report prints and stdout is a terminal, nowhere otherwise. `stop` (in
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
from ..probes import clock, cpu_seconds
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
    def __init__(self, started: float, printing: bool, publisher: Any,
                 parent: dict[str, Any] | None, host_bytes: int | None) -> None:
        self.started, self.main_thread = started, threading.get_ident()
        self.cpu_s, self.host_bytes = cpu_seconds(), host_bytes
        self.reader: Reader | None = None  # made at the first tick: a short cell makes none
        self.printing, self.publisher, self.parent = printing, publisher, parent
        self.frontend: KernelDisplay | TerminalLine | None = None
        self.watch: StreamWatch | None = None


class LiveLine:
    """The session's live line: on when `delay_s` > 0, after that many seconds of a cell."""

    def __init__(self, line_open: Callable[[], bool] = lambda: False) -> None:
        self.delay_s = 1.0
        self.period_s = 1.0  # between two ticks (tests make it shorter)
        self._line_open = line_open  # the cell's output so far ends inside a line (terminal)
        self.label = DEFAULT_LABEL  # what the cell is doing: a magic sets it ('profiling')
        self._sampler = Sampler()
        self._cell: _Cell | None = None

    @property
    def thread_alive(self) -> bool:
        return self._sampler.alive

    def start(self, shell: Any, printing: bool, host_bytes: int | None = None) -> None:
        """A cell starts: on a kernel or where the report prints (a terminal, maybe);
        `host_bytes`: RSS at its start, where the report read it."""
        self.label = DEFAULT_LABEL
        if not self.delay_s:
            return
        started = clock()
        publisher = shell.display_pub
        parent = None if printing else parent_of(publisher)
        if not printing and parent is None:
            return  # neither a kernel whose IOPub we can queue on nor a terminal
        self._cell = _Cell(started, printing, publisher, parent, host_bytes)
        self._sampler.begin(self._tick, started + self.delay_s, self.period_s)

    def _tick(self) -> None:
        cell = self._cell
        if cell is None:
            return
        if cell.reader is None:
            cell.reader = Reader(cell.started, cell.main_thread, cell.cpu_s, cell.host_bytes)
            if cell.parent is not None:
                cell.frontend = KernelDisplay(cell.publisher, cell.parent)
            elif _is_tty(sys.stdout):
                cell.frontend = TerminalLine(sys.stdout, self._line_open())
            if cell.frontend is not None:
                cell.watch = StreamWatch(cell.frontend.before_write)
                cell.watch.install()
        if cell.frontend is not None:
            cell.frontend.draw(line(self.label, cell.reader.read()))
        else:  # nowhere to draw: nothing more to read
            self._sampler.end_from_tick()

    def stop(self) -> Ended | None:
        """The cell ended: no tick after this returns; the terminal's line is erased.
        None where it never ticked."""
        cell, self._cell = self._cell, None
        if cell is None:
            return None
        self._sampler.end()
        if cell.watch is not None:
            cell.watch.remove()
        frontend, reader = cell.frontend, cell.reader
        if reader is None:
            return None  # it never ticked: a short cell
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
        self._sampler = Sampler()


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:  # a closed or odd stream: no terminal to draw on
        return False
