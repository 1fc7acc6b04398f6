"""Probes and the Meter, without a shell: exact host peaks, None for what cannot be read."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from torch_device_magic import measure, probes
from torch_device_magic.measure import Meter
from torch_device_magic.probes import Accelerator, PeakSampler, ProcHighWater

MiB = 2**20
HAS_ACCELERATOR = probes.active_accelerator() is not None


def host_probes():
    """Every host probe this machine can run: the exact /proc one (Linux) and the sampler."""
    made = [pytest.param(lambda: PeakSampler(probes.rss_bytes), id="sampler")]
    try:
        ProcHighWater().close()
        made.insert(0, pytest.param(ProcHighWater, id="proc"))
    except OSError:
        pass
    return made


def allocate(n_bytes: int) -> torch.Tensor:
    return torch.ones(n_bytes, dtype=torch.uint8)  # written, so every page is resident


def host_change(make, n_bytes: int, keep: bool) -> tuple[int | None, int | None]:
    """(delta, peak) a probe reads around allocating `n_bytes` (freed inside unless `keep`)."""
    probe = make()
    try:
        probe.start()
        tensor = allocate(n_bytes)
        if not keep:
            del tensor
        return probe.stop()
    finally:
        probe.close()


@pytest.mark.parametrize("make", host_probes())
def test_transient_peak_is_seen_and_delta_is_near_zero(make):
    delta, peak = host_change(make, 512 * MiB, keep=False)
    assert peak == pytest.approx(512 * MiB, rel=0.10)
    assert abs(delta) < 0.10 * 512 * MiB


@pytest.mark.parametrize("make", host_probes())
def test_kept_allocation_is_the_delta(make):
    delta, peak = host_change(make, 256 * MiB, keep=True)
    assert delta == pytest.approx(256 * MiB, rel=0.10)
    assert peak == pytest.approx(256 * MiB, rel=0.10)


def test_host_probe_falls_back_to_sampling_where_proc_refuses(monkeypatch):
    def refuse(*args):
        raise PermissionError("clear_refs")

    monkeypatch.setattr(probes, "ProcHighWater", refuse)
    probe = probes.host_probe()
    assert isinstance(probe, PeakSampler)


def test_proc_probe_refuses_a_missing_proc(tmp_path):
    with pytest.raises(OSError):
        ProcHighWater(proc=str(tmp_path))


def test_failing_reads_give_none_not_zero(monkeypatch):
    probe = probes.host_probe()

    def broken(*args):
        raise OSError("gone")

    monkeypatch.setattr(probes.os, "pread", broken)
    monkeypatch.setattr(probes.os, "pwrite", broken)
    monkeypatch.setattr(probes, "rss_bytes", lambda: None)
    probe.start()
    assert probe.stop() == (None, None)
    probe.close()


def test_sampler_with_a_failing_reading_gives_none():
    def broken():
        raise RuntimeError("no counter")

    sampler = PeakSampler(broken)
    sampler.start()
    assert sampler.stop() == (None, None)
    sampler.close()


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


class FakeEvent:
    clock_ms = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = FakeEvent.clock_ms

    def elapsed_time(self, end):
        return end.at - self.at


def fake_cuda(stats: list[dict]) -> types.SimpleNamespace:
    """A torch.cuda stand-in whose memory_stats returns `stats` one reading at a time."""
    return types.SimpleNamespace(
        memory_stats=lambda index: stats.pop(0),
        reset_peak_memory_stats=lambda index: None,
        synchronize=lambda index: None,
        Event=FakeEvent,
    )


def reading(allocated, peak, reserved, count):
    return {
        "allocated_bytes.all.current": allocated,
        "allocated_bytes.all.peak": peak,
        "reserved_bytes.all.current": reserved,
        "allocation.all.allocated": count,
    }


def meter_on(monkeypatch, module) -> Meter:
    accel = Accelerator("cuda", 0)
    accel._module = module
    monkeypatch.setattr(measure, "active_accelerator", lambda device=None, kinds=None: accel)
    return Meter()


def test_meter_turns_allocator_readings_into_delta_peak_reserved_and_device_time(monkeypatch):
    stats = [reading(100, 100, 200, 5), reading(150, 1100, 1200, 9)]
    meter = meter_on(monkeypatch, fake_cuda(stats))
    FakeEvent.clock_ms = 10.0
    meter.start()
    FakeEvent.clock_ms = 260.0
    m = meter.stop()
    meter.close()
    assert (m.device, m.device_delta_bytes, m.device_peak_bytes) == ("cuda:0", 50, 1000)
    assert m.device_reserved_delta_bytes == 1000
    assert m.device_s == pytest.approx(0.25)
    assert m.device_allocated_bytes == 150


def test_device_time_is_none_when_no_accelerator_work_ran(monkeypatch):
    stats = [reading(100, 100, 200, 5), reading(100, 100, 200, 5)]
    meter = meter_on(monkeypatch, fake_cuda(stats))
    meter.start()
    m = meter.stop()
    meter.close()
    assert m.device_s is None
    assert (m.device_delta_bytes, m.device_peak_bytes) == (0, 0)


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


def test_nvml_answers_none_without_a_cuda_device_or_a_driver(monkeypatch):
    assert probes.nvml_used_bytes(None) is None
    failing = types.ModuleType("pynvml")

    def no_driver():
        raise RuntimeError("NVMLError_LibraryNotFound")

    failing.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", failing)
    props = types.SimpleNamespace(uuid="0c5d7e2a-1111-2222-3333-444455556666")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    probes._nvml.cache_clear()
    try:
        assert probes.nvml_used_bytes(Accelerator("cuda", 0)) is None
    finally:
        probes._nvml.cache_clear()


def test_nvml_maps_the_device_by_uuid(monkeypatch):
    uuid = "0c5d7e2a-1111-2222-3333-444455556666"
    props = types.SimpleNamespace(uuid=uuid)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    used = {"handle-1": 12345}
    nvml = types.SimpleNamespace(
        nvmlDeviceGetHandleByUUID={f"GPU-{uuid}": "handle-1"}.__getitem__,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=used[h]),
    )
    monkeypatch.setattr(probes, "_nvml", lambda: nvml)
    assert probes.nvml_used_bytes(Accelerator("cuda", 3)) == 12345


def test_cpu_build_never_asks_torch_cuda(monkeypatch):
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build")

    def spy():
        raise AssertionError("torch.cuda.is_initialized called on a CPU-only build")

    monkeypatch.setattr(torch.cuda, "is_initialized", spy)
    assert probes.runtime_up("cuda") is False
    assert probes.active_accelerator() is None


def proc_reading_with_maxrss(monkeypatch, maxrss_bytes: int, kept_bytes: int):
    """(delta, peak) of the /proc probe around keeping `kept_bytes`, getrusage faked."""
    try:
        probe = ProcHighWater()
    except OSError:
        pytest.skip("/proc refuses the reset here")
    usage = types.SimpleNamespace(ru_maxrss=maxrss_bytes // 1024)
    monkeypatch.setattr(probes.resource, "getrusage", lambda who: usage)
    probe.start()
    kept = allocate(kept_bytes)
    try:
        return probe.stop()
    finally:
        probe.close()
        del kept


def test_a_stale_getrusage_mark_is_not_taken_for_a_peak(monkeypatch):
    """getrusage keeps an exited thread's mark forever; VmHWM decides then."""
    delta, peak = proc_reading_with_maxrss(monkeypatch, 2**40, 1 * MiB)
    assert peak < 8 * MiB and delta < 8 * MiB


def test_a_lagging_high_water_mark_never_reads_below_the_delta(monkeypatch):
    """RSS and the high-water mark are separate counters: the peak is at least the delta."""
    delta, peak = proc_reading_with_maxrss(monkeypatch, 0, 4 * MiB)
    assert delta > 2 * MiB and peak == delta
