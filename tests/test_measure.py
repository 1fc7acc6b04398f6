"""The Meter without a shell, on a fake CUDA machine: delta, peak, reserved, device time,
the devices a cell changed, a sticky error, and None for what cannot be read."""

from __future__ import annotations

import time

import pytest
import torch
from fakegpu import GIB, FakeMachine, Gpu

from torch_device_magic import measure, probes
from torch_device_magic.measure import Meter
from torch_device_magic.probes import Accelerator
from torch_device_magic.units import fmt_bytes

HAS_ACCELERATOR = probes.active_accelerator() is not None


@pytest.mark.skipif(HAS_ACCELERATOR, reason="an accelerator runtime is up")
def test_without_an_accelerator_device_fields_are_none():
    meter = Meter()
    meter.start()
    m = meter.stop()
    meter.close()
    assert probes.active_accelerator() is None
    assert m.device is None
    assert m.device_s is m.device_delta_bytes is m.device_peak_bytes is None
    assert m.device_reserved_delta_bytes is None
    assert m.host_peak_bytes is not None and m.wall_s > 0


def meter_on(monkeypatch, module) -> Meter:
    accel = Accelerator("cuda", 0)
    accel._module = module
    monkeypatch.setattr(measure, "active_accelerator", lambda device=None, kinds=None: accel)
    monkeypatch.setattr(measure, "devices_in_use", lambda main: [main])
    return Meter()


def two_gpus(monkeypatch, **kwargs) -> FakeMachine:
    """Two GPUs, CUDA up with a context on each (as after using both)."""
    machine = FakeMachine([Gpu("A"), Gpu("B")], **kwargs).install(monkeypatch)
    machine.start_cuda(0)
    machine.context(1, "earlier work")
    return machine


def measured(machine: FakeMachine, cell, device=None) -> measure.Measurement:
    meter = Meter()
    try:
        meter.start(device)
        cell(machine)
        return meter.stop()
    finally:
        meter.close()


def test_meter_turns_allocator_readings_into_delta_peak_reserved_and_device_time(monkeypatch):
    machine = two_gpus(monkeypatch)
    machine.allocate(0, 100)

    def cell(m):
        m.allocate(0, 1000, keep=False)
        m.allocate(0, 50)
        m.run(0, 250.0)

    m = measured(machine, cell)
    assert (m.device, m.device_delta_bytes, m.device_peak_bytes) == ("cuda:0", 50, 1000)
    assert m.device_reserved_delta_bytes == 1000
    assert m.device_s == pytest.approx(0.25)
    assert m.device_allocated_bytes == 150
    assert m.other_devices is None and m.device_error is None


def test_device_time_goes_on_the_measured_devices_stream_and_touches_no_other_gpu(monkeypatch):
    """After `%device cuda:1`, the events go on cuda:1's stream, not the current device's."""
    machine = FakeMachine([Gpu("A"), Gpu("B")]).install(monkeypatch)
    machine.start_cuda(1)  # cuda:0 stays the current device, without a context
    m = measured(machine, lambda m: m.run(1, 40.0), device="cuda:1")
    assert m.device == "cuda:1" and m.device_s == pytest.approx(0.040)
    assert machine.contexts == {1}  # no event, no synchronise started a context on cuda:0
    assert {d for call, d in machine.calls if call == "Event.record"} == {1}


def test_every_device_the_cell_changed_is_synchronised_and_named(monkeypatch):
    machine = two_gpus(monkeypatch)

    def both(m):
        m.allocate(0, 10)
        m.allocate(1, 2 * GIB)

    m = measured(machine, both)
    synced = {d for call, d in machine.calls if call == "synchronize"}
    assert synced == {0, 1}
    assert (m.device, m.device_delta_bytes, m.other_devices) == ("cuda:0", 10, "cuda:1")
    assert "cuda:0 (also used: cuda:1)" in m.summary()
    only_other = measured(machine, lambda m: m.allocate(1, GIB))
    assert (only_other.device, only_other.device_delta_bytes) == ("cuda:1", GIB)
    assert only_other.other_devices is None


def test_a_device_without_a_context_is_neither_read_for_time_nor_synchronised(monkeypatch):
    machine = FakeMachine([Gpu("A"), Gpu("B"), Gpu("C")]).install(monkeypatch)
    machine.start_cuda(0)
    m = measured(machine, lambda m: m.allocate(0, 10))
    assert machine.contexts == {0} and m.device == "cuda:0"
    assert {d for call, d in machine.calls if call == "synchronize"} == {0}


def test_the_session_device_without_a_context_is_not_asked_for_counters(monkeypatch):
    """cudaMallocAsync reads its counters and resets its peak under a device guard, which
    makes a context: a device that has none (`%device cuda:1`, not used yet) is not asked."""
    machine = FakeMachine([Gpu("A"), Gpu("B")], backend="cudaMallocAsync").install(monkeypatch)
    machine.start_cuda(0)
    m = measured(machine, lambda m: None, device="cuda:1")
    asked = {d for call, d in machine.calls if call in ("memory_stats", "reset_peak_memory_stats")}
    assert asked == {0} and machine.contexts == {0}
    assert (m.device, m.device_delta_bytes, m.device_s) == ("cuda:1", 0, None)


def test_without_sync_nothing_is_waited_for_and_there_is_no_device_time(monkeypatch):
    machine = two_gpus(monkeypatch)
    meter = Meter(sync=False)
    meter.start()
    machine.run(0, 5.0)
    m = meter.stop()
    meter.close()
    assert m.device == "cuda:0" and m.device_s is None
    assert not any(call in ("synchronize", "Event.record") for call, _ in machine.calls)


def test_device_time_reads_as_the_current_streams(monkeypatch):
    machine = two_gpus(monkeypatch)
    m = measured(machine, lambda m: m.run(0, 12.5))
    assert "cuda:0 12.5 ms current stream, 0 B (peak 0 B)" in m.summary()


@pytest.mark.parametrize("backend", ["native", "cudaMallocAsync"])
def test_in_place_work_keeps_its_device_time_under_every_allocator(monkeypatch, backend):
    """No allocation (an in-place op, a CUDA-graph replay) and cudaMallocAsync, whose
    allocation counter stays 0: the device time is still measured."""
    machine = two_gpus(monkeypatch, backend=backend)
    m = measured(machine, lambda m: m.run(0, 30.0))
    assert m.device_s == pytest.approx(0.030)
    assert probes._accelerator("cuda", 0).allocator() == backend


def test_without_memory_caching_the_counters_read_n_a_not_zero(monkeypatch):
    machine = two_gpus(monkeypatch)
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    m = measured(machine, lambda m: m.run(0, 5.0))
    assert m.device_delta_bytes is m.device_peak_bytes is m.device_reserved_delta_bytes is None
    assert "current stream, n/a (peak n/a)" in m.summary()
    assert m.device_s == pytest.approx(0.005)
    assert probes._accelerator("cuda", 0).allocator() == "uncached"


def test_a_sticky_cuda_error_at_the_end_of_the_cell_is_kept_and_said(monkeypatch):
    machine = two_gpus(monkeypatch)

    def crash(m):
        m.run(0, 1.0)
        m.sticky = "an illegal memory access was encountered"

    m = measured(machine, crash)
    assert m.device_error == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert m.summary().endswith(
        "| a CUDA error surfaced at the end of the cell: "
        "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    assert m.device_s is None  # the events cannot be read after it


def test_a_broken_accelerator_reads_none_and_never_raises(monkeypatch):
    class Broken:
        def __getattr__(self, name):
            def fail(*args, **kwargs):
                raise RuntimeError(f"{name} failed")

            return fail

    meter = meter_on(monkeypatch, Broken())
    meter.start()
    m = meter.stop()
    meter.close()
    assert m.device == "cuda:0"
    assert m.device_s is m.device_delta_bytes is m.device_peak_bytes is None
    assert m.device_reserved_delta_bytes is None
    assert m.host_peak_bytes is not None
    assert "cuda:0 n/a (peak n/a)" in str(m)


class Heap:
    """A free heap of `chunks` free chunks read through a fake clock: each reading takes
    `cost_s`."""

    def __init__(self, monkeypatch, cost_s: float, chunks: int = 10) -> None:
        self.now, self.free, self.cost_s, self.chunks, self.reads = 0.0, 0, cost_s, chunks, 0
        monkeypatch.setattr(measure, "clock", lambda: self.now)

    def __call__(self) -> tuple[int, int]:
        self.reads += 1
        self.now += self.cost_s
        return self.free, self.chunks


def test_memory_left_free_in_the_heap_counts_for_the_cell_that_freed_it(monkeypatch):
    heap = Heap(monkeypatch, cost_s=1e-6)
    free = measure.FreeHeap(heap)
    free.start()
    assert free.free_bytes == 0
    heap.free += 280 * 2**20  # the cell freed 280 MiB, RSS fell by 15
    assert free.correction(-15 * 2**20, busy_s=0.3) == 280 * 2**20
    free.start()
    heap.free -= 265 * 2**20  # glibc trims what an earlier cell freed: RSS falls as much
    assert free.correction(-265 * 2**20, busy_s=1e-4) == -265 * 2**20  # so the cell reads 0
    heap.free -= 256 * 2**20  # a tensor made of free chunks that malloc_trim had released
    assert free.correction(256 * 2**20, busy_s=0.05) == 0  # RSS grew: it says the cost
    heap.free += 400 * 2**20  # a quick cell that freed large blocks: RSS did not move
    assert free.correction(0, busy_s=1e-6) == 400 * 2**20


def test_a_dear_reading_waits_for_a_cell_it_costs_one_percent_of(monkeypatch):
    heap = Heap(monkeypatch, cost_s=0.03, chunks=250_000)  # fragmented: 30 ms a reading
    free = measure.FreeHeap(heap)
    free.start()  # the first reading: its cost is not known yet
    heap.free += 2**20
    assert free.correction(-2**20, busy_s=0.5) == 0 and heap.reads == 1  # 6% of this cell
    assert free.free_bytes is None
    free.start()
    assert heap.reads == 1  # not read at the start either
    assert free.correction(-2**20, busy_s=5.0) == 0 and heap.reads == 2  # a count starts again
    free.start()
    heap.free += 2**20
    assert free.correction(0, busy_s=3.0) == 2**20  # counted from there
    heap.chunks, heap.cost_s = 50, 1e-6  # compact again, which the next reading shows
    assert free.correction(0, busy_s=1e-6) == 0 and heap.reads == 3  # not read yet
    assert free.correction(0, busy_s=5.0) == 0 and heap.reads == 4
    heap.free += 2**20
    assert free.correction(0, busy_s=1e-6) == 2**20  # from then on, quick cells are read


class CpuHost:
    """A host probe that reads no memory and says the CPU time it is given."""

    cpu_s: float | None = None

    def start(self) -> None:
        pass

    def stop(self) -> tuple[int, int]:
        return 0, 0

    def close(self) -> None:
        pass


def test_a_dear_reading_is_timed_against_the_cpu_of_the_thread_that_runs_the_cell(monkeypatch):
    """The host probe's CPU time is its thread's: a stop on another thread than the last
    (a kernel's subshell) cannot subtract one thread's time from another's."""
    import threading

    heap = Heap(monkeypatch, cost_s=0.03, chunks=250_000)  # fragmented: 30 ms a reading
    host = CpuHost()
    meter = measure.Meter(host=host)
    meter._heap = measure.FreeHeap(heap)

    def cell(cpu_s: float) -> None:
        meter.start()
        host.cpu_s = cpu_s
        meter.stop()

    cell(1.0)  # the first reading learns its cost; no CPU time to compare with yet
    assert heap.reads == 1
    cell(1.5)  # 0.5 s of this thread's CPU: 6% of the cell goes to a reading, not taken
    assert heap.reads == 1
    other = threading.Thread(target=cell, args=(100.0,))  # another thread's count
    other.start()
    other.join()
    assert heap.reads == 1  # its wall time (none here), not 98.5 s across two threads
    cell(101.0)
    assert heap.reads == 1  # the last stop was the other thread's: wall time again
    cell(106.0)  # 5 s of this thread's CPU: a reading is affordable
    assert heap.reads == 2


class SlowHost(CpuHost):
    """A host probe whose start and stop each take `seconds` (a slow read of /proc)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def start(self) -> None:
        time.sleep(self.seconds)

    def stop(self) -> tuple[int, int]:
        time.sleep(self.seconds)
        return 0, 0


def test_the_device_window_lies_inside_the_wall_window(monkeypatch):
    """The device's events are stamped on the host's clock here: whatever of ours runs
    around the cell (a slow host probe), the device time never exceeds the wall time."""
    machine = FakeMachine([Gpu()], host_timeline=True).install(monkeypatch)
    machine.start_cuda(0)
    meter = Meter(host=SlowHost(0.02))
    for cell in (lambda: None, lambda: machine.run(0, 5.0), lambda: None):
        meter.start()
        cell()
        m = meter.stop()
        assert m.device_s is not None and m.device_s <= m.wall_s
    meter.close()


MIB = 2**20


def test_a_cell_reads_the_allocator_once_and_never_through_torchs_flattening(monkeypatch):
    """The counters come nested from the C++ call, once at each boundary between two
    cells: the reading that ends one cell starts the next."""
    machine = FakeMachine([Gpu()]).install(monkeypatch)
    machine.start_cuda(0)

    def flattening(*args, **kwargs):
        raise AssertionError("torch's Python flattening: 5x the C++ call it flattens")

    monkeypatch.setattr(torch.cuda, "memory_stats", flattening)
    monkeypatch.setattr(torch.accelerator, "memory_stats", flattening, raising=False)
    meter = Meter(carry=True)  # the per-cell reporter's
    found = []
    for n in range(1, 4):
        meter.start()
        machine.allocate(0, n * MIB, keep=False)
        machine.allocate(0, 10)
        found.append(meter.stop())
    meter.close()
    assert [(m.device_delta_bytes, m.device_peak_bytes) for m in found] == [
        (10, MIB), (10, 2 * MIB), (10, 3 * MIB)]
    assert [m.device_allocated_bytes for m in found] == [10, 20, 30]
    assert sum(call == "memory_stats" for call, _ in machine.calls) == 1 + 3


def test_what_another_thread_allocates_between_two_cells_counts_in_the_next(monkeypatch):
    """Nothing is lost between two cells: the next one starts from the last reading (and
    a start on another device reads that device afresh)."""
    machine = two_gpus(monkeypatch)
    meter = Meter(carry=True)
    meter.start()
    machine.allocate(0, 100)
    assert meter.stop().device_delta_bytes == 100
    machine.allocate(0, 7 * MIB, keep=False)  # a transient between the cells
    machine.allocate(0, 50)
    meter.start()
    second = meter.stop()
    assert (second.device_delta_bytes, second.device_peak_bytes) == (50, 7 * MIB)
    reads = sum(call == "memory_stats" for call, _ in machine.calls)
    meter.start("cuda:1")
    machine.allocate(1, 30)
    third = meter.stop()
    meter.close()
    assert (third.device, third.device_delta_bytes) == ("cuda:1", 30)
    assert sum(call == "memory_stats" for call, _ in machine.calls) == reads + 4  # both, twice


def test_after_forget_stop_the_next_start_reads_the_allocator_afresh(monkeypatch):
    """What code of ours frees after a stop (the hint releasing a failing cell's frames)
    is no stretch's: the next start reads the allocator again, its peak window too."""
    machine = two_gpus(monkeypatch)
    meter = Meter(carry=True)
    meter.start()
    machine.allocate(0, GIB)
    assert meter.stop().device_delta_bytes == GIB
    machine.free(0, GIB)
    meter.forget_stop()
    meter.start()
    machine.allocate(0, 10)
    m = meter.stop()
    meter.close()
    assert (m.device_delta_bytes, m.device_peak_bytes) == (10, 10)


def test_a_meter_stopped_inside_another_leaves_it_the_peak(monkeypatch):
    """%%profile's and %%gpumem's Meters run inside the cell's: their stop must not restart
    the peak window, or the cell's line misses what they measured."""
    machine = two_gpus(monkeypatch)
    outer, inner = Meter(carry=True), Meter()
    outer.start()
    inner.start()
    machine.allocate(0, GIB, keep=False)
    assert inner.stop().device_peak_bytes == GIB
    assert outer.stop().device_peak_bytes == GIB
    outer.close()
    inner.close()


@pytest.mark.parametrize("backend", ["native", "cudaMallocAsync"])
def test_a_transient_gigabyte_is_the_peak_under_both_allocators(monkeypatch, backend):
    """As on an H200: a float kept, then 1 GiB made and freed. Under cudaMallocAsync only
    the byte counters of "all" move (and the allocation count stays 0)."""
    machine = FakeMachine([Gpu()], backend=backend).install(monkeypatch)
    machine.start_cuda(0)
    meter = Meter()
    meter.start()
    machine.allocate(0, 4)
    warm = meter.stop()
    meter.start()
    machine.allocate(0, GIB, keep=False)
    transient = meter.stop()
    meter.close()
    assert (warm.device_delta_bytes, warm.device_peak_bytes) == (4, 4)
    assert (transient.device_delta_bytes, transient.device_peak_bytes) == (0, GIB)
    moved = {k for k, v in torch.cuda.memory_stats(0).items() if v and k != "max_split_size"}
    if backend == "cudaMallocAsync":
        assert moved == {"allocated_bytes.all.current", "allocated_bytes.all.peak",
                         "active_bytes.all.current", "active_bytes.all.peak",
                         "reserved_bytes.all.current", "reserved_bytes.all.peak"}
    else:
        assert {"allocation.all.allocated", "segment.all.current"} <= moved


def test_a_host_change_below_a_page_reads_zero(monkeypatch):
    """RSS moves by pages: a cell that left 880 B in malloc's free lists while RSS stood
    still reads 0 B, not -880 B; a change of pages keeps its bytes."""
    heap = Heap(monkeypatch, cost_s=1e-6)
    host = CpuHost()
    meter = measure.Meter(host=host)
    meter._heap = measure.FreeHeap(heap)
    meter.start()
    heap.free += 880
    small = meter.stop()
    host.stop = lambda: (3 * probes.PAGE_BYTES, 3 * probes.PAGE_BYTES)
    meter.start()
    heap.free += 880
    pages = meter.stop()
    meter.close()
    assert (small.host_delta_bytes, small.host_peak_bytes) == (0, 0)
    assert "host 0 B (peak 0 B)" in small.summary()
    assert pages.host_delta_bytes == 3 * probes.PAGE_BYTES - 880


@pytest.mark.parametrize("delta, peak", [
    (0, 0), (0, 4096), (-3 * 2**20, 2**30), (1536, None), (None, 512), (None, None),
])
def test_a_repeated_host_figure_reads_as_the_first_time(delta, peak):
    """The line's host part is formatted once per figures and then remembered: the second
    line with the same figures reads as the first, and as the units say."""
    host = "host n/a" if delta is None and peak is None else (
        f"host {fmt_bytes(delta, signed=True)} (peak {fmt_bytes(peak)})")
    lines = [measure.Measurement(0.5, host_delta_bytes=delta, host_peak_bytes=peak).summary()
             for _ in range(2)]
    assert lines == [f"time 500.0 ms | {host}"] * 2
    other = measure.Measurement(0.5, host_delta_bytes=(delta or 0) + 2**20, host_peak_bytes=peak)
    assert other.summary() != lines[0]
