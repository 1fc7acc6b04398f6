"""%device, %%nograd and the cell runner, through a fresh shell that re-raises."""

from __future__ import annotations

import os
import re

import pytest
import torch
from IPython.core.error import UsageError

from torch_device_magic.probes import torch_default_device


def state(ip):
    """What a bad input must leave exactly as it was."""
    ns = {k: v for k, v in ip.user_ns.items() if not k.startswith("_")}
    return ns, torch.is_grad_enabled(), torch_default_device()


def test_device_meta_binds_device_and_new_tensors_land_there(ip, capsys):
    ip.run_cell("%device meta")
    assert capsys.readouterr().out.splitlines()[0] == "device = meta"
    assert ip.user_ns["device"] == torch.device("meta")
    ip.run_cell("import torch; x = torch.zeros(3); layer = torch.nn.Linear(2, 2)")
    assert ip.user_ns["x"].device.type == "meta"
    assert ip.user_ns["layer"].weight.device.type == "meta"


def test_device_cpu_installs_no_torch_default(ip):
    ip.run_cell("%device meta")
    ip.run_cell("%device cpu")
    assert ip.user_ns["device"] == torch.device("cpu")
    assert torch_default_device() is None  # no per-call cost for what torch does anyway
    assert torch.zeros(1).device.type == "cpu"


def test_device_reset_returns_to_the_cpu(ip):
    ip.run_cell("%device meta")
    ip.run_cell("%device reset")
    assert ip.user_ns["device"] == torch.device("cpu")
    assert torch_default_device() is None
    assert torch.zeros(1).device.type == "cpu"


def test_torch_default_can_be_switched_off(ip):
    ip.run_cell("%config TorchDeviceMagics.set_torch_default = False")
    ip.run_cell("%device meta")
    assert ip.user_ns["device"] == torch.device("meta")
    assert torch.zeros(1).device.type == "cpu"
    ip.run_cell("%config TorchDeviceMagics.set_torch_default = True")
    assert torch.zeros(1).device.type == "meta"


def test_auto_on_a_cpu_machine_says_so(ip, capsys):
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this machine has an accelerator")
    ip.run_cell("%device auto")
    out = capsys.readouterr().out.splitlines()[0]
    assert out.startswith("device = no GPU available") and out.endswith("using the CPU")
    assert ip.user_ns["device"] == torch.device("cpu")


def test_bare_device_shows_a_table_with_the_cpu(ip, capsys):
    ip.run_cell("%device meta")
    capsys.readouterr()
    ip.run_cell("%device")
    out = capsys.readouterr().out
    assert "session device: meta" in out
    assert any(line.split()[:1] == ["cpu"] for line in out.splitlines())
    assert "memory used / total" in out


BAD_DEVICE_LINES = [
    ("%device banana", "'banana' is not a device"),
    ("%device cuda:-1", "'cuda:-1' is not a device"),
    ("%device cpu cuda", "%device: unrecognized arguments: cuda"),
    ("%device --bogus", "%device: unrecognized arguments: --bogus"),
    ("%%nograd --bogus\nx = 1", "%nograd: unrecognized arguments: --bogus"),
    ("%nograd maybe", "%nograd takes 'on' or 'off'"),
    ("%%nograd on\nx = 1", "%%nograd takes no argument but --inference"),
]
if not torch.cuda.is_available():
    BAD_DEVICE_LINES += [
        ("%device cuda", "cuda is not available"),
        ("%device cuda:7", "cuda:7 is not available"),
    ]


@pytest.mark.parametrize(("line", "message"), BAD_DEVICE_LINES)
def test_bad_input_is_one_usage_error_and_changes_nothing(ip, line, message):
    ip.run_cell("%device meta")
    ip.run_cell("w = torch.ones(2, requires_grad=True)")
    before = state(ip)
    with pytest.raises(UsageError) as err:
        ip.run_cell(line)
    assert type(err.value) is UsageError
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)
    assert state(ip) == before


@pytest.mark.parametrize("line", ['%device "meta"', "%device 'meta'"])
def test_a_quoted_device_reads_as_the_device(ip, line):
    ip.run_cell(line)
    assert ip.user_ns["device"] == torch.device("meta")


@pytest.mark.parametrize("line", [
    "%device --bogus", "%%ondevice meta --bogus\n1", "%%nograd --bogus\n1", "%tensors --bogus",
    "%%devcompare cpu meta --bogus\n1", "%gpufree --bogus", "%devreport --bogus",
    "%%gpumem --bogus\n1", "%devhistory --bogus",
])
def test_an_option_mistake_points_at_help_that_exists(ip, line):
    with pytest.raises(UsageError) as err:
        ip.run_cell(line)
    magic = re.search(r"\(see (%%?\w+)\? for its options\)$", str(err.value)).group(1)
    typed = line.split()[0]  # the message names the magic as typed; its help is at `magic`
    assert typed.lstrip("%") == magic.lstrip("%")
    assert str(err.value).startswith(f"{typed}: unrecognized arguments: --bogus") or (
        str(err.value).startswith(f"{magic}: unrecognized arguments: --bogus"))
    assert ip.object_inspect(magic)["found"]


def test_usage_error_prints_without_a_traceback(shell, capsys):
    shell.run_line_magic("load_ext", "torch_device_magic")
    result = super(type(shell), shell).run_cell("%device banana")
    err = capsys.readouterr()
    text = err.out + err.err
    assert result.error_in_exec is not None
    assert "UsageError: 'banana' is not a device" in text
    assert "Traceback" not in text


def test_nograd_cell_runs_without_autograd_and_restores(ip):
    ip.run_cell("w = torch.ones(2, requires_grad=True)")
    ip.run_cell("%%nograd\ny = w * 2\ninside = torch.is_grad_enabled()")
    assert ip.user_ns["inside"] is False
    assert ip.user_ns["y"].requires_grad is False
    assert torch.is_grad_enabled()


def test_nograd_inference_mode(ip):
    ip.run_cell(
        "%%nograd --inference\ny = torch.ones(2) * 2\ninside = torch.is_inference_mode_enabled()"
    )
    assert ip.user_ns["inside"] is True
    assert ip.user_ns["y"].is_inference()
    assert not torch.is_inference_mode_enabled()


@pytest.mark.parametrize("error", ["ZeroDivisionError", "KeyboardInterrupt"])
def test_grad_mode_comes_back_after_an_exception(ip, error):
    with pytest.raises(BaseException) as err:
        ip.run_cell(f"%%nograd\nx = 1\nraise {error}()")
    assert type(err.value).__name__ == error
    assert torch.is_grad_enabled()


def test_nograd_line_form_toggles_later_cells(ip):
    ip.run_cell("%nograd on")
    ip.run_cell("a = torch.is_grad_enabled()")
    ip.run_cell("%nograd off")
    ip.run_cell("b = torch.is_grad_enabled()")
    assert (ip.user_ns["a"], ip.user_ns["b"]) == (False, True)


def test_unload_restores_default_device_and_grad_mode(ip):
    ip.run_cell("%device meta")
    ip.run_cell("%nograd on")
    ip.run_line_magic("unload_ext", "torch_device_magic")
    assert torch.is_grad_enabled()
    assert torch_default_device() is None
    assert "device" not in ip.magics_manager.magics["line"]
    assert "nograd" not in ip.magics_manager.magics["cell"]


def test_unload_rebinds_device_to_the_default_unless_the_user_rebound_it(ip):
    ip.run_cell("%device meta")
    ip.run_line_magic("reload_ext", "torch_device_magic")
    assert ip.user_ns["device"] == torch.device("cpu")
    assert torch.empty(1).device == ip.user_ns["device"]
    ip.run_cell("%device meta")
    ip.run_cell("device = 'mine'")
    ip.run_line_magic("unload_ext", "torch_device_magic")
    assert ip.user_ns["device"] == "mine"


def test_the_magics_hold_one_session_and_say_when_they_have_no_shell(ip):
    from torch_device_magic.magics import TorchDeviceMagics

    magics = ip.magics_manager.registry["TorchDeviceMagics"]
    ip.run_cell("%device meta")
    assert magics.session.device == torch.device("meta") and magics.shell is ip
    alone = TorchDeviceMagics(None)
    alone.apply_report_settings()  # no shell to hook into: nothing to do
    with pytest.raises(AssertionError, match="TorchDeviceMagics needs a shell"):
        alone.shell  # noqa: B018


def ours(objects) -> list[str]:
    """The class names of the objects that are the extension's."""
    return sorted(type(o).__name__ for o in objects
                  if type(o).__module__.startswith("torch_device_magic"))


def test_config_lists_the_one_configurable_and_a_reload_leaves_one_of_each(ip, capsys):
    from torch_device_magic.magics import GROUPS

    ip.run_line_magic("reload_ext", "torch_device_magic")
    capsys.readouterr()
    ip.run_line_magic("config", "")
    listed = capsys.readouterr().out
    assert listed.count("TorchDeviceMagics") == 1  # the groups hold no trait of their own
    ip.run_line_magic("config", "TorchDeviceMagics")
    traits = capsys.readouterr().out
    assert "TorchDeviceMagics.report_min_seconds" in traits and "set_torch_default" in traits
    ip.run_line_magic("config", "TorchDeviceMagics.report_min_seconds = 2.5")
    core = ip.magics_manager.registry["TorchDeviceMagics"]
    assert core.report_min_seconds == 2.5 and core.reporter.min_seconds == 2.5
    assert ours(ip.configurables) == sorted(["TorchDeviceMagics", *(g.__name__ for g in GROUPS)])
    for kind in ("line", "cell"):  # every magic is bound to an object of this load
        bound = [fn.__self__ for fn in ip.magics_manager.magics[kind].values()
                 if hasattr(fn, "__self__") and ours([fn.__self__])]
        assert all(getattr(m, "core", m) is core for m in bound)
    ip.run_line_magic("unload_ext", "torch_device_magic")
    assert ours(ip.configurables) == [] and ours(ip.magics_manager.registry.values()) == []
    assert {"device", "ondevice", "tensors", "gpumem", "devcompare"}.isdisjoint(
        {*ip.magics_manager.magics["line"], *ip.magics_manager.magics["cell"]})


@pytest.mark.parametrize("refused", ["-1", "float('nan')", "'soon'"])
def test_a_refused_config_value_leaves_the_config_so_that_reload_works(
    ip, capsys, caplog, refused
):
    ip.run_line_magic("config", "TorchDeviceMagics.report_min_seconds = 2.5")
    ip.run_line_magic("config", f"TorchDeviceMagics.report_min_seconds = {refused}")
    assert "report_min_seconds" in caplog.text  # IPython logs the refusal
    ip.run_line_magic("config", "TorchDeviceMagics.report_min_bytes = -1")  # never set before
    ip.run_line_magic("reload_ext", "torch_device_magic")
    core = ip.magics_manager.registry["TorchDeviceMagics"]
    assert core.report_min_seconds == 2.5 and core.report_min_bytes == 0
    assert {"device", "gpumem"} <= {*ip.magics_manager.magics["line"]}
    assert capsys.readouterr().out == ""  # nothing to say: the config is as it was


def test_loading_drops_a_value_in_the_shells_config_that_a_trait_refuses(shell, capsys):
    shell.config.TorchDeviceMagics.report_min_bytes = -5  # as an old %config left it
    shell.config.TorchDeviceMagics.report_min_seconds = 2.5
    shell.run_line_magic("load_ext", "torch_device_magic")
    core = shell.magics_manager.registry["TorchDeviceMagics"]
    assert core.report_min_bytes == 0 and core.report_min_seconds == 2.5
    assert "gpumem" in shell.magics_manager.magics["cell"]
    assert capsys.readouterr().out == (
        "torch_device_magic: TorchDeviceMagics.report_min_bytes = -5 in the shell's config is "
        "refused (report_min_bytes must be 0 (unset) or more): 0 is used\n"
    )
    shell.run_line_magic("reload_ext", "torch_device_magic")
    assert capsys.readouterr().out == ""  # said once: it is out of the config now


def test_last_expression_is_out_and_semicolon_silences_it(ip):
    ip.run_cell("%%nograd\nx = 20\nx + 22", store_history=True)
    assert ip.user_ns["_"] == 42
    n = ip.execution_count - 1
    assert ip.user_ns["Out"][n] == 42
    ip.run_cell("%%nograd\n7 * 6;", store_history=True)
    assert ip.execution_count - 1 not in ip.user_ns["Out"]


@pytest.mark.parametrize(("body", "error", "line", "shown"), [
    ("x = 1\ny = 2\n1 / 0\n", "ZeroDivisionError", 3, "1 / 0"),
    ("x = 1\nx +\n", "SyntaxError", 2, "x +"),
])
def test_tracebacks_point_at_the_cells_own_line(shell, capsys, body, error, line, shown):
    shell.run_line_magic("load_ext", "torch_device_magic")
    n = shell.execution_count
    super(type(shell), shell).run_cell(f"%%nograd\n{body}", store_history=True)
    out = capsys.readouterr().out
    assert error in out and shown in out
    assert f"In[{n}], line {line}" in out or f"<ipython-input-{n}-" in out
    assert "<unknown>" not in out


def test_shell_escapes_and_nested_magics_work(ip):
    ip.run_cell("%%nograd\nfiles = !echo hello\n%device meta\nz = torch.zeros(1)")
    assert list(ip.user_ns["files"]) == ["hello"]
    assert ip.user_ns["z"].device.type == "meta"


def test_reload_leaves_exactly_one_set_of_hooks(ip):
    def ours():
        from torch_device_magic.hooks import is_ours

        return sum(
            is_ours(cb) for event in ("pre_run_cell", "post_run_cell")
            for cb in ip.events.callbacks[event]
        )

    assert ours() == 2
    for _ in range(20):
        ip.run_line_magic("reload_ext", "torch_device_magic")
    assert ours() == 2
    ip.run_cell("x = 1")
    ip.run_line_magic("unload_ext", "torch_device_magic")
    assert ours() == 0


def test_device_no_default_binds_device_only(ip):
    ip.run_cell("%device meta --no-default")
    assert ip.user_ns["device"] == torch.device("meta")
    assert torch_default_device() is None
    assert torch.zeros(1).device.type == "cpu"
    ip.run_cell("%device meta")
    assert torch.zeros(1).device.type == "meta"
    ip.run_cell("%device meta --no-default")  # takes back the default it had set
    assert torch_default_device() is None
    ip.run_cell("%config TorchDeviceMagics.set_torch_default = False")
    ip.run_cell("%config TorchDeviceMagics.set_torch_default = True")
    assert torch_default_device() is None  # still this choice's: bind `device` only


def test_a_default_device_set_by_hand_is_never_undone(ip):
    meta, cpu = torch.device("meta"), torch.device("cpu")
    torch.set_default_device(meta)  # the user's own, after loading
    ip.run_cell("%config TorchDeviceMagics.set_torch_default = False")
    ip.run_cell("%config TorchDeviceMagics.set_torch_default = True")
    assert torch_default_device() == meta
    ip.run_cell("%device reset")  # nothing of ours to undo
    assert torch_default_device() == meta
    ip.run_cell("%device meta")
    torch.set_default_device(cpu)  # the user's again, over ours
    ip.run_cell("%device reset")
    ip.run_cell("%config TorchDeviceMagics.set_torch_default = False")
    assert torch_default_device() == cpu
    ip.run_line_magic("unload_ext", "torch_device_magic")
    assert torch_default_device() == cpu


def in_a_forked_child(report) -> str:
    """What `report()` returns in a child forked from this process."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer, and never return into pytest
        try:
            os.write(write, report().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        text = answer.read()
    os.waitpid(pid, 0)
    return text


def default_here() -> str:
    return f"{torch.zeros(1).device.type} {torch_default_device()}"


def test_forked_children_start_without_our_default_device(ip):
    ip.run_cell("%device meta")
    assert in_a_forked_child(default_here) == "cpu None"
    assert default_here() == "meta meta"  # this process keeps it
    ip.run_line_magic("unload_ext", "torch_device_magic")
    torch.set_default_device("meta")  # the user's own: the handler, still registered, keeps it
    assert in_a_forked_child(default_here) == "meta meta"


def test_data_loader_workers_under_device_meta(ip):
    ip.run_cell("%device meta")
    ip.run_cell(
        "import numpy as np\n"
        "from torch.utils.data import DataLoader, Dataset\n"
        "from torch_device_magic.probes import torch_default_device\n"
        "class Samples(Dataset):\n"
        "    def __len__(self):\n"
        "        return 4\n"
        "    def __getitem__(self, i):  # runs in a worker: what is torch's default there?\n"
        "        return np.full(2, i, dtype=np.float32), str(torch_default_device())\n"
        "loader = DataLoader(Samples(), batch_size=2, num_workers=2, "
        "multiprocessing_context='fork')\n"
        "with torch.device('cpu'):  # the parent draws the workers' seeds: meta has no numbers\n"
        "    batches = list(loader)\n"
        "after = torch.zeros(1).device.type"
    )
    batches = ip.user_ns["batches"]
    assert [seen for _, defaults in batches for seen in defaults] == ["None"] * 4
    assert [b.device.type for b, _ in batches] == ["cpu", "cpu"]
    assert torch.cat([b for b, _ in batches])[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert ip.user_ns["after"] == "meta"  # the main process still has it


def test_a_failing_restore_does_not_replace_the_cells_error(ip, capsys, monkeypatch):
    from torch_device_magic import moving

    def broken(ns, moved, hold=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(moving, "restore", broken)
    ip.run_cell("w = torch.ones(2)")
    with pytest.raises(ValueError, match="mine"):
        ip.run_cell("%%ondevice meta --restore\nw = w * 2\nraise ValueError('mine')")
    assert "%%ondevice --restore could not send back what moved: CUDA error" in (
        capsys.readouterr().out
    )
    with pytest.raises(RuntimeError, match="illegal memory access"):  # after a cell that ran
        ip.run_cell("%%ondevice meta --restore\nw = w * 2")
