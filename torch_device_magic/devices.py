"""Deciding about devices: what the machine has, what the user's string means, "auto".

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
it. Every reading comes from `probes.py`; this module only decides, from the
plain values it is given: `resolve` and `pick_auto` take an `Inventory` and
return a `torch.device`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import torch

from . import probes
from .errors import DeviceMagicError, first_sentence
from .probes import NvmlDevice
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
    others: tuple[tuple[int, int], ...] = ()  # other processes on it: (host pid, bytes)
    capability: tuple[int, int] | None = None  # a CUDA GPU's compute capability

    @property
    def type(self) -> str:
        return self.device.split(":")[0]


@dataclass
class Inventory:
    """The devices found, and why a kind of device is missing when it is."""

    devices: list[DeviceInfo]
    notes: list[str] = field(default_factory=list)
    cuda_built: bool = True  # whether this torch is a build with CUDA

    def of_type(self, kind: str) -> list[DeviceInfo]:
        return [d for d in self.devices if d.type == kind]


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
    except (RuntimeError, ValueError, TypeError) as err:
        raise DeviceMagicError(
            f"{spec!r} is not a device: use {EXAMPLES} (any torch.device string)"
        ) from err
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
    found = inventory.of_type(dev.type)
    if dev.type in ("cpu", "meta") or (
        not found and dev.type not in ("cuda", "mps", "xpu")
        and probes.backend_available(dev.type)
    ):  # an out-of-tree device module the inventory does not list: as torch takes it
        return dev, str(dev)
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
    except Exception as err:  # whatever CUDA raised is the reason to give; kept as the cause
        reason = first_sentence(err, named=True)
        raise DeviceMagicError(f"cannot make cuda:{index} CUDA's current device: {reason}") from err


def _unavailable(name: str, kind: str, inventory: Inventory) -> str:
    same = inventory.of_type(kind)
    has = ", ".join(d.device for d in same or inventory.devices)  # meta is no machine's
    if same:
        return f"{name} is not available: this machine has {has}"
    why = "".join(f" ({n})" for n in inventory.notes if n.startswith(kind))
    if kind == "cuda" and not inventory.cuda_built:
        return (
            f"{name} is not available{why}: install a CUDA build of torch (on Linux: pip "
            "install --force-reinstall torch; elsewhere the command at "
            "https://pytorch.org/get-started/locally/), or on Colab choose a GPU under "
            f"Runtime > Change runtime type; this machine has {has}"
        )
    return f"{name} is not available{why}: this machine has {has}"


def take_inventory(probe_cuda_runtime: bool = False) -> Inventory:
    """Every device this process can use; `probe_cuda_runtime` allows torch's own
    CUDA count when NVML is missing (it starts the CUDA runtime, so only on request)."""
    inv = Inventory([], cuda_built=probes.cuda_built())
    inv.devices += _cuda_devices(inv.notes, probe_cuda_runtime)
    if probes.mps_available():
        free, total = probes.free_and_total(torch.device("mps")) or (None, None)
        inv.devices.append(DeviceInfo("mps", "Apple GPU (MPS)", total, free))
    inv.devices += _xpu_devices()
    kind, names = probes.private_names()
    if kind is not None:  # a PrivateUse1 accelerator: Ascend's npu, the test device
        inv.devices += _listed(kind, names, "PrivateUse1 accelerator")
    free, total = probes.free_and_total(torch.device("cpu")) or (None, None)
    inv.devices.append(DeviceInfo("cpu", probes.cpu_name(), total, free))
    return inv


def _cuda_devices(notes: list[str], probe_cuda_runtime: bool) -> list[DeviceInfo]:
    if not probes.cuda_built():
        notes.append(f"cuda: torch {torch.__version__} is a build without CUDA")
        return []
    gpus, why = nvml_gpus()
    if gpus:
        return gpus
    names, failure = probes.cuda_names()  # once a context exists anyway: torch names them
    if names is not None:
        return [DeviceInfo(f"cuda:{i}", name) for i, name in enumerate(names)]
    if failure is not None:
        notes.append(f"cuda: {why}; CUDA itself failed ({failure})")
        return []
    if probe_cuda_runtime:
        count, failure = probes.cuda_count()  # starts no context (naming would): by count only
        if count:
            return [DeviceInfo(f"cuda:{i}", "CUDA GPU (named once CUDA starts)")
                    for i in range(count)]
        if failure:
            why += f"; CUDA says: {failure.splitlines()[0]}"
    notes.append(f"cuda: {why}")
    return []


def nvml_gpus() -> tuple[list[DeviceInfo], str]:
    """The CUDA devices this process sees, as NVML reads them, and why none when so."""
    listed, why = probes.nvml_devices()
    if why:
        return [], why
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    torch_uuids = probes.torch_cuda_uuids()
    order = cuda_order([d.uuid or "" for d in listed], visible, torch_uuids)
    known = torch_uuids is not None or _order_known(listed, visible)
    driver_problem = _driver_problem(probes.nvml_cuda_driver_version(), torch.version.cuda)
    arches = probes.cuda_arch_list()
    processes = probes.nvml_device_processes()[0] or {}
    gpus = []
    for i, n in enumerate(order):
        d = listed[n]
        problem = d.problem or driver_problem or _arch_problem(d.capability, arches)
        gpus.append(DeviceInfo(
            f"cuda:{i}" if known else UNKNOWN_ORDER, d.name or "unknown GPU",
            d.total_bytes, d.free_bytes, d.utilization_pct, problem,
            other_processes(processes.get(_bare(d.uuid or ""), {})), d.capability,
        ))
    return gpus, "" if gpus else "NVML sees no GPU visible to this process"


def other_processes(listed: dict[int, int]) -> tuple[tuple[int, int], ...]:
    """The processes other than this one in NVML's list of a device, largest first."""
    me = os.getpid()
    return tuple(sorted(((p, n) for p, n in listed.items() if p != me), key=lambda pn: -pn[1]))


def others_note(device: str, others: tuple[tuple[int, int], ...]) -> str:
    """What other processes hold on `device`: a stale kernel of the user's often holds GiBs."""
    listed = ", ".join(f"pid {pid} {fmt_bytes(n)}" for pid, n in others[:5])
    more = f" and {len(others) - 5} more" if len(others) > 5 else ""
    return (
        f"{device}: other processes hold {fmt_bytes(sum(n for _, n in others))} "
        f"({listed}{more}); an old kernel of yours? shut it down to get it back"
    )


def _bf16_note(d: DeviceInfo) -> str:
    """bfloat16 is native from compute capability 8.0 (Ampere) on; below, torch emulates it."""
    major, minor = d.capability or (0, 0)
    return (
        f"{d.device} ({d.name}): compute capability {major}.{minor} has no native bfloat16; "
        "torch.cuda.is_bf16_supported() may say True, but bf16 is emulated and slow there: "
        "use float16 with torch.amp.GradScaler"
    )


def cuda_other_processes(index: int) -> tuple[tuple[int, int], ...]:
    """The other processes on CUDA device `index` per NVML, once CUDA runs (naming the
    device would start it); none where NVML cannot say."""
    uuids = probes.torch_cuda_uuids()
    if uuids is None or not 0 <= index < len(uuids):
        return ()
    processes = probes.nvml_device_processes()[0] or {}
    return other_processes(processes.get(_bare(uuids[index]), {}))


def accelerators_in_use() -> list[probes.Accelerator]:
    """Every accelerator device whose runtime is already up and, for CUDA, that has a
    context (asking starts none, and a GPU never used is not touched)."""
    found = []
    for kind in probes.built_kinds():  # a registered PrivateUse1 backend too
        if probes.runtime_up(kind):
            count = 1 if kind == "mps" else getattr(torch, kind).device_count()
            found += [probes.active_accelerator(torch.device(kind, i)) for i in range(count)]
    return [a for a in found if a is not None and a.has_context()]


def _order_known(listed: list[NvmlDevice], visible: str | None) -> bool:
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
    names = {d.name for d in listed if d.uuid is not None}
    return len(names) <= 1 and None not in names


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


def _driver_problem(driver: int | None, built: str | None) -> str | None:
    """Why a driver that runs CUDA up to `driver` (12040 is 12.4) cannot run this torch's
    CUDA `built` (an older major version), or None."""
    if driver is None or built is None:
        return None
    try:
        needed = int(built.split(".")[0])
    except ValueError:  # a version string torch never writes
        return None
    if driver // 1000 >= needed:
        return None
    return (
        f"its driver supports CUDA up to {driver // 1000}.{driver % 1000 // 10}, "
        f"this torch needs CUDA {built}"
    )


def _arch_problem(capability: tuple[int, int] | None, arches: list[str]) -> str | None:
    """Why this torch has no kernels for a GPU's compute capability, or None."""
    if capability is None or not arches or torch.version.hip is not None:
        return None
    if _runs_on(capability, arches):
        return None
    major, minor = capability
    return f"compute capability {major}.{minor} is not among this torch's ({' '.join(arches)})"


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


def _xpu_devices() -> list[DeviceInfo]:
    return _listed("xpu", probes.xpu_names(), "XPU (named once XPU starts)")


def _listed(kind: str, names: list[str | None], unnamed: str) -> list[DeviceInfo]:
    """A device of `kind` per entry of `names` (None: `unnamed`), with its memory where
    its runtime is up (asking starts none)."""
    found = []
    for i, name in enumerate(names):
        free, total = probes.free_and_total(torch.device(kind, i)) or (None, None)
        found.append(DeviceInfo(f"{kind}:{i}", name or unnamed, total, free))
    return found


def device_table(
    inventory: Inventory, current: torch.device | None, cuda_start: str | None = None
) -> Table:
    """The `%device` table: every device with its memory, the session device, and which
    cell initialised CUDA (`cuda_start`, as the report noted it)."""
    rows = []
    for d in inventory.devices:
        mem = "n/a"
        if d.total_bytes is not None and d.free_bytes is not None:
            mem = f"{fmt_bytes(d.total_bytes - d.free_bytes)} / {fmt_bytes(d.total_bytes)}"
        util = "n/a" if d.utilization_pct is None else f"{d.utilization_pct} %"
        mark = "*" if current is not None and d.device in _names_of(current) else ""
        name = d.name if d.problem is None else f"{d.name} (not usable: {d.problem})"
        rows.append([mark, d.device, name, mem, util])
    unset = f"not set (torch default: {probes.torch_default_device() or 'cpu'})"
    title = f"session device: {unset if current is None else current}"
    notes = [f"no {n.split(':', 1)[0].upper()} device listed: {n.split(': ', 1)[1]}"
             for n in inventory.notes]
    if any(d.device == UNKNOWN_ORDER for d in inventory.devices):
        notes.append(
            "cuda:? : CUDA numbers differing GPUs fastest first, NVML lists them in PCI "
            "order, so which GPU is cuda:N is unknown until CUDA starts "
            "(CUDA_DEVICE_ORDER=PCI_BUS_ID makes them agree)"
        )
    notes += [others_note(d.device, d.others) for d in inventory.devices if d.others]
    notes += [_bf16_note(d) for d in inventory.devices
              if d.problem is None and d.capability is not None and d.capability < (8, 0)]
    if cuda_start is not None:
        notes.append(cuda_start)
    return Table(title, ["", "device", "name", "memory used / total", "util"], rows, notes)


def _names_of(dev: torch.device) -> set[str]:
    return {str(dev), f"{dev.type}:{dev.index or 0}"}

