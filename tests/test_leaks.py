"""After a magic cell fails, `del` frees the user's tensors: nothing of ours keeps them.

IPython keeps the last error (`sys.last_value`, the last execution result, the
traceback for `%debug`), and with it every frame the error passed through: a
frame of ours that holds the user's tensors in a local keeps them alive until
the next error.
"""

from __future__ import annotations

import gc
import weakref

import torch
from faults import FailOnAllocation
from IPython.core.interactiveshell import InteractiveShell

from torch_device_magic import moving

META = torch.device("meta")


def run_as_a_notebook_does(ip, cell: str):
    """Run `cell` showing its error, as a notebook does, instead of raising it."""
    return InteractiveShell.run_cell(ip, cell, store_history=True)


def tensors_freed_after(ip, cell: str, fault=None) -> bool:
    """Whether x and y are freed by `del x, y` after `cell` failed."""
    ip.run_cell("x = torch.ones(1000); y = torch.ones(1000)")
    refs = [weakref.ref(ip.user_ns[name]) for name in ("x", "y")]
    if fault is None:
        failed = run_as_a_notebook_does(ip, cell).error_in_exec is not None
    else:
        with fault:
            failed = run_as_a_notebook_does(ip, cell).error_in_exec is not None
        fault.error = None  # it keeps the error it raised, and that error its traceback
    assert failed
    run_as_a_notebook_does(ip, "del x, y")
    gc.collect()
    return all(ref() is None for ref in refs)


def test_a_failed_move_keeps_nothing_alive(ip, monkeypatch):
    # Meta as an accelerator: the refusal to drop data there for good would come first.
    monkeypatch.setattr(moving.commit, "_refuse_dropping_data", lambda plan: None)
    assert tensors_freed_after(ip, "%%ondevice meta\nx + y", FailOnAllocation(META, 2))


def test_a_failed_devcompare_keeps_nothing_alive(ip):
    assert tensors_freed_after(ip, "%%devcompare cpu meta -n 1\nx + y\n1 / 0")


def test_a_devcompare_failing_on_the_second_device_keeps_nothing_alive(ip):
    assert tensors_freed_after(ip, "%%devcompare cpu meta -n 1\nz = x + y\nz.tolist()")


def test_a_failed_cell_restored_from_meta_keeps_nothing_alive(ip):
    assert tensors_freed_after(ip, "%%ondevice meta --restore\nx + y\n1 / 0")


def test_a_class_redefined_in_a_cell_is_freed_after_moves_and_a_reload(ip):
    """The mover keeps no class it looked at: a class defined in a cell, with a big class
    attribute, is freed once redefined, through `%%ondevice` cells and `%reload_ext`."""
    define = "class Config:\n    table = torch.ones(1 << 20)  # 4 MiB\nconfig = Config()"
    refs = []
    for _ in range(3):
        ip.run_cell(define)
        refs.append(weakref.ref(ip.user_ns["Config"]))
        ip.run_cell("x = torch.ones(2)\n")
        ip.run_cell("%%ondevice meta --restore\ny = (config, x.shape)")
        ip.run_line_magic("reload_ext", "torch_device_magic")
    ip.run_cell("del Config, config, y")
    gc.collect()
    assert [ref() for ref in refs] == [None, None, None]
