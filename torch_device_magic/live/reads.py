"""What the live line reads once a tick, through `probes` alone; a part that fails once is
dropped for the rest of the cell, and why is kept for the cell's report."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ..advice.thresholds import capacity_share
from ..probes import (
    Accelerator,
    active_accelerator,
    clock,
    cpu_seconds,
    guarded,
    nvml_busy_since,
    nvml_status,
    rss_bytes,
)
from .text import Reading
from .where import cell_line

MAX_SAMPLES = 240


class Reader:
    """The ticks of one cell: elapsed from the clock, where the main thread is, host memory
    and its change, cores busy since the last tick, the accelerator's allocator figures
    (only where its runtime is up: nothing is started, nothing synchronised)."""

    def __init__(self, started: float, main_thread: int, host_bytes: int | None = None) -> None:
        self.started = started
        self.main_thread = main_thread
        self.dropped: dict[str, str] = {}  # part: why it was dropped
        # (elapsed, bytes) a tick, for the report's picture; halved past MAX_SAMPLES
        self.samples: dict[str, list[tuple[float, int]]] = {}
        self.host_start_bytes = host_bytes  # the cell's; else the first tick's
        # (clock, CPU time) at the last tick: none at the first, so cores busy from the second
        self._cpu: tuple[float, float] | None = None
        self._accel: Accelerator | bool | None = False  # False: not looked for yet
        self._total: int | None = None  # the device's memory, read once
        self._busy_asked = self._busy_read = False  # NVML asked; a figure it gave
        # NVML's clock (wall time, µs) at the last tick, or at the cell's start
        self._nvml_since_us = int((time.time() - (clock() - started)) * 1e6)

    def read(self) -> Reading:
        now = clock()
        where = self._part("where", cell_line, self.main_thread)
        host = self._part("host memory", rss_bytes)
        if host is not None and self.host_start_bytes is None:
            self.host_start_bytes = host
        host0 = self.host_start_bytes
        cores = self._part("cores busy", self._cores, now)
        device, allocated, peak = self._part("device memory", self._device) or (None, None, None)
        busy = self._part("GPU busy", self._busy) if device is not None else None
        near = (None if peak is None or not self._total
                else capacity_share(peak, self._total))
        self._keep("host", now - self.started, host)
        if device is not None:
            self._keep(device, now - self.started, allocated)
        return Reading(
            elapsed_s=now - self.started, where=where, host_bytes=host,
            host_delta_bytes=None if host is None or host0 is None else host - host0,
            cores_busy=cores, device=device, device_bytes=allocated, device_peak_bytes=peak,
            device_total_bytes=self._total, near_capacity=near, gpu_busy=busy,
        )

    def _keep(self, name: str, elapsed_s: float, value: int | None) -> None:
        if value is None:
            return
        kept = self.samples.setdefault(name, [])
        kept.append((elapsed_s, value))
        if len(kept) > MAX_SAMPLES:  # every other one: an hour's cell keeps 2 a minute
            kept[:] = kept[::2]

    def _part(self, name: str, read: Any, *args: Any) -> Any:
        if name in self.dropped:
            return None
        try:
            return read(*args)
        except Exception as err:
            self.dropped[name] = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            return None

    def _cores(self, now: float) -> float | None:
        cpu, last = cpu_seconds(), self._cpu
        self._cpu = (now, cpu)
        if last is None or now <= last[0]:
            return None
        return max(0.0, (cpu - last[1]) / (now - last[0]))

    def _device(self) -> tuple[str, int | None, int | None] | None:
        if self._accel is False:
            self._accel = active_accelerator()
            if isinstance(self._accel, Accelerator) and self._accel.kind == "cuda":
                props = guarded(torch.cuda.get_device_properties, self._accel.index)
                self._total = getattr(props, "total_memory", None)  # CUDA is up: no start
        accel = self._accel
        if not isinstance(accel, Accelerator):
            return None
        counters = accel.counters()
        return accel.name, counters.allocated_bytes, counters.peak_bytes

    def _busy(self) -> float | None:
        """How busy the CUDA device was since the last tick (NVML's own samples)."""
        accel = self._accel
        if not isinstance(accel, Accelerator) or accel.kind != "cuda":
            return None
        if nvml_status()[0] is None:  # said once, in the report: the part is dropped
            self.dropped["GPU busy"] = nvml_status()[1]
            return None
        since, self._nvml_since_us = self._nvml_since_us, int(time.time() * 1e6)
        self._busy_asked = True
        try:
            busy = nvml_busy_since(accel.index, since, {os.getpid()})
        except RuntimeError as err:  # NVML failed: said once, in the report
            self.dropped["GPU busy"] = str(err)
            return None
        self._busy_read = self._busy_read or busy is not None
        return busy

    def why_dropped(self) -> list[str]:
        """One sentence a part that failed: what the final report says."""
        if self._busy_asked and not self._busy_read and "GPU busy" not in self.dropped:
            self.dropped["GPU busy"] = "NVML gave no samples; an idle GPU gives none"
        return [f"live line: {name} was not read ({why.removeprefix('NVML is ')})"
                for name, why in self.dropped.items()]
