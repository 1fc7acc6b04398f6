"""Device parsing, resolution and "auto", on made-up inventories: no GPU needed."""

from __future__ import annotations

import sys

import pytest
import torch
from fakegpu import GIB, FakeMachine, Gpu, GpuIsLost, LibraryNotFound, NoPermission, mig

from torch_device_magic import devices
from torch_device_magic.devices import DeviceInfo, Inventory, cuda_order, pick_auto, resolve
from torch_device_magic.errors import DeviceMagicError, first_sentence

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
    ("mps", "mps is not available: this machine has cuda:0, cuda:1, cpu"),
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


def test_cuda_without_cuda_names_the_reason_and_what_to_do():
    inv = Inventory([CPU], ["cuda: torch 2.13.0+cpu is a build without CUDA"], cuda_built=False)
    with pytest.raises(DeviceMagicError) as err:
        resolve("cuda", inv)
    assert str(err.value) == (
        "cuda is not available (cuda: torch 2.13.0+cpu is a build without CUDA): install a "
        "CUDA build of torch (on Linux: pip install --force-reinstall torch; elsewhere the "
        "command at https://pytorch.org/get-started/locally/), or on Colab choose a GPU "
        "under Runtime > Change runtime type; this machine has cpu"
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


def listed(inv: Inventory) -> list[tuple]:
    return [(d.device, d.name, d.total_bytes, d.problem) for d in inv.of_type("cuda")]


def three_gpus(**kwargs) -> FakeMachine:
    """Three identical GPUs (so NVML's order is CUDA's), 1, 2 and 3 GiB used."""
    return FakeMachine([Gpu(used=(n + 1) * GIB) for n in range(3)], **kwargs)


def test_nvml_listing_maps_visible_devices_to_cuda_ordinals(monkeypatch):
    machine = three_gpus().install(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,1")
    gpus, why = devices.nvml_gpus()
    assert [(g.device, g.free_bytes) for g in gpus] == [("cuda:0", 77 * GIB), ("cuda:1", 78 * GIB)]
    assert gpus[0].utilization_pct == 4 and why == ""
    assert not machine.initialized


def test_nvml_missing_is_a_reason_not_a_crash(monkeypatch):
    FakeMachine([Gpu()], nvml=False).install(monkeypatch)
    gpus, why = devices.nvml_gpus()
    assert gpus == [] and why == "NVML is not available (NVMLError_LibraryNotFound)"


def test_nvml_starts_once_per_session_and_a_failed_start_is_tried_again(monkeypatch):
    machine = three_gpus().install(monkeypatch)
    machine.nvml_init_error = LibraryNotFound
    assert devices.take_inventory().of_type("cuda") == []
    machine.nvml_init_error = None  # the driver came back (a container restarted it)
    for _ in range(3):
        assert len(devices.take_inventory().of_type("cuda")) == 3
    assert machine.nvml_inits == 2  # the failure, then one start for the session


@pytest.mark.parametrize("error", [NoPermission, GpuIsLost])
def test_one_gpu_nvml_refuses_does_not_hide_the_others(monkeypatch, error):
    machine = three_gpus().install(monkeypatch)
    machine.gpus[0].fail = error
    inv = devices.take_inventory()
    reason = f"NVML cannot read it ({error.__name__.removeprefix('NVMLError_')})"
    assert [(d.device, d.problem) for d in inv.of_type("cuda")] == [
        ("cuda:0", reason), ("cuda:1", None), ("cuda:2", None)
    ]
    assert pick_auto(inv)[0] == torch.device("cuda:1")  # the most free of the readable ones
    assert f"unknown GPU (not usable: {reason})" in devices.device_table(inv, None).text()


def test_a_lost_gpu_reading_its_memory_is_listed_with_the_reason(monkeypatch):
    machine = three_gpus().install(monkeypatch)
    real = sys.modules["pynvml"].nvmlDeviceGetMemoryInfo

    def lost(gpu):
        if gpu is machine.gpus[2]:
            raise GpuIsLost()
        return real(gpu)

    monkeypatch.setattr(sys.modules["pynvml"], "nvmlDeviceGetMemoryInfo", lost)
    inv = devices.take_inventory()
    problems = [d.problem for d in inv.of_type("cuda")]
    assert problems == [None, None, "NVML cannot read it (GpuIsLost)"]


def test_mig_instances_named_in_cuda_visible_devices_are_listed(monkeypatch):
    parent = Gpu(migs=[mig(total=10 * GIB), mig("NVIDIA A100 MIG 3g.40gb", 40 * GIB)])
    machine = FakeMachine([parent], cuda_order=[1]).install(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent.migs[1].nvml_uuid)
    inv = devices.take_inventory()
    assert listed(inv) == [("cuda:0", "NVIDIA A100 MIG 3g.40gb", 40 * GIB, None)]
    assert pick_auto(inv)[0] == torch.device("cuda:0")
    assert not machine.initialized


def test_mig_mode_shows_each_instances_memory_not_the_parents(monkeypatch):
    parent = Gpu(total=80 * GIB, migs=[mig(total=10 * GIB), mig(total=20 * GIB)])
    FakeMachine([parent]).install(monkeypatch)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    inv = devices.take_inventory()
    assert [d.total_bytes for d in inv.of_type("cuda")] == [10 * GIB, 20 * GIB]
    # CUDA enumerates one MIG instance at most: which of several is unknown before it starts
    assert {d.device for d in inv.of_type("cuda")} == {"cuda:?"}
    assert pick_auto(inv)[0] == torch.device("cuda")


def test_cuda_order_matches_mig_uuids_bare_once_a_context_exists():
    assert cuda_order(["GPU-aaaa", "MIG-bbbb"], None, torch_uuids=["bbbb", "aaaa"]) == [1, 0]


def mixed(monkeypatch) -> FakeMachine:
    """An old small GPU first on the bus, a big fast one second: CUDA counts the fast one
    first unless CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    gpus = [Gpu("Tesla T4", 16 * GIB, used=GIB, capability=(7, 5)), Gpu("NVIDIA H200", 140 * GIB)]
    return FakeMachine(gpus, cuda_order=[1, 0]).install(monkeypatch)


def test_mixed_gpus_without_pci_order_are_listed_with_an_unknown_ordinal(monkeypatch):
    mixed(monkeypatch)
    inv = devices.take_inventory()
    assert [d.device for d in inv.of_type("cuda")] == ["cuda:?", "cuda:?"]
    dev, why = pick_auto(inv)
    assert dev == torch.device("cuda") and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in why
    table = devices.device_table(inv, None).text()
    assert "which GPU is cuda:N is unknown until CUDA starts" in table
    assert "unknown until CUDA starts" in resolve("cuda:1", inv)[1]


@pytest.mark.parametrize("setting", ["order", "uuids"])
def test_pci_order_or_uuids_make_the_mapping_trusted(monkeypatch, setting):
    machine = mixed(monkeypatch)
    if setting == "order":
        monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", machine.gpus[1].nvml_uuid)
    inv = devices.take_inventory()
    names = [(d.device, d.name) for d in inv.of_type("cuda")]
    if setting == "order":
        assert names == [("cuda:0", "Tesla T4"), ("cuda:1", "NVIDIA H200")]
        assert pick_auto(inv)[0] == torch.device("cuda:1")
    else:
        assert names == [("cuda:0", "NVIDIA H200")]


def test_a_context_tells_the_order_whatever_the_gpus(monkeypatch):
    machine = mixed(monkeypatch)
    machine.start_cuda(0)
    assert [(d.device, d.name) for d in devices.take_inventory().of_type("cuda")] == [
        ("cuda:0", "NVIDIA H200"), ("cuda:1", "Tesla T4")
    ]


def test_a_driver_too_old_for_this_torch_is_the_reason_auto_skips_cuda(monkeypatch):
    FakeMachine([Gpu()], driver_cuda=11080, torch_cuda="12.8").install(monkeypatch)
    inv = devices.take_inventory()
    problem = "its driver supports CUDA up to 11.8, this torch needs CUDA 12.8"
    assert [d.problem for d in inv.of_type("cuda")] == [problem]
    dev, why = pick_auto(inv)
    assert dev == torch.device("cpu") and f"cuda:0 not usable: {problem}" in why


def test_a_gpu_this_build_has_no_kernels_for_is_skipped_by_auto_once_cuda_runs(monkeypatch):
    """torch's arch list is read only once CUDA is up: reading it registers torch's fork
    handler, after which no forked child could use CUDA."""
    gpus = [Gpu("Tesla K80", used=0, capability=(3, 7)), Gpu("NVIDIA A100", used=70 * GIB)]
    machine = FakeMachine(gpus).install(monkeypatch)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert [d.problem for d in devices.take_inventory().of_type("cuda")] == [None, None]
    assert machine.fork_poisons == []
    machine.start_cuda(1)
    inv = devices.take_inventory()
    assert inv.of_type("cuda")[0].problem.startswith("compute capability 3.7 is not among")
    assert pick_auto(inv)[0] == torch.device("cuda:1")  # less free, but usable
    assert "it may not work: compute capability 3.7" in resolve("cuda:0", inv)[1]


@pytest.mark.parametrize(("capability", "arches", "runs"), [
    ((8, 6), ["sm_80"], True),  # a newer minor of the same major runs sm_80 code
    ((8, 0), ["sm_86"], False),
    ((9, 0), ["sm_80", "compute_80"], True),  # PTX is compiled for newer GPUs
    ((12, 0), ["sm_80", "sm_90a"], False),
    ((9, 0), ["sm_90a"], True),
    ((7, 0), ["sm_75"], False),
])
def test_compute_capability_against_the_arch_list(capability, arches, runs):
    assert devices._runs_on(capability, arches) is runs


def test_without_nvml_cuda_is_listed_by_count_and_cuda_does_not_start(monkeypatch):
    machine = FakeMachine([Gpu(), Gpu()], nvml=False).install(monkeypatch)
    inv = devices.take_inventory(probe_cuda_runtime=True)
    assert [d.device for d in inv.of_type("cuda")] == ["cuda:0", "cuda:1"]
    assert not machine.initialized
    assert ("get_device_name", None) not in machine.calls
    assert resolve("cuda:1", inv)[1] == "cuda:1 (CUDA GPU (named once CUDA starts))"


def test_xpu_is_listed_by_count_until_its_runtime_is_up(monkeypatch):
    def starts_xpu(i):
        raise AssertionError("get_device_name initialises XPU")

    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.xpu, "get_device_name", starts_xpu)
    assert [(d.device, d.name) for d in devices._xpu_devices()] == [
        ("xpu:0", "XPU (named once XPU starts)")
    ]


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


# --- deciding from plain readings: probes asks, devices decides ------------------------


def test_the_gpu_list_is_decided_from_plain_readings(monkeypatch):
    from torch_device_magic import probes
    from torch_device_magic.probes import NvmlDevice

    listed = [
        NvmlDevice("GPU-a", "NVIDIA A100", 80 * GIB, 70 * GIB, 5, (8, 0)),
        NvmlDevice(None, problem="NVML cannot read it (NoPermission)"),
        NvmlDevice("GPU-c", "NVIDIA A100", 80 * GIB, 10 * GIB, None, (7, 0)),
    ]
    monkeypatch.setattr(probes, "nvml_devices", lambda: (listed, ""))
    monkeypatch.setattr(probes, "torch_cuda_uuids", lambda: ["c", "a"])  # CUDA's own order
    monkeypatch.setattr(probes, "nvml_cuda_driver_version", lambda: 12080)
    monkeypatch.setattr(probes, "cuda_arch_list", lambda: ["sm_80", "sm_90"])
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    gpus, why = devices.nvml_gpus()
    assert why == ""
    assert [(g.device, g.free_bytes, g.problem) for g in gpus] == [
        ("cuda:0", 10 * GIB, "compute capability 7.0 is not among this torch's (sm_80 sm_90)"),
        ("cuda:1", 70 * GIB, None),
    ]


def test_a_driver_older_than_the_build_is_decided_from_two_versions():
    assert devices._driver_problem(12040, "12.8") is None
    assert devices._driver_problem(11080, "12.8") == (
        "its driver supports CUDA up to 11.8, this torch needs CUDA 12.8"
    )
    assert devices._driver_problem(None, "12.8") is devices._driver_problem(12040, None) is None


def test_a_device_string_that_is_not_one_keeps_torchs_error_as_its_cause():
    with pytest.raises(DeviceMagicError) as err:
        devices.parse("gpu:0")
    assert isinstance(err.value.__cause__, RuntimeError)


def test_a_failed_make_current_names_the_error_and_keeps_it_as_the_cause(monkeypatch):
    machine = FakeMachine([Gpu()]).install(monkeypatch)
    machine.start_cuda(0)

    def refuse(i):
        raise RuntimeError("CUDA error: invalid device ordinal\nCUDA kernel errors might be ...")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    with pytest.raises(DeviceMagicError) as err:
        devices.make_current(3)
    assert str(err.value) == (
        "cannot make cuda:3 CUDA's current device: RuntimeError: CUDA error: invalid device ordinal"
    )
    assert isinstance(err.value.__cause__, RuntimeError)


@pytest.mark.parametrize(("error", "named", "said"), [
    (RuntimeError("CUDA error: x. More\nadvice"), True, "RuntimeError: CUDA error: x. More"),
    (RuntimeError("CUDA error: x. More\nadvice"), False, "CUDA error: x"),
    (RuntimeError(""), True, "RuntimeError"),
    (RuntimeError(""), False, "RuntimeError"),
])
def test_one_helper_tells_an_error_in_one_line(error, named, said):
    assert first_sentence(error, named=named) == said
