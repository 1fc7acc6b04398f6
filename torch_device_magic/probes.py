"""Asking the machine: clocks, allocator counters, NVML, host memory, the devices there are.

Everything torch_device_magic reads from the machine (or from torch's own state)
is read here, and nothing here decides anything: `devices.py` turns these
readings into the device list, `auto` and the table; `measure.py` turns them into
a cell's figures.

Design rules, which every function here keeps:

- A reading that cannot be taken is `None`. Nothing here raises, and nothing
  reports a zero it did not read.
- Nothing here starts an accelerator runtime. CUDA is read only once
  `torch.cuda.is_initialized()` says a context exists (even torch's build facts:
  `_cuda_getArchFlags` registers torch's fork handler, after which no forked
  child can use CUDA). On a CPU-only build
  (`torch.version.cuda is None`), torch.cuda is not called at all. NVML needs no
  CUDA context; it is initialised behind one gate (`nvml_status`), once per
  session.
- A failure caught broadly is logged at debug level with its traceback
  (`errors.py` says how to see them).
- On Linux the host peak is exact and costs a few cheap system calls per cell:
  `/proc/self/clear_refs` resets the kernel's high-water mark before the cell
  and the mark is read after it, from files kept open. Where `/proc` refuses,
  a sampling thread stands in.
"""

from __future__ import annotations

import logging
import os
import platform
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple, Protocol

import psutil
import torch

try:
    import resource
except ImportError:  # Windows: no /proc either, so the sampling thread measures
    resource = None  # type: ignore[assignment]

from .errors import first_sentence

_log = logging.getLogger(__name__)

clock = time.perf_counter
"""The wall clock every measurement uses (monotonic, sub-microsecond)."""

cpu_seconds = time.process_time
"""The CPU time of every thread of this process (the live line's cores busy)."""

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
"""What RSS moves by: the host probes' resolution."""


def guarded(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or None if it raises: a probe never breaks the user's cell."""
    try:
        return fn(*args)
    except Exception:
        _log.debug("probe %r failed", fn, exc_info=True)
        return None


# --- host memory ----------------------------------------------------------------


class HostProbe(Protocol):
    """Host RSS change and peak between `start()` and `stop()`."""

    def start(self) -> None: ...

    def stop(self) -> tuple[int | None, int | None]:
        """(RSS delta, peak above the starting RSS) in bytes; None where not measured."""
        ...

    def close(self) -> None: ...


class ProcHighWater:
    """Exact host peak on Linux: reset the kernel's high-water mark before, read it after.

    Four cheap system calls a cell, on files kept open: the reset (`clear_refs`)
    and RSS (`statm`) before; the high-water mark (`getrusage`, the same counter
    as `VmHWM`) and RSS after. getrusage is asked for this thread (`RUSAGE_THREAD`:
    the same mark, without summing every thread's CPU time as `RUSAGE_SELF` does).
    It also keeps the highest mark any exited thread saw, and never forgets it: so
    where it reads more than `_SLACK` above the start, the mark is read from
    `/proc/self/status` instead (one slower call, only in cells that used memory).
    """

    def __init__(self, proc: str = "/proc/self") -> None:
        self._fds: list[int] = []
        self._clear = self._open(f"{proc}/clear_refs", os.O_WRONLY)
        self._statm = self._open(f"{proc}/statm", os.O_RDONLY)
        self._status = self._open(f"{proc}/status", os.O_RDONLY)
        self._rss0: int | None = None
        self.cpu_s: float | None = None  # this thread's CPU time at the last stop (getrusage's)
        self.start()  # fails here, not in a user's cell, where the kernel refuses the reset
        if self.stop() == (None, None):
            self.close()
            raise OSError(f"{proc} gives no resettable VmHWM")

    def _open(self, path: str, flags: int) -> int:
        try:
            fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self.close()
            raise
        self._fds.append(fd)
        return fd

    def _rss(self) -> int:
        return int(os.pread(self._statm, 64, 0).split(None, 2)[1]) * PAGE_BYTES

    @property
    def start_bytes(self) -> int | None:
        """RSS at the last start (None after a stop): the live line's host change is from it."""
        return self._rss0

    def start(self) -> None:
        try:
            os.pwrite(self._clear, b"5", 0)
            self._rss0 = self._rss()
        except (OSError, ValueError, IndexError):
            self._rss0 = None

    def stop(self) -> tuple[int | None, int | None]:
        rss0, self._rss0 = self._rss0, None
        if rss0 is None:
            return None, None
        try:
            usage = resource.getrusage(_RUSAGE)
            self.cpu_s = usage.ru_utime + usage.ru_stime
            hwm = usage.ru_maxrss * 1024  # KiB on Linux
            rss = self._rss()
            if hwm > rss0 + _SLACK:  # a real peak, or a stale mark: VmHWM tells them apart
                status = os.pread(self._status, 4096, 0)
                hwm = _status_kib(status, b"VmHWM:") * 1024
                rss = _status_kib(status, b"VmRSS:") * 1024
        except (OSError, ValueError, IndexError):
            return None, None
        # RSS and the high-water mark are separate kernel counters that can lag each
        # other by a few pages; a peak is never below where the cell ended.
        return rss - rss0, max(0, rss - rss0, hwm - rss0)

    def close(self) -> None:
        for fd in self._fds:
            guarded(os.close, fd)
        self._fds.clear()


# The same high-water mark either way; the thread's reading sums no other thread's CPU.
_RUSAGE = getattr(resource, "RUSAGE_THREAD", getattr(resource, "RUSAGE_SELF", 0))
_SLACK = 256 * 1024  # below this a cell's peak is read from getrusage, within this much


def _status_kib(status: bytes, key: bytes) -> int:
    start = status.index(key) + len(key)
    return int(status[start : status.index(b"kB", start)])


class PeakSampler:
    """Peak of any reading between `start()` and `stop()`, sampled by one idle-waiting thread.

    It can miss a peak shorter than `interval_s`; it is the fallback where no exact
    counter exists (host RSS off Linux, MPS memory).
    """

    def __init__(self, read: Callable[[], int | None], interval_s: float = 0.005) -> None:
        self._read = read
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._active = threading.Event()
        self._closed = False
        self._start: int | None = None
        self._max: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        value = guarded(self._read)
        with self._lock:
            self._start = self._max = value
        if value is None:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tdm-peak", daemon=True)
            self._thread.start()
        self._active.set()

    def _sample(self) -> None:
        value = guarded(self._read)
        with self._lock:
            if value is not None and self._max is not None and self._active.is_set():
                self._max = max(self._max, value)

    def _run(self) -> None:
        while True:
            self._active.wait()
            if self._closed:
                return
            self._sample()
            time.sleep(self._interval_s)

    def stop(self) -> tuple[int | None, int | None]:
        self._sample()
        self._active.clear()
        with self._lock:
            start, peak, self._start, self._max = self._start, self._max, None, None
        end = guarded(self._read)
        if start is None or peak is None or end is None:
            return None, None
        return end - start, max(0, end - start, peak - start)

    def close(self) -> None:
        self._closed = True
        self._active.set()


def rss_bytes() -> int | None:
    """This process's resident set size, or None where no way to read it exists."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        pass
    return guarded(lambda: psutil.Process().memory_info().rss)


def rss_and_high_water() -> tuple[int, int] | None:
    """RSS and the kernel's high-water mark (`VmHWM`) now, in bytes; None off Linux."""
    try:
        with open("/proc/self/status", "rb") as f:
            status = f.read()
        return _status_kib(status, b"VmRSS:") * 1024, _status_kib(status, b"VmHWM:") * 1024
    except (OSError, ValueError):
        return None


def malloc_free_reader() -> Callable[[], tuple[int, int]] | None:
    """A function giving the bytes glibc's malloc holds free in every arena (resident or
    not), `mallinfo2().fordblks`, and the number of free chunks it walked to count them;
    None without glibc 2.33+ (macOS, musl, Windows).

    It walks every free chunk, so its cost follows that number: about 1 µs on a compact
    heap, 5–40 ms with a quarter of a million free chunks (the caller decides when it can
    afford it). Where the fast bins hold more than `_FAST_CHUNKS` chunks (after a mass
    free of small blocks), `mallopt(M_ARENA_TEST, 0)` consolidates the main arena's fast
    bins, as glibc's next large malloc would, turning hundreds of thousands of chunks into
    a few dozen, and the walk is taken again; it changes no setting (only a value above 0
    is taken) and, unlike a malloc and free, never trims the heap, so the reading gives
    nothing back. A compact heap is walked once, without it (a `mallopt` costs about what
    the walk does).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallinfo2, mallopt = libc.mallinfo2, libc.mallopt
    except (OSError, AttributeError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    mallinfo2.restype = MallInfo2
    mallopt.restype, mallopt.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]

    def read() -> tuple[int, int]:
        info = mallinfo2()
        if info.smblks > _FAST_CHUNKS:
            mallopt(_M_ARENA_TEST, 0)
            info = mallinfo2()
        return info.fordblks, info.ordblks + info.smblks

    return read


_M_ARENA_TEST = -7  # malloc.h; mallopt consolidates the main arena whatever the parameter
_FAST_CHUNKS = 256  # more chunks than this in the fast bins: consolidate before the walk


def host_probe() -> HostProbe:
    """The exact /proc probe where the kernel allows it, else a sampling thread over RSS."""
    try:
        return ProcHighWater()
    except OSError:
        return PeakSampler(rss_bytes)


# --- accelerators ---------------------------------------------------------------

ACCELERATOR_TYPES = ("cuda", "xpu", "mps")
_MPS_BUILT = guarded(torch.backends.mps.is_built) is True


class Counters(NamedTuple):  # one a reading: half the cost of a frozen dataclass
    """One reading of an accelerator's caching allocator, in bytes."""

    allocated_bytes: int | None
    peak_bytes: int | None  # most allocated since the last peak reset
    reserved_bytes: int | None
    allocations: int | None  # allocation requests so far: tells whether work ran


def cuda_built() -> bool:
    """Whether this torch was built with CUDA (or ROCm, which torch calls cuda)."""
    return torch.version.cuda is not None or torch.version.hip is not None


def built_kinds() -> tuple[str, ...]:
    """The accelerator kinds this torch build has (read from the build: nothing starts)."""
    built = {
        "cuda": cuda_built(),
        "xpu": getattr(torch.version, "xpu", None) is not None,
        "mps": _MPS_BUILT,
    }
    private = _private_backend()
    return tuple(kind for kind in ACCELERATOR_TYPES if built[kind]) + (
        (private,) if private else ()
    )


def _private_backend() -> str | None:
    """The name of an out-of-tree accelerator registered as PrivateUse1 (Ascend's `npu`,
    a test device), or None: the generic `torch.accelerator` counters read it."""
    name = guarded(getattr(torch._C, "_get_privateuse1_backend_name", lambda: None))
    return None if name in (None, "privateuseone") else name


def runtime_up(kind: str) -> bool:
    """Whether `kind`'s runtime already runs in this process; asking never starts it."""
    if kind == "cuda":
        return cuda_built() and torch.cuda.is_initialized()
    if kind == "xpu":
        return getattr(torch.version, "xpu", None) is not None and torch.xpu.is_initialized()
    if kind == "mps":
        # MPS has no context to create; it counts as in use once it holds memory.
        return _MPS_BUILT and guarded(_mps_holds_memory) is True
    if kind == _private_backend():  # its own module says, where it has one
        return bool(guarded(getattr(getattr(torch, kind, None), "is_initialized", bool)))
    return False


def _mps_holds_memory() -> bool:
    return torch.backends.mps.is_available() and torch.mps.driver_allocated_memory() > 0


class Accelerator:
    """One accelerator device whose runtime is already up; every call is guarded."""

    def __init__(self, kind: str, index: int) -> None:
        self.kind = kind
        self.index = index
        self._module = getattr(torch, kind)
        mps = kind == "mps"
        self._mps_peak = PeakSampler(self._module.current_allocated_memory) if mps else None
        self._context = kind != "cuda"  # only CUDA devices can be without one
        self._uncached: bool | None = None  # CUDA's caching allocator off (read once)

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}"

    def counters(self) -> Counters:
        """Allocated, peak, reserved and the allocation count; None for what cannot be read."""
        if self.kind == "mps":
            return Counters(
                guarded(self._module.current_allocated_memory),
                None,
                guarded(self._module.driver_allocated_memory),
                None,
            )
        if self._uncached is None and self.kind == "cuda":  # torch read it when CUDA started
            self._uncached = caching_off()
        if self._uncached:
            return Counters(None, None, None, None)  # the allocator keeps no counts: n/a, not 0
        if not self.has_context():  # nothing allocated; and cudaMallocAsync would make one
            return Counters(0, 0, 0, 0)
        return guarded(self._read_counters) or Counters(None, None, None, None)

    def _read_counters(self) -> Counters:
        """One reading of the allocator's statistics. CUDA's come nested, straight from the
        C++ call: torch's `memory_stats` flattens them in Python, at 5x its cost (116 µs
        against 22 on an H200)."""
        if self.kind == "cuda":
            read = getattr(torch._C, "_cuda_memoryStats", None)
            if read is None:  # not in this build: torch's Python wrapper of the same call
                read = torch.cuda.memory.memory_stats_as_nested_dict
        elif _GENERIC_STATS is not None and _current_kind(torch.accelerator) == self.kind:
            # torch 2.9+: the nested C++ call under torch.accelerator.memory_stats, which
            # flattens it in Python at 7x its cost (52 µs against 7 on the test device)
            if not torch._C._accelerator_isAllocatorInitialized():
                return Counters(None, None, None, None)  # as memory_stats: nothing to read
            read = _GENERIC_STATS
        else:
            flat = self._module.memory_stats(self.index)
            return Counters(*(flat.get(key) for key in _COUNTERS))
        stats = read(self.index)
        if not stats:  # read before the runtime started
            return Counters(None, None, None, None)
        used, reserved = stats["allocated_bytes"]["all"], stats["reserved_bytes"]["all"]
        # cudaMallocAsync fills only the byte counters of "all": this count stays 0 there
        requests = stats["allocation"]["all"]["allocated"]
        return Counters(used["current"], used["peak"], reserved["current"], requests)

    def allocator(self) -> str | None:
        """The CUDA allocator backend: 'native', 'cudaMallocAsync', or 'uncached'."""
        if self.kind != "cuda":
            return None
        if caching_off():
            return "uncached"
        return guarded(self._module.get_allocator_backend)

    def has_context(self) -> bool:
        """Whether work can have run here already: for CUDA, whether this device has a
        primary context (asked without creating one); other kinds have no such state.
        A context, once there, stays for the process (torch never destroys it), so a
        yes is not asked again."""
        if self._context:
            return True
        has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        self._context = has is None or guarded(has, self.index) is True
        return self._context

    def start_peak(self) -> None:
        """Start the peak window: reset the process-wide peak counter (or sample, on MPS)."""
        if self._mps_peak is not None:
            self._mps_peak.start()
            return
        if not self.has_context():  # no peak to reset; cudaMallocAsync's reset would make one
            return
        reset = self._module.reset_peak_memory_stats
        generic: Any = getattr(torch, "accelerator", None)
        if self.kind == "cuda":  # the C++ call itself, without torch's parsing of the index
            reset = getattr(torch._C, "_cuda_resetPeakMemoryStats", reset)
        elif hasattr(generic, "reset_peak_memory_stats") and _current_kind(generic) == self.kind:
            reset = generic.reset_peak_memory_stats
        guarded(reset, self.index)

    def sampled_peak_bytes(self) -> int | None:
        """End the MPS sampling window: the most allocated above its start, None elsewhere."""
        if self._mps_peak is None:
            return None
        return self._mps_peak.stop()[1]

    def synchronize(self) -> str | None:
        """Wait for the device's queued work (so that a clock read after it is honest).

        Returns None, or the error the wait raised: a CUDA error from an earlier
        kernel (an illegal address, a device-side assert) surfaces here, and it is
        sticky, so the caller must say so rather than swallow it.
        """
        try:
            if self.kind == "mps":
                self._module.synchronize()
            else:
                self._module.synchronize(self.index)
        except Exception as err:  # whatever the device raised is the message to show
            _log.debug("synchronising %s failed", self.name, exc_info=True)
            return first_sentence(err, named=True)
        return None

    def record_event(self) -> Any:
        """A timing event recorded now on this device's current stream, or None.

        Not the current device's stream: after `%device cuda:1` the events must go
        where the work goes (and must not start a context on cuda:0).
        """

        def record() -> Any:
            event = self._module.Event(enable_timing=True)
            if self.kind == "mps":  # one queue, no stream objects
                event.record()
            else:
                event.record(self._module.current_stream(self.index))
            return event

        return guarded(record)

    @staticmethod
    def elapsed_s(start: Any, end: Any) -> float | None:
        """Device seconds between two recorded events (after a synchronise)."""
        if start is None or end is None:
            return None
        ms = guarded(start.elapsed_time, end)
        return None if ms is None else ms / 1000

    def description(self) -> str:
        """'cuda:0 (NVIDIA H200)', or just the name where the device has no readable name."""
        label = None
        if self.kind in ("cuda", "xpu"):
            label = guarded(self._module.get_device_name, self.index)
        return f"{self.name} ({label})" if label else self.name


def active_accelerator(
    device: str | torch.device | None = None, kinds: tuple[str, ...] | None = None
) -> Accelerator | None:
    """The accelerator to measure, if its runtime is up: `device`, else the session's one.

    Without `device`: the torch default device when it is an accelerator, else the
    current device of the first runtime that is up. `kinds` (default: `built_kinds()`)
    lets a caller that asks every cell read the build once. Never starts a runtime.
    """
    kinds = built_kinds() if kinds is None else kinds
    if not kinds:  # a CPU-only build: asked every cell, so answered first
        return None
    if device is not None:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError, ValueError):  # not a device: nothing to measure
            return None
        if dev.type not in kinds or not runtime_up(dev.type):
            return None
    else:
        kind = next((k for k in kinds if runtime_up(k)), None)
        if kind is None:
            return None
        default = torch_default_device()
        dev = default if default is not None and default.type == kind else torch.device(kind)
    index = guarded(_index, dev)  # a broken runtime cannot say its current device
    return None if index is None else guarded(_accelerator, dev.type, index)


def devices_in_use(main: Accelerator) -> list[Accelerator]:
    """`main`, then every other device of its kind that work may have run on: for CUDA,
    each device with a primary context (asking creates none); for XPU or a PrivateUse1
    backend, whose runtime is up (`main`'s), each of its devices. MPS has one."""
    if main.kind == "mps":
        return [main]
    count = guarded(main._module.device_count) or 0
    others = (_accelerator(main.kind, i) for i in range(count) if i != main.index)
    return [main, *(a for a in others if a.has_context())]


def caching_off() -> bool:
    """Whether PYTORCH_NO_CUDA_MEMORY_CACHING switched the CUDA caching allocator off
    (its counters then stay 0, so they are not read)."""
    value = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "").strip().lower()
    return value not in ("", "0", "false", "no", "off")


def _current_kind(generic: Any) -> str | None:
    current = generic.current_accelerator()
    return None if current is None else current.type


# torch.accelerator's nested allocator statistics of a device (torch 2.9+), or None.
_GENERIC_STATS = getattr(torch._C, "_accelerator_getDeviceStats", None)
# The Counters' fields, as the flat statistics name them.
_COUNTERS = ("allocated_bytes.all.current", "allocated_bytes.all.peak",
             "reserved_bytes.all.current", "allocation.all.allocated")


@cache
def _accelerator(kind: str, index: int) -> Accelerator:
    return Accelerator(kind, index)  # one per device, so an MPS sampling thread is made once


def _index(dev: torch.device) -> int:
    if dev.index is not None:
        return dev.index
    return 0 if dev.type == "mps" else getattr(torch, dev.type).current_device()


def torch_default_device() -> torch.device | None:
    """The device `torch.set_default_device` set, or None; read without touching CUDA
    (`torch.get_default_device()` makes a tensor to find a CUDA index)."""
    return getattr(default_context(), "device", None)


def default_context() -> object:
    """What holds torch's default device now (a DeviceContext), or None for none."""
    slot = getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None)
    if isinstance(slot, threading.local):  # torch 2.3+: one per thread
        return getattr(slot, "device_context", None)
    return slot  # torch 2.1-2.2: the DeviceContext itself


def free_and_total(device: torch.device) -> tuple[int, int] | None:
    """Free and total bytes of `device` as torch (or, for the CPU, the OS) says, or None.

    An accelerator whose runtime is not up is not asked (asking would start it);
    `torch.device("cuda")` without an index is CUDA's current device.
    """
    if device.type == "cpu":
        vm = guarded(psutil.virtual_memory)
        return None if vm is None else (vm.available, vm.total)
    if device.type == "mps":
        def read() -> tuple[int, int]:
            total = torch.mps.recommended_max_memory()
            return total - torch.mps.driver_allocated_memory(), total

        return guarded(read)
    backend: Any = getattr(torch, device.type, None)
    if not hasattr(backend, "mem_get_info") or not _started(device.type):
        return None
    # No index: the current device, which torch < 2.2 reads only from None.
    at = None if device.index is None else device
    return guarded(lambda: tuple(backend.mem_get_info(at)))


def free_bytes(device: torch.device) -> int | None:
    """Free memory on `device` where torch or the OS says, else None (see `free_and_total`)."""
    found = free_and_total(device)
    return None if found is None else found[0]


def empty_cache(device: torch.device) -> None:
    """Hand the cached, unused blocks of `device`'s kind back to the device, where it has
    a caching allocator (torch's `empty_cache` does nothing before its runtime is up)."""
    backend: Any = getattr(torch, device.type, None)
    if hasattr(backend, "empty_cache"):
        guarded(backend.empty_cache)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`, where it is an accelerator whose runtime is up
    (never starting one to wait on it): a clock read afterwards then sees it done."""
    backend: Any = getattr(torch, device.type, None)
    up = getattr(backend, "is_initialized", None)
    if device.type not in ("cpu", "meta") and up is not None and up():
        backend.synchronize(device)


def _started(kind: str) -> bool:
    """Whether `kind`'s runtime is up, where it can say (MPS has no runtime to start)."""
    if kind in ("cuda", "xpu"):
        return runtime_up(kind)  # a CPU build's torch.cuda is not asked at all
    up = getattr(getattr(torch, kind, None), "is_initialized", None)
    return up is None or guarded(up) is True


def backend_available(kind: str) -> bool:
    """Whether torch has a device module for `kind` (an out-of-tree backend) that says it
    can be used."""
    available = getattr(getattr(torch, kind, None), "is_available", None)
    return available is not None and bool(guarded(available))


# --- NVML -------------------------------------------------------------------------

# NVML is initialised once per session (it is process-wide and torch shares it);
# a failed start is not remembered, so a driver that appears later is found.
_nvml_module: Any = None


def nvml_status() -> tuple[Any, str]:
    """The initialised pynvml module (from nvidia-ml-py), or None and why: the one gate
    every NVML reading goes through."""
    global _nvml_module
    if _nvml_module is None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as err:  # no library, no driver: each NVML error is its own class
            _log.debug("NVML did not start", exc_info=True)
            return None, f"NVML is not available ({type(err).__name__})"
        _nvml_module = pynvml
    return _nvml_module, ""


def nvml() -> Any:
    """The initialised pynvml module, or None without a driver."""
    return nvml_status()[0]


def nvml_gpu_count() -> int | None:
    """How many GPUs NVML lists, None without NVML (NVML initialises no CUDA driver)."""
    module = nvml()
    return None if module is None else guarded(module.nvmlDeviceGetCount)


def nvml_handle(module: Any, uuid: str) -> Any:
    """NVML's handle for a device torch names by `uuid` (bare, as torch prints it, or
    with NVML's `GPU-`/`MIG-` prefix: a MIG instance's UUID starts with `MIG-`)."""
    spellings = [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"]
    for spelling in spellings:
        try:
            return module.nvmlDeviceGetHandleByUUID(spelling)
        except Exception:  # not under this spelling
            _log.debug("NVML has no device %s", spelling, exc_info=True)
    return None


def nvml_used_bytes(accel: Accelerator | None) -> int | None:
    """Memory used on the whole device per NVML (context, other processes included);
    on a MIG instance, the instance's own memory."""
    if accel is None or accel.kind != "cuda":
        return None
    uuid = guarded(lambda: str(torch.cuda.get_device_properties(accel.index).uuid))
    module = nvml()
    if uuid is None or module is None:
        return None
    handle = nvml_handle(module, uuid)
    return None if handle is None else guarded(lambda: module.nvmlDeviceGetMemoryInfo(handle).used)


@dataclass(frozen=True)
class NvmlDevice:
    """One device CUDA could count, as NVML reads it: a GPU, or a MIG instance of one.

    A figure NVML would not give is None. `problem` says why the device could not be
    read at all (its handle, or its memory), in NVML's words."""

    uuid: str | None  # None: NVML could not read even this
    name: str | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    utilization_pct: int | None = None
    capability: tuple[int, int] | None = None
    problem: str | None = None


def nvml_devices() -> tuple[list[NvmlDevice], str]:
    """Every device NVML lists, in its (PCI) order, a GPU in MIG mode replaced by its
    MIG instances; and why there is no listing where there is none ("" otherwise).

    Each device is read on its own: one that NVML refuses (no permission, a GPU that
    fell off the bus) is listed with the reason, the others as usual.
    """
    module, why = nvml_status()
    if module is None:
        return [], why
    try:
        count = module.nvmlDeviceGetCount()
    except Exception as err:
        _log.debug("NVML cannot count the devices", exc_info=True)
        return [], f"NVML failed ({type(err).__name__}: {err})"
    found = []
    for i in range(count):
        try:
            handle = module.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(module.nvmlDeviceGetUUID(handle))
        except Exception as err:
            _log.debug("NVML cannot read device %d", i, exc_info=True)
            found.append(NvmlDevice(None, problem=f"NVML cannot read it ({_nvml_error(err)})"))
            continue
        found += [_nvml_read(module, *mig) for mig in _mig_instances(module, handle)] or [
            _nvml_read(module, handle, uuid)
        ]
    return found, ""


def _mig_instances(module: Any, handle: Any) -> list[tuple[Any, str]]:
    """The handle and UUID of each MIG instance of a GPU in MIG mode; none otherwise."""
    try:
        if module.nvmlDeviceGetMigMode(handle)[0] != 1:
            return []
        slots = module.nvmlDeviceGetMaxMigDeviceCount(handle)
    except Exception:  # a board without MIG
        _log.debug("no MIG mode to read", exc_info=True)
        return []
    found = []
    for j in range(slots):
        try:
            mig = module.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
            found.append((mig, _text(module.nvmlDeviceGetUUID(mig))))
        except Exception:  # an empty slot
            _log.debug("MIG slot %d is empty", j, exc_info=True)
    return found


def _nvml_read(module: Any, handle: Any, uuid: str) -> NvmlDevice:
    """What NVML says of one device; for a MIG instance, its own memory, not its parent's."""
    name = guarded(lambda: _text(module.nvmlDeviceGetName(handle)))
    try:
        mem = module.nvmlDeviceGetMemoryInfo(handle)
    except Exception as err:
        _log.debug("NVML cannot read the memory of %s", uuid, exc_info=True)
        return NvmlDevice(uuid, name, problem=f"NVML cannot read it ({_nvml_error(err)})")
    # NotSupported on some boards, on MIG instances and in some containers:
    util = guarded(lambda: int(module.nvmlDeviceGetUtilizationRates(handle).gpu))
    capability = guarded(lambda: tuple(module.nvmlDeviceGetCudaComputeCapability(handle)))
    return NvmlDevice(uuid, name, mem.total, mem.free, util, capability)


def nvml_process_bytes() -> tuple[dict[int, int] | None, str]:
    """GPU memory per process id, summed over every device NVML lists (a GPU in MIG
    mode through its instances), from `nvmlDeviceGetComputeRunningProcesses`; None and
    why where NVML cannot list them. The ids are the host's: inside a container they
    need not be this machine's. A process whose memory NVML does not give is left out."""
    per_device, why = nvml_device_processes()
    if per_device is None:
        return None, why
    found: dict[int, int] = {}
    for listed in per_device.values():
        for pid, used in listed.items():
            found[pid] = found.get(pid, 0) + used
    return found, ""


def nvml_device_processes() -> tuple[dict[str, dict[int, int]] | None, str]:
    """GPU memory per process id on each device NVML lists, by the device's bare UUID
    (a GPU in MIG mode by its instances'); None and why where NVML cannot list them.
    The ids are the host's, as in `nvml_process_bytes`."""
    module, why = nvml_status()
    if module is None:
        return None, why
    try:
        handles = [module.nvmlDeviceGetHandleByIndex(i) for i in range(module.nvmlDeviceGetCount())]
    except Exception as err:
        _log.debug("NVML cannot list the devices", exc_info=True)
        return None, f"NVML failed ({_nvml_error(err)})"
    found: dict[str, dict[int, int]] = {}
    for handle in handles:
        for device in [mig for mig, _ in _mig_instances(module, handle)] or [handle]:
            uuid = _text(guarded(module.nvmlDeviceGetUUID, device) or "")
            listed = guarded(module.nvmlDeviceGetComputeRunningProcesses, device) or []
            mine = found.setdefault(uuid.removeprefix("GPU-").removeprefix("MIG-"), {})
            for process in listed:
                used = getattr(process, "usedGpuMemory", None)  # None: not available
                if used is not None:
                    mine[process.pid] = mine.get(process.pid, 0) + int(used)
    return found, ""


def nvml_busy_percent(index: int, since_us: int, pids: set[int]) -> float | None:
    """How busy CUDA device `index` was since `since_us` (NVML's clock: microseconds of
    wall time), in percent of the time a kernel ran, from NVML's own sample buffers: the
    device's utilisation samples, and, where other processes ran kernels there, only
    those of `pids` (this process and its workers). None where NVML gives no samples, or
    where the busy processes are none of `pids` (a container that hides their ids), or
    where NVML fails. Two NVML calls; no polling."""
    return guarded(nvml_busy_since, index, since_us, pids)


def nvml_busy_since(index: int, since_us: int, pids: set[int]) -> float | None:
    """`nvml_busy_percent`, except that NVML failing (not merely having no samples) raises
    RuntimeError('NVML failed: GpuIsLost'): the live line drops the part and says why."""
    module = nvml()
    uuid = guarded(lambda: str(torch.cuda.get_device_properties(index).uuid))
    if module is None or uuid is None:
        return None
    handle = nvml_handle(module, uuid)
    if handle is None:
        return None
    kind = getattr(module, "NVML_GPU_UTILIZATION_SAMPLES", 1)
    try:
        found = module.nvmlDeviceGetSamples(handle, kind, since_us)
    except Exception as err:  # NVML raises NotFound for none: an idle GPU, a bare container
        if _nvml_error(err) == "NotFound":
            return None
        raise RuntimeError(f"NVML failed: {_nvml_error(err)}") from err
    samples = [s for s in found[1] if s.timeStamp > since_us]
    if not samples:
        return None
    device = sum(s.sampleValue.uiVal for s in samples) / len(samples)
    per_process = guarded(module.nvmlDeviceGetProcessUtilization, handle, since_us) or []
    per_process = [p for p in per_process if p.timeStamp > since_us and p.smUtil]
    if not any(p.pid not in pids for p in per_process):
        return device  # the device's figure is ours alone
    ours = [p.smUtil for p in per_process if p.pid in pids]
    return None if not ours else min(device, sum(ours) / len(samples))


def nvml_cuda_driver_version() -> int | None:
    """The newest CUDA the driver runs, as NVML writes it (12040 is CUDA 12.4), or None."""
    module = nvml()
    return None if module is None else guarded(
        lambda: int(module.nvmlSystemGetCudaDriverVersion())
    )


def _nvml_error(err: BaseException) -> str:
    return type(err).__name__.removeprefix("NVMLError_") or str(err)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# --- the devices there are, as torch and the OS see them ------------------------------


def torch_cuda_uuids() -> list[str] | None:
    """The UUIDs of CUDA's devices in CUDA's order, once CUDA runs (None before: asking
    would start it, or where CUDA fails)."""
    if not runtime_up("cuda"):
        return None
    return guarded(
        lambda: [str(torch.cuda.get_device_properties(i).uuid)
                 for i in range(torch.cuda.device_count())]
    )


def cuda_names() -> tuple[list[str] | None, str | None]:
    """CUDA's name for each of its devices once CUDA runs, else None (naming would start
    it); and the error where CUDA failed to say."""
    if not runtime_up("cuda"):
        return None, None
    try:
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], None
    except Exception as err:  # a broken driver or context: what it said is the reason
        _log.debug("CUDA cannot name its devices", exc_info=True)
        return None, first_sentence(err, named=True)


def cuda_count() -> tuple[int, str | None]:
    """How many devices CUDA counts, and what CUDA said where it counts none (a broken
    driver raises, or warns). Counting starts the CUDA runtime but makes no context."""
    failure = None
    with warnings.catch_warnings(record=True) as caught:  # a broken driver warns
        warnings.simplefilter("always")
        try:
            count = torch.cuda.device_count()
        except Exception as err:
            _log.debug("CUDA cannot count its devices", exc_info=True)
            count, failure = 0, first_sentence(err, named=True)
    if count:
        return count, None
    return 0, failure or next((str(w.message).strip() for w in caught), None)


def cuda_arch_list() -> list[str]:
    """The CUDA architectures this torch was built for, once CUDA runs; none before.

    Asking earlier starts no context, but `_cuda_getArchFlags` registers torch's fork
    handler, which marks every process forked afterwards as one that cannot use CUDA
    (notebook_launcher's, ddp_notebook's): so the build is read only once CUDA is up."""
    if not runtime_up("cuda"):
        return []
    flags = getattr(torch._C, "_cuda_getArchFlags", None)
    arches = guarded(flags) if flags is not None else guarded(torch.cuda.get_arch_list)
    return arches.split() if isinstance(arches, str) else list(arches or [])


def mps_available() -> bool:
    """Whether this Mac's GPU can be used through MPS."""
    return bool(guarded(torch.backends.mps.is_available))


def xpu_names() -> list[str | None]:
    """One entry per XPU device: its name once the XPU runtime is up, else None (naming
    would start it)."""
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not guarded(xpu.is_available):
        return []
    count = guarded(xpu.device_count) or 0
    if not xpu.is_initialized():
        return [None] * count
    return guarded(lambda: [xpu.get_device_name(i) for i in range(count)]) or []


def private_names() -> tuple[str | None, list[str | None]]:
    """The registered PrivateUse1 accelerator's name (Ascend's `npu`, the test device) and
    one entry per device of it: its name where its module names devices and its runtime
    is up, else None; (None, []) where none is registered or it says it cannot be used."""
    kind = _private_backend()
    if kind is None or not backend_available(kind):
        return None, []
    module: Any = getattr(torch, kind)
    count = guarded(getattr(module, "device_count", int)) or 0
    name = getattr(module, "get_device_name", None) if runtime_up(kind) else None
    return kind, [None if name is None else guarded(name, i) for i in range(count)]


def cpu_name() -> str:
    """The CPU's model name, or the best the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"
