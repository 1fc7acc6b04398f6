"""What devices the machine has, what the user's device string means, and "auto".

    >>> inv = Inventory([DeviceInfo("cuda:0", "NVIDIA H200", 150e9, 149e9)])
    >>> resolve("cuda:3", inv)
    DeviceMagicError: cuda:3 is not available: this machine has cuda:0

Taking the inventory never creates a CUDA context, so a notebook can still fork
workers afterwards: CUDA GPUs come from NVML, mapped to CUDA ordinals by UUID
through CUDA_VISIBLE_DEVICES (NVML enumerates in PCI order and ignores it), or
through torch itself once a context exists anyway. `resolve` and `pick_auto`
are pure: they take an `Inventory` and return a `torch.device`.
"""

from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import dataclass, field

import psutil
import torch

from .errors import DeviceMagicError
from .reports import Table
from .units import fmt_bytes

EXAMPLES = "auto, cpu, cuda, cuda:N, mps, xpu or meta"


@dataclass(frozen=True)
class DeviceInfo:
    """One device the machine has, with memory figures where they could be read."""

    device: str
    name: str
    total_bytes: float | None = None
    free_bytes: float | None = None
    utilization_pct: int | None = None

    @property
    def type(self) -> str:
        return self.device.split(":")[0]


@dataclass
class Inventory:
    """The devices found, and why a kind of device is missing when it is."""

    devices: list[DeviceInfo]
    notes: list[str] = field(default_factory=list)

    def of_type(self, kind: str) -> list[DeviceInfo]:
        return [d for d in self.devices if d.type == kind]

    def names(self) -> list[str]:
        return [d.device for d in self.devices] + ["meta"]


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.1f}"


def pick_auto(inventory: Inventory) -> tuple[torch.device, str]:
    """The CUDA GPU with the most free memory, else MPS, else XPU, else the CPU; and why."""
    gpus = inventory.of_type("cuda")
    if gpus:
        best = max(gpus, key=lambda d: -1 if d.free_bytes is None else d.free_bytes)
        why = f"{_gib(best.free_bytes)} of {_gib(best.total_bytes)} GiB free"
        if len(gpus) > 1:
            why += f", the most of {len(gpus)} GPUs"
        return torch.device(best.device), f"{best.device} ({best.name}, {why})"
    for kind in ("mps", "xpu"):
        found = inventory.of_type(kind)
        if found:
            return torch.device(found[0].device), f"{found[0].device} ({found[0].name})"
    reason = f" ({'; '.join(inventory.notes)})" if inventory.notes else ""
    return torch.device("cpu"), f"no GPU available{reason}: using the CPU"


def parse(spec: str) -> torch.device:
    """Turn what the user typed into a `torch.device`, or say in one sentence why not."""
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        raise DeviceMagicError(
            f"{spec!r} is not a device: use {EXAMPLES} (any torch.device string)"
        ) from None
    if dev.type in ("cpu", "meta") and dev.index not in (None, 0):
        raise DeviceMagicError(f"{spec!r} is not a device: {dev.type} takes no index")
    return canonical(dev)


def canonical(dev: torch.device) -> torch.device:
    """`cpu:0` as `cpu` (and `meta:0` as `meta`): tensors there report no index, so a
    device compared with theirs must not carry one."""
    return torch.device(dev.type) if dev.type in ("cpu", "meta") else dev


def resolve(spec: str, inventory: Inventory) -> tuple[torch.device, str]:
    """The device `spec` names if this machine has it, with the line to show the user."""
    spec = spec.strip()
    if spec == "auto":
        return pick_auto(inventory)
    dev = parse(spec)
    if dev.type in ("cpu", "meta") or (
        dev.type not in ("cuda", "mps", "xpu") and _backend_available(dev.type)
    ):
        return dev, str(dev)
    found = inventory.of_type(dev.type)
    if (dev.index or 0) >= len(found):
        raise DeviceMagicError(_unavailable(str(dev), dev.type, inventory))
    return dev, f"{dev} ({found[dev.index or 0].name})"


def _unavailable(name: str, kind: str, inventory: Inventory) -> str:
    same = inventory.of_type(kind)
    if same:
        return f"{name} is not available: this machine has {', '.join(d.device for d in same)}"
    why = "".join(f" ({n})" for n in inventory.notes if n.startswith(kind))
    return (
        f"{name} is not available{why}: this machine has {', '.join(inventory.names())}"
    )


def _backend_available(kind: str) -> bool:
    module = getattr(torch, kind, None)
    try:
        return bool(module.is_available()) if module is not None else False
    except Exception:
        return False


def take_inventory(probe_cuda_runtime: bool = False) -> Inventory:
    """Every device this process can use; `probe_cuda_runtime` allows torch's own
    CUDA count when NVML is missing (it starts the CUDA runtime, so only on request)."""
    inv = Inventory([])
    inv.devices += _cuda_devices(inv.notes, probe_cuda_runtime)
    if _mps_available():
        inv.devices.append(_mps_info())
    inv.devices += _xpu_devices()
    vm = psutil.virtual_memory()
    inv.devices.append(DeviceInfo("cpu", _cpu_name(), vm.total, vm.available))
    return inv


def _cuda_devices(notes: list[str], probe_cuda_runtime: bool) -> list[DeviceInfo]:
    if torch.version.cuda is None and torch.version.hip is None:
        notes.append(f"cuda: torch {torch.__version__} is a build without CUDA")
        return []
    gpus, why = nvml_gpus()
    if gpus:
        return gpus
    if probe_cuda_runtime or torch.cuda.is_initialized():
        try:
            count = torch.cuda.device_count()
        except Exception:  # a broken driver: say so, as NVML did
            count = 0
        if count:
            return [DeviceInfo(f"cuda:{i}", torch.cuda.get_device_name(i)) for i in range(count)]
    notes.append(f"cuda: {why}")
    return []


def nvml_gpus() -> tuple[list[DeviceInfo], str]:
    """The CUDA devices this process sees, read through NVML, and why none when so."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:  # no library, no driver
        return [], f"NVML is not available ({type(err).__name__})"
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
        order = cuda_order(uuids, os.environ.get("CUDA_VISIBLE_DEVICES"), _torch_uuids())
        gpus = [_nvml_info(pynvml, f"cuda:{i}", handles[n]) for i, n in enumerate(order)]
        return gpus, "" if gpus else "NVML sees no GPU visible to this process"
    except Exception as err:
        return [], f"NVML failed ({type(err).__name__}: {err})"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def cuda_order(
    nvml_uuids: list[str], visible: str | None, torch_uuids: list[str] | None = None
) -> list[int]:
    """NVML indices in CUDA ordinal order: cuda:i is NVML device `result[i]`.

    With a CUDA context, torch's own UUIDs decide. Otherwise CUDA_VISIBLE_DEVICES
    does, as CUDA reads it: indices or UUID prefixes, stopping at the first entry
    that matches nothing.
    """
    if torch_uuids is not None:
        return [nvml_uuids.index(u) for u in torch_uuids if u in nvml_uuids]
    if visible is None:
        return list(range(len(nvml_uuids)))
    order: list[int] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.lstrip("-").isdigit():
            n = int(entry)
            if not 0 <= n < len(nvml_uuids):
                break
        else:
            matches = [i for i, u in enumerate(nvml_uuids) if entry and u.startswith(entry)]
            if len(matches) != 1:
                break
            n = matches[0]
        if n in order:
            break
        order.append(n)
    return order


def _torch_uuids() -> list[str] | None:
    if not torch.cuda.is_initialized():
        return None
    return [
        f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(torch.cuda.device_count())
    ]


def _nvml_info(pynvml, device: str, handle) -> DeviceInfo:
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        util = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # NotSupported on some boards and in some containers
        util = None
    name = _text(pynvml.nvmlDeviceGetName(handle))
    return DeviceInfo(device, name, mem.total, mem.free, util)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _mps_available() -> bool:
    try:
        return bool(torch.backends.mps.is_available())
    except Exception:
        return False


def _mps_info() -> DeviceInfo:
    try:
        total = torch.mps.recommended_max_memory()
        free = total - torch.mps.driver_allocated_memory()
    except Exception:
        total = free = None
    return DeviceInfo("mps", "Apple GPU (MPS)", total, free)


def _xpu_devices() -> list[DeviceInfo]:
    xpu = getattr(torch, "xpu", None)
    try:
        if xpu is None or not xpu.is_available():
            return []
        return [DeviceInfo(f"xpu:{i}", xpu.get_device_name(i)) for i in range(xpu.device_count())]
    except Exception:
        return []


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def device_table(inventory: Inventory, current: torch.device | None) -> Table:
    """The `%device` table: every device with its memory, and the session device."""
    rows = []
    for d in inventory.devices:
        mem = "n/a"
        if d.total_bytes is not None and d.free_bytes is not None:
            mem = f"{fmt_bytes(d.total_bytes - d.free_bytes)} / {fmt_bytes(d.total_bytes)}"
        util = "n/a" if d.utilization_pct is None else f"{d.utilization_pct} %"
        mark = "*" if current is not None and d.device in _names_of(current) else ""
        rows.append([mark, d.device, d.name, mem, util])
    title = f"session device: {current if current is not None else 'not set (torch default: cpu)'}"
    notes = [f"no {n.split(':', 1)[0].upper()} device listed: {n.split(': ', 1)[1]}"
             for n in inventory.notes]
    return Table(title, ["", "device", "name", "memory used / total", "util"], rows, notes)


def _names_of(dev: torch.device) -> set[str]:
    return {str(dev), f"{dev.type}:{dev.index or 0}"}


def torch_default_device() -> torch.device | None:
    """The device `torch.set_default_device` set, or None; read without touching CUDA
    (`torch.get_default_device()` makes a tensor to find a CUDA index)."""
    context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return getattr(context, "device", None)
