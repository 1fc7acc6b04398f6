"""Golden outputs: the tables the magics show, in text and in HTML, against tests/golden/.

A layout change, a column out of line, a unit or a label changed fails here. Where the
change is meant, `pytest tests/test_golden.py --update-golden` rewrites the files (as
torchinfo's `--overwrite` does), and their diff shows what users will see differently.

Each table is built through its pure module from fixed figures, and compared exactly,
spaces included. Then one shell-level test per magic checks that the magic shows that
same type of object, and compares its rendering with what varies from run to run
replaced: durations by <time>, host memory by <bytes>, this machine's CPU by <cpu>.
A varying figure changes its column's width, so in those the runs of spaces and of
dashes are squeezed; the alignment itself is what the pure tests hold.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fakegpu import GIB, FakeMachine, Gpu, mig

from torch_device_magic import devices, probes
from torch_device_magic.devcompare import Comparison, DeviceTiming
from torch_device_magic.devices import DeviceInfo, Inventory, device_table
from torch_device_magic.gpumem import GpumemReport, TensorInfo
from torch_device_magic.history import History
from torch_device_magic.measure import Measurement
from torch_device_magic.namespace import TensorsReport, scan
from torch_device_magic.reports import Table

GOLDEN = Path(__file__).parent / "golden"
MiB = 2**20

TIME = re.compile(r"\b\d+ min \d+ s\b|\b\d+(?:\.\d+)? (?:µs|ms|s)\b")
BYTES = r"[+-]?\b\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB)\b"
WALL = re.compile(rf"(?:{TIME.pattern}) \(device synchronised\)")  # %%gpumem's on a device
HOST_RSS = re.compile(rf"{BYTES}, peak {BYTES} above the start")  # %%gpumem's host row


def readable(markup: str) -> str:
    """The HTML one row or block a line, so that a diff of the golden file reads."""
    for end in ("</thead>", "</tr>", "</table>", "</div>"):
        markup = markup.replace(end, end + "\n")
    return markup.rstrip("\n")


@pytest.fixture
def golden(request) -> Callable[..., None]:
    """`golden(name, shown)`: `shown`'s text/plain and text/html against
    tests/golden/name.txt and name.html (rewritten under --update-golden)."""
    update = request.config.getoption("--update-golden")

    def check(name: str, shown: object, plain: Callable[[str], str] = str,
              markup: Callable[[str], str] = str) -> None:
        """`plain` and `markup` normalise the text and the HTML before the comparison."""
        bundle = shown._repr_mimebundle_()
        for suffix, rendered in ((".txt", plain(bundle["text/plain"])),
                                 (".html", readable(markup(bundle["text/html"])))):
            path = GOLDEN / f"{name}{suffix}"
            rendered += "\n"
            if update:
                path.write_text(rendered, encoding="utf-8")
            assert path.exists(), f"{path} is missing: pytest --update-golden writes it"
            assert rendered == path.read_text(encoding="utf-8")

    return check


def varying(text: str) -> str:
    """Durations read <time> (they vary from run to run)."""
    return TIME.sub("<time>", text)


def squeezed(text: str) -> str:
    """Runs of spaces and dashes made one width: a varying figure sets its column's."""
    text = re.sub(r" {2,}", "  ", text)
    return "\n".join(re.sub(r"-{2,}", "--", line).rstrip() for line in text.splitlines())


@pytest.fixture
def shown(ip, monkeypatch) -> list[object]:
    """What the magics `display()` from now on: IPython formats it through the shell's
    display formatter, which hands it on unchanged."""
    objects: list[object] = []
    original = ip.display_formatter.format

    def spy(obj, *args, **kwargs):
        objects.append(obj)
        return original(obj, *args, **kwargs)

    monkeypatch.setattr(ip.display_formatter, "format", spy)
    return objects


def run(ip, cell: str):
    """Run a cell as a notebook does: numbered, in the history."""
    return ip.run_cell(cell, store_history=True)


def no_accelerator() -> bool:
    return probes.active_accelerator() is None


# --- %device --------------------------------------------------------------------------------

FIXED_CPU = DeviceInfo("cpu", "<cpu>", 64 * GIB, 48 * GIB)


def test_device_table_of_every_kind_of_row(golden):
    inventory = Inventory(
        [
            DeviceInfo("cpu", "AMD EPYC 7763 64-Core Processor", 503 * GIB, 400 * GIB),
            DeviceInfo("cuda:0", "NVIDIA H200", 140 * GIB, 139 * GIB, 0),
            DeviceInfo("cuda:1", "NVIDIA H200", 140 * GIB, 12 * GIB + 512 * MiB, 97),
            DeviceInfo("cuda:2", "Tesla K80", 12 * GIB, 12 * GIB, 0,
                       problem="this torch has no kernels for compute capability 3.7"),
            DeviceInfo("cuda:?", "NVIDIA A100 MIG 1g.10gb", 10 * GIB, 10 * GIB),
            DeviceInfo("mps", "Apple M2"),
        ],
        notes=["xpu: torch was built without XPU"],
    )
    golden("device_every_row", device_table(inventory, torch.device("cuda:1")))


def fake_machine_inventory(monkeypatch, started: bool) -> Inventory:
    """A T4 first on the bus, an H200 that CUDA counts first, an A100 in MIG mode with two
    instances; CUDA started (the order is known) or not (it is not)."""
    gpus = [
        Gpu("Tesla T4", 16 * GIB, used=GIB, capability=(7, 5)),
        Gpu("NVIDIA H200", 140 * GIB, used=3 * GIB, capability=(9, 0)),
        Gpu(migs=[mig(), mig("NVIDIA A100 MIG 3g.40gb", 40 * GIB)]),
    ]
    machine = FakeMachine(gpus, cuda_order=[1, 0, 2, 3]).install(monkeypatch)
    if started:
        machine.start_cuda(0)
    inventory = devices.take_inventory()
    # This machine's CPU and RAM vary: the CPU row is a fixed one.
    inventory.devices = [FIXED_CPU if d.type == "cpu" else d for d in inventory.devices]
    return inventory


def test_device_table_on_a_fake_machine_with_several_gpus_and_mig(golden, monkeypatch):
    inventory = fake_machine_inventory(monkeypatch, started=True)
    golden("device_fake_machine", device_table(inventory, torch.device("cuda:1")))


def test_device_table_on_a_fake_machine_before_cuda_starts(golden, monkeypatch):
    inventory = fake_machine_inventory(monkeypatch, started=False)
    golden("device_fake_machine_order_unknown", device_table(inventory, None))


def test_the_device_magic_shows_this_cpu_only_machines_table(ip, shown, golden):
    inventory = devices.take_inventory()
    if [d.type for d in inventory.devices] != ["cpu"] or torch.version.cuda is not None:
        pytest.skip("the golden table is a CPU-only build's on a machine without GPUs")
    run(ip, "%device")
    [table] = shown
    assert isinstance(table, Table)
    cpu = inventory.devices[0].name

    def normal(text: str) -> str:  # the torch version is in the note on the missing CUDA
        text = text.replace(cpu, "<cpu>").replace(html.escape(cpu), "<cpu>")
        return re.sub(BYTES, "<bytes>", text.replace(torch.__version__, "<torch version>"))

    golden("device_shell_cpu_only", table, lambda t: squeezed(normal(t)), normal)


def test_the_device_magic_lists_a_privateuse1_accelerators_devices(tdmdev, ip, shown, golden):
    if torch.version.cuda is not None:
        pytest.skip("the golden table is a CPU-only build's, with the test device")
    run(ip, "%device tdmdev:1")
    run(ip, "%device")
    [table] = shown
    cpu = devices.take_inventory().of_type("cpu")[0].name

    def normal(text: str) -> str:  # host memory is the test device's: it varies
        text = text.replace(cpu, "<cpu>").replace(html.escape(cpu), "<cpu>")
        return re.sub(BYTES, "<bytes>", text.replace(torch.__version__, "<torch version>"))

    golden("device_shell_tdmdev", table, lambda t: squeezed(normal(t)), normal)


# --- %tensors -------------------------------------------------------------------------------

def a_namespace() -> dict[str, object]:
    """Tensors, a view, a Parameter with a grad, a trained model and its optimizer,
    containers, another device and a module spanning two: fixed sizes, whatever the values."""
    base = torch.zeros(4, 256)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    )
    model(base).sum().backward()
    opt = torch.optim.Adam(model.parameters())
    opt.step()
    weight = torch.nn.Parameter(torch.ones(64, 64))
    weight.grad = torch.ones(64, 64)
    split = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, device="meta"))
    return {
        "base": base,
        "row": base[1],
        "half": torch.ones(1000, dtype=torch.bfloat16),
        "mask": torch.ones(3, 5, dtype=torch.bool).requires_grad_(False),
        "weight": weight,
        "model": model,
        "opt": opt,
        "batch": {"x": torch.ones(8, 3), "y": torch.zeros(8, dtype=torch.long)},
        "pair": (torch.ones(2), torch.empty(1024, 1024, device="meta")),
        "split": split,
        "count": 3,
        "_hidden": torch.ones(10),
    }


def test_tensors_table(golden):
    golden("tensors", scan(a_namespace()))


def test_tensors_table_filtered(golden):
    golden("tensors_on_meta", scan(a_namespace(), device=torch.device("meta"), min_bytes=MiB))
    golden("tensors_none_kept", scan(a_namespace(), min_bytes=2**40))


def test_the_tensors_magic_shows_a_tensors_report(ip, shown, golden):
    run(ip, "x = torch.ones(3, 4)\nm = torch.nn.Linear(4, 2)\nv = x[0]")
    run(ip, "%tensors")
    [report] = shown
    assert isinstance(report, TensorsReport)
    golden("tensors_shell", report)


# --- %%gpumem -------------------------------------------------------------------------------

def test_gpumem_report_on_a_device(golden):
    report = GpumemReport(
        0.2124,
        device_s=0.2119,
        device_delta_bytes=GIB,
        device_peak_bytes=GIB + 512 * MiB,
        device_reserved_delta_bytes=2 * GIB,
        host_delta_bytes=12 * MiB,
        host_peak_bytes=40 * MiB,
        device="cuda:0",
        device_allocated_bytes=2 * GIB + 256 * MiB,
        other_devices="cuda:1",
        device_error="RuntimeError: CUDA error: an illegal memory access was encountered",
        device_description="cuda:0 (NVIDIA H200)",
        allocator="native",
        nvml_used_bytes=3 * GIB + 512 * MiB,
        tensors=[
            TensorInfo("y", (64, 1024, 1024), "float32", "cuda:0", 256 * MiB),
            TensorInfo("mask", (64, 1024), "bool", "cuda:0", 64 * 1024),
            TensorInfo("nt", (2, None), "float32", "cuda:0", 20),
        ],
    )
    golden("gpumem_device", report)


def test_gpumem_report_without_an_accelerator(golden):
    report = GpumemReport(0.0453, host_delta_bytes=-3 * MiB, host_peak_bytes=512 * MiB,
                          tensors=[TensorInfo("x", (1000, 1000), "float32", "cpu", 4_000_000)])
    golden("gpumem_host", report)
    golden("gpumem_host_unreadable", GpumemReport(1.5))


def test_the_gpumem_magic_shows_a_gpumem_report(ip, shown, golden):
    if not no_accelerator():
        pytest.skip("the golden report is the CPU-only one")
    run(ip, "%%gpumem\nbig = torch.ones(1000, 1000)\nsmall = torch.ones(3, dtype=torch.int8)")
    [report] = shown
    assert isinstance(report, GpumemReport)

    def normal(text: str) -> str:
        return varying(HOST_RSS.sub("<bytes>, peak <bytes> above the start", text))

    golden("gpumem_shell", report, lambda t: squeezed(normal(t)), normal)


def test_the_gpumem_magic_on_a_fake_gpu_shows_its_device_figures(ip, shown, golden, monkeypatch):
    machine = FakeMachine([Gpu(used=3 * GIB)]).install(monkeypatch)
    machine.start_cuda(0)
    ip.user_ns["machine"] = machine
    run(ip, "%%gpumem\nmachine.allocate(0, 2**30)\nmachine.allocate(0, 2**29, keep=False)\n"
            "machine.run(0, 20.0)\nsmall = torch.ones(3)")
    [report] = shown
    assert isinstance(report, GpumemReport) and report.device == "cuda:0"

    def normal(text: str) -> str:  # the fake device's figures and clock are fixed
        text = WALL.sub("<time> (device synchronised)", text)
        return HOST_RSS.sub("<bytes>, peak <bytes> above the start", text)

    golden("gpumem_shell_fake_gpu", report, lambda t: squeezed(normal(t)), normal)


# --- %devhistory ----------------------------------------------------------------------------

def test_devhistory_table(golden):
    history = History(maxlen=5)
    records = [
        Measurement(0.000045, host_delta_bytes=0, host_peak_bytes=4096, cell=1),
        Measurement(0.0123, device_s=0.0101, device_delta_bytes=GIB, device_peak_bytes=2 * GIB,
                    host_delta_bytes=MiB, host_peak_bytes=3 * MiB, device="cuda:0",
                    device_allocated_bytes=GIB, cell=2),
        Measurement(1.25, device_s=1.2, device_delta_bytes=-512 * MiB, device_peak_bytes=0,
                    host_delta_bytes=-MiB, host_peak_bytes=0, device="cuda:0",
                    device_allocated_bytes=512 * MiB, cell=3),
        Measurement(125.0, device_delta_bytes=10 * MiB, device_peak_bytes=10 * MiB,
                    device="cuda:1", device_allocated_bytes=10 * MiB, cell=4),
        Measurement(0.5, cell=None),
    ]
    for record in records:
        history.append(record)
    golden("devhistory", history.table())
    golden("devhistory_empty", History().table())


def test_the_devhistory_magic_shows_a_table(ip, shown, golden):
    if not no_accelerator():
        pytest.skip("the golden history is the CPU-only one")
    run(ip, "x = torch.ones(10)")
    run(ip, "y = x * 2")
    run(ip, "%devhistory")
    [table] = shown
    assert isinstance(table, Table)

    def normal(text: str) -> str:  # without an accelerator every size is the host's
        return re.sub(BYTES, "<bytes>", varying(text))

    golden("devhistory_shell", table, lambda t: squeezed(normal(t)), normal)


# --- %%devcompare ---------------------------------------------------------------------------

def test_devcompare_table(golden):
    comparison = Comparison(
        [
            DeviceTiming("cpu", [0.3124, 0.3051, 0.3309, 0.3150, 0.3200], 1.0, None),
            DeviceTiming("cuda:0", [0.0041, 0.0040, 0.0043, 0.0041, 0.0042], 76.19, 3.1e-05),
            DeviceTiming("cuda:1", [0.0052, 0.0050, 0.0061, 0.0049, 0.0055], 60.07, math.nan),
            DeviceTiming("meta", [0.000012, 0.000011, 0.000015, 0.000012, 0.000013], None, None),
        ],
        warmup=1,
    )
    golden("devcompare", comparison)
    one = Comparison([DeviceTiming("cpu", [2.5], 1.0, None),
                      DeviceTiming("mps", [0.5], 5.0, 0.0)], warmup=0)
    golden("devcompare_one_run", one)


def test_the_devcompare_magic_shows_a_comparison(ip, shown, golden):
    run(ip, "x = torch.ones(4, 4)")
    run(ip, "%%devcompare cpu meta\nx @ x")
    [comparison] = shown
    assert isinstance(comparison, Comparison)
    assert [d.device for d in comparison.devices] == ["cpu", "meta"]
    golden("devcompare_shell", comparison, lambda t: squeezed(varying(t)), varying)
