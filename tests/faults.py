"""Fault injection: out of memory (or any error) at the n-th tensor made on a device; a real
SIGINT some time after a function is first called."""

from __future__ import annotations

import gc
import os
import signal
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class FailOnAllocation(TorchDispatchMode):
    """Raise `error` (OutOfMemoryError) at the n-th tensor created on `device`; n=0 only counts.

    `alive()` lists the tensors it saw created there that are still alive.
    """

    def __init__(self, device: torch.device, n: int, error: BaseException | None = None) -> None:
        super().__init__()
        self.device, self.n, self.count = torch.device(device), n, 0
        self.made: list[weakref.ref] = []
        self.error = error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inplace = func._schema.name.endswith("_")
        if isinstance(out, torch.Tensor) and out.device == self.device and not inplace:
            self.count += 1
            self.made.append(weakref.ref(out))
            if self.count == self.n:
                del out
                raise self.error
        return out

    def alive(self) -> list[torch.Tensor]:
        gc.collect()
        return [t for t in (ref() for ref in self.made) if t is not None]


def sigint_on(monkeypatch, module: object, name: str, delay: float, timers: list) -> None:
    """Send a real SIGINT `delay` seconds after `module.<name>` is first called (the timer
    goes into `timers`), from another thread, as a Ctrl-C comes."""
    real = getattr(module, name)

    def armed(*args, **kwargs):
        if not timers:
            timers.append(threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)))
            timers[0].start()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, armed)


def settle(timers: list) -> None:
    """Wait until the timers' SIGINTs are sent and Python has handled them."""
    for timer in timers:
        timer.join()
    for _ in range(10_000):
        pass
