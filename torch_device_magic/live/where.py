"""Where a cell is now: the line of the cell's own code that the main thread runs.

    at line 7: loss.backward()

Read from the thread's frames (`sys._current_frames()`), innermost first: the first
frame whose code IPython compiled from a cell (a cell's source is in `linecache`
without a file's modification time; IPython 7 keeps its cells in `_ipython_cache`
too) is the cell's, or a function the notebook defined.
"""

from __future__ import annotations

import linecache
import sys
from typing import Any


def cell_line(thread_id: int) -> str | None:
    """'at line 7: loss.backward()' for the thread `thread_id`; None outside a cell's code."""
    frame = sys._current_frames().get(thread_id)
    ipython_7 = getattr(linecache, "_ipython_cache", ())  # 7.x gives cells an mtime
    while frame is not None:
        code = frame.f_code
        entry: Any = linecache.cache.get(code.co_filename)
        if entry is not None and (entry[1] is None or code.co_filename in ipython_7):
            lines = entry[2]
            number = frame.f_lineno or 0
            text = lines[number - 1].strip() if 0 < number <= len(lines) else ""
            return f"at line {number}: {text}" if text else f"at line {number}"
        frame = frame.f_back
    return None
