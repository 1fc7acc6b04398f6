"""A fake CUDA machine at the probe boundary: what torch.cuda and NVML would answer.

    machine = FakeMachine([Gpu("A100"), Gpu("H200")]).install(monkeypatch)
    machine.start_cuda()            # as a first CUDA tensor would
    machine.allocate(1, 2**30)      # cuda:1's allocator grows by 1 GiB
    held = machine.held(0, 2**20)   # 1 MiB on cuda:0, freed when `held` is collected

It models several GPUs (NVML lists them in PCI order; `cuda_order` is CUDA's
numbering), MIG instances, NVML's per-process lists (host pids, so a container's
processes need not match), an allocator backend, a busy GPU, a handle NVML
refuses, a sticky CUDA error, and, above all, where contexts exist: anything
that would create a context on a device (an event recorded on its stream, a
synchronise, set_device, memory_stats before CUDA started) is recorded in
`contexts`, so that a test can say which GPUs were touched. Only what
torch_device_magic calls is modelled; `calls` lists them in order.

What leaves a forked child unable to use CUDA while CUDA is not up is recorded in
`fork_poisons`: torch's build facts (`_cuda_getArchFlags` registers torch's fork
handler, which marks every later child a bad fork) and torch.profiler's start
(its `at::hasCUDA()` runs `cudaGetDeviceCount`, which initialises the driver
whatever activities are asked). CUDA's own start is the user's work, not one.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
import types
import uuid as uuidlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_device_magic import probes

GIB = 2**30
# What the fake allocator counts per device: bytes, their peaks, and requests.
_COUNTS = ("allocated", "peak", "reserved", "reserved_peak", "count", "live", "live_peak",
           "frees", "freed_bytes")


class NVMLError(Exception):
    """pynvml's base error; subclasses are named NVMLError_<Reason> as in nvidia-ml-py."""


def nvml_error(reason: str) -> type[NVMLError]:
    return type(f"NVMLError_{reason}", (NVMLError,), {})


NoPermission, GpuIsLost, NotFound, NotSupported, LibraryNotFound = (
    nvml_error(r) for r in ("NoPermission", "GpuIsLost", "NotFound", "NotSupported",
                            "LibraryNotFound")
)
_serial = itertools.count(1)


@dataclass
class Gpu:
    """One GPU as NVML sees it (or one MIG instance of a GPU)."""

    name: str = "NVIDIA A100-SXM4-80GB"
    total: int = 80 * GIB
    used: int = 1 * GIB  # NVML's used: other processes, contexts
    capability: tuple[int, int] = (8, 0)
    migs: list[Gpu] = field(default_factory=list)  # instances: MIG mode is on when any
    fail: type[NVMLError] | None = None  # NVML refuses this GPU's handle with this error
    uuid: str = field(default_factory=lambda: str(uuidlib.UUID(int=next(_serial))))
    mig: bool = False  # this is a MIG instance
    multiprocessors: int | None = None  # CUDA's multi_processor_count (MFU's MIG share)
    # NVML's per-process list: {host pid: bytes used}, None where NVML gives no figure
    processes: dict[int, int | None] = field(default_factory=dict)
    # NVML's sample buffers: (time in µs, percent busy); (pid, time in µs, percent of SMs)
    samples: list[tuple[int, int]] = field(default_factory=list)
    process_samples: list[tuple[int, int, int]] = field(default_factory=list)
    samples_fail: type[NVMLError] | None = None  # reading the samples raises this (the live line)

    @property
    def nvml_uuid(self) -> str:
        return f"{'MIG' if self.mig else 'GPU'}-{self.uuid}"


def mig(name: str = "NVIDIA A100 MIG 1g.10gb", total: int = 10 * GIB) -> Gpu:
    return Gpu(name, total, used=0, mig=True)


class _Held:
    """What `FakeMachine.held` returns: a fake tensor's memory lives as long as it does."""


class FakeEvent:
    """torch.cuda.Event: remembers the stream it was recorded on and a fake clock."""

    def __init__(self, machine: FakeMachine, enable_timing: bool = False) -> None:
        self.machine, self.device, self.at_ms = machine, None, None

    def record(self, stream: Any = None) -> None:
        m = self.machine
        device = m.current if stream is None else stream.device_index
        m.context(device, "Event.record")
        self.device, self.at_ms = device, m.clock_ms[device]
        if m.host_timeline:  # done when the queued work is, and not before it is recorded
            self.at_ms = max(time.perf_counter(), m.busy_until[device]) * 1000
        m.calls.append(("Event.record", device))

    def elapsed_time(self, end: FakeEvent) -> float:
        if self.device != end.device:
            raise RuntimeError("Both events must be recorded on the same device")
        if self.machine.sticky is not None:
            raise RuntimeError(self.machine.sticky)
        return end.at_ms - self.at_ms


class FakeMachine:
    """What torch.cuda and pynvml answer on a made-up machine; see the module docstring."""

    def __init__(
        self,
        gpus: list[Gpu],
        cuda_order: list[int] | None = None,
        driver_cuda: int = 12080,
        torch_cuda: str = "12.8",
        arch_flags: str = "sm_75 sm_80 sm_86 sm_90 compute_90",
        backend: str = "native",
        nvml: bool = True,
        host_timeline: bool = False,
    ) -> None:
        self.gpus = gpus  # NVML (PCI) order
        visible = [m for g in gpus for m in (g.migs or [g])]
        self.cuda = [visible[i] for i in (cuda_order or range(len(visible)))]
        self.driver_cuda, self.torch_cuda, self.arch_flags = driver_cuda, torch_cuda, arch_flags
        self.backend = backend
        self.initialized = False
        self.contexts: set[int] = set()
        self.current = 0
        self.lazy: list[Any] = []
        self.calls: list[tuple[str, Any]] = []
        self.fork_poisons: list[str] = []  # see the module docstring
        self.nvml_inits = 0
        self.nvml_init_error: type[Exception] | None = None if nvml else LibraryNotFound
        self.count_error: Exception | None = None
        self.sticky: str | None = None
        n = len(self.cuda)
        self.clock_ms = [0.0] * n
        # With `host_timeline`, a device runs on the host's clock (time.perf_counter, the
        # Meter's): kernels queue up until `busy_until`, an event is stamped when the
        # device reaches it, and a synchronise waits for the queue to drain.
        self.host_timeline = host_timeline
        self.busy_until = [0.0] * n
        self.stats = [dict.fromkeys(_COUNTS, 0) for _ in range(n)]

    # --- what a test does to the machine ---------------------------------------------

    def start_cuda(self, device: int | None = None) -> None:
        """CUDA starts, as for a first CUDA tensor: the queued calls run, a context appears."""
        if not self.initialized:
            self.initialized = True
            for call in self.lazy:
                call()
            self.lazy.clear()
        self.context(self.current if device is None else device, "tensor")

    def allocate(self, device: int, n_bytes: int, keep: bool = True) -> None:
        """A tensor on `device` made (and, unless `keep`, freed again)."""
        self.context(device, "tensor")
        s = self.stats[device]
        s["allocated"] += n_bytes
        s["peak"] = max(s["peak"], s["allocated"])
        s["reserved"] = max(s["reserved"], s["allocated"])
        s["reserved_peak"] = max(s["reserved_peak"], s["reserved"])
        s["count"] += 1
        s["live"] += 1
        s["live_peak"] = max(s["live_peak"], s["live"])
        if not keep:
            self.free(device, n_bytes)

    def free(self, device: int, n_bytes: int) -> None:
        """A tensor of `n_bytes` on `device` freed."""
        s = self.stats[device]
        s["allocated"] -= n_bytes
        s["live"] -= 1
        s["frees"] += 1
        s["freed_bytes"] += n_bytes

    def held(self, device: int, n_bytes: int) -> object:
        """A tensor on `device` made, and freed when the object returned is collected
        (when the last name, frame or list that holds it lets go)."""
        self.allocate(device, n_bytes)
        tensor = _Held()
        weakref.finalize(tensor, self.free, device, n_bytes)
        return tensor

    def run(self, device: int, ms: float) -> None:
        """Kernels on `device`'s current stream that take `ms` milliseconds."""
        self.context(device, "kernel")
        self.clock_ms[device] += ms
        self.busy_until[device] = max(time.perf_counter(), self.busy_until[device]) + ms / 1000

    def sample(self, device: int, percents: list[int], pid: int | None = None,
               at_us: int | None = None) -> None:
        """NVML's buffers get one sample per percent, now (or at `at_us`): the device's,
        and `pid`'s (the device's figure) where a pid is given."""
        gpu = self.cuda[device]
        now = int(time.time() * 1e6) if at_us is None else at_us
        for i, value in enumerate(percents):
            gpu.samples.append((now + i, value))
            if pid is not None:
                gpu.process_samples.append((pid, now + i, value))

    def poison_fork(self, why: str) -> None:
        """`why` would leave a child forked from now on unable to use CUDA, where CUDA
        is not up yet (once it is, every fork is poisoned by the user's own work)."""
        if not self.initialized:
            self.fork_poisons.append(why)

    def arch_flags_read(self) -> str:
        self.poison_fork("torch._C._cuda_getArchFlags (torch's fork handler)")
        return self.arch_flags

    def context(self, device: int, why: str) -> None:
        if not self.initialized:
            raise AssertionError(f"{why} on cuda:{device} would initialise CUDA")
        self.contexts.add(device)

    # --- torch.cuda ----------------------------------------------------------------------

    def _init(self, what: str) -> None:
        self.calls.append((what, None))
        if not self.initialized:
            self.start_cuda()

    def device_count(self) -> int:
        self.calls.append(("device_count", None))
        if self.count_error is not None:
            raise self.count_error
        return len(self.cuda)

    def get_device_name(self, i: int) -> str:
        self._init("get_device_name")
        return self.cuda[i].name

    def get_device_properties(self, i: int) -> Any:
        self._init("get_device_properties")
        g = self.cuda[i]
        return types.SimpleNamespace(name=g.name, uuid=g.uuid, total_memory=g.total,
                                     major=g.capability[0], minor=g.capability[1],
                                     multi_processor_count=g.multiprocessors)

    def memory_stats_nested(self, i: int) -> dict[str, Any]:
        """`torch._C._cuda_memoryStats`: the allocator's counters as the C++ call builds them
        (every key, nested), so that torch's own flattening costs what it does on a GPU.
        cudaMallocAsync fills only the byte counters of "all" (the driver's pool
        attributes); every other figure stays 0 there."""
        self.calls.append(("memory_stats", i))
        if not self.initialized:
            raise AssertionError(f"memory_stats on cuda:{i} would initialise CUDA")
        if self.backend == "cudaMallocAsync":
            self.context(i, "memory_stats")  # it reads the pool under a device guard
        s = self.stats[i]

        def stat(current: int = 0, peak: int = 0, allocated: int = 0, freed: int = 0) -> dict:
            return {"current": current, "peak": peak, "allocated": allocated, "freed": freed}

        native = self.backend != "cudaMallocAsync"
        bytes_ = (s["allocated"], s["peak"], s["allocated"] + s["freed_bytes"], s["freed_bytes"])
        reserved = (s["reserved"], s["reserved_peak"], s["reserved"])
        counts = (s["live"], s["live_peak"], s["count"], s["frees"])
        segments = (int(s["reserved"] > 0),) * 3
        if not native:  # the driver's pool: the current and peak bytes of "all" only
            bytes_, reserved, counts, segments = bytes_[:2], reserved[:2], (), ()

        def pools(whole: tuple = ()) -> dict:
            """One stat array, every dict new as pybind makes them (its blocks are large)."""
            return {"all": stat(*whole), "small_pool": stat(),
                    "large_pool": stat(*whole) if native else stat()}

        arrays = {"allocation": pools(counts), "segment": pools(segments),
                  "active": pools(counts), "inactive_split": pools(),
                  "allocated_bytes": pools(bytes_), "reserved_bytes": pools(reserved),
                  "active_bytes": pools(bytes_), "inactive_split_bytes": pools(),
                  "requested_bytes": pools(bytes_ if native else ())}
        return {"num_alloc_retries": 0, "num_ooms": 0, "max_split_size": -1 if native else 0,
                "num_sync_all_streams": 0, "num_device_alloc": s["count"] if native else 0,
                "num_device_free": 0, **arrays,
                "oversize_allocations": stat(), "oversize_segments": stat()}

    def memory_stats_as_nested_dict(self, device: Any = None) -> dict[str, Any]:
        """torch.cuda.memory's own: {} before CUDA starts, else the C++ call."""
        if not self.initialized:
            return {}
        index = device if isinstance(device, int) or device is None else torch.device(device).index
        return self.memory_stats_nested(self.current if index is None else index)

    def reset_peak_memory_stats(self, i: int) -> None:
        """`torch._C._cuda_resetPeakMemoryStats`: every peak back to its current value."""
        self.calls.append(("reset_peak_memory_stats", i))
        if self.backend == "cudaMallocAsync":
            self.context(i, "reset_peak_memory_stats")
        s = self.stats[i]
        s["peak"], s["reserved_peak"], s["live_peak"] = s["allocated"], s["reserved"], s["live"]

    def synchronize(self, i: int | None = None) -> None:
        device = self.current if i is None else i
        self.calls.append(("synchronize", device))
        self.context(device, "synchronize")
        if self.host_timeline:
            time.sleep(max(0.0, self.busy_until[device] - time.perf_counter()))
        if self.sticky is not None:
            raise RuntimeError(f"CUDA error: {self.sticky}\nCUDA kernel errors might be ...")

    def current_stream(self, i: int | None = None) -> Any:
        return types.SimpleNamespace(device_index=self.current if i is None else i)

    def current_device(self) -> int:
        self._init("current_device")
        return self.current

    def set_device(self, i: int) -> None:
        self._init("set_device")
        self.current = i
        self.context(i, "set_device")  # cudaSetDevice makes a context on CUDA 12

    def lazy_call(self, fn: Any, **kwargs: Any) -> None:
        if self.initialized:
            fn()
        else:
            self.lazy.append(fn)

    def has_primary_context(self, i: int) -> bool:
        return i in self.contexts

    # --- pynvml ----------------------------------------------------------------------------

    def pynvml(self) -> types.ModuleType:
        mod = types.ModuleType("pynvml")
        by_uuid = {m.nvml_uuid: m for g in self.gpus for m in [g, *g.migs]}

        def init() -> None:
            self.nvml_inits += 1
            if self.nvml_init_error is not None:
                raise self.nvml_init_error()

        def handle_by_index(i: int) -> Gpu:
            gpu = self.gpus[i]
            if gpu.fail is not None:
                raise gpu.fail()
            return gpu

        def mig_handle(gpu: Gpu, j: int) -> Gpu:
            if j >= len(gpu.migs):
                raise NotFound()
            return gpu.migs[j]

        def utilization(gpu: Gpu) -> Any:
            if gpu.mig:
                raise NotSupported()
            return types.SimpleNamespace(gpu=round(100 * gpu.used / gpu.total))

        def mig_mode(gpu: Gpu) -> tuple[int, int]:
            if gpu.mig or gpu.capability < (8, 0):
                raise NotSupported()
            return (1, 1) if gpu.migs else (0, 0)

        def compute_capability(gpu: Gpu) -> tuple[int, int]:
            if gpu.mig:
                raise NotSupported()
            return gpu.capability

        def samples(gpu: Gpu, kind: int, since_us: int) -> tuple[int, list[Any]]:
            if gpu.samples_fail is not None:
                raise gpu.samples_fail()
            found = [types.SimpleNamespace(timeStamp=at, sampleValue=types.SimpleNamespace(
                uiVal=value)) for at, value in gpu.samples if at > since_us]
            if not found:
                raise NotFound()
            return 1, found

        def process_utilization(gpu: Gpu, since_us: int) -> list[Any]:
            found = [types.SimpleNamespace(pid=pid, timeStamp=at, smUtil=sm, memUtil=0)
                     for pid, at, sm in gpu.process_samples if at > since_us]
            if not found:
                raise NotFound()
            return found

        mod.NVMLError = NVMLError
        mod.NVML_GPU_UTILIZATION_SAMPLES = 1
        mod.nvmlDeviceGetSamples = samples
        mod.nvmlDeviceGetProcessUtilization = process_utilization
        mod.nvmlInit = init
        mod.nvmlShutdown = lambda: None
        mod.nvmlDeviceGetCount = lambda: len(self.gpus)
        mod.nvmlDeviceGetHandleByIndex = handle_by_index
        mod.nvmlDeviceGetHandleByUUID = by_uuid.__getitem__
        mod.nvmlDeviceGetUUID = lambda g: g.nvml_uuid.encode()
        mod.nvmlDeviceGetName = lambda g: g.name
        mod.nvmlDeviceGetMemoryInfo = lambda g: types.SimpleNamespace(
            total=g.total, used=g.used, free=g.total - g.used)
        mod.nvmlDeviceGetUtilizationRates = utilization
        mod.nvmlDeviceGetMigMode = mig_mode
        mod.nvmlDeviceGetMaxMigDeviceCount = lambda g: 7
        mod.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
        mod.nvmlSystemGetCudaDriverVersion = lambda: self.driver_cuda
        mod.nvmlDeviceGetCudaComputeCapability = compute_capability
        mod.nvmlDeviceGetComputeRunningProcesses = lambda g: [
            types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in g.processes.items()
        ]
        return mod

    # --- installing it ---------------------------------------------------------------------

    def install(self, monkeypatch: Any) -> FakeMachine:
        """Put this machine behind torch.cuda, torch.version and pynvml for one test."""
        cuda = torch.cuda
        for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "PYTORCH_NO_CUDA_MEMORY_CACHING"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setattr(torch.version, "cuda", self.torch_cuda)
        monkeypatch.setattr(torch.version, "hip", None)
        for name in ("device_count", "get_device_name", "get_device_properties", "synchronize",
                     "current_stream", "current_device", "set_device"):
            monkeypatch.setattr(cuda, name, getattr(self, name))
        # The allocator's C++ calls; torch.cuda.memory_stats and the rest stay torch's own
        # Python (its flattening), reading them through memory_stats_as_nested_dict.
        monkeypatch.setattr(torch._C, "_cuda_memoryStats", self.memory_stats_nested, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", self.reset_peak_memory_stats,
                            raising=False)
        monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict",
                            self.memory_stats_as_nested_dict)
        monkeypatch.setattr(cuda, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(cuda, "_lazy_call", self.lazy_call)
        monkeypatch.setattr(cuda, "Event", lambda enable_timing=False: FakeEvent(self))
        monkeypatch.setattr(cuda, "get_allocator_backend", lambda: self.backend)
        monkeypatch.setattr(cuda, "empty_cache", lambda: self.calls.append(("empty_cache", None)))
        monkeypatch.setattr(cuda, "ipc_collect", lambda: self.calls.append(("ipc_collect", None)))
        monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", self.has_primary_context,
                            raising=False)
        monkeypatch.setattr(torch._C, "_cuda_getArchFlags", self.arch_flags_read, raising=False)
        prepare = torch.autograd.profiler._prepare_profiler

        def prepare_profiler(*args: Any, **kwargs: Any) -> Any:
            self.poison_fork("torch.profiler's start (cudaGetDeviceCount initialises the driver)")
            return prepare(*args, **kwargs)

        monkeypatch.setattr(torch.autograd.profiler, "_prepare_profiler", prepare_profiler)
        # torch.accelerator must not answer for a real device under the fake one
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None,
                            raising=False)
        monkeypatch.setitem(sys.modules, "pynvml", self.pynvml())
        monkeypatch.setattr(probes, "_nvml_module", None)
        # Devices of this machine, not another test's (an Accelerator keeps what it learnt)
        monkeypatch.setattr(probes, "_accelerator", functools.cache(probes.Accelerator))
        monkeypatch.setattr(probes, "mps_available", lambda: False)
        monkeypatch.setattr(probes, "_MPS_BUILT", False)
        return self


def loaded_with_gpu(shell: Any, monkeypatch: Any, gpu: Gpu) -> FakeMachine:
    """`gpu` with a context, then the extension loaded in `shell` (it reads the kinds at
    load), the machine in the namespace as `machine`."""
    machine = FakeMachine([gpu]).install(monkeypatch)
    machine.start_cuda(0)
    shell.run_line_magic("load_ext", "torch_device_magic")
    shell.user_ns["machine"] = machine
    return machine
