"""The one thread of the session that ticks the live line of the cell running now.

It is started with the first cell, and sleeps on a condition between cells. A cell
takes no lock: `begin` and `end` only set which cell runs (one attribute each), and
wake the thread only where its sleep would end after the cell's first tick is due (in
a run of short cells the thread wakes about once a delay, at the due time of a cell
that has ended, to look at the current one; after an idle time, once); `end` waits
only for a tick of its own cell that is running at that moment. While a cell runs, the
thread waits for the delay, then ticks about once a `period_s`, from the clock. A fork
(a DataLoader's workers) copies no thread: the child forgets it
(`os.register_at_fork`), and starts none of its own.
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
MIN_GAP_S = 0.05  # between two ticks, after one that ran late (a frozen GIL)


class Sampler:
    """Calls `tick()` for the cell begun, from its due time on, each `period_s` after,
    until `end` or until `tick()` returns False (nowhere to draw)."""

    def __init__(self, tick: Callable[[], bool]) -> None:
        self.period_s = 1.0
        self._tick = tick
        self._cond = threading.Condition(threading.Lock())
        # Set by the cell's thread without the lock (one store each: the thread reads
        # them and checks again under the lock before it sleeps or ticks):
        self._due: float | None = None  # the running cell's first tick; None: none runs
        self._latest: float | None = None  # the last cell begun's first tick
        self._thread: threading.Thread | None = None
        self._closed = False
        self._ticking: float | None = None  # the `_due` of the cell whose tick runs now
        self._waking_at = math.inf  # when the thread's wait ends by itself (inf: never)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def begin(self, first_at: float, period_s: float) -> None:
        """A cell begins: tick from the clock's `first_at` on, each `period_s`, until `end`."""
        self.period_s = period_s
        self._latest = self._due = first_at
        if self._waking_at > first_at:  # else the thread wakes in time by itself
            with self._cond:
                if self._thread is None and not self._closed:
                    self._thread = threading.Thread(
                        target=self._run, name="torch_device_magic live line", daemon=True)
                    _samplers.add(self)
                    self._thread.start()
                self._cond.notify()

    def end(self) -> None:
        """The cell ends; when this returns, no tick of it runs."""
        due, self._due = self._due, None
        if due is not None and self._ticking is due:
            with self._cond:
                while self._ticking is due and self._thread is not threading.current_thread():
                    self._cond.wait()

    def close(self) -> None:
        """End the thread (at unload); waits for it."""
        self.end()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self._thread = None

    def _forked(self) -> None:
        """In a forked child: the thread is not there; the condition may be held by it."""
        self._cond = threading.Condition(threading.Lock())
        self._due = self._latest = self._ticking = self._thread = None
        self._closed = True

    def _run(self) -> None:
        cond = self._cond
        followed: float | None = None  # the `_due` of the cell ticked, and its next tick
        next_at = math.inf
        with cond:
            while not self._closed:
                due, latest, now = self._due, self._latest, clock()
                if due is not followed:
                    followed, next_at = due, (math.inf if due is None else due)
                if due is not None and next_at <= now:
                    next_at = self._ticked(due, next_at)
                    continue
                # asleep until the running cell's next tick, or the due time of the last
                # cell begun (any cell begun later is due later), or a cell's `begin`
                target = min(next_at, latest if latest is not None and latest > now
                             else math.inf)
                self._waking_at = target
                if self._due is not due or self._latest is not latest or self._closed:
                    continue  # a cell began or ended meanwhile: look again
                cond.wait(None if target == math.inf else target - now)
                self._waking_at = math.inf

    def _ticked(self, due: float, next_at: float) -> float:
        """Tick the cell due at `due` (the condition held, released for the tick); its
        next tick's time, from the clock (inf: no more)."""
        cond = self._cond
        self._ticking = due
        if self._due is not due:  # it ended meanwhile
            self._ticking = None
            cond.notify_all()
            return math.inf
        cond.release()
        more = True
        try:
            more = self._tick()
        except Exception:  # never into the cell; the line just stops changing
            _log.debug("a live tick failed", exc_info=True)
        finally:
            cond.acquire()
            self._ticking = None
            cond.notify_all()
        return max(next_at + self.period_s, clock() + MIN_GAP_S) if more else math.inf


def _after_fork_in_child() -> None:
    for sampler in list(_samplers):
        sampler._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
