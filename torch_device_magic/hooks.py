"""The per-cell reporter: one object owns every IPython event callback of ours.

`register(ip)` first drops callbacks that an older instance left behind (a
reload after a failed unload), so there is always exactly one set; pre and
post are paired through `result.info`, since blank cells and the `%load_ext`
cell fire `post_run_cell` without `pre_run_cell`.
"""

from __future__ import annotations

import time
from typing import Any

EVENTS = ("pre_run_cell", "post_run_cell")


class CellReporter:
    """Times every cell and prints one line after it while `enabled`."""

    def __init__(self) -> None:
        self.enabled = True
        self._info: object = None
        self._start = 0.0

    def register(self, ip: Any) -> None:
        for event in EVENTS:
            for callback in list(ip.events.callbacks[event]):
                if is_ours(callback):
                    ip.events.unregister(event, callback)
        ip.events.register("pre_run_cell", self.pre_run_cell)
        ip.events.register("post_run_cell", self.post_run_cell)

    def unregister(self, ip: Any) -> None:
        for event, callback in zip(EVENTS, (self.pre_run_cell, self.post_run_cell)):
            if callback in ip.events.callbacks[event]:
                ip.events.unregister(event, callback)

    def pre_run_cell(self, info: object) -> None:
        self._info = info
        self._start = time.perf_counter()

    def post_run_cell(self, result: Any) -> None:
        wall_s = time.perf_counter() - self._start
        paired = result.info is self._info
        self._info = None
        if self.enabled and paired:
            from .units import fmt_seconds

            print(f"[{fmt_seconds(wall_s)}]")


def is_ours(callback: object) -> bool:
    """A bound method of an object defined in this package (any instance, any reload)."""
    owner = getattr(callback, "__self__", None)
    return type(owner).__module__.startswith("torch_device_magic.")
