"""The live line in a terminal: one status line at the bottom of the cell's output,
redrawn with a carriage return and erase-line, and erased before the cell writes
anything (and at its end), so that the cell's own output is never garbled."""

from __future__ import annotations

import shutil
import threading
from typing import Any

ERASE = "\r\x1b[2K"


class TerminalLine:
    """The line on `stream` (a terminal), written past any wrapper of its `write`."""

    def __init__(self, stream: Any, line_open: bool) -> None:
        self.stream = stream
        self._lock = threading.Lock()  # held for one write of the line, or one erase
        self._drawn = False
        self._line_open = line_open  # the cell's output ends inside a line: no room to draw

    def _write(self, text: str) -> None:
        type(self.stream).write(self.stream, text)
        self.stream.flush()

    def draw(self, text: str) -> None:
        width = shutil.get_terminal_size().columns - 1  # a wrapped line could not be erased
        with self._lock:
            if not self._line_open:
                self._write(ERASE + text[:max(width, 10)])
                self._drawn = True

    def before_write(self, text: str) -> None:
        with self._lock:
            if self._drawn:
                self._write(ERASE)
                self._drawn = False
            self._line_open = not text.endswith("\n")

    def erase(self) -> None:
        self.before_write("\n")
