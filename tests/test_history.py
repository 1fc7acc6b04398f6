"""The per-cell history without a shell: bounded, its table, and the session peak that the
per-cell peak resets would otherwise lose."""

from __future__ import annotations

from torch_device_magic.history import History
from torch_device_magic.measure import Measurement

MiB = 2**20


def cell(n: int, device: str | None, start: int, delta: int, peak: int | None) -> Measurement:
    return Measurement(0.1, device_delta_bytes=delta, device_peak_bytes=peak, device=device,
                       device_allocated_bytes=None if delta is None else start + delta, cell=n)


def test_the_session_peak_is_the_most_allocated_in_any_cell_per_device():
    history = History()
    history.append(cell(1, "cuda:0", start=0, delta=100 * MiB, peak=300 * MiB))
    history.append(cell(2, "cuda:0", start=100 * MiB, delta=0, peak=250 * MiB))  # 350 at most
    history.append(cell(3, "cuda:1", start=0, delta=0, peak=64 * MiB))
    history.append(cell(4, "cuda:0", start=100 * MiB, delta=None, peak=None))  # not measured
    history.append(cell(5, None, start=0, delta=0, peak=0))  # no accelerator in use
    assert history.session_peaks() == {"cuda:0": (350 * MiB, 2), "cuda:1": (64 * MiB, 3)}
    text = history.table().text()
    assert "session peak allocated (max over the kept cells;" in text
    assert "cuda:0 350.0 MiB in cell 2, cuda:1 64.0 MiB in cell 3" in text


def test_without_device_figures_there_is_no_session_peak():
    history = History()
    history.append(cell(1, None, start=0, delta=0, peak=0))
    assert history.session_peaks() == {} and "session peak" not in history.table().text()


def test_a_history_of_one_cell_reads_in_the_singular():
    kept = History()
    kept.append(Measurement(0.1, cell=1))
    assert kept.table().title == "per-cell history: 1 cell (the last 1000 are kept)"


def test_history_is_bounded():
    kept = History(maxlen=3)
    for n in range(10):
        kept.append(Measurement(0.1, cell=n))
    assert [r.cell for r in kept] == [7, 8, 9]


def test_columns_that_no_cell_has_are_left_out():
    history = History()
    history.append(Measurement(0.1, host_delta_bytes=MiB, host_peak_bytes=MiB, cell=1))
    history.append(Measurement(0.2, host_delta_bytes=0, host_peak_bytes=None, cell=2))
    table = history.table()
    assert list(table.headers) == ["cell", "time", "host Δ", "host peak"]
    assert [list(map(str, row)) for row in table.rows] == [
        ["1", "100.0 ms", "+1.0 MiB", "1.0 MiB"], ["2", "200.0 ms", "0 B", "n/a"]
    ]
    history.append(Measurement(0.3, device_s=0.1, device_delta_bytes=0, device_peak_bytes=0,
                               device="cuda:0", device_allocated_bytes=0, cell=3))
    assert "device time" in history.table().headers  # once a cell has it, every row shows it
