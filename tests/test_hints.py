"""Hints on the classic device errors: each reproduced for real where this machine can."""

from __future__ import annotations

import io
import logging
import sys
import weakref

import pytest
import torch
from torch.utils.data import DataLoader

from torch_device_magic.advice.hints import PREFIX, hint

META = torch.device("meta")


def error_of(fn):
    try:
        fn()
    except BaseException as err:
        return err
    raise AssertionError("no error")


def test_meta_cpu_mismatch_names_the_cells_variables_and_the_fix():
    ns = {"model": torch.nn.Linear(2, 2, device="meta"), "x": torch.ones(1, 2), "n": 3}
    err = error_of(lambda: ns["model"](ns["x"]))
    assert "is not on the expected device" in str(err)
    text = hint(err, ns, "y = model(x) * n  # x again: x", None)
    assert text.splitlines() == [
        f"{PREFIX} the tensors this operation got are on different devices.",
        "  The cell uses: model (meta), x (cpu)",
        "  Fix: meta tensors hold no data, so they cannot be moved to a real device: "
        "build them there, or give a module storage with .to_empty(device=device) "
        "and load its weights (load_state_dict).",
    ]
    assert "%%ondevice meta " in hint(err, ns, "y = model(x)", META)  # meta on purpose


def test_cuda_form_suggests_the_gpu_named_in_the_message():
    err = RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        "cuda:0 and cpu!"
    )
    text = hint(err, {"x": torch.ones(1)}, "x @ w", None)
    assert text.startswith(PREFIX)
    assert "The cell uses: x (cpu)" in text
    assert "%%ondevice cuda:0 " in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="loads fine where CUDA exists")
def test_cuda_checkpoint_on_a_cpu_machine_says_map_location(monkeypatch):
    buf = io.BytesIO()
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        torch.save({"w": torch.ones(2)}, buf)
    buf.seek(0)
    err = error_of(lambda: torch.load(buf))
    assert "Attempting to deserialize object on a CUDA device" in str(err)
    assert "torch.load(path, map_location='cpu')" in hint(err, {}, "torch.load(buf)", None)
    assert "map_location='meta'" in hint(err, {}, "torch.load(buf)", META)


def test_data_loader_under_a_meta_default_device():
    loader = DataLoader(list(range(10)), shuffle=True, batch_size=2)
    torch.set_default_device("meta")
    try:
        err = error_of(lambda: next(iter(loader)))
        text = hint(err, {}, "next(iter(loader))", META)
        by_hand = hint(err, {}, "next(iter(loader))", None)
    finally:
        torch.set_default_device(None)
    assert "cannot be called on meta tensors" in str(err)  # not the CUDA generator message
    assert text.splitlines() == [
        f"{PREFIX} the DataLoader draws its shuffling on torch's default device, "
        "which %device set to meta.",
        "  Either keep factory functions on the CPU: "
        "%config TorchDeviceMagics.set_torch_default = False",
        "  or iterate it under `with torch.device('cpu'):` (the CPU for the tensors made "
        "inside only)",
    ]
    assert "which torch.set_default_device set to meta" in by_hand
    assert "torch.set_default_device(None)" in by_hand
    assert hint(err, {}, "next(iter(loader))", None) is None  # the CPU default is back


def test_data_loader_under_a_cuda_default_offers_a_generator(monkeypatch):
    import torch_device_magic.advice.hints as hints

    monkeypatch.setattr(hints, "torch_default_device", lambda: torch.device("cuda:0"))
    err = error_of(lambda: next(iter(DataLoader([1], collate_fn=generator_error))))
    text = hint(err, {}, "next(iter(loader))", torch.device("cuda:0"))
    assert "which %device set to cuda:0" in text
    assert "generator=torch.Generator(device='cuda:0')" in text
    outside = error_of(lambda: generator_error([1]))  # no frame in torch/utils/data
    assert hint(outside, {}, "", torch.device("cuda:0")) is None


def generator_error(batch):
    raise RuntimeError("Expected a 'cuda' generator device but found 'cpu'")


def test_out_of_memory_frees_the_tracebacks_frames():
    freed = []

    def step():
        activations = torch.ones(1000)
        freed.append(weakref.ref(activations))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    err = error_of(step)
    sys.last_value, sys.last_traceback = err, err.__traceback__
    assert freed[0]() is not None
    text = hint(err, {"x": torch.ones(3)}, "step()", None)
    assert freed[0]() is None
    assert not hasattr(sys, "last_value") and not hasattr(sys, "last_traceback")
    assert text.startswith(f"{PREFIX} the accelerator ran out of memory.")
    assert "%gpufree" in text
    assert "Largest" not in text  # CPU tensors are not what filled the GPU


def test_mps_out_of_memory_gets_the_out_of_memory_hint():
    freed = []

    def step():
        activations = torch.ones(1000)
        freed.append(weakref.ref(activations))
        # What MPS raises: a plain RuntimeError, not torch.OutOfMemoryError.
        raise RuntimeError(
            "MPS backend out of memory (MPS allocated: 17.00 GB, other allocations: 1.20 GB, "
            "max allowed: 18.13 GB). Tried to allocate 256.00 MB on private pool."
        )

    err = error_of(step)
    text = hint(err, {}, "step()", torch.device("mps"))
    assert text.startswith(f"{PREFIX} the accelerator ran out of memory.")
    assert "%gpufree" in text
    assert freed[0]() is None


def test_cuda_in_a_forked_data_loader_worker_names_the_fix():
    loader = DataLoader(ForkedCuda(), num_workers=1, multiprocessing_context="fork")
    err = error_of(lambda: next(iter(loader)))  # re-raised from the worker, as torch does
    assert "Caught RuntimeError in DataLoader worker process 0" in str(err)
    text = hint(err, {}, "next(iter(loader))", torch.device("cuda:1"))
    assert text.splitlines()[0] == (
        f"{PREFIX} a forked subprocess (a DataLoader worker) used CUDA, which cannot start "
        "again in a child of a process that already started it."
    )
    assert "DataLoader(..., multiprocessing_context='spawn')" in text
    assert "%device cuda:1 --no-default" in text
    assert "persistent_workers=True" in text
    assert "%device cuda --no-default" in hint(err, {}, "", None)


def test_the_fork_hint_names_the_cell_that_initialised_cuda():
    loader = DataLoader(ForkedCuda(), num_workers=1, multiprocessing_context="fork")
    err = error_of(lambda: next(iter(loader)))
    text = hint(err, {}, "", None, cuda_start="CUDA initialised by cell [7]: model.cuda()")
    assert text.splitlines()[1] == "  CUDA initialised by cell [7]: model.cuda()."


LAUNCHERS = {  # the messages as accelerate and Lightning raise them
    "accelerate, CUDA up": ValueError(
        "To launch a multi-GPU training from your notebook, you need to avoid running any "
        "instruction using `torch.cuda` in any cell. Restart your notebook and make sure no "
        "cells use any CUDA function."
    ),
    "accelerate, a worker failed": RuntimeError(
        "CUDA has been initialized before the `notebook_launcher` could create a forked "
        "subprocess. This likely stems from an outside import causing issues once the "
        "`notebook_launcher()` is called."
    ),
    "Lightning ddp_notebook": RuntimeError(
        "Lightning can't create new processes if CUDA is already initialized. Did you "
        "manually call `torch.cuda.*` functions, have moved the model to the device, or "
        "allocated memory on the GPU any other way? Please remove any such calls, or change "
        "the selected strategy. You will have to restart the Python kernel."
    ),
}


@pytest.mark.parametrize("error", LAUNCHERS.values(), ids=LAUNCHERS.keys())
def test_a_launcher_refusing_a_kernel_with_cuda_up_names_the_cell(error):
    text = hint(error, {}, "notebook_launcher(train, num_processes=2)", None,
                cuda_start="CUDA initialised by cell [3]: model = Net().to('cuda')")
    lines = text.splitlines()
    assert lines[0] == (
        f"{PREFIX} a launcher that forks (notebook_launcher, Lightning's ddp_notebook) "
        "needs a kernel where CUDA has not been initialised."
    )
    assert lines[1] == "  CUDA initialised by cell [3]: model = Net().to('cuda')."
    assert lines[2].startswith("  Fix: restart the kernel and launch before that cell runs")
    assert len(hint(error, {}, "", None).splitlines()) == 2  # where no cell was noted


def test_the_launcher_hint_reaches_the_cell_from_the_shell(shell, monkeypatch, capsys):
    from fakegpu import FakeMachine, Gpu

    machine = FakeMachine([Gpu()]).install(monkeypatch)  # a CUDA build: read at loading
    shell.run_line_magic("load_ext", "torch_device_magic")
    ip = shell
    ip.user_ns.update(machine=machine, error=LAUNCHERS["Lightning ddp_notebook"])
    cell = ip.execution_count
    ip.run_cell("model = 1\nmachine.start_cuda()", store_history=True)
    capsys.readouterr()
    with pytest.raises(RuntimeError):
        ip.run_cell("raise error", store_history=True)
    out = capsys.readouterr().out
    assert f"  CUDA initialised by cell [{cell}]: model = 1.\n" in out


class ForkedCuda(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        raise RuntimeError(
            "Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, "
            "you must use the 'spawn' start method"
        )


@pytest.mark.parametrize("error", [
    ZeroDivisionError("division by zero"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
    KeyboardInterrupt(),
])
def test_other_errors_get_no_hint(error):
    assert hint(error, {"x": torch.ones(1)}, "x / 0", None) is None


# --- through a shell: the hint under the traceback, from the one hooks object ---------


def show(shell, cell):
    """Run `cell` as IPython does (printing its error instead of raising it)."""
    return super(type(shell), shell).run_cell(cell)


def test_the_hint_comes_under_the_traceback_and_before_the_report_line(ip, capsys):
    ip.run_cell("model = torch.nn.Linear(2, 2, device='meta'); x = torch.ones(1, 2)")
    capsys.readouterr()
    result = show(ip, "y = model(x)")
    out = capsys.readouterr().out
    assert isinstance(result.error_in_exec, RuntimeError)
    assert out.count("Traceback (most recent call last)") == 1
    error_at = out.index("RuntimeError: Tensor on device")
    hint_at = out.index(f"{PREFIX} the tensors this operation got are on different devices.")
    assert error_at < hint_at < out.rindex("\ntime ")
    assert "  The cell uses: model (meta), x (cpu)\n" in out


def test_data_loader_under_device_meta_for_real(ip, capsys):
    ip.run_cell("from torch.utils.data import DataLoader\n%device meta")
    capsys.readouterr()
    show(ip, "loader = DataLoader(list(range(10)), shuffle=True, batch_size=2)\nnext(iter(loader))")
    out = capsys.readouterr().out
    assert "Tensor.item() cannot be called on meta tensors" in out
    assert "which %device set to meta" in out
    assert "%config TorchDeviceMagics.set_torch_default = False" in out


def test_data_loader_under_ondevice_meta_for_real(ip, capsys):
    ip.run_cell("from torch.utils.data import DataLoader")
    capsys.readouterr()
    cell = "loader = DataLoader(list(range(10)), shuffle=True, batch_size=2)\nnext(iter(loader))"
    show(ip, f"%%ondevice meta\n{cell}")
    out = capsys.readouterr().out
    assert "Tensor.item() cannot be called on meta tensors" in out
    assert "which %%ondevice set to meta" in out
    assert "iterate it in a cell that does not run under %%ondevice" in out
    show(ip, "raise RuntimeError('unrelated')")  # the next failing cell is not taken for it
    assert PREFIX not in capsys.readouterr().out


def test_out_of_memory_in_a_cell_frees_what_its_frames_held(ip, capsys):
    ip.run_cell(
        "import weakref\nrefs = []\n"
        "def step():\n"
        "    activations = torch.ones(1000)\n"
        "    refs.append(weakref.ref(activations))\n"
        "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB.')"
    )
    show(ip, "step()")
    out = capsys.readouterr().out
    assert "OutOfMemoryError" in out and f"{PREFIX} the accelerator ran out of memory." in out
    assert ip.user_ns["refs"][0]() is None
    assert not hasattr(sys, "last_traceback")


@pytest.mark.parametrize("switch", [None, "%config TorchDeviceMagics.hints = False"])
def test_no_hint_for_other_errors_or_when_switched_off(ip, capsys, switch):
    if switch:
        ip.run_cell(switch)
        ip.run_cell("m = torch.nn.Linear(2, 2, device='meta')")
        cell = "m(torch.ones(2))"
    else:
        cell = "1 / 0"
    show(ip, cell)
    out = capsys.readouterr().out
    assert "Traceback (most recent call last)" in out
    assert PREFIX not in out


def test_hints_without_the_report_keep_only_post_run_cell(ip, capsys):
    from torch_device_magic.hooks import is_ours

    def ours(event):
        return sum(is_ours(cb) for cb in ip.events.callbacks[event])

    ip.run_cell("%devreport off")
    assert (ours("pre_run_cell"), ours("post_run_cell")) == (0, 1)
    show(ip, "torch.ones(1) + torch.ones(1, device='meta')")
    assert PREFIX in capsys.readouterr().out
    ip.run_cell("%config TorchDeviceMagics.hints = False")
    assert (ours("pre_run_cell"), ours("post_run_cell")) == (0, 0)
    ip.run_cell("%config TorchDeviceMagics.hints = True")
    ip.run_cell("%devreport on")
    assert (ours("pre_run_cell"), ours("post_run_cell")) == (1, 1)
    ip.run_line_magic("unload_ext", "torch_device_magic")
    assert (ours("pre_run_cell"), ours("post_run_cell")) == (0, 0)


def test_a_fault_while_hinting_prints_nothing_more(ip, capsys, monkeypatch):
    import torch_device_magic.advice.hints as hints

    def broken(*args):
        raise ValueError("bug in a hint")

    monkeypatch.setattr(hints, "hint", broken)
    show(ip, "torch.ones(1) + torch.ones(1, device='meta')")
    out = capsys.readouterr().out
    assert out.count("Traceback (most recent call last)") == 1
    assert "bug in a hint" not in out and PREFIX not in out


@pytest.mark.slow
def test_on_a_kernel_the_hint_follows_the_error_output():
    from kernel import execute, notebook
    from nbclient.exceptions import CellExecutionError

    nb = notebook(
        "%load_ext torch_device_magic\nimport torch",
        "x = torch.ones(1); m = torch.zeros(1, device='meta')\nx + m",
    )
    with pytest.raises(CellExecutionError):
        execute(nb)
    kinds = [(o.output_type, o.get("text", "")) for o in nb.cells[1].outputs]
    error_at = [kind for kind, _ in kinds].index("error")
    hint_at = next(i for i, (_, text) in enumerate(kinds) if text.startswith(PREFIX))
    assert error_at < hint_at
    assert "The cell uses: x (cpu), m (meta)" in kinds[hint_at][1]


def test_a_bug_in_a_hint_leaves_a_debug_record_with_its_traceback(ip, capsys, caplog, monkeypatch):
    import torch_device_magic.advice.hints as hints

    def broken(*args):
        raise ValueError("bug in a hint")

    monkeypatch.setattr(hints, "_mismatch", broken)  # a bug inside hints.py itself
    with caplog.at_level(logging.DEBUG, logger="torch_device_magic"):
        show(ip, "torch.ones(1) + torch.ones(1, device='meta')")
    assert PREFIX not in capsys.readouterr().out
    [record] = [r for r in caplog.records if r.exc_info and r.exc_info[0] is ValueError]
    assert record.levelno == logging.DEBUG and record.name == "torch_device_magic.hooks"
    assert "bug in a hint" in caplog.text  # the traceback is in the log


def test_mismatch_names_what_the_notebook_functions_read_and_what_cannot_move():
    import types

    module = types.ModuleType("tdm_user_mod")  # a module of the user's own, with a tensor
    exec("import torch\nw = torch.ones(2)\ndef scale(x):\n    return x * w", vars(module))
    ns = {"model": torch.nn.Linear(2, 2, device="meta"), "x": torch.ones(1, 2),
          "scale": module.scale}
    exec("def step():\n    return model(x)", ns)
    err = error_of(lambda: ns["model"](ns["x"]))
    lines = hint(err, ns, "y = scale(step())", None).splitlines()
    assert lines[1] == "  The cell uses: model (meta), x (cpu)"
    assert lines[-1] == ("  %%ondevice cannot move these (.to(device) them yourself): "
                         "tdm_user_mod.scale reads w from its module tdm_user_mod.")


CLOSURE = """\
vals = torch.arange(3.0)
def make(w):
    def scale(v):
        return v * w
    return scale
scale = make(torch.ones(3))
"""


def hint_block(out: str) -> list[str]:
    """The hint's lines in a cell's output, up to the report line."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(PREFIX))
    return [line for line in lines[start:] if line.startswith((PREFIX, "  "))]


@pytest.mark.parametrize("cell, said", [
    ("s = scale(vals)",  # what a closure keeps: reach knows it could not follow it
     "  %%ondevice tdmdev moved what the cell uses before it ran, but not these: "
     "scale keeps w in a closure."),
    ("w = torch.ones(3, device='cpu')\ns = vals * w",  # a name the cell bound elsewhere
     "  %%ondevice tdmdev moved what the cell uses before it ran, but not these: w (cpu)."),
    ("import numpy as np\ns = vals * torch.from_numpy(np.ones(3))",  # nothing names it
     "  %%ondevice tdmdev moved what the cell uses before it ran; the other tensor is one "
     "it cannot see: one the cell made on the CPU (torch.from_numpy, torch.load without "
     "map_location, device='cpu'), or one an object keeps in its attributes."),
])
def test_a_mismatch_under_ondevice_says_what_was_not_moved_not_to_run_it_again(
        ip, tdmdev, capsys, cell, said):
    """Issue 29, point 19: the cell ran under %%ondevice, so the hint does not tell the
    user to do what they just did; it says what did not move and how to move it."""
    ip.run_cell(CLOSURE)
    capsys.readouterr()
    show(ip, f"%%ondevice tdmdev\n{cell}")
    out = capsys.readouterr().out
    assert "Expected all tensors to be on the same device" in out
    lines = hint_block(out)
    assert said in lines
    assert lines[-1].startswith("  Fix: .to('tdmdev') ")
    assert not any("run the cell with %%ondevice" in line for line in lines)
    assert not any("%%ondevice cannot move these" in line for line in lines)  # said once


def test_a_mismatch_under_ondevice_restore_names_no_tensor_that_was_sent_back(
        ip, tdmdev, capsys):
    """Under --restore the names' tensors are back on the CPU when the hint is made: it
    does not say they were not moved, only what the code it calls keeps."""
    ip.run_cell(CLOSURE)
    capsys.readouterr()
    show(ip, "%%ondevice tdmdev --restore\ns = scale(vals)")
    lines = hint_block(capsys.readouterr().out)
    assert ip.user_ns["vals"].device.type == "cpu"  # sent back
    assert ("  %%ondevice tdmdev moved what the cell uses before it ran (--restore has sent "
            "it back since), but not these: scale keeps w in a closure.") in lines
    assert not any("vals (cpu)" in line and "not these" in line for line in lines)


def test_a_mismatch_in_a_plain_cell_still_says_run_it_under_ondevice(ip, tdmdev, capsys):
    ip.run_cell(CLOSURE)
    show(ip, "%%ondevice tdmdev\ns = scale(vals)")  # fails under %%ondevice first
    capsys.readouterr()
    show(ip, "s = vals * torch.ones(3)")  # vals is on tdmdev now; this cell is a plain one
    lines = hint_block(capsys.readouterr().out)
    assert lines[-1] == ("  Fix: run the cell with %%ondevice tdmdev:0 (moves what it uses "
                         "there), or .to(device) each one.")
