"""Ctrl-C held while torch.profiler starts and stops: a press then waits until that is done,
and reaches the cell's run only."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class CtrlC:
    """The SIGINTs that came while held (see `ctrl_c_held`)."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler  # the one in force before; None: none of ours installed
        self.held = 0
        self.through = False

    def on_sigint(self, signum: int, frame: Any) -> None:
        if not self.through:
            self.held += 1
            return
        self.through = False  # what its KeyboardInterrupt unwinds is not cut in turn
        self.handler(signum, frame)
        self.through = True  # a handler of the user's own that did not raise

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Ctrl-C waits for the block, also inside `let_through` (a press held then comes
        at its end)."""
        through, self.through = self.through, False
        try:
            yield
        finally:
            self.through = through
            if through and self.held:
                self.held -= 1
                self.on_sigint(signal.SIGINT, None)

    @contextlib.contextmanager
    def let_through(self) -> Iterator[None]:
        """Ctrl-C reaches the handler for the block (a press held so far, at once)."""
        if self.handler is None:
            yield
            return
        self.through = True
        try:
            if self.held:
                self.held -= 1
                self.on_sigint(signal.SIGINT, None)
            yield
        finally:
            self.through = False


@contextlib.contextmanager
def ctrl_c_held() -> Iterator[CtrlC]:
    """Hold SIGINT (Ctrl-C, a notebook's stop button) in the block but where `let_through`,
    then hand each press held to the handler in force before (Python's raises
    KeyboardInterrupt). Only in the main thread, where a Python handler is in force."""
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGINT) if main else None
    ctrl_c = CtrlC(handler if callable(handler) else None)
    if ctrl_c.handler is None:
        yield ctrl_c
        return
    signal.signal(signal.SIGINT, ctrl_c.on_sigint)
    try:
        yield ctrl_c
    finally:
        if signal.getsignal(signal.SIGINT) == ctrl_c.on_sigint:  # else the cell set its own
            signal.signal(signal.SIGINT, ctrl_c.handler)
    for _ in range(ctrl_c.held):
        ctrl_c.handler(signal.SIGINT, None)
