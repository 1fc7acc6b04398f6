"""Probes without a shell: exact host peaks, None for what cannot be read, NVML by UUID."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
from fakegpu import GIB, FakeMachine, Gpu, mig
from pythonpath import child_env

from torch_device_magic import probes
from torch_device_magic.probes import Accelerator, PeakSampler, ProcHighWater

pytestmark = pytest.mark.once  # nothing here depends on IPython's version

MiB = 2**20


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


@pytest.mark.parametrize("make", host_probes())
def test_a_peak_made_by_another_thread_is_the_cells(make):
    """The high-water mark is the process's, though getrusage is asked for this thread."""
    import threading

    probe = make()
    try:
        probe.start()
        worker = threading.Thread(target=lambda: allocate(256 * MiB))  # made and freed there
        worker.start()
        worker.join()
        delta, peak = probe.stop()
    finally:
        probe.close()
    assert peak == pytest.approx(256 * MiB, rel=0.10)
    assert abs(delta) < 0.10 * 256 * MiB


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


def test_nvml_answers_none_without_a_cuda_device_or_a_driver(monkeypatch):
    assert probes.nvml_used_bytes(None) is None
    machine = FakeMachine([Gpu()], nvml=False).install(monkeypatch)
    machine.start_cuda(0)
    assert probes.nvml_used_bytes(Accelerator("cuda", 0)) is None


def test_nvml_maps_the_device_by_uuid(monkeypatch):
    machine = FakeMachine([Gpu(used=1 * GIB), Gpu(used=3 * GIB)], cuda_order=[1, 0])
    machine.install(monkeypatch).start_cuda(0)
    assert probes.nvml_used_bytes(Accelerator("cuda", 0)) == 3 * GIB


def test_nvml_reads_a_mig_instance_by_its_mig_uuid(monkeypatch):
    """torch prints a MIG instance's bare UUID: NVML knows it as MIG-..., never GPU-..."""
    parent = Gpu(migs=[mig(total=10 * GIB), mig(total=20 * GIB)])
    parent.migs[1].used = 5 * GIB
    machine = FakeMachine([parent], cuda_order=[1]).install(monkeypatch)
    machine.start_cuda(0)
    assert probes.nvml_used_bytes(Accelerator("cuda", 0)) == 5 * GIB


def test_nvml_lists_gpu_memory_per_process_over_every_gpu_and_mig_instance(monkeypatch):
    """No CUDA context is needed; a process on two GPUs sums; NVML's "not available"
    (None) is left out rather than read as 0."""
    parent = Gpu(migs=[mig(), mig()])
    parent.migs[1].processes = {7: 2 * GIB}
    plain = Gpu(processes={7: 1 * GIB, 8: None, 9: 3 * GIB})
    machine = FakeMachine([plain, parent]).install(monkeypatch)
    assert probes.nvml_process_bytes() == ({7: 3 * GIB, 9: 3 * GIB}, "")
    assert not machine.initialized


def test_nvml_per_process_list_says_why_without_a_driver(monkeypatch):
    FakeMachine([Gpu(processes={7: GIB})], nvml=False).install(monkeypatch)
    why = "NVML is not available (NVMLError_LibraryNotFound)"
    assert probes.nvml_process_bytes() == (None, why)


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
    usage = types.SimpleNamespace(ru_maxrss=maxrss_bytes // 1024, ru_utime=0.0, ru_stime=0.0)
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


# --- asking the machine: probes decides nothing and imports nothing that decides -------


def test_probes_imports_nothing_that_decides():
    """devices.py decides from what probes.py reads; never the other way round."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(probes.__file__).read_text())
    ours = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    assert ours == {"errors"}


def test_free_and_total_of_the_cpu_is_the_oss_and_of_meta_nothing():
    free, total = probes.free_and_total(torch.device("cpu"))
    assert 0 < free <= total
    assert probes.free_bytes(torch.device("cpu")) > 0
    assert probes.free_and_total(torch.device("meta")) is None
    probes.empty_cache(torch.device("meta"))  # nothing to empty: nothing happens


def test_free_bytes_asks_cuda_only_once_it_runs(monkeypatch):
    machine = FakeMachine([Gpu(), Gpu()]).install(monkeypatch)
    asked = []

    def mem_get_info(device=None):
        asked.append(device)
        return (3 * GIB, 80 * GIB)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    assert probes.free_bytes(torch.device("cuda:1")) is None and asked == []
    machine.start_cuda(0)
    assert probes.free_and_total(torch.device("cuda:1")) == (3 * GIB, 80 * GIB)
    assert probes.free_bytes(torch.device("cuda:1")) == 3 * GIB
    assert asked == [torch.device("cuda:1")] * 2


def test_a_failing_free_memory_read_is_none_and_leaves_a_debug_record(monkeypatch, caplog):
    machine = FakeMachine([Gpu()]).install(monkeypatch)
    machine.start_cuda(0)

    def broken(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "mem_get_info", broken)
    with caplog.at_level("DEBUG", logger="torch_device_magic"):
        assert probes.free_bytes(torch.device("cuda:0")) is None
    [record] = caplog.records
    assert record.name == "torch_device_magic.probes" and record.exc_info[0] is RuntimeError


def test_empty_cache_empties_the_kinds_allocator(monkeypatch):
    machine = FakeMachine([Gpu()]).install(monkeypatch)
    machine.start_cuda(0)
    probes.empty_cache(torch.device("cuda:0"))
    probes.empty_cache(torch.device("cpu"))
    assert machine.calls.count(("empty_cache", None)) == 1


def test_nvml_starts_once_for_the_device_list_and_the_measurements(monkeypatch):
    from torch_device_magic import devices

    machine = FakeMachine([Gpu(used=2 * GIB)]).install(monkeypatch)
    assert len(devices.take_inventory().of_type("cuda")) == 1
    machine.start_cuda(0)
    assert probes.nvml_used_bytes(Accelerator("cuda", 0)) == 2 * GIB
    assert machine.nvml_inits == 1


def test_a_fault_in_a_private_backends_flag_reads_as_not_up_and_is_logged(monkeypatch, caplog):
    def broken():
        raise RuntimeError("driver gone")

    monkeypatch.setattr(probes, "_private_backend", lambda: "tdmfake")
    monkeypatch.setattr(torch, "tdmfake", types.SimpleNamespace(is_initialized=broken),
                        raising=False)
    with caplog.at_level("DEBUG", logger="torch_device_magic"):
        assert probes.runtime_up("tdmfake") is False
        assert probes.active_accelerator("tdmfake:0", kinds=("tdmfake",)) is None
    assert "driver gone" in caplog.text


def test_a_bug_in_a_runtime_flag_is_not_taken_for_no_accelerator(monkeypatch):
    """runtime_up reads flags: only a device's own fault is caught, not any error."""
    FakeMachine([Gpu()]).install(monkeypatch)

    def bug():
        raise TypeError("a bug")

    monkeypatch.setattr(torch.cuda, "is_initialized", bug)
    with pytest.raises(TypeError):
        probes.active_accelerator()


def test_free_memory_of_cuda_without_an_index_is_the_current_devices(monkeypatch):
    machine = FakeMachine([Gpu(), Gpu()]).install(monkeypatch)
    machine.start_cuda(0)
    asked = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: asked.append(d) or (1, 2))
    assert probes.free_and_total(torch.device("cuda")) == (1, 2)
    assert asked == [None]  # torch < 2.2 refuses a torch.device without an index


def test_the_default_device_reads_on_torch_2_1_and_2_2_too(monkeypatch):
    """Before torch 2.3 the slot holds the DeviceContext itself, not a thread-local."""
    from torch.utils._device import DeviceContext

    monkeypatch.setattr(torch, "_GLOBAL_DEVICE_CONTEXT", DeviceContext("meta"))
    assert probes.torch_default_device() == torch.device("meta")
    monkeypatch.setattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    assert probes.torch_default_device() is None


_FREE_HEAP = """
import torch
from torch_device_magic import probes
read = probes.malloc_free_reader()
kept = [torch.randn(256) for _ in range(50_000)]  # about 50 MiB of heap chunks
before, _ = read()
del kept
free, chunks = read()
print(free - before, chunks)
"""


@pytest.mark.skipif(probes.malloc_free_reader() is None, reason="needs glibc 2.33+ (mallinfo2)")
def test_the_free_heap_grows_by_what_small_tensors_leave_there():
    # A fresh process: in one that earlier tests left with a holed heap, the tensors fill
    # scattered holes between live chunks, and their free chunks cannot merge.
    run = subprocess.run([sys.executable, "-c", _FREE_HEAP], env=child_env(), capture_output=True,
                         text=True, timeout=300)
    grew, chunks = map(int, run.stdout.split())
    assert grew > 40 * MiB  # freed to the heap, whatever RSS says
    assert chunks < 50_000  # consolidated: the walk is short


def test_every_device_of_an_xpu_is_watched_and_an_mps_device_alone(monkeypatch):
    """A two-tile XPU (as a PrivateUse1 backend's devices): work on the other tile counts."""
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    watched = probes.devices_in_use(Accelerator("xpu", 1))
    assert [a.name for a in watched] == ["xpu:1", "xpu:0"]
    assert [a.name for a in probes.devices_in_use(Accelerator("mps", 0))] == ["mps:0"]
