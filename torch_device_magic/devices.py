"""What devices the machine has, what the user's device string means, and "auto".

    >>> inv = Inventory([DeviceInfo("cuda:0", "NVIDIA H200", 150e9, 149e9)])
    >>> resolve("cuda:3", inv)
    DeviceMagicError: cuda:3 is not available: this machine has cuda:0

Taking the inventory never creates a CUDA context, so a notebook can still fork
workers afterwards: CUDA GPUs come from NVML (each GPU, or its MIG instances
where MIG mode is on), mapped to CUDA ordinals by UUID through
CUDA_VISIBLE_DEVICES (NVML enumerates in PCI order and ignores it), or through
torch itself once a context exists anyway. CUDA numbers GPUs fastest first
unless CUDA_DEVICE_ORDER=PCI_BUS_ID: before a context exists, the PCI mapping is
trusted only under PCI_BUS_ID, for identical GPUs, or for a CUDA_VISIBLE_DEVICES
of UUIDs; otherwise the GPUs are listed as `cuda:?` and `auto` takes `cuda`.
A GPU this torch cannot run on (driver too old for its CUDA, a compute
capability it was not built for) is listed with the reason, and `auto` skips
it. `resolve` and `pick_auto` are pure: they take an `Inventory` and return a
`torch.device`.
"""

from __future__ import annotations

import os
import platform
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

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
    problem: str | None = None  # why torch cannot use it (auto skips it); None: usable

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


UNKNOWN_ORDER = "cuda:?"  # a GPU whose CUDA ordinal cannot be known before CUDA starts


def pick_auto(inventory: Inventory) -> tuple[torch.device, str]:
    """The usable CUDA GPU with the most free memory, else MPS, else XPU, else the CPU;
    and why. Where CUDA's order of the GPUs is unknown, `cuda` (CUDA's first GPU)."""
    gpus = [d for d in inventory.of_type("cuda") if d.problem is None]
    if gpus and any(d.device == UNKNOWN_ORDER for d in gpus):
        return torch.device("cuda"), (
            "cuda (CUDA's first GPU: which cuda:N has the most free memory is unknown until "
            "CUDA starts, as these GPUs differ; set CUDA_DEVICE_ORDER=PCI_BUS_ID to let auto "
            "choose)"
        )
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
    reasons = inventory.notes + [
        f"{d.device} not usable: {d.problem}" for d in inventory.devices if d.problem
    ]
    reason = f" ({'; '.join(reasons)})" if reasons else ""
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
    chosen = found[dev.index or 0]
    if chosen.device == UNKNOWN_ORDER:
        return dev, f"{dev} (which of the listed GPUs it is is unknown until CUDA starts)"
    problem = "" if chosen.problem is None else f"; it may not work: {chosen.problem}"
    return dev, f"{dev} ({chosen.name}{problem})"


def make_current(index: int) -> int:
    """Make cuda:`index` CUDA's current device, so that work and probes without an index
    go there too: at once where CUDA runs, else queued on torch's lazy-init queue, which
    runs when CUDA starts (nothing starts now). Returns the device it replaces (CUDA's
    own default, 0, before CUDA starts)."""
    try:
        if not torch.cuda.is_initialized():
            torch.cuda._lazy_call(lambda: torch.cuda.set_device(index))
            return 0
        before = torch.cuda.current_device()
        torch.cuda.set_device(index)
        return before
    except Exception as err:
        message = f"cannot make cuda:{index} CUDA's current device: {first_line(err)}"
        raise DeviceMagicError(message) from None


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
    if torch.cuda.is_initialized():  # a context exists anyway: torch can name them
        try:
            count = torch.cuda.device_count()
            return [DeviceInfo(f"cuda:{i}", torch.cuda.get_device_name(i)) for i in range(count)]
        except Exception as err:
            notes.append(f"cuda: {why}; CUDA itself failed ({first_line(err)})")
            return []
    if probe_cuda_runtime:
        # Counting starts no context (get_device_name would): list by count only.
        failure = None
        with warnings.catch_warnings(record=True) as caught:  # a broken driver warns
            warnings.simplefilter("always")
            try:
                count = torch.cuda.device_count()
            except Exception as err:
                count, failure = 0, first_line(err)
        if count:
            return [DeviceInfo(f"cuda:{i}", "CUDA GPU (named once CUDA starts)")
                    for i in range(count)]
        failure = failure or next((str(w.message).strip() for w in caught), None)
        if failure:
            why += f"; CUDA says: {failure.splitlines()[0]}"
    notes.append(f"cuda: {why}")
    return []


# NVML is initialised once per session (it is process-wide and torch shares it);
# a failed start is not remembered, so a driver that appears later is found.
_nvml_module: Any = None


def nvml_status() -> tuple[Any, str]:
    """The initialised pynvml module (from nvidia-ml-py), or None and why."""
    global _nvml_module
    if _nvml_module is None:
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as err:  # no library, no driver
            return None, f"NVML is not available ({type(err).__name__})"
        _nvml_module = pynvml
    return _nvml_module, ""


def nvml() -> Any:
    """The initialised pynvml module, or None without a driver."""
    return nvml_status()[0]


def nvml_handle(module: Any, uuid: str) -> Any:
    """NVML's handle for a device torch names by `uuid` (bare, as torch prints it, or
    with NVML's `GPU-`/`MIG-` prefix: a MIG instance's UUID starts with `MIG-`)."""
    spellings = [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"]
    for spelling in spellings:
        try:
            return module.nvmlDeviceGetHandleByUUID(spelling)
        except Exception:
            continue
    return None


@dataclass
class _Listed:
    """One device CUDA could count, as NVML sees it: a GPU or a MIG instance."""

    uuid: str | None  # None: NVML could not read it
    handle: Any = None
    problem: str | None = None


def nvml_gpus() -> tuple[list[DeviceInfo], str]:
    """The CUDA devices this process sees, read through NVML, and why none when so.

    Each device is read in its own try: one that NVML refuses (no permission, a
    GPU that fell off the bus) is listed with the reason, the others as usual.
    """
    module, why = nvml_status()
    if module is None:
        return [], why
    try:
        listed = _nvml_listing(module)
    except Exception as err:
        return [], f"NVML failed ({type(err).__name__}: {err})"
    uuids = [d.uuid or "" for d in listed]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    torch_uuids = _torch_uuids()
    order = cuda_order(uuids, visible, torch_uuids)
    known = torch_uuids is not None or _order_known(module, listed, visible)
    driver_problem = _driver_problem(module)
    gpus = []
    for i, n in enumerate(order):
        name = f"cuda:{i}" if known else UNKNOWN_ORDER
        gpus.append(_nvml_info(module, name, listed[n], driver_problem))
    return gpus, "" if gpus else "NVML sees no GPU visible to this process"


def _nvml_listing(module: Any) -> list[_Listed]:
    """Every GPU in NVML (PCI) order, a GPU in MIG mode replaced by its MIG instances."""
    found = []
    for i in range(module.nvmlDeviceGetCount()):
        try:
            handle = module.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(module.nvmlDeviceGetUUID(handle))
        except Exception as err:
            found.append(_Listed(None, problem=f"NVML cannot read it ({_nvml_error(err)})"))
            continue
        found += _mig_instances(module, handle) or [_Listed(uuid, handle)]
    return found


def _mig_instances(module: Any, handle: Any) -> list[_Listed]:
    try:
        if module.nvmlDeviceGetMigMode(handle)[0] != 1:
            return []
        slots = module.nvmlDeviceGetMaxMigDeviceCount(handle)
    except Exception:  # a board without MIG
        return []
    found = []
    for j in range(slots):
        try:
            mig = module.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
            found.append(_Listed(_text(module.nvmlDeviceGetUUID(mig)), mig))
        except Exception:  # an empty slot
            continue
    return found


def _order_known(module: Any, listed: list[_Listed], visible: str | None) -> bool:
    """Whether NVML's PCI order is CUDA's too, before a context can tell: CUDA counts
    fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, which is the same order only
    for identical GPUs; a CUDA_VISIBLE_DEVICES of UUIDs fixes the order itself. A CUDA
    process enumerates one MIG instance at most: with several, which one is unknown."""
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if entries and not any(e.lstrip("-").isdigit() for e in entries):
        return True
    if sum(bool(d.uuid and d.uuid.startswith("MIG-")) for d in listed) > 1:
        return False
    if os.environ.get("CUDA_DEVICE_ORDER", "").strip() == "PCI_BUS_ID":
        return True
    # A GPU NVML cannot read is left out: it is listed as unusable anyway.
    names = {_guarded_text(module.nvmlDeviceGetName, d.handle) for d in listed if d.handle}
    return len(names) <= 1 and None not in names


def _guarded_text(fn: Any, *args: Any) -> str | None:
    try:
        return _text(fn(*args))
    except Exception:
        return None


def _nvml_error(err: BaseException) -> str:
    return type(err).__name__.removeprefix("NVMLError_") or str(err)


def first_line(err: BaseException) -> str:
    """`RuntimeError: CUDA error: an illegal memory access was encountered`: one line."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def cuda_order(
    nvml_uuids: list[str], visible: str | None, torch_uuids: list[str] | None = None
) -> list[int]:
    """NVML indices in CUDA ordinal order: cuda:i is NVML device `result[i]`.

    With a CUDA context, torch's own UUIDs decide (compared bare: NVML writes
    `GPU-` or, for a MIG instance, `MIG-` in front). Otherwise CUDA_VISIBLE_DEVICES
    does, as CUDA reads it: indices or UUID prefixes, stopping at the first entry
    that matches nothing.
    """
    if torch_uuids is not None:
        bare = [_bare(u) for u in nvml_uuids]
        return [bare.index(_bare(u)) for u in torch_uuids if _bare(u) in bare]
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


def _bare(uuid: str) -> str:
    return uuid.removeprefix("GPU-").removeprefix("MIG-")


def _torch_uuids() -> list[str] | None:
    if not torch.cuda.is_initialized():
        return None
    try:
        count = torch.cuda.device_count()
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
    except Exception:
        return None


def _nvml_info(module: Any, device: str, listed: _Listed, driver_problem: str | None) -> DeviceInfo:
    if listed.handle is None:
        return DeviceInfo(device, "unknown GPU", problem=listed.problem)
    handle = listed.handle
    name = _guarded_text(module.nvmlDeviceGetName, handle) or "unknown GPU"
    try:  # a MIG instance reads its own memory here, not its parent's
        mem = module.nvmlDeviceGetMemoryInfo(handle)
    except Exception as err:
        return DeviceInfo(device, name, problem=f"NVML cannot read it ({_nvml_error(err)})")
    try:
        util = int(module.nvmlDeviceGetUtilizationRates(handle).gpu)
    except Exception:  # NotSupported on some boards, on MIG instances and in some containers
        util = None
    problem = driver_problem or _arch_problem(module, handle)
    return DeviceInfo(device, name, mem.total, mem.free, util, problem)


def _driver_problem(module: Any) -> str | None:
    """Why the driver cannot run this torch's CUDA (an older major version), or None."""
    if torch.version.cuda is None:
        return None
    try:
        driver = int(module.nvmlSystemGetCudaDriverVersion())  # 12040 is CUDA 12.4
        built = int(torch.version.cuda.split(".")[0])
    except Exception:
        return None
    if driver // 1000 >= built:
        return None
    return (
        f"its driver supports CUDA up to {driver // 1000}.{driver % 1000 // 10}, "
        f"this torch needs CUDA {torch.version.cuda}"
    )


def _arch_problem(module: Any, handle: Any) -> str | None:
    """Why this torch has no kernels for the GPU's compute capability, or None."""
    try:
        major, minor = module.nvmlDeviceGetCudaComputeCapability(handle)
    except Exception:
        return None
    arches = _arch_list()
    if not arches or torch.version.hip is not None or _runs_on((major, minor), arches):
        return None
    return f"compute capability {major}.{minor} is not among this torch's ({' '.join(arches)})"


def _arch_list() -> list[str]:
    """The CUDA architectures this torch was built for, read from the build (no context)."""
    flags = getattr(torch._C, "_cuda_getArchFlags", None)
    try:
        return (flags() or "").split() if flags is not None else torch.cuda.get_arch_list()
    except Exception:
        return []


def _runs_on(capability: tuple[int, int], arches: list[str]) -> bool:
    """Whether a kernel image fits: `sm_XY` runs on X.Y and later minors of X;
    `compute_XY` (PTX) is compiled by the driver for X.Y and anything newer."""
    for arch in arches:
        found = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", arch)
        if found is None:
            continue
        built = (int(found[2]), int(found[3]))
        if built <= capability and (found[1] == "compute" or built[0] == capability[0]):
            return True
    return False


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
        count = xpu.device_count()
        if not xpu.is_initialized():  # get_device_name would start the XPU runtime
            return [DeviceInfo(f"xpu:{i}", "XPU (named once XPU starts)") for i in range(count)]
        return [DeviceInfo(f"xpu:{i}", xpu.get_device_name(i)) for i in range(count)]
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
        name = d.name if d.problem is None else f"{d.name} (not usable: {d.problem})"
        rows.append([mark, d.device, name, mem, util])
    title = f"session device: {current if current is not None else 'not set (torch default: cpu)'}"
    notes = [f"no {n.split(':', 1)[0].upper()} device listed: {n.split(': ', 1)[1]}"
             for n in inventory.notes]
    if any(d.device == UNKNOWN_ORDER for d in inventory.devices):
        notes.append(
            "cuda:? : CUDA numbers differing GPUs fastest first, NVML lists them in PCI "
            "order, so which GPU is cuda:N is unknown until CUDA starts "
            "(CUDA_DEVICE_ORDER=PCI_BUS_ID makes them agree)"
        )
    return Table(title, ["", "device", "name", "memory used / total", "util"], rows, notes)


def _names_of(dev: torch.device) -> set[str]:
    return {str(dev), f"{dev.type}:{dev.index or 0}"}


def torch_default_device() -> torch.device | None:
    """The device `torch.set_default_device` set, or None; read without touching CUDA
    (`torch.get_default_device()` makes a tensor to find a CUDA index)."""
    context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return getattr(context, "device", None)
