"""The one thread of the session that ticks the live line of the cell running now.

It is started with the first cell, and sleeps on a condition between cells. A cell
pays the condition's lock at its start and at its end, and wakes the thread only where
its sleep would end after the cell's first tick is due: in a run of short cells the
thread wakes about once a delay (at the due time of a cell that has ended, to take the
current one's). While a cell runs,
it waits for the delay, then ticks about once a `period_s`; `end` returns only when no
tick of that cell can draw any more. A fork (a DataLoader's workers) copies no thread:
the child forgets it (`os.register_at_fork`), and starts none of its own.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import weakref
from collections.abc import Callable

from ..probes import clock

_log = logging.getLogger(__name__)
_samplers: weakref.WeakSet[Sampler] = weakref.WeakSet()


class Sampler:
    """Calls `tick()` of the cell begun, from a given time on, each `period_s` after."""

    def __init__(self) -> None:
        self.period_s = 1.0
        self._cond = threading.Condition()
        self._tick: Callable[[], None] | None = None
        self._next = 0.0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._ticking = False  # a tick runs now, outside the condition
        self._waking_at = math.inf  # when the thread's wait ends by itself (inf: never)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin(self, tick: Callable[[], None], first_at: float, period_s: float) -> None:
        """Tick `tick` from the clock's `first_at` on, each `period_s`, until `end`."""
        with self._cond:
            self.period_s = period_s
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="torch_device_magic live line", daemon=True)
                _samplers.add(self)
                self._thread.start()
            self._tick, self._next = tick, first_at
            if self._waking_at > first_at:  # else it wakes in time by itself
                self._cond.notify()

    def end(self) -> None:
        """Stop ticking the cell begun; when this returns, no tick of it runs."""
        with self._cond:
            self._tick = None
            while self._ticking and self._thread is not threading.current_thread():
                self._cond.wait()

    def end_from_tick(self) -> None:
        """From the tick itself: no more ticks for this cell (nowhere to draw)."""
        with self._cond:
            self._tick = None

    def close(self) -> None:
        """End the thread (at unload); waits for it."""
        with self._cond:
            self._tick, self._closed = None, True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self._thread = None

    def _forked(self) -> None:
        """In a forked child: the thread is not there; the condition may be held by it."""
        self._cond = threading.Condition()
        self._tick, self._thread, self._ticking, self._closed = None, None, False, True

    def _run(self) -> None:
        cond = self._cond
        with cond:
            while not self._closed:
                tick = self._tick
                if tick is None:
                    self._waking_at = math.inf
                    cond.wait()
                    continue
                wait = self._next - clock()
                if wait > 0:
                    self._waking_at = self._next
                    cond.wait(wait)
                    continue
                self._waking_at = math.inf
                self._ticking = True
                cond.release()
                try:
                    tick()
                except Exception:  # never into the cell; the line just stops changing
                    _log.debug("a live tick failed", exc_info=True)
                finally:
                    cond.acquire()
                    self._ticking = False
                    cond.notify_all()
                self._next = max(self._next + self.period_s, clock() + 0.05)


def _after_fork_in_child() -> None:
    for sampler in list(_samplers):
        sampler._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
