"""What one cell did to accelerator memory: the engine of `%%gpumem`.

    In [4]: %%gpumem
       ...: y = model(x)
    %%gpumem cuda:0 (NVIDIA H200)
    measure                  value
    -----------------------  ---------------------------------
    wall time                212.4 ms (device synchronised)
    device time              211.9 ms (current stream)
    allocated                1.2 GiB -> 2.2 GiB (+1.0 GiB)
    ...

It measures with the same `Meter` as the per-cell report, always synchronised,
adds the NVML figure for the whole device and names the largest tensors the
cell bound in the namespace. It remembers only names and `id`s of what was
there before, never the objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .measure import Measurement, Meter
from .namespace import shape_of
from .probes import active_accelerator, nvml_used_bytes
from .reports import Table
from .tensors import storage_bytes
from .units import fmt_bytes, fmt_seconds
from .workers import Worker

TENSORS_SHOWN = 5
_ALLOCATORS = {
    "uncached": "none (PYTORCH_NO_CUDA_MEMORY_CACHING=1: torch keeps no counts)",
}


@dataclass(slots=True)
class TensorInfo:
    """One tensor the cell left in the namespace: its name and what it occupies."""

    name: str
    shape: tuple[int | None, ...]  # None: a nested tensor's ragged dimension
    dtype: str
    device: str
    bytes: int


@dataclass(slots=True)
class GpumemReport(Measurement):
    """The `%%gpumem` report: the `Measurement` fields plus NVML and the largest tensors."""

    device_description: str | None = None  # 'cuda:0 (NVIDIA H200)'
    allocator: str | None = None  # CUDA's backend: 'native', 'cudaMallocAsync', 'uncached'
    nvml_used_bytes: int | None = None  # device-wide, all processes and the context
    tensors: list[TensorInfo] = field(default_factory=list)
    processes: list[Worker] = field(default_factory=list)  # the cell's workers, one by one
    asked: str | None = None  # the device --device named ('cpu'); None: the session's

    def tables(self) -> list[Table]:
        """The measures, then the cell's workers and the largest new tensors (where the
        cell had any)."""
        host = (
            f"{fmt_bytes(self.host_delta_bytes, signed=True)}, "
            f"peak {fmt_bytes(self.host_peak_bytes)} above the start"
        )
        if self.host_delta_bytes is None and self.host_peak_bytes is None:
            host = "n/a"  # not "n/a, peak n/a above the start"
        if self.device is None:
            title = "%%gpumem: no accelerator in use, so host memory only"
            if self.asked == "cpu":
                title = "%%gpumem cpu: host memory only"
            elif self.asked is not None:  # named, but its runtime has not started
                title = (f"%%gpumem {self.asked}: not in use (its runtime is not up), so host "
                         "memory only")
            rows = [["wall time", fmt_seconds(self.wall_s)], ["host RSS", host]]
        else:
            title = f"%%gpumem {self.device_description or self.device}"
            rows = [
                ["wall time", f"{fmt_seconds(self.wall_s)} (device synchronised)"],
                # Events on the device's current stream: work on other streams is not in it.
                ["device time", f"{fmt_seconds(self.device_s)} (current stream)"],
                ["allocated", self._allocated()],
                ["peak", f"{fmt_bytes(self.device_peak_bytes)} above the start"],
                ["reserved (cache)", fmt_bytes(self.device_reserved_delta_bytes, signed=True)],
                ["device used (NVML)", f"{fmt_bytes(self.nvml_used_bytes)} (all processes)"],
                ["host RSS", host],
            ]
            if self.allocator is not None:
                rows.insert(5, ["allocator", _ALLOCATORS.get(self.allocator, self.allocator)])
            if self.other_devices is not None:
                rows.append(["also changed", f"{self.other_devices} (synchronised, not shown)"])
            if self.device_error is not None:
                rows.append(["error at the end", self.device_error])
        if self.workers is not None:
            rows.append(["workers", self.workers.summary()])
        out = [Table(title, ["measure", "value"], rows)]
        if self.processes:
            out.append(self._workers_table())
        if self.tensors:
            out.append(
                Table(
                    "largest tensors the cell left in the namespace",
                    ["name", "shape", "dtype", "device", "size"],
                    [
                        [t.name, tuple(t.shape), t.dtype, t.device, fmt_bytes(t.bytes)]
                        for t in self.tensors
                    ],
                )
            )
        return out

    def _workers_table(self) -> Table:
        """A row per worker: its peak and PSS, and on a GPU its memory there (NVML)."""
        note = None if self.workers is None else self.workers.note
        gpu = note is not None or any(
            w.device_bytes is not None for w in self.processes
        )
        headers = ["pid", "state", "peak", "PSS at the end"] + (["GPU (NVML)"] if gpu else [])
        rows = []
        for w in self.processes:
            if w.exited:
                row = [w.pid, "exited", "-", "-"]
            else:
                row = [w.pid, "running", fmt_bytes(w.peak_bytes), fmt_bytes(w.pss_bytes)]
            rows.append(row + (["-" if w.device_bytes is None else fmt_bytes(w.device_bytes)]
                               if gpu else []))
        notes = []
        if any(w.exited for w in self.processes):
            notes.append(
                "an exited worker's peak is not kept process by process: the largest is in "
                "the workers row (getrusage)"
            )
        if note is not None:
            notes.append(note)
        return Table("the cell's worker processes", headers, rows, notes)

    def _allocated(self) -> str:
        after, delta = self.device_allocated_bytes, self.device_delta_bytes
        before = None if after is None or delta is None else after - delta
        return f"{fmt_bytes(before)} -> {fmt_bytes(after)} ({fmt_bytes(delta, signed=True)})"

    def __str__(self) -> str:
        return "\n\n".join(t.text() for t in self.tables())

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        return {"text/plain": str(self), "text/html": "".join(t.html() for t in self.tables())}


def tensor_ids(namespace: dict[str, Any]) -> dict[str, int]:
    """`{name: id(tensor)}` for the tensors a namespace binds (no reference kept)."""
    return {k: id(v) for k, v in namespace.items() if isinstance(v, torch.Tensor)}


def new_tensors(
    namespace: dict[str, Any], before: dict[str, int], limit: int = TENSORS_SHOWN
) -> list[TensorInfo]:
    """The largest tensors bound to names that are new or rebound since `before`."""
    found = [
        TensorInfo(k, shape_of(v), str(v.dtype).removeprefix("torch."), str(v.device),
                   storage_bytes(v))
        for k, v in namespace.items()
        if isinstance(v, torch.Tensor) and before.get(k) != id(v) and not k.startswith("_")
    ]
    return sorted(found, key=lambda t: t.bytes, reverse=True)[:limit]


def measure(
    namespace: dict[str, Any], run: Callable[[], Any], device: torch.device | None = None
) -> tuple[GpumemReport, Any]:
    """Call `run` (a cell compiled by `cells.compiled`) measured on `device` (default: the
    session's accelerator); the report and its value. New tensors are looked for in
    `namespace`."""
    __tracebackhide__ = True
    before = tensor_ids(namespace)
    meter = Meter(sync=True)
    meter.start(device)
    try:
        value = run()
        measured = meter.stop()
    finally:
        meter.close()
    accel = None if measured.device is None else active_accelerator(measured.device)
    report = GpumemReport(
        **{f.name: getattr(measured, f.name) for f in fields(Measurement)},  # workers kept whole
        device_description=None if accel is None else accel.description(),
        allocator=None if accel is None else accel.allocator(),
        nvml_used_bytes=nvml_used_bytes(accel),
        tensors=new_tensors(namespace, before),
        processes=list(meter.workers.processes),
        asked=None if device is None else str(device),
    )
    return report, value
