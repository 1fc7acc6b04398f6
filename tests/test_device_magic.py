"""`%device` through a shell on a fake CUDA machine: a broken driver in one line, and CUDA's
current device set, and put back, without starting CUDA before it has to."""

from __future__ import annotations

import pytest
import torch
from fakegpu import GIB, FakeMachine, Gpu
from IPython.core.error import UsageError


def test_a_broken_driver_without_nvml_is_one_clear_line(ip, monkeypatch):
    machine = FakeMachine([Gpu()], nvml=False).install(monkeypatch)
    machine.count_error = RuntimeError("Found no NVIDIA driver on your system.\nPlease check")
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("device", "cuda")
    assert str(err.value) == (
        "cuda is not available (cuda: NVML is not available (NVMLError_LibraryNotFound); "
        "CUDA says: RuntimeError: Found no NVIDIA driver on your system.): "
        "this machine has cpu"
    )
    assert not machine.initialized


def test_device_cuda_n_becomes_the_current_device_without_starting_cuda(ip, monkeypatch):
    machine = FakeMachine([Gpu(used=70 * GIB), Gpu(used=GIB)]).install(monkeypatch)
    ip.run_line_magic("device", "auto")
    assert ip.user_ns["device"] == torch.device("cuda:1")
    assert not machine.initialized and machine.contexts == set()
    machine.start_cuda()  # the first CUDA tensor
    assert machine.current == 1 and machine.contexts == {1}
    ip.run_line_magic("device", "cuda:0")  # CUDA runs now: at once
    assert machine.current == 0


@pytest.mark.parametrize("started", [False, True])
@pytest.mark.parametrize("then", ["reset", "cpu", "cuda", "unload"])
def test_leaving_cuda_n_puts_back_the_current_device_it_replaced(ip, monkeypatch, started, then):
    machine = FakeMachine([Gpu(), Gpu()]).install(monkeypatch)
    if started:
        machine.start_cuda()
    ip.run_line_magic("device", "cuda:1")
    if then == "unload":
        ip.run_line_magic("unload_ext", "torch_device_magic")
    else:
        ip.run_line_magic("device", then)
    machine.start_cuda()
    assert machine.current == 0


def device_notes(ip, capsys) -> list[str]:
    capsys.readouterr()
    ip.run_line_magic("device", "")
    return [line.strip() for line in capsys.readouterr().out.splitlines()]


def test_device_names_the_cell_that_initialised_cuda(shell, monkeypatch, capsys):
    machine = FakeMachine([Gpu()]).install(monkeypatch)  # a CUDA build: read at loading
    shell.run_line_magic("load_ext", "torch_device_magic")
    ip = shell
    ip.user_ns["machine"] = machine
    ip.run_cell("x = torch.ones(2)", store_history=True)  # CUDA stays down
    assert not any("CUDA" in line for line in device_notes(ip, capsys))
    cell = ip.execution_count
    ip.run_cell("# the first CUDA tensor\n\nmachine.start_cuda()  # as .cuda() would\ny = 1",
                store_history=True)
    ip.run_cell("z = 2", store_history=True)  # a later cell does not take its place
    assert f"CUDA initialised by cell [{cell}]: machine.start_cuda()  # as .cuda() would" in (
        device_notes(ip, capsys)
    )


def test_cuda_up_before_loading_is_said_as_such(shell, monkeypatch, capsys):
    machine = FakeMachine([Gpu()]).install(monkeypatch)
    machine.start_cuda()
    shell.run_line_magic("load_ext", "torch_device_magic")
    shell.run_cell("x = 1", store_history=True)
    assert (
        "CUDA was initialised before torch_device_magic watched (before it was loaded, "
        "or while its report and hints were off)"
    ) in device_notes(shell, capsys)


def test_on_a_cpu_build_cuda_is_never_asked_about(ip, monkeypatch, capsys):
    def asked():
        raise AssertionError("torch.cuda.is_initialized() asked on a CPU build")

    monkeypatch.setattr(torch.cuda, "is_initialized", asked)
    for _ in range(3):
        ip.run_cell("x = torch.ones(2)", store_history=True)
    assert not any("CUDA initialised" in line for line in device_notes(ip, capsys))


@pytest.mark.parametrize("when", ["before", "after"])
def test_reset_binds_device_to_the_default_torch_is_left_with(ip, capsys, when):
    """A default set by hand (tutorials begin so) stays after reset, and `device` says it."""
    if when == "before":
        ip.run_cell("torch.set_default_device('meta')")
    ip.run_line_magic("device", "cpu")
    if when == "after":
        ip.run_cell("torch.set_default_device('meta')")
    capsys.readouterr()
    ip.run_line_magic("device", "reset")
    assert capsys.readouterr().out.splitlines()[0] == (
        "device = meta (torch's default device restored: the one torch.set_default_device set)"
    )
    ip.run_cell("x = torch.zeros(3)")
    assert ip.user_ns["x"].device == ip.user_ns["device"] == torch.device("meta")
    ip.run_line_magic("unload_ext", "torch_device_magic")
    assert ip.user_ns["device"] == torch.device("meta") == torch.zeros(1).device
