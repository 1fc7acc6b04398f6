"""The one thread of the session that ticks the live line of the cell running now.

A cell calls nothing here: the cell's thread and this one speak through plain attributes
of a `Board` (the `LiveLine`). As a cell starts, the report sets `board.cell` to the
cell's start on the clock (and to None as it ends); the thread looks at it about once a
delay, and ticks a cell from its start plus the delay on, about once a `period_s`, from
the clock. Before a tick it sets `board.touched` to the cell, then looks again: so the
report, which sets `cell` to None and then reads `touched`, either sees that the cell
was ticked (and calls `end`, which waits for a tick running at that moment) or the
thread sees that the cell ended, and ticks no more (both hold the GIL in turn: each sees
the other's store). After `IDLE_POLLS` looks with no cell running, the thread sleeps
until a cell `wake`s it (`board.idle`: the report reads it as a cell starts). It is
started by the first cell's `wake`. A fork (a DataLoader's workers) copies no thread:
the child forgets it (`os.register_at_fork`), and starts none of its own.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from ..probes import clock

_log = logging.getLogger(__name__)
_samplers: weakref.WeakSet[Sampler] = weakref.WeakSet()
MIN_GAP_S = 0.05  # between two ticks, after one that ran late (a frozen GIL)
IDLE_POLLS = 60  # looks with no cell running (a minute at the default delay), then asleep


class Board(Protocol):
    """What the cell's thread and the sampler's say to each other (plain attributes)."""

    cell: float | None  # set by the report: the running cell's start; None between cells
    touched: float | None  # set by the thread before it ticks `cell`
    idle: bool  # set by the thread: asleep until `wake` (or not started)
    delay_s: float  # 0: no ticks
    period_s: float


class Sampler:
    """Calls `tick(cell)` for the `board`'s running cell from its start plus the delay on,
    each `period_s` after, until the cell ends or `tick` returns False (nowhere to draw)."""

    def __init__(self, board: Board, tick: Callable[[float], bool]) -> None:
        self._board, self._tick = board, tick
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None
        self._closed = False
        self._ticking = False  # a tick runs now (its lock released)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wake(self) -> None:
        """A cell began while the thread sleeps (or before it is started)."""
        with self._cond:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="torch_device_magic live line", daemon=True)
                _samplers.add(self)
                self._thread.start()
            self._board.idle = False
            self._cond.notify()

    def look(self) -> None:
        """Have the thread (if started) look at the board now (its delay changed)."""
        with self._cond:
            self._cond.notify()

    def end(self) -> None:
        """The board's cell ended (its `cell` None already): when this returns, no tick of
        it runs."""
        with self._cond:
            while self._ticking and self._thread is not threading.current_thread():
                self._cond.wait()

    def close(self) -> None:
        """End the thread (at unload); waits for it."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self._thread = None
        self._board.idle = True

    def _forked(self) -> None:
        """In a forked child: the thread is not there; the condition may be held by it."""
        self._cond = threading.Condition(threading.Lock())
        self._thread, self._ticking, self._closed = None, False, True

    def _run(self) -> None:
        board, cond = self._board, self._cond
        polls = 0  # looks in a row with no cell running
        with cond:
            while not self._closed:
                cell, delay = board.cell, board.delay_s
                if cell is not None and delay:
                    polls = 0
                    self._follow(cell)
                    continue
                polls += 1
                if polls < IDLE_POLLS:
                    cond.wait(delay or 1.0)
                    continue
                board.idle = True  # then look again: a cell that began meanwhile reads
                if board.cell is None and not self._closed:  # idle True, or is seen here
                    cond.wait()  # until a cell's `wake`, or `close`
                board.idle, polls = False, 0

    def _follow(self, cell: float) -> None:
        """Tick `cell` from its due time on, until it ends (the condition held, released
        while asleep and for each tick)."""
        board, cond = self._board, self._cond
        next_at = cell + board.delay_s
        while not self._closed and board.cell is cell and board.delay_s:
            now = clock()
            if now < next_at:  # (inf: nowhere to draw; it waits to see the cell end)
                cond.wait(min(next_at - now, board.delay_s))
            else:
                next_at = self._ticked(cell, next_at)

    def _ticked(self, cell: float, next_at: float) -> float:
        """Tick `cell` (the condition held, released for the tick); its next tick's time,
        from the clock (inf: no more)."""
        board, cond = self._board, self._cond
        board.touched = cell
        if board.cell is not cell:  # it ended meanwhile
            board.touched = None
            return math.inf
        self._ticking = True
        cond.release()
        more = True
        try:
            more = self._tick(cell)
        except Exception:  # never into the cell; the line just stops changing
            _log.debug("a live tick failed", exc_info=True)
        finally:
            cond.acquire()
            self._ticking = False
            cond.notify_all()
        return max(next_at + board.period_s, clock() + MIN_GAP_S) if more else math.inf


def _after_fork_in_child() -> None:
    for sampler in list(_samplers):
        sampler._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
