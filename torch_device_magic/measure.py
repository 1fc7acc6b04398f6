"""Measuring one stretch of code: a `Meter` started before it and stopped after.

    meter = Meter()
    meter.start(); x = torch.ones(2**27); del x; m = meter.stop()
    m.host_peak_bytes      # about 512 MiB: the tensor came and went inside
    m.device_delta_bytes   # None: no accelerator was in use

The per-cell report and `%%gpumem` both measure with a `Meter` and read the same
`Measurement` fields. A peak is the most memory above the starting level at any
moment between start and stop.
"""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from .probes import (
    Accelerator,
    Counters,
    HostProbe,
    active_accelerator,
    built_kinds,
    clock,
    host_probe,
)
from .units import fmt_bytes, fmt_seconds


@dataclass(slots=True)
class Measurement:
    """What one cell did to time and memory; a field that could not be measured is None."""

    wall_s: float
    device_s: float | None = None  # None where no accelerator work ran
    device_delta_bytes: int | None = None
    device_peak_bytes: int | None = None
    device_reserved_delta_bytes: int | None = None
    host_delta_bytes: int | None = None
    host_peak_bytes: int | None = None
    device: str | None = None  # the accelerator measured ('cuda:0'); None without one
    device_allocated_bytes: int | None = None  # allocated at the end
    cell: int | None = None  # the cell number, in the per-cell history

    @classmethod
    def field_names(cls) -> list[str]:
        """The record's fields in order, as `%devhistory --csv` writes them."""
        return [f.name for f in fields(cls)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def largest_bytes(self) -> int:
        """The biggest memory figure of the cell (peaks, and changes either way)."""
        figures = (
            self.device_peak_bytes,
            self.device_delta_bytes,
            self.host_peak_bytes,
            self.host_delta_bytes,
        )
        return max((abs(b) for b in figures if b is not None), default=0)

    def summary(self) -> str:
        """The compact line: time, then device and host memory (`n/a` where not measured)."""
        if self.host_delta_bytes is None and self.host_peak_bytes is None:
            host = "host n/a"
        else:
            host = (
                f"host {fmt_bytes(self.host_delta_bytes, signed=True)}"
                f" (peak {fmt_bytes(self.host_peak_bytes)})"
            )
        if self.device is None:
            return f"time {fmt_seconds(self.wall_s)} | {host}"
        gpu_time = "" if self.device_s is None else f" {fmt_seconds(self.device_s)},"
        return (
            f"time {fmt_seconds(self.wall_s)} | {self.device}{gpu_time}"
            f" {fmt_bytes(self.device_delta_bytes, signed=True)}"
            f" (peak {fmt_bytes(self.device_peak_bytes)}) | {host}"
        )

    def __str__(self) -> str:
        return self.summary()

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        text = self.summary()
        return {
            "text/plain": text,
            "text/html": f'<div class="tdm-report" style="font-size:smaller;opacity:.7">'
            f"{html.escape(text)}</div>",
        }


def _sub(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


class Meter:
    """Measures one stretch of code at a time: `start()` before it, `stop()` after."""

    def __init__(self, host: HostProbe | None = None, sync: bool = True) -> None:
        self.host = host if host is not None else host_probe()
        self.sync = sync
        self._kinds = built_kinds()
        self._device: str | torch.device | None = None
        self._accel: Accelerator | None = None
        self._before: Counters | None = None
        self._event: Any = None
        self._t0 = clock()

    def start(self, device: str | torch.device | None = None) -> None:
        """Begin measuring; `device` picks the accelerator (default: the session's)."""
        self._device = device
        self._accel = accel = active_accelerator(device, self._kinds)
        self._before = self._event = None
        if accel is not None:
            self._before = accel.counters()
            accel.start_peak()
            self._event = accel.record_event()
        self.host.start()
        self._t0 = clock()

    def stop(self) -> Measurement:
        """End measuring: synchronise if a runtime is up (and `sync`), read every counter."""
        accel = self._accel or active_accelerator(self._device, self._kinds)
        end_event = None
        if accel is not None and self.sync:
            end_event = accel.record_event() if self._event is not None else None
            accel.synchronize()
        wall_s = clock() - self._t0
        host_delta, host_peak = self.host.stop()
        if accel is None:
            return Measurement(wall_s, host_delta_bytes=host_delta, host_peak_bytes=host_peak)
        after = accel.counters()
        if self._before is None:  # the runtime came up inside the cell: nothing was allocated
            before, peak = Counters(0, 0, 0, 0), after.peak_bytes
        else:
            before = self._before
            sampled = accel.sampled_peak_bytes()
            peak = _sub(after.peak_bytes, before.allocated_bytes) if sampled is None else sampled
        work_ran = after.allocations is None or after.allocations != before.allocations
        return Measurement(
            wall_s,
            device_s=Accelerator.elapsed_s(self._event, end_event) if work_ran else None,
            device_delta_bytes=_sub(after.allocated_bytes, before.allocated_bytes),
            device_peak_bytes=None if peak is None else max(0, peak),
            device_reserved_delta_bytes=_sub(after.reserved_bytes, before.reserved_bytes),
            host_delta_bytes=host_delta,
            host_peak_bytes=host_peak,
            device=accel.name,
            device_allocated_bytes=after.allocated_bytes,
        )

    def close(self) -> None:
        self.host.close()
