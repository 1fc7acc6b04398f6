"""Device parsing, resolution and "auto", on made-up inventories: no GPU needed."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from torch_device_magic import devices
from torch_device_magic.devices import DeviceInfo, Inventory, cuda_order, pick_auto, resolve
from torch_device_magic.errors import DeviceMagicError

GIB = 2**30
CPU = DeviceInfo("cpu", "Some CPU", 24 * GIB, 20 * GIB)


def two_gpus(free0: float = 10 * GIB, free1: float = 100 * GIB) -> Inventory:
    return Inventory([
        DeviceInfo("cuda:0", "NVIDIA A", 80 * GIB, free0),
        DeviceInfo("cuda:1", "NVIDIA H200", 140 * GIB, free1),
        CPU,
    ])


@pytest.mark.parametrize(("free0", "free1", "chosen"), [
    (10 * GIB, 100 * GIB, "cuda:1"),
    (100 * GIB, 10 * GIB, "cuda:0"),
    (None, 1 * GIB, "cuda:1"),
])
def test_auto_picks_the_gpu_with_most_free_memory(free0, free1, chosen):
    dev, why = pick_auto(two_gpus(free0, free1))
    assert dev == torch.device(chosen)
    assert why.startswith(f"{chosen} (")
    assert "GiB free" in why and "the most of 2 GPUs" in why


def test_auto_line_reads_like_the_spec():
    _, why = pick_auto(two_gpus(free1=139.1 * GIB))
    assert why == "cuda:1 (NVIDIA H200, 139.1 of 140.0 GiB free, the most of 2 GPUs)"


@pytest.mark.parametrize(("kind", "name"), [("mps", "mps"), ("xpu", "xpu:0")])
def test_auto_falls_back_to_mps_then_xpu(kind, name):
    inv = Inventory([DeviceInfo(name, "accelerator"), CPU])
    assert pick_auto(inv)[0] == torch.device(name)


def test_auto_prefers_cuda_over_mps_and_mps_over_xpu():
    inv = Inventory([DeviceInfo("xpu:0", "x"), DeviceInfo("mps", "m"), CPU])
    assert pick_auto(inv)[0] == torch.device("mps")
    inv.devices.insert(0, DeviceInfo("cuda:0", "c", 1, 1))
    assert pick_auto(inv)[0] == torch.device("cuda:0")


def test_auto_without_gpu_says_cpu_and_why():
    dev, why = pick_auto(Inventory([CPU], ["cuda: torch 2.13.0+cpu is a build without CUDA"]))
    assert dev == torch.device("cpu")
    assert why == "no GPU available (cuda: torch 2.13.0+cpu is a build without CUDA): using the CPU"
    assert pick_auto(Inventory([CPU]))[1] == "no GPU available: using the CPU"


@pytest.mark.parametrize("spec", ["cpu", "meta", " cpu ", "cpu:0"])
def test_cpu_and_meta_always_resolve(spec):
    dev, _ = resolve(spec, Inventory([CPU]))
    assert dev.type == spec.strip().split(":")[0]


@pytest.mark.parametrize(("spec", "expected"), [("cuda", "cuda"), ("cuda:1", "cuda:1")])
def test_present_gpu_resolves_with_its_name(spec, expected):
    dev, why = resolve(spec, two_gpus())
    assert dev == torch.device(expected)
    assert why.startswith(expected) and "NVIDIA" in why


@pytest.mark.parametrize(("spec", "message"), [
    ("cuda:7", "cuda:7 is not available: this machine has cuda:0, cuda:1"),
    ("cuda:2", "cuda:2 is not available: this machine has cuda:0, cuda:1"),
    ("mps", "mps is not available: this machine has cuda:0, cuda:1, cpu, meta"),
    ("banana", "'banana' is not a device: use auto, cpu, cuda, cuda:N, mps, xpu or meta"),
    ("cuda:-1", "'cuda:-1' is not a device"),
    ("cpu cuda", "'cpu cuda' is not a device"),
    ("cpu:1", "'cpu:1' is not a device: cpu takes no index"),
])
def test_bad_or_missing_devices_say_what_exists(spec, message):
    with pytest.raises(DeviceMagicError) as err:
        resolve(spec, two_gpus())
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_cuda_without_cuda_names_the_reason():
    inv = Inventory([CPU], ["cuda: torch 2.13.0+cpu is a build without CUDA"])
    with pytest.raises(DeviceMagicError) as err:
        resolve("cuda", inv)
    assert str(err.value) == (
        "cuda is not available (cuda: torch 2.13.0+cpu is a build without CUDA): "
        "this machine has cpu, meta"
    )


def test_exotic_backend_is_checked_with_torch():
    with pytest.raises(DeviceMagicError, match="hpu is not available"):
        resolve("hpu", Inventory([CPU]))


UUIDS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]


@pytest.mark.parametrize(("visible", "order"), [
    (None, [0, 1, 2]),
    ("2,0", [2, 0]),
    ("GPU-cc,GPU-a", [2, 0]),
    ("1,7,0", [1]),  # CUDA stops at the first entry that matches nothing
    ("", []),
    ("0,0", [0]),  # a repeated entry ends the list too
])
def test_cuda_order_follows_cuda_visible_devices(visible, order):
    assert cuda_order(UUIDS, visible) == order


def test_cuda_order_prefers_torch_uuids_once_a_context_exists():
    assert cuda_order(UUIDS, "0,1", torch_uuids=["GPU-cccc", "GPU-aaaa"]) == [2, 0]


def fake_nvml(monkeypatch, uuids, free):
    """A stand-in pynvml module with len(uuids) GPUs in NVML (PCI) order."""
    mod = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(uuids),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda h: uuids[h].encode(),
        nvmlDeviceGetName=lambda h: f"GPU {h}",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80 * GIB, free=free[h]),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=7 * h),
    )
    monkeypatch.setitem(sys.modules, "pynvml", mod)


def test_nvml_listing_maps_visible_devices_to_cuda_ordinals(monkeypatch):
    fake_nvml(monkeypatch, UUIDS, [1 * GIB, 2 * GIB, 3 * GIB])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    gpus, why = devices.nvml_gpus()
    assert [(g.device, g.name, g.free_bytes) for g in gpus] == [
        ("cuda:0", "GPU 2", 3 * GIB),
        ("cuda:1", "GPU 1", 2 * GIB),
    ]
    assert gpus[0].utilization_pct == 14 and why == ""


def test_nvml_missing_is_a_reason_not_a_crash(monkeypatch):
    def boom():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    fake_nvml(monkeypatch, UUIDS, [0, 0, 0])
    monkeypatch.setattr(sys.modules["pynvml"], "nvmlInit", boom)
    gpus, why = devices.nvml_gpus()
    assert gpus == [] and why == "NVML is not available (OSError)"


def test_inventory_on_this_machine_lists_the_cpu_with_its_ram():
    inv = devices.take_inventory()
    cpu = inv.of_type("cpu")[0]
    assert cpu.total_bytes > 0 and 0 < cpu.free_bytes <= cpu.total_bytes
    if torch.version.cuda is None:
        assert inv.of_type("cuda") == [] and "without CUDA" in inv.notes[0]


def test_device_table_marks_the_session_device():
    table = devices.device_table(two_gpus(), torch.device("cuda:1"))
    text = table.text()
    assert "session device: cuda:1" in text
    marked = [line for line in text.splitlines() if line.startswith("*")]
    assert len(marked) == 1 and "cuda:1" in marked[0] and "NVIDIA H200" in marked[0]
    assert "<table>" in table._repr_mimebundle_()["text/html"]
