"""%%ondevice and %device --move, through a fresh shell that re-raises."""

from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch
from faults import FailOnAllocation
from IPython.core.error import UsageError
from test_reach import SCORES

from torch_device_magic import moving
from torch_device_magic.cells import cell_label
from torch_device_magic.probes import torch_default_device

META = torch.device("meta")

SETUP = """\
import torch
model = torch.nn.Linear(3, 2)
opt = torch.optim.Adam(model.parameters())
model(torch.ones(1, 3)).sum().backward()
opt.step()
x = torch.arange(4.0)
view = x[1:]
bystander = torch.ones(2)
"""


@pytest.fixture(autouse=True)
def meta_as_an_accelerator(monkeypatch):
    """Meta stands in here for an accelerator, whose moves are the same but for the data:
    the refusal to drop data on meta for good is lifted (test_moves_hints.py tests it)."""
    monkeypatch.setattr(moving.commit, "_refuse_dropping_data", lambda plan: None)


@pytest.fixture
def ns(ip):
    ip.run_cell(SETUP)
    return ip.user_ns


def state(ip):
    """What a refused line must leave as it was: bindings, devices, grad mode, default."""
    names = {k: v for k, v in ip.user_ns.items() if not k.startswith("_")}
    devices = {k: v.device for k, v in names.items() if isinstance(v, torch.Tensor)}
    params = [(p, p.device) for p in ip.user_ns["model"].parameters()]
    return names, devices, params, torch.is_grad_enabled(), torch_default_device()


def test_the_cell_moves_what_it_names_and_runs_there(ip, ns):
    ip.run_cell("%%ondevice meta\nout = model(x[:3])\nmade = torch.zeros(1)")
    assert ns["x"].device == META and ns["view"].device == META  # x's view: its storage's
    assert ns["model"].weight.device == META and ns["out"].device == META
    assert ns["made"].device == META
    assert ns["bystander"].device.type == "cpu"
    assert ns["opt"].state[ns["model"].weight]["exp_avg"].device.type == "cpu"  # not named
    assert torch.zeros(1).device.type == "cpu" and torch_default_device() is None


def test_the_previous_default_comes_back_after_an_error(ip, ns):
    with pytest.raises(ZeroDivisionError):
        ip.run_cell("%%ondevice meta\ny = x * 2\n1 / 0")
    assert ns["y"].device == META and torch_default_device() is None


def test_the_last_expression_is_out_and_a_semicolon_silences_it(ip, ns):
    ip.run_cell("%%ondevice meta\nx.device", store_history=True)
    assert ip.user_ns["_"] == META
    ip.run_cell("%%ondevice meta\nx.shape;", store_history=True)
    assert ip.execution_count - 1 not in ip.user_ns["Out"]


def test_all_moves_every_name_but_ipythons_own(ip, ns):
    ip.run_cell("_private = torch.ones(1)")
    ip.run_cell("%%ondevice meta --all\npass")
    assert ns["bystander"].device == META and ns["model"].bias.device == META
    assert ns["opt"].state[ns["model"].weight]["exp_avg"].device == META
    assert ns["_private"].device.type == "cpu"


def test_restore_from_meta_brings_back_the_originals(ip, ns):
    before = ns["x"].clone()
    ip.run_cell("%%ondevice meta --restore\nx.mul_(0)\nfresh = torch.ones(1)")
    assert ns["x"].device.type == "cpu" and torch.equal(ns["x"], before)
    assert ns["view"].untyped_storage().data_ptr() == ns["x"].untyped_storage().data_ptr()
    assert ns["fresh"].device == META


def test_restore_happens_when_the_cell_fails_too(ip, ns):
    with pytest.raises(RuntimeError, match="boom"):
        ip.run_cell("%%ondevice meta --restore\nmodel(x[:3])\nraise RuntimeError('boom')")
    assert ns["model"].weight.device.type == "cpu" and ns["x"].device.type == "cpu"


KEEP = """\
params, state = list(model.parameters()), dict(opt.state[model.weight])
values = [p.detach().clone() for p in params]
a = torch.arange(4.0)
box = {"x": x, "a": a, "params": list(params)}
"""
GIVEN_BACK = """\
assert all(a is b for a, b in zip(model.parameters(), params))
assert all(a is b for a, b in zip(box["params"], params)) and box["x"] is x
assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params))
assert all(p.device.type == "cpu" and torch.equal(p, v) for p, v in zip(params, values))
assert opt.state[model.weight]["exp_avg"] is state["exp_avg"] and x.device.type == "cpu"
assert box["a"] is a and torch.equal(a, torch.arange(4.0))
assert opt.state_dict()["state"]
opt.zero_grad()
model(torch.ones(2, 3)).sum().backward()
opt.step()
assert not torch.equal(model.weight, values[0])
"""


@pytest.mark.parametrize("cell", [
    "loss = model(x[:3]).sum()",  # the graph stays bound
    "model(x[:3]).sum()",  # ... or in Out[n]
    "v = a[2:]",  # a view of a named tensor
])
def test_restore_from_meta_gives_back_the_same_objects_whatever_the_cell_kept(ip, ns, cell):
    ip.run_cell(KEEP)
    ip.run_cell(f"%%ondevice meta --restore\n{cell}", store_history=True)
    ip.run_cell(GIVEN_BACK)


def test_restore_from_meta_gives_back_the_same_objects_after_a_shape_error(ip, ns):
    ip.run_cell(KEEP)
    with pytest.raises(RuntimeError, match="must have same reduction dim"):
        ip.run_cell("%%ondevice meta --restore\nh = model(x[:3])\nmodel(torch.ones(2, 5))")
    ip.run_cell(GIVEN_BACK)


def test_restore_from_meta_gives_back_a_loss_the_cell_only_read(ip, ns):
    ip.run_cell("loss = model(x[:3]).sum()\nmodel.zero_grad()")
    ip.run_cell("%%ondevice meta --restore\nloss.shape")
    assert ns["loss"].grad_fn is not None and ns["loss"].device.type == "cpu"
    ip.run_cell("loss.backward()")
    assert torch.equal(ns["model"].bias.grad, torch.ones(2))


def test_verbose_says_what_moved_and_what_could_not_follow(ip, ns, capsys):
    ip.run_cell("held = (lambda v: lambda: v)(x[:2])")  # a view no name of the notebook holds
    capsys.readouterr()
    ip.run_cell("%%ondevice meta -v\nx.sum()")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("moved 16 B to meta in ")
    assert ["x", "16 B"] in [line.split(maxsplit=1) for line in out]
    follow = "could not follow: x: moved, but a view or an autograd graph made before"
    assert any(line.startswith(follow) for line in out)


def test_a_view_named_with_its_base_moves_with_it(ip, ns):
    ip.run_cell("%%ondevice meta\nview + x[1:]")
    assert ns["x"].device == META and ns["view"].device == META
    assert ns["view"].untyped_storage()._cdata == ns["x"].untyped_storage()._cdata


def test_without_a_device_the_session_device_is_used(ip, ns):
    ip.run_cell("%device meta")
    ip.run_cell("%%ondevice\ny = x + 1")
    assert ns["x"].device == META and ns["y"].device == META


def test_all_skips_and_names_what_raises_when_walked(ip, ns, capsys):
    ip.run_cell(
        "class Bad(dict):\n    def items(self):\n        raise RuntimeError('no')\n"
        "bad = Bad(t=torch.ones(1))"
    )
    ip.run_cell("%%ondevice meta --all -v\npass")
    assert ns["bystander"].device == META and ns["bad"]["t"].device.type == "cpu"
    assert "not walked: bad, where its Bad raised RuntimeError: no" in capsys.readouterr().out
    ip.run_cell("%device meta --move")
    assert ns["x"].device == META


def test_device_move_moves_everything_and_sets_the_session_device(ip, ns, capsys):
    ip.run_cell("%device --move meta")
    assert capsys.readouterr().out.startswith("device = meta\nmoved ")
    assert ns["device"] == META and ns["bystander"].device == META
    assert ns["opt"].state[ns["model"].weight]["exp_avg"].device == META


def test_a_move_that_runs_out_of_memory_changes_nothing_and_skips_the_cell(ip, ns):
    before = state(ip)
    with pytest.raises(UsageError) as err, FailOnAllocation(META, 2):
        ip.run_cell("%%ondevice meta\nran = True\nmodel(x)")
    assert type(err.value) is UsageError
    assert str(err.value).startswith("Could not move ") and "out of memory" in str(err.value)
    assert "ran" not in ns and state(ip) == before


def test_a_failed_device_move_keeps_the_session_device(ip, ns):
    ip.run_cell("%device meta --move")
    ip.run_cell("%device cpu")
    with pytest.raises(UsageError, match="on the meta device, which holds no data"):
        ip.run_cell("%device cpu --move")
    ip.run_cell("%device meta")
    before = state(ip)
    with pytest.raises(UsageError):
        ip.run_cell("%device cpu --move")
    assert state(ip) == before and ns["device"] == META


BAD_LINES = [
    ("%%ondevice banana\nran = True", "'banana' is not a device"),
    ("%%ondevice meta --bogus\nran = True", "%ondevice: unrecognized arguments: --bogus"),
    ("%%ondevice\nran = True", "%%ondevice needs a device"),
    ("%ondevice meta", "%ondevice is a cell magic"),
    ("%device --move", "%device --move needs a device"),
]
if not torch.cuda.is_available():
    BAD_LINES.append(("%%ondevice cuda\nran = True", "cuda is not available"))
if torch.cuda.device_count() <= 3:
    BAD_LINES.append(("%%ondevice cuda:3\nran = True", "cuda:3 is not available"))


@pytest.mark.parametrize(("cell", "line"), [
    ("%%ondevice meta\n", "%ondevice meta"), ("%%devcompare cpu meta\n", "%devcompare cpu meta"),
])
def test_an_empty_cell_does_not_send_the_user_round_in_a_circle(ip, cell, line):
    # IPython answers an empty cell magic with "Did you mean the line magic?"; the line
    # magic must then say what to do instead of sending the user back to the cell magic.
    with pytest.raises(UsageError, match="Did you mean the line magic"):
        ip.run_cell(cell)
    with pytest.raises(UsageError) as err:
        ip.run_cell(line)
    assert "the code" in str(err.value) and "under it" in str(err.value)


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_bad_input_is_one_usage_error_and_changes_nothing(ip, ns, line, message):
    before = state(ip)
    with pytest.raises(UsageError) as err:
        ip.run_cell(line)
    assert type(err.value) is UsageError
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert "ran" not in ns and state(ip) == before


def test_a_parameter_or_loop_variable_named_like_a_global_does_not_move_it(ip, ns):
    ip.run_cell(
        "%%ondevice meta\nscale = lambda x: x * 2\ndef f(view):\n    return view\n"
        "ys = [bystander for bystander in range(3)]\nout = model(torch.ones(1, 3))"
    )
    assert ns["model"].weight.device == META
    assert ns["x"].device.type == "cpu" and ns["view"].device.type == "cpu"
    assert ns["bystander"].device.type == "cpu"


def test_a_function_the_cell_defines_moves_the_globals_it_reads(ip, ns):
    ip.run_cell("%%ondevice meta\ndef f():\n    return model(x[:3])\nout = f()")
    assert ns["model"].weight.device == META and ns["x"].device == META
    assert ns["out"].device == META


@pytest.mark.parametrize("body", ["y = x * 2\nreturn y", "y = x * 2\nawait f(x)"])
def test_a_body_that_cannot_compile_moves_nothing(ip, ns, body):
    before = state(ip)
    with pytest.raises(UsageError) as err:
        ip.run_cell(f"%%ondevice meta\n{body}")
    assert type(err.value) is UsageError and "\n" not in str(err.value)
    assert state(ip) == before and "y" not in ns


def test_cpu_0_is_the_cpu_and_nothing_is_copied(ip, ns):
    x, ptr = ns["x"], ns["x"].data_ptr()
    ip.run_cell("%%ondevice cpu:0 -v\ny = x + 1")
    ip.run_cell("%device cpu:0 --move")
    assert ns["x"] is x and x.data_ptr() == ptr
    assert ns["device"] == torch.device("cpu") and torch_default_device() is None


def test_a_ctrl_c_once_the_move_is_done_still_restores(ip, monkeypatch):
    import os
    import signal

    from torch_device_magic import probes

    x = torch.arange(4.0)
    ip.user_ns["x"] = x
    monkeypatch.setattr(probes, "synchronize", lambda dev: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        ip.run_cell_magic("ondevice", "meta --restore", "ran = x.sum()")
    assert "ran" not in ip.user_ns  # the cell did not run
    assert ip.user_ns["x"] is x and torch.equal(x, torch.arange(4.0))  # back, with its data


@pytest.mark.parametrize("move", [
    "%%ondevice meta\nout = model(x[:3])\nopt.zero_grad()",
    "%device meta --move",
])
def test_a_move_inside_inference_mode_leaves_tensors_that_train(ip, ns, move):
    ip.run_cell(f"%%nograd --inference\n{move}")
    assert ns["model"].weight.device == META and not ns["model"].weight.is_inference()
    ip.run_cell("opt.zero_grad()\nmodel(torch.ones(2, 3, device='meta')).sum().backward()")
    ip.run_cell("opt.step()")  # both refuse inference tensors
    assert ns["model"].weight.grad.device == META
    assert ns["opt"].state[ns["model"].weight]["exp_avg"].device == META


def test_verbose_lists_each_name_with_what_it_holds_counted_once(ip, capsys):
    # `adam` sorts before `net`: its parameters still count under the model.
    ip.run_cell(
        "net = torch.nn.Linear(3, 2)\nadam = torch.optim.Adam(net.parameters())\n"
        "net(torch.ones(1, 3)).sum().backward()\nadam.step()\nx = torch.ones(4, 3)"
    )
    capsys.readouterr()
    ip.run_cell("%%ondevice meta -v\nadam.zero_grad()\nnet(x).sum().backward()\nadam.step()")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("moved 176 B to meta in ")
    rows = [line.split(maxsplit=1) for line in out[3:6]]
    # net: weight and bias and their grads; adam: its moments (`step` stays on the CPU)
    assert rows == [["net", "64 B"], ["x", "48 B"], ["adam", "64 B"]]
    assert out[6] == "adam also holds 32 B counted under net"


def test_a_move_out_of_meta_is_refused_in_one_line_before_any_copy(ip, ns, monkeypatch):
    ip.run_cell("z = torch.ones(3, device='meta')")
    before = state(ip)
    collected = []  # a failed copy collects garbage to free what it made: 150 ms
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(args))
    with pytest.raises(UsageError) as err:
        ip.run_cell("%%ondevice cpu\nran = True\nz + x[:3]")
    assert collected == []
    assert str(err.value) == (
        "Could not move z (12 B) to cpu: it is on the meta device, which holds no data; "
        "nothing was moved."
    )
    assert "ran" not in ns and state(ip) == before


def test_restore_from_meta_gives_back_a_name_the_cell_rebound(ip, capsys):
    images = torch.arange(24.0).reshape(2, 3, 4)
    ip.user_ns["images"] = images
    ip.run_cell_magic("ondevice", "meta --restore", "images = images.flatten(1)\nimages.shape")
    assert ip.user_ns["images"] is images  # the meta result held nothing
    assert torch.equal(images, torch.arange(24.0).reshape(2, 3, 4))
    assert capsys.readouterr().out == (
        "--restore from meta gave back what the name images held: "
        "the cell bound it to meta tensors, which hold no data\n"
    )


def test_a_ctrl_c_in_the_restore_from_meta_loses_nothing(ip, monkeypatch, capsys):
    import os
    import signal

    from torch_device_magic import moving

    x = torch.arange(4.0)
    ip.user_ns["x"] = x
    put_back = moving.restoring._put_back_originals

    def interrupted(*args):
        os.kill(os.getpid(), signal.SIGINT)
        return put_back(*args)

    monkeypatch.setattr(moving.restoring, "_put_back_originals", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ip.run_cell_magic("ondevice", "meta --restore", "ran = x.sum()")
    assert ip.user_ns["ran"].device == META  # the cell ran
    assert ip.user_ns["x"] is x and torch.equal(x, torch.arange(4.0))  # back, with its data
    assert "Ctrl-C during --restore: it finished first" in capsys.readouterr().out


def test_a_users_sigint_handler_sees_a_ctrl_c_in_the_move_and_the_cell_goes_on(ip, monkeypatch):
    import os
    import signal

    from torch_device_magic import moving

    ip.run_cell(
        "import signal\nstop = []\n"
        "def stop_after_this_epoch(signum, frame):\n    stop.append(signum)\n"
        "signal.signal(signal.SIGINT, stop_after_this_epoch)\nx = torch.arange(4.0)"
    )
    handler, x = ip.user_ns["stop_after_this_epoch"], ip.user_ns["x"]
    swap_all = moving.commit._swap_all

    def swapping(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # lands in the commit, then in the restore
        return swap_all(*args, **kwargs)

    for module in (moving.commit, moving.restoring):  # where it is called
        monkeypatch.setattr(module, "_swap_all", swapping)
    try:
        ip.run_cell_magic("ondevice", "meta --restore", "ran = x.sum()")
        assert signal.getsignal(signal.SIGINT) is handler
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C cancelled the move instead of reaching the user's handler")
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert ip.user_ns["stop"] == [signal.SIGINT] * 2  # one Ctrl-C in the move, one in the restore
    assert ip.user_ns["ran"].device == META and x.device.type == "cpu"
    assert torch.equal(x, torch.arange(4.0))


def test_a_users_sigint_handler_that_raises_in_the_move_still_gets_everything_back(
    ip, monkeypatch
):
    """A "save, then stop" handler raises KeyboardInterrupt itself: the move to meta is
    done by then, and --restore must still bring the data back."""
    import os
    import signal

    from torch_device_magic import moving

    ip.run_cell(
        "import signal\nsaved = []\n"
        "def save_then_stop(signum, frame):\n"
        "    saved.append(signum)\n    raise KeyboardInterrupt\n"
        "signal.signal(signal.SIGINT, save_then_stop)\nx = torch.arange(4.0)"
    )
    x = ip.user_ns["x"]
    swap_all = moving.commit._swap_all
    sent = []

    def swapping(*args, **kwargs):
        if not sent:  # once, in the move's commit
            sent.append(os.kill(os.getpid(), signal.SIGINT))
        return swap_all(*args, **kwargs)

    for module in (moving.commit, moving.restoring):
        monkeypatch.setattr(module, "_swap_all", swapping)
    try:
        with pytest.raises(KeyboardInterrupt):
            ip.run_cell_magic("ondevice", "meta --restore", "ran = x.sum()")
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    assert ip.user_ns["saved"] == [signal.SIGINT] and "ran" not in ip.user_ns
    assert x.device.type == "cpu" and torch.equal(x, torch.arange(4.0))


TRAIN_STEP = """\
batch = torch.ones(4, 3)
def loss_of(out):
    return out.pow(2).sum()
def train_step():
    opt.zero_grad()
    loss = loss_of(model(batch))
    loss.backward()
    opt.step()
    return loss
"""


def test_a_cell_that_calls_a_notebook_function_moves_what_the_function_reads(ip, ns, capsys):
    ip.run_cell(TRAIN_STEP)
    capsys.readouterr()
    loss = ip.run_cell_magic("ondevice", "meta -v", "train_step()")
    assert loss.device == META
    assert all(p.device == META for p in ns["model"].parameters())
    assert ns["batch"].device == META and ns["bystander"].device.type == "cpu"
    assert all(t.device == META for s in ns["opt"].state.values()
               for k, t in s.items() if k != "step")
    out = capsys.readouterr().out.splitlines()
    assert "followed into train_step: opt, model, batch" in out  # not loss_of: no tensor


NET = """\
train_x = torch.randn(64, 3); gallery = [torch.randn(3) for _ in range(4)]
scale = torch.ones(2)
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 2)
    def forward(self, x):
        return self.fc1(x) * scale
    def fit(self):
        return self(train_x).sum()
    def show_examples(self):
        return [self(g) for g in gallery]
net = Net()
"""


def test_calling_a_module_moves_what_its_forward_reads_not_what_its_other_methods_read(
        ip, ns, capsys):
    ip.run_cell(NET)
    train_x, gallery = ns["train_x"].clone(), [g.clone() for g in ns["gallery"]]
    capsys.readouterr()
    out = ip.run_cell_magic("ondevice", "meta -v", "out = net(x[:3])\nout")
    assert out.device == META and ns["scale"].device == META  # read by forward: moved
    # read only by methods the cell never calls: on the CPU with their data
    assert torch.equal(ns["train_x"], train_x)
    assert all(map(torch.equal, ns["gallery"], gallery))
    assert "followed into Net.forward: scale" in capsys.readouterr().out.splitlines()
    ip.run_cell("%%ondevice meta\nnet.fit()")  # a cell that names fit moves what fit reads
    assert ns["train_x"].device == META and ns["gallery"][0].device.type == "cpu"


@pytest.mark.parametrize("cell", ["s = score(vals)", "s = bound_kw(vals)"])
def test_a_callable_given_as_a_default_or_to_a_partial_moves_what_it_reads(ip, tdmdev, cell):
    ip.run_cell(SCORES)  # score(v, metric=weighted), where weighted reads weights
    ip.run_cell(f"%%ondevice tdmdev\n{cell}")
    ns = ip.user_ns
    assert ns["vals"].device.type == "tdmdev" and ns["weights"].device.type == "tdmdev"
    assert ns["s"].device.type == "tdmdev" and ns["s"].item() == 3.0


def test_verbose_names_what_a_function_of_the_users_own_module_keeps(ip, ns, tmp_path,
                                                                   monkeypatch, capsys):
    (tmp_path / "tdm_user_steps.py").write_text(
        "import torch\nweights = torch.ones(3)\ndef scale(x):\n    return x * weights\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        ip.run_cell("from tdm_user_steps import scale")
        capsys.readouterr()
        ip.run_cell("%%ondevice meta -v\ny = x[:3]")  # a cell that does not call it: no note
        assert not any("could not follow: tdm" in s for s in capsys.readouterr().out.splitlines())
        with pytest.raises(RuntimeError):
            ip.run_cell("%%ondevice meta -v\nscale(x[:3])")
        out = capsys.readouterr().out.splitlines()
        assert ("could not follow: tdm_user_steps.scale reads weights from its module "
                "tdm_user_steps") in out
    finally:
        import sys
        sys.modules.pop("tdm_user_steps", None)


# --- the cell's default device: installed as %device installs it, no mode -----------------

MODES = "modes = [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()]"


def test_a_warning_a_torch_op_raises_in_the_cell_names_the_users_line(ip):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ip.run_cell("%%ondevice cpu\nx = 1\nt = torch.tensor(torch.ones(2))\n"
                    "s = torch.nn.functional.softmax(torch.ones(2))")
    found = [(cell_label(ip, w.filename) is not None, w.lineno) for w in caught
             if "copy construct" in str(w.message) or "softmax" in str(w.message)]
    assert found == [(True, 2), (True, 3)]  # not torch/utils/_device.py


@pytest.mark.parametrize(("cell", "error"), [
    ("", None), ("1 / 0", ZeroDivisionError), ("raise KeyboardInterrupt", KeyboardInterrupt)])
def test_factory_calls_land_on_the_cells_device_under_no_mode_and_the_default_comes_back(
        ip, tdmdev, cell, error):
    ip.run_cell("%device meta")
    before = torch_default_device()
    body = f"%%ondevice tdmdev:1\n{MODES}\nmade = torch.zeros(2)\nlinear = torch.nn.Linear(2, 2)\n"
    with pytest.raises(error) if error else contextlib.nullcontext():
        ip.run_cell(body + cell)
    ns = ip.user_ns
    assert ns["modes"] == [] and ns["made"].device == torch.device("tdmdev:1")
    assert ns["linear"].weight.device == torch.device("tdmdev:1")
    assert torch_default_device() == before == META and torch.zeros(1).device == META
    ip.run_cell("%device reset")  # still the default %device installed: it is undone
    assert torch_default_device() is None


def test_the_cpu_installs_no_default_and_a_session_default_comes_back_after(ip, tdmdev):
    ip.run_cell("%device tdmdev:1")
    ip.run_cell(f"%%ondevice cpu\n{MODES}\nmade = torch.zeros(2)\nnow = torch.get_default_device()")
    ns = ip.user_ns
    assert ns["modes"] == [] and ns["made"].device.type == "cpu" and ns["now"].type == "cpu"
    assert torch.zeros(1).device == torch.device("tdmdev:1")


@pytest.mark.parametrize("session", [None, "cpu", "meta"])
@pytest.mark.parametrize("spec", ["cpu", "meta"])
def test_a_default_the_cell_sets_by_hand_stays(ip, session, spec):
    if session:
        ip.run_cell(f"%device {session}")
    ip.run_cell(f"%%ondevice {spec} --restore\ntorch.set_default_device('cpu:0')")
    assert torch_default_device() == torch.device("cpu", 0)
    modes = torch.overrides._get_current_function_mode_stack()
    assert [type(m).__name__ for m in modes] == ["DeviceContext"]  # torch's, for it: no other


# --- nested magics: a body of Python is read as the cell's code; other syntax said -------

@pytest.mark.parametrize("nested", [
    "%%nograd", "%%nograd --inference", "%%time", "%%capture captured", "%%gpumem",
    "%%nograd\n%%time", "%%ondevice meta"])
def test_a_nested_cell_magic_of_python_moves_what_its_body_uses(ip, ns, nested, capsys):
    ip.run_cell(f"%%ondevice meta\n{nested}\ny = model(x[:3])")
    assert ns["model"].weight.device == META and ns["x"].device == META
    assert ns["y"].device == META and ns["bystander"].device.type == "cpu"
    assert ns["y"].requires_grad is ("nograd" not in nested)  # the nested magic still applies
    assert "%%ondevice:" not in capsys.readouterr().out


@pytest.mark.parametrize("line", [
    "%time y = model(x[:3])", "%timeit -n 1 -r 1 -o model(x[:3])", "%prun -q -l 1 model(x[:3])"])
def test_a_line_magic_whose_argument_is_python_moves_what_it_uses(ip, ns, line):
    ip.run_cell(f"%%ondevice meta\n{line}")
    assert ns["model"].weight.device == META and ns["x"].device == META


def test_a_nested_cell_magic_whose_body_is_not_python_says_nothing_it_uses_moved(
        ip, ns, tmp_path, capsys):
    path = tmp_path / "step.py"
    ip.run_cell(f"%%ondevice meta\n%%writefile {path}\ny = model(x[:3])")
    assert path.read_text() == "y = model(x[:3])\n"
    assert ns["model"].weight.device.type == "cpu" and ns["x"].device.type == "cpu"
    out = [line for line in capsys.readouterr().out.splitlines() if "%%ondevice" in line]
    assert out == ["%%ondevice: the body of %%writefile is not Python it can read, so nothing "
                   "it uses moved to meta (model, x hold tensors)"]


def test_tensors_named_only_in_ipython_syntax_are_said_not_moved(ip, ns, capsys):
    ip.run_cell("%%ondevice meta\n!echo {x.shape}")  # a !command: not Python
    assert ns["x"].device.type == "cpu"
    out = [line for line in capsys.readouterr().out.splitlines() if "%%ondevice" in line]
    assert out == ["%%ondevice: x holds tensors the cell names only in IPython syntax that "
                   "is not Python (a !command, a %magic's argument), so not moved to meta"]


# --- what shares a storage moves with it, once -----------------------------------


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def moved_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("moved "))


@pytest.mark.parametrize("restore", [False, True])
def test_a_view_moves_with_its_base_and_the_write_through_it_is_the_bases(
    ip, tdmdev, capsys, restore
):
    ip.run_cell("base = torch.arange(12.).reshape(3, 4)\nview = base[1]")
    capsys.readouterr()
    ip.run_cell(f"%%ondevice tdmdev -v{' --restore' * restore}\nview.mul_(2)")  # names view only
    out = capsys.readouterr().out
    base, view = ip.user_ns["base"], ip.user_ns["view"]
    assert moved_line(out).startswith("moved 48 B to tdmdev:0")  # the storage, once
    assert "moved too, as it shares storage with what the cell uses: base" in out
    assert {base.device.type, view.device.type} == {"cpu" if restore else "tdmdev"}
    assert base[1].tolist() == [8.0, 10.0, 12.0, 14.0] and view.tolist() == base[1].tolist()
    assert storage(view) == storage(base) and view.data_ptr() - base.data_ptr() == 16
    assert view._base is base._base is not None  # still views of one base: one version counter
    base.add_(1)
    assert view.tolist() == [9.0, 11.0, 13.0, 15.0] and view._version == base._version


def test_what_shares_a_storage_moves_with_it_parameters_aliases_and_optimizer_state(
    ip, tdmdev, capsys
):
    ip.run_cell(
        "model = torch.nn.Linear(4, 3)\nw0 = model.weight[0]\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "model(torch.ones(1, 4)).sum().backward()\nopt.step()\n"
        "avg = opt.state[model.weight]['exp_avg'][:1]\n"  # the optimizer's state, viewed
        "a = torch.ones(3, requires_grad=True)\nd = a.detach()"
    )
    ns = ip.user_ns
    weight = ns["model"].weight
    ip.run_cell("%%ondevice tdmdev\ns = w0.sum()")  # a view of a module's parameter
    assert ns["model"].weight is weight and weight.device.type == "tdmdev"
    assert ns["w0"]._base is weight and storage(ns["w0"]) == storage(weight)
    ip.run_cell("%%ondevice tdmdev --restore\nd.mul_(2)")  # a detached alias of a leaf
    a = ns["a"]
    assert a.tolist() == [2.0, 2.0, 2.0] and a.device.type == "cpu"
    assert a.is_leaf and a.requires_grad and storage(a) == storage(ns["d"])
    before = ns["avg"].clone()
    ip.run_cell("%%ondevice tdmdev --restore\nmodel(torch.ones(1, 4)).sum().backward()\n"
                "opt.step()")
    exp_avg = ns["opt"].state[weight]["exp_avg"]
    assert ns["avg"].device.type == "cpu" and storage(ns["avg"]) == storage(exp_avg)
    assert torch.equal(ns["avg"], exp_avg[:1]) and not torch.equal(ns["avg"], before)


@pytest.mark.parametrize("line", ["%%ondevice tdmdev --all\npass", "%device tdmdev --move"])
def test_moving_every_name_keeps_views_views_of_their_base(ip, tdmdev, line):
    ip.run_cell("base = torch.arange(12.).reshape(3, 4)\nview = base[1]")
    ip.run_cell(line)
    base, view = ip.user_ns["base"], ip.user_ns["view"]
    assert view.device.type == "tdmdev" and storage(view) == storage(base)
    assert view._base is base._base is not None
    ip.run_cell("%device reset --move")
    assert view.device.type == "cpu" and view._base is base._base is not None


def test_overlapping_views_move_as_their_storage_and_stay_views(ip, tdmdev, capsys):
    ip.run_cell(
        "sig = torch.arange(1000.)\nwin = sig.unfold(0, 256, 1)\n"  # 745 windows of 4,000 B
        "pe = torch.arange(64.).reshape(64, 1).clone()\npos = pe.expand(512, 64, 32)"
    )
    capsys.readouterr()
    ip.run_cell("%%ondevice tdmdev --restore -v\n"  # names neither sig nor pe
                "seen = [t.untyped_storage().nbytes() for t in (win, pos)]\n"
                "total = win.sum() + pos.sum()")
    ns = ip.user_ns
    assert moved_line(capsys.readouterr().out).startswith("moved 4.2 KiB to tdmdev:0")
    assert ns["seen"] == [4000, 256]  # on the device too: views of the one storage
    win, pos = ns["win"], ns["pos"]
    assert win._base is ns["sig"] and pos._base is ns["pe"] and win.device.type == "cpu"
    assert win.stride() == (1, 1) and pos.stride() == (0, 1, 0)
    assert ns["total"].item() == win.sum().item() + pos.sum().item()


def test_an_overlapping_view_alone_moves_its_storage_not_its_elements(ip, tdmdev, capsys):
    ip.run_cell("win = torch.arange(1000.).unfold(0, 256, 1)")  # its base has no name
    capsys.readouterr()
    ip.run_cell("%%ondevice tdmdev --restore -v\nn = win.untyped_storage().nbytes()")
    ns = ip.user_ns
    assert moved_line(capsys.readouterr().out).startswith("moved 3.9 KiB to tdmdev:0")
    assert ns["n"] == 4000 and ns["win"].untyped_storage().nbytes() == 4000
    assert ns["win"].stride() == (1, 1) and ns["win"]._base is not None
    assert torch.equal(ns["win"], torch.arange(1000.).unfold(0, 256, 1))
