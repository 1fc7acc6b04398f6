"""The live line's words, from one `Reading`.

    running 0:42 | at line 7: loss.backward() | cuda:0 12.4 GiB allocated (peak 14.1 GiB)
    | host 3.1 GiB (+1.2 GiB) | 1.0 cores busy   (one line)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..units import fmt_bytes


@dataclass(frozen=True)
class Reading:
    """One tick's figures; None where not read."""

    elapsed_s: float
    where: str | None = None
    host_bytes: int | None = None
    host_delta_bytes: int | None = None
    cores_busy: float | None = None
    device: str | None = None  # 'cuda:0', where an accelerator's runtime is up
    device_bytes: int | None = None  # allocated now
    device_peak_bytes: int | None = None
    device_total_bytes: int | None = None
    near_capacity: float | None = None  # the peak's share of the device, where near it
    gpu_busy: float | None = None  # percent, since the last tick (NVML)


def clock_text(seconds: float) -> str:
    """0:42, 12:03, 1:02:03."""
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def line(label: str, reading: Reading) -> str:
    """The line: `label` ('running', 'profiling') and the elapsed time first."""
    parts = [f"{label} {clock_text(reading.elapsed_s)}"]
    if reading.where:
        parts.append(reading.where)
    if reading.gpu_busy is not None:
        parts.append(f"GPU {reading.gpu_busy:.0f}% busy")
    if reading.device is not None and reading.device_bytes is not None:
        of = ("" if reading.device_total_bytes is None
              else f" of {fmt_bytes(reading.device_total_bytes)}")
        peak = ("" if reading.device_peak_bytes is None
                else f" (peak {fmt_bytes(reading.device_peak_bytes)}{of})")
        parts.append(f"{reading.device} {fmt_bytes(reading.device_bytes)} allocated{peak}")
        if reading.near_capacity is not None:
            parts.append(f"NEAR CAPACITY: peak at {reading.near_capacity:.0%} of the device's "
                         "memory")
    if reading.host_bytes is not None:
        change = ("" if reading.host_delta_bytes is None
                  else f" ({fmt_bytes(reading.host_delta_bytes, signed=True)})")
        parts.append(f"host {fmt_bytes(reading.host_bytes)}{change}")
    if reading.cores_busy is not None:
        parts.append(f"{reading.cores_busy:.1f} cores busy")
    return " | ".join(parts)
