"""The per-cell records behind `%devhistory`: a bounded table, a CSV, a plot.

    In [9]: %devhistory
    per-cell history: 3 cells (the last 1000 are kept)
    cell    time  device time  device  device Δ  device peak    host Δ  host peak
    ...

Columns that no kept cell has (the device's, on a CPU machine) are left out.

Only the most recent `maxlen` records are kept, so a session of any length holds
a fixed amount of memory. A record holds numbers and strings, never a user object.
"""

from __future__ import annotations

import csv
import os
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from .errors import DeviceMagicError
from .measure import Measurement
from .reports import Table
from .units import fmt_bytes, fmt_seconds, plural

HEADERS = [
    "cell", "time", "device time", "device", "device Δ", "device peak", "host Δ", "host peak"
]


class History:
    """The last `maxlen` measured cells, oldest first."""

    def __init__(self, maxlen: int = 1000) -> None:
        self._records: deque[Measurement] = deque(maxlen=maxlen)
        # Called after every cell: the deque's own append, with no call of ours around it.
        self.append: Callable[[Measurement], None] = self._records.append

    @property
    def maxlen(self) -> int:
        return self._records.maxlen or 0

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Measurement]:
        return iter(self._records)

    def records(self) -> list[Measurement]:
        """A list of the kept records (what `%devhistory -o` returns)."""
        return list(self._records)

    def table(self) -> Table:
        """Every kept record as a row of human units."""
        rows = [
            [
                "" if r.cell is None else r.cell,
                fmt_seconds(r.wall_s),
                fmt_seconds(r.device_s),
                r.device or "-",
                fmt_bytes(r.device_delta_bytes, signed=True),
                fmt_bytes(r.device_peak_bytes),
                fmt_bytes(r.host_delta_bytes, signed=True),
                fmt_bytes(r.host_peak_bytes),
            ]
            for r in self._records
        ]
        headers = HEADERS
        if any(r.workers for r in self._records):  # a column only where a cell had workers
            headers = [*HEADERS, "workers"]
            for row, r in zip(rows, self._records):
                row.append("-" if r.workers is None else r.workers.summary())
        # A column that no row has (the device's, on a CPU machine) is left out.
        kept = [i for i in range(len(headers)) if any(row[i] not in ("n/a", "-") for row in rows)]
        headers = [headers[i] for i in kept]
        rows = [[row[i] for i in kept] for row in rows]
        title = f"per-cell history: {plural(len(rows), 'cell')} (the last {self.maxlen} are kept)"
        notes = [] if rows else ["no cell measured yet: the report records cells while it is on"]
        peaks = self.session_peaks()
        if peaks:
            notes.append(
                "session peak allocated (max over the kept cells; the report resets torch's "
                "process-wide peak before each cell): "
                + ", ".join(f"{d} {fmt_bytes(b)} in cell {c}" for d, (b, c) in peaks.items())
            )
        return Table(title, headers, rows, notes)

    def session_peaks(self) -> dict[str, tuple[int, int | None]]:
        """`{device: (bytes, cell)}`: the most allocated at any moment of a kept cell, what
        `torch.cuda.max_memory_allocated()` would say had the report not reset it."""
        peaks: dict[str, tuple[int, int | None]] = {}
        for r in self._records:
            device, peak = r.device, r.device_peak_bytes
            allocated, delta = r.device_allocated_bytes, r.device_delta_bytes
            if device is None or peak is None or allocated is None or delta is None:
                continue
            most = allocated - delta + peak  # the cell's start, plus its peak above it
            if device not in peaks or most > peaks[device][0]:
                peaks[device] = (most, r.cell)
        return peaks

    def write_csv(self, path: str) -> int:
        """Write every kept record to `path` (raw numbers, empty where not measured; `~` is
        the home directory)."""
        if not path.strip():
            raise DeviceMagicError("--csv needs a file name, e.g. --csv cells.csv")
        names = Measurement.field_names()
        try:
            with open(os.path.expanduser(path), "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(names)
                for r in self._records:
                    writer.writerow([_csv(v) for v in r.row()])
        except OSError as err:
            raise DeviceMagicError(f"cannot write {path}: {err.strerror or err}") from err
        return len(self._records)

    def plot(self) -> Any:
        """A matplotlib figure of time and memory per cell (matplotlib is optional)."""
        try:
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise DeviceMagicError(
                "--plot needs matplotlib, which is not installed: "
                "pip install matplotlib (or torch-device-magic[plot])"
            ) from err
        if not self._records:
            raise DeviceMagicError("nothing to plot yet: no cell has been measured")
        cells = [r.cell if r.cell is not None else i for i, r in enumerate(self._records)]
        fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
        top.plot(cells, [r.wall_s for r in self._records], ".-", label="wall")
        top.plot(cells, [_or_nan(r.device_s) for r in self._records], ".-", label="device")
        top.set_ylabel("seconds")
        mib = 2**20
        for name, label in (("host_peak_bytes", "host peak"), ("device_peak_bytes", "device peak")):
            values = [_or_nan(getattr(r, name)) / mib for r in self._records]
            bottom.plot(cells, values, ".-", label=label)
        bottom.set_ylabel("MiB above the cell's start")
        bottom.set_xlabel("cell")
        for ax in (top, bottom):
            ax.legend(loc="upper left")
        fig.tight_layout()
        plt.close(fig)  # shown once, by whoever displays it, not again by the inline backend
        return fig


def save_plot(figure: Any) -> str:
    """Write `figure` to a new PNG file in the temporary folder; return its path (for a
    terminal, which would print only the figure's repr)."""
    fd, path = tempfile.mkstemp(prefix="tdm-devhistory-", suffix=".png")
    with os.fdopen(fd, "wb") as f:
        figure.savefig(f, format="png")
    return path


def _csv(value: object) -> object:
    """A field as one CSV cell: empty where not measured, the notes' texts joined."""
    if isinstance(value, tuple):
        return "; ".join(map(str, value))
    return "" if value is None else value


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)
