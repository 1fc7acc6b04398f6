"""Moves and hints from the user's side: which cell started CUDA across %reload_ext, the
restore's last window, moves onto meta that would lose data, and what the hints name."""

from __future__ import annotations

import pytest
import torch
from fakegpu import FakeMachine, Gpu
from IPython.core.error import UsageError

PREFIX = "Hint (torch_device_magic):"
LAUNCHER_ERROR = RuntimeError(
    "CUDA has been initialized before the `notebook_launcher` could create a forked subprocess."
)


def device_notes(ip, capsys) -> list[str]:
    capsys.readouterr()
    ip.run_line_magic("device", "")
    return [line.strip() for line in capsys.readouterr().out.splitlines()]


def show(shell, cell):
    """Run `cell` as IPython does (printing its error instead of raising it)."""
    return super(type(shell), shell).run_cell(cell)


# --- 16: %reload_ext keeps which cell started CUDA ---------------------------------------


@pytest.mark.parametrize("again", ["%reload_ext torch_device_magic",
                                   "%unload_ext torch_device_magic\n%load_ext torch_device_magic"])
def test_the_cell_that_started_cuda_is_still_named_after_a_reload(shell, monkeypatch, capsys,
                                                                  again):
    machine = FakeMachine([Gpu()]).install(monkeypatch)
    shell.run_line_magic("load_ext", "torch_device_magic")
    shell.user_ns.update(machine=machine, error=LAUNCHER_ERROR)
    cell = shell.execution_count
    shell.run_cell("model = 1\nmachine.start_cuda()", store_history=True)
    for line in again.splitlines():
        shell.run_cell(line, store_history=True)
    named = f"CUDA initialised by cell [{cell}]: model = 1"
    notes = device_notes(shell, capsys)
    assert named in notes and not any("before torch_device_magic watched" in n for n in notes)
    show(shell, "raise error")  # the launcher hint names it too
    out = capsys.readouterr().out
    assert f"  {named}.\n" in out and "before torch_device_magic watched" not in out
