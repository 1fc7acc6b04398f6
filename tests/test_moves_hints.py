"""Moves and hints from the user's side: which cell started CUDA across %reload_ext, the
restore's last window, moves onto meta that would lose data, and what the hints name."""

from __future__ import annotations

import pytest
import torch
from fakegpu import FakeMachine, Gpu
from IPython.core.error import UsageError

from torch_device_magic.probes import cuda_built

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


# --- 19: the mismatch hint names what the code uses, not words of comments or strings ----

MISMATCH_SETUP = """\
big = torch.nn.Linear(3, 3, device='meta')
X = torch.ones(2, 3)
model = torch.nn.Linear(3, 3)
a = torch.ones(1)
"""


@pytest.mark.parametrize("cell", [
    "big(X)   # not the model, not a",
    's = "model a"; big(X)',
    "big(X)  # model\n'''a model\nstring'''",
    "%%nograd\nbig(X)  # a model",
])
def test_the_mismatch_hint_names_only_what_the_code_uses(ip, capsys, cell):
    ip.run_cell(MISMATCH_SETUP)
    capsys.readouterr()
    result = show(ip, cell)
    assert isinstance(result.error_in_exec, RuntimeError)
    out = capsys.readouterr().out
    assert f"{PREFIX} the tensors this operation got are on different devices." in out
    assert "  The cell uses: big (meta), X (cpu)\n" in out


def test_an_attribute_is_not_taken_for_a_global_of_its_name(ip, capsys):
    ip.run_cell("weight = torch.ones(3)\nb = torch.ones(3, device='meta')\n"
                "lin = torch.nn.Linear(3, 3)")
    capsys.readouterr()
    show(ip, "lin.weight + b")
    assert "  The cell uses: lin (cpu), b (meta)\n" in capsys.readouterr().out


# --- issue 23, 17: the DataLoader hint under meta offers two ways out, and both work -----

LOADER = "loader = DataLoader(list(range(10)), shuffle=True, batch_size=2)\n"
SECOND_WAY = ("  or iterate it under `with torch.device('cpu'):` (the CPU for the tensors made "
              "inside only)")


@pytest.mark.parametrize(("before", "magic"), [("%device meta", ""), ("", "%%ondevice meta\n")])
def test_the_data_loader_hint_under_meta_offers_a_second_way_that_works(ip, capsys, before,
                                                                         magic):
    ip.run_cell(f"from torch.utils.data import DataLoader\n{before}")
    cell = magic + LOADER
    capsys.readouterr()
    show(ip, cell + "next(iter(loader))")
    lines = capsys.readouterr().out.splitlines()
    at = lines.index(next(line for line in lines if line.startswith(PREFIX)))
    assert lines[at + 1].startswith("  Either keep factory functions on the CPU: ")
    assert lines[at + 2] == SECOND_WAY
    # As it says: the batches come, while the cell's other tensors stay on meta.
    ip.run_cell(cell + "with torch.device('cpu'):\n    batch = next(iter(loader))\n"
                "after = torch.zeros(1)")
    assert ip.user_ns["batch"].device.type == "cpu" and ip.user_ns["after"].is_meta


# --- issue 23, 12: %device cuda on a torch without CUDA says what to do -------------------


def test_device_cuda_on_a_cpu_build_says_how_to_get_cuda(ip):
    if cuda_built():
        pytest.skip("this torch is a build with CUDA")
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("device", "cuda")
    message = str(err.value)
    assert message.startswith(
        f"cuda is not available (cuda: torch {torch.__version__} is a build without CUDA): "
        "install a CUDA build of torch (on Linux: pip install --force-reinstall torch;"
    )
    assert "on Colab choose a GPU under Runtime > Change runtime type" in message
    assert message.endswith("this machine has cpu") and "\n" not in message
    assert ip.user_ns.get("device") is None


# --- issue 23, 14: --restore -v lists the names once, and says nothing of an empty restore


def test_restore_verbose_lists_the_names_once(ip, capsys):
    ip.run_cell("x = torch.ones(3)\nm = torch.nn.Linear(2, 2)")
    capsys.readouterr()
    ip.run_cell("%%ondevice meta --restore -v\ny = x + 1\nm.weight.shape;")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("moved 36 B to meta in ")
    assert out[1:5] == ["name  bytes", "----  -----", "m      24 B", "x      12 B"]
    assert out[5] == "restored 3 tensors from meta (the originals put back)"
    assert sum(line.startswith("x ") for line in out) == 1
    assert ip.user_ns["x"].device.type == "cpu" and torch.equal(ip.user_ns["x"], torch.ones(3))


def test_restore_verbose_with_nothing_moved_says_only_that(ip, capsys):
    ip.run_cell("x = torch.ones(3)")
    capsys.readouterr()
    ip.run_cell("%%ondevice meta --restore -v\nz = 1")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "nothing to move to meta" and out[1].startswith("time ")  # the report


# --- 18: no move onto meta that loses data with no way back ------------------------------

REFUSED = (
    "Moving model (16 B), x (16 B) to meta would lose their data for good (meta tensors hold "
    "none); nothing was moved: %%ondevice meta --restore runs a cell on meta and gives back "
    "what it moved"
)


def user_state(ip):
    """What a refused line must leave as it was: bindings, devices, data, the default."""
    names = {k: v for k, v in ip.user_ns.items() if not k.startswith("_") and k != "In"}
    tensors = [t for v in names.values() for t in (
        list(v.parameters()) if isinstance(v, torch.nn.Module) else [v]
    ) if isinstance(t, torch.Tensor)]
    data = [(t, t.device, t.clone()) for t in tensors if not t.is_meta]
    return names, data, torch.get_default_device()


def same_state(before, after) -> bool:
    names, data, default = before
    return names == after[0] and default == after[2] and all(
        t.device == dev and torch.equal(t, copy) for t, dev, copy in data
    )


@pytest.mark.parametrize("line", ["%device meta --move", "%%ondevice meta\nran = model(x[:2])",
                                  "%%ondevice meta --all\nran = 1"])
def test_a_move_that_would_lose_data_on_meta_is_refused_in_one_line(ip, capsys, line):
    ip.run_cell("model = torch.nn.Linear(2, 2, bias=False)\nx = torch.arange(4.0)\n"
                "shape_only = torch.ones(3, device='meta')\nn = 3")
    before = user_state(ip)
    with pytest.raises(UsageError) as err:
        ip.run_cell(line)
    assert str(err.value) == REFUSED
    assert "ran" not in ip.user_ns and same_state(before, user_state(ip))
    assert "device" not in ip.user_ns  # %device did not change the session device either
    ip.run_cell("%%ondevice meta --restore\nran = model(x[:2])")  # the way it points to
    assert ip.user_ns["ran"].is_meta and ip.user_ns["x"].device.type == "cpu"
    assert torch.equal(ip.user_ns["x"], torch.arange(4.0))


def test_tensors_already_on_meta_hold_no_data_and_may_move(ip):
    ip.run_cell("shape_only = torch.ones(3, device='meta')\nnet = torch.nn.Linear(2, 2, "
                "device='meta')\nempty = torch.ones(0)\nn = 3")
    ip.run_cell("%%ondevice meta\nout = net(shape_only[:2])\nalso = empty + 1")
    assert ip.user_ns["out"].is_meta and ip.user_ns["empty"].is_meta  # 0 bytes: no data
    ip.run_cell("%device meta --move")
    assert ip.user_ns["device"] == torch.device("meta")
    assert torch.zeros(1).is_meta


# --- 17: a Ctrl-C between the cell's end and the restore still restores -------------------


@pytest.mark.parametrize("cell", ["y = x * 2", "y = x * 2\n1 / 0"])
def test_a_ctrl_c_between_the_cells_end_and_the_restore_loses_nothing(ip, monkeypatch, capsys,
                                                                       cell):
    import os
    import signal

    from torch_device_magic import moving

    x = torch.arange(4.0)
    ip.user_ns["x"] = x
    restore = moving.restore

    def ctrl_c_first(*args, **kwargs):  # a real SIGINT, as the restore is called
        os.kill(os.getpid(), signal.SIGINT)
        return restore(*args, **kwargs)

    monkeypatch.setattr(moving, "restore", ctrl_c_first)
    with pytest.raises(KeyboardInterrupt):
        ip.run_cell_magic("ondevice", "meta --restore", cell)
    assert ip.user_ns["y"].is_meta  # the cell ran
    assert ip.user_ns["x"] is x and x.device.type == "cpu"  # back, with its data
    assert torch.equal(x, torch.arange(4.0))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert "Ctrl-C during --restore: it finished first" in capsys.readouterr().out


# --- issue 23, 7: what docs/device.md says of `%device reset --move` after meta ----------


def test_reset_move_with_a_tensor_on_meta_is_refused_and_the_session_stays_meta(ip):
    ip.run_cell("%device meta\nz = torch.ones(3)\nx = torch.ones(2, device='cpu')")
    with pytest.raises(UsageError) as err:
        ip.run_cell("%device reset --move")
    assert str(err.value) == (
        "Could not move z (12 B) to cpu: it is on the meta device, which holds no data; "
        "nothing was moved."
    )
    assert ip.user_ns["device"] == torch.device("meta") and torch.zeros(1).is_meta
    ip.run_cell("del z\n%device reset --move")  # as the docs say: del it (or rebuild it)
    assert ip.user_ns["x"].device.type == "cpu" and not torch.zeros(1).is_meta
