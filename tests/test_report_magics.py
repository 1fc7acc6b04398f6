"""The per-cell report, %devreport, %%gpumem and %devhistory, through a fresh shell."""

from __future__ import annotations

import csv
import os
import sys
import weakref

import pytest
import torch
from fakegpu import Gpu, loaded_with_gpu
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from traitlets import TraitError

from torch_device_magic import probes
from torch_device_magic.gpumem import GpumemReport
from torch_device_magic.history import History
from torch_device_magic.hooks import CellReporter, is_ours
from torch_device_magic.measure import Measurement, Meter

MiB = 2**20
FIELDS = [
    "wall_s", "device_s", "device_delta_bytes", "device_peak_bytes",
    "device_reserved_delta_bytes", "host_delta_bytes", "host_peak_bytes",
]
NO_ACCELERATOR = probes.active_accelerator() is None


def report_lines(out: str) -> list[str]:
    """The per-cell report's lines in printed output."""
    return [line for line in out.splitlines() if line.startswith("time ")]


def magics(ip):
    return ip.magics_manager.registry["TorchDeviceMagics"]


def history(ip) -> list[Measurement]:
    return magics(ip).reporter.history.records()


def run(ip, cell: str):
    """Run a cell as a notebook does: numbered, in the history."""
    return ip.run_cell(cell, store_history=True)


def test_every_cell_gets_one_line_and_a_numbered_record(ip, capsys):
    capsys.readouterr()
    n = ip.execution_count
    run(ip, "a = 1")
    out = capsys.readouterr().out
    assert len(report_lines(out)) == 1 and "host" in out
    record = history(ip)[-1]
    assert record.cell == n
    assert record.wall_s > 0


def test_blank_cells_and_cells_of_comments_alone_are_not_reported(ip, capsys):
    capsys.readouterr()
    before = len(history(ip))
    run(ip, "")
    run(ip, "   \n")
    run(ip, "# a note to self\n\n   # and another")
    assert not report_lines(capsys.readouterr().out)
    assert len(history(ip)) == before
    run(ip, "# a comment, then code\nx = 1")
    assert len(report_lines(capsys.readouterr().out)) == 1


def test_the_loading_cell_gets_a_line_from_the_start_of_loading(shell, capsys):
    capsys.readouterr()
    cell = shell.execution_count
    run(shell, "%load_ext torch_device_magic")
    assert len(report_lines(capsys.readouterr().out)) == 1
    (record,) = history(shell)
    assert record.cell == cell
    assert record.wall_s > 0 and record.host_peak_bytes is not None
    run(shell, "")  # a blank cell after it gets none
    assert not report_lines(capsys.readouterr().out)


def test_a_config_load_gives_no_line_to_the_first_blank_cell(shell, capsys):
    shell.run_line_magic("load_ext", "torch_device_magic")  # outside a cell, as a config does
    run(shell, "")
    run(shell, "x = 1")
    assert len(report_lines(capsys.readouterr().out)) == 1


FREED_IN_A_FRESH_PROCESS = '''
import json
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
for cell in ("%load_ext torch_device_magic", "import torch",
             "x = [torch.randn(256) for _ in range(200_000)]", "del x", "pass"):
    ip.run_cell(cell, store_history=True)
records = ip.run_line_magic("devhistory", "-o")
print(json.dumps([r.host_delta_bytes for r in records[-2:]]))
'''


def test_freed_small_tensors_are_credited_to_the_cell_that_freed_them():
    # glibc keeps freed small chunks and hands them back to the system whenever it
    # trims: RSS falls by a few MiB in the cell that frees them, the rest later or never.
    # A fresh process, as a notebook's kernel is: what a free-heap reading costs, and so
    # whether it is taken, depends on how many free chunks earlier tests left in this one.
    import json
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", FREED_IN_A_FRESH_PROCESS], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    freed, after = json.loads(out.strip().splitlines()[-1])
    assert -330 * MiB < freed < -230 * MiB
    assert abs(after) < 2 * MiB



def test_a_cell_that_never_ran_is_not_reported(ip, capsys):
    capsys.readouterr()
    before = len(history(ip))
    with pytest.raises(SyntaxError):
        run(ip, "x = (")  # nothing ran
    assert not report_lines(capsys.readouterr().out)
    assert len(history(ip)) == before
    with pytest.raises(ZeroDivisionError):
        run(ip, "1 / 0")  # ran, and raised: reported
    assert len(report_lines(capsys.readouterr().out)) == 1
    assert len(history(ip)) == before + 1


def test_transient_peak_in_the_automatic_record(ip):
    run(ip, "x = torch.ones(512 * 2**20, dtype=torch.uint8); del x")
    record = history(ip)[-1]
    assert record.host_peak_bytes == pytest.approx(512 * MiB, rel=0.10)
    assert abs(record.host_delta_bytes) < 0.10 * 512 * MiB


def test_transient_peak_in_gpumem_output(ip):
    report = run(ip, "%%gpumem -o\nx = torch.ones(512 * 2**20, dtype=torch.uint8); del x").result
    assert isinstance(report, GpumemReport)
    assert report.host_peak_bytes == pytest.approx(512 * MiB, rel=0.10)
    assert abs(report.host_delta_bytes) < 0.10 * 512 * MiB


def test_kept_allocation_is_the_recorded_delta(ip):
    run(ip, "kept = torch.ones(256 * 2**20, dtype=torch.uint8)")
    assert history(ip)[-1].host_delta_bytes == pytest.approx(256 * MiB, rel=0.10)


@pytest.mark.skipif(not NO_ACCELERATOR, reason="an accelerator runtime is up")
def test_without_an_accelerator_device_fields_are_none(ip, capsys):
    report = run(ip, "%%gpumem -o\ny = torch.zeros(10)").result
    record = history(ip)[-1]
    for measured in (report, record):
        assert measured.device is None
        assert all(getattr(measured, f) is None for f in FIELDS if f.startswith("device"))
    run(ip, "%%gpumem\nz = torch.zeros(10)")
    out = capsys.readouterr().out
    assert "no accelerator in use" in out and "host RSS" in out


@pytest.mark.parametrize(
    "switch",
    [
        "%devreport off",
        "%config TorchDeviceMagics.auto_report = False",
        "%config TorchDeviceMagics.report_min_seconds = 60",
        "%config TorchDeviceMagics.report_min_bytes = 2**40",
    ],
)
def test_switches_silence_the_report(ip, capsys, switch):
    run(ip, switch)
    capsys.readouterr()
    run(ip, "b = 2")
    assert not report_lines(capsys.readouterr().out)


def test_devreport_turns_it_back_on_and_says_how_it_is_set(ip, capsys):
    run(ip, "%devreport off")
    assert "per-cell report: off" in capsys.readouterr().out
    run(ip, "%devreport on")
    run(ip, "c = 3")
    out = capsys.readouterr().out
    assert "per-cell report: on" in out and len(report_lines(out)) == 1
    run(ip, "%config TorchDeviceMagics.report_min_seconds = 2.5")
    run(ip, "%devreport status")
    assert "cells reaching at least 2.50 s" in capsys.readouterr().out


def test_devreport_status_counts_one_cell_in_the_singular(ip, capsys):
    ip.run_line_magic("devreport", "status")  # not a cell: nothing in the history yet
    assert "0 cells in the history" in capsys.readouterr().out
    run(ip, "%devreport status")  # this cell is recorded once it ends
    run(ip, "%devreport status")
    assert "1 cell in the history" in capsys.readouterr().out


def test_thresholds_show_only_cells_that_reach_one(ip, capsys):
    run(ip, "%config TorchDeviceMagics.report_min_bytes = 16 * 2**20")
    capsys.readouterr()
    run(ip, "small = torch.ones(10)")
    assert not report_lines(capsys.readouterr().out)
    run(ip, "big = torch.ones(32 * 2**20, dtype=torch.uint8)")
    assert len(report_lines(capsys.readouterr().out)) == 1
    assert len(history(ip)) == 3  # hidden cells are still recorded


def test_hidden_cells_are_not_formatted(ip, capsys, monkeypatch):
    run(ip, "%config TorchDeviceMagics.report_min_seconds = 60")

    def formatting(self):
        raise AssertionError("formatted a hidden cell")

    monkeypatch.setattr(Measurement, "summary", formatting)
    run(ip, "d = 4")
    out = capsys.readouterr()
    assert "formatted" not in out.out + out.err
    assert history(ip)[-1].wall_s > 0


def test_bad_threshold_is_refused(ip):
    with pytest.raises(TraitError):
        magics(ip).report_min_seconds = -1
    magics(ip).sync = False
    assert magics(ip).reporter.sync is False


@pytest.mark.parametrize("value", [float("inf"), float("nan"), float("-inf")])
def test_a_threshold_must_be_finite(ip, capsys, value):
    with pytest.raises(TraitError, match="report_min_seconds must be a finite number"):
        magics(ip).report_min_seconds = value
    assert magics(ip).report_min_seconds == 0
    run(ip, "%devreport status")
    assert "per-cell report: on (every cell" in capsys.readouterr().out


def test_a_gpumem_cell_is_reported_once(ip, capsys):
    capsys.readouterr()
    run(ip, "%%gpumem\ne = torch.ones(1000)")
    out = capsys.readouterr().out
    assert out.count("%%gpumem") == 1
    assert not report_lines(out)
    assert isinstance(history(ip)[-1], GpumemReport)


def test_gpumem_names_the_largest_new_tensors_and_returns_the_value(ip, capsys):
    run(ip, "old = torch.ones(10**6)")
    result = run(ip, "%%gpumem\nbig = torch.ones(1000, 1000)\nsmall = torch.ones(3)\n40 + 2")
    assert result.result == 42
    out = capsys.readouterr().out
    table = out[out.index("largest tensors") :]
    assert table.index("big") < table.index("small")
    assert "old" not in table
    assert "(1000, 1000)" in table and "float32" in table


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_gpumem_lists_a_nested_tensor_and_returns_the_value(ip, capsys):
    result = run(ip, "%%gpumem\nnt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])\n7")
    assert result.result == 7
    assert "nt    (2, None)  float32  cpu     20 B" in capsys.readouterr().out


def test_gpumem_quiet_shows_nothing(ip, capsys):
    run(ip, "%%gpumem -q\nf = 1")
    assert capsys.readouterr().out == ""


def test_gpumem_output_has_the_spec_fields(ip):
    report = run(ip, "%%gpumem -o --device cpu\ng = torch.ones(10)").result
    assert all(hasattr(report, f) for f in FIELDS)
    assert report.wall_s > 0 and report.device is None


def test_no_references_are_held(ip):
    run(ip, "x = torch.ones(10**6)")
    ref = weakref.ref(ip.user_ns["x"])
    run(ip, "%%gpumem\ny = x * 2")
    run(ip, "%%gpumem -o\nz = x.sum()")
    run(ip, "%devhistory")
    run(ip, "%devhistory -o")
    run(ip, "del x")
    assert ref() is None


def test_devhistory_table_records_csv(ip, capsys, tmp_path):
    run(ip, "h = torch.ones(100)")
    run(ip, "%devhistory")
    assert "per-cell history" in capsys.readouterr().out
    records = run(ip, "%devhistory -o").result
    assert all(hasattr(records[0], f) for f in [*FIELDS, "cell"])
    path = tmp_path / "cells.csv"
    run(ip, f"%devhistory --csv {path}")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(history(ip)) - 1  # the --csv cell is recorded after it wrote
    assert set(FIELDS) <= set(rows[0]) and "cell" in rows[0]
    assert rows[0]["device_delta_bytes"] == ""  # not measured is empty, not 0
    assert float(rows[0]["wall_s"]) > 0


@pytest.mark.parametrize("quote", ['"', "'"])
def test_devhistory_csv_takes_a_quoted_path_with_spaces(ip, tmp_path, quote):
    run(ip, "h = 1")
    run(ip, f"%devhistory --csv {quote}{tmp_path}/my cells.csv{quote}")
    assert [p.name for p in tmp_path.iterdir()] == ["my cells.csv"]


def test_devhistory_csv_expands_the_home_directory(ip, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    run(ip, "h = 1")
    run(ip, "%devhistory --csv ~/cells.csv")
    assert (tmp_path / "cells.csv").exists()


def test_devhistory_csv_with_an_empty_path_is_a_usage_error(ip, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="--csv needs a file name") as err:
        run(ip, '%devhistory --csv ""')
    assert type(err.value) is UsageError
    assert list(tmp_path.iterdir()) == []


def test_devhistory_plot_without_matplotlib_says_so(ip, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(UsageError, match="--plot needs matplotlib"):
        run(ip, "%devhistory --plot")


def test_devhistory_plot_draws_time_and_memory(ip):
    pytest.importorskip("matplotlib")
    run(ip, "p = 1")
    fig = History.plot(magics(ip).reporter.history)
    assert len(fig.axes) == 2


def test_devhistory_plot_in_a_terminal_without_images_saves_a_png_and_says_where(
        ip, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(ip.display_formatter, "active_types", ["text/plain"])  # as a terminal
    run(ip, "p = 1")
    capsys.readouterr()
    run(ip, "%devhistory --plot")
    out = capsys.readouterr().out
    assert "<Figure" not in out
    said = out.splitlines()[0]
    assert said.startswith("this terminal shows no images: the plot is in ")
    path = said.rsplit(" ", 1)[1]
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    os.remove(path)


# A device this machine lacks is refused, not measured as "no accelerator" or all n/a.
BAD_GPUMEM_DEVICES = []
if torch.cuda.device_count() <= 7:
    BAD_GPUMEM_DEVICES.append(("%%gpumem --device cuda:7\nx = 1", "cuda:7 is not available"))
if not torch.cuda.is_available():
    BAD_GPUMEM_DEVICES.append(("%%gpumem --device cuda\nx = 1", "cuda is not available"))
if not torch.backends.mps.is_available():
    BAD_GPUMEM_DEVICES.append(("%%gpumem --device mps\nx = 1", "mps is not available"))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("%%gpumem --bogus\nx = 1", "%%gpumem: unrecognized arguments: --bogus"),
        ("%%gpumem --device banana\nx = 1", "'banana' is not a device"),
        ("%devhistory --csv", "%devhistory: argument --csv: expected one argument"),
        ("%devreport maybe", "%devreport takes on, off or status, not 'maybe'"),
        *BAD_GPUMEM_DEVICES,
    ],
)
def test_bad_input_is_one_usage_error(ip, line, message):
    before = dict(ip.user_ns)
    with pytest.raises(UsageError) as err:
        run(ip, line)
    assert type(err.value) is UsageError
    assert str(err.value).startswith(message)
    assert "x" not in ip.user_ns or ip.user_ns["x"] is before.get("x")


def test_a_failing_probe_prints_no_traceback_and_says_what_is_missing(ip, capsys, monkeypatch):
    def broken(*args):
        raise OSError("proc went away")

    monkeypatch.setattr(probes.os, "pread", broken)
    monkeypatch.setattr(probes, "rss_bytes", lambda: None)
    run(ip, "i = 1")
    out = capsys.readouterr()
    assert "host n/a" in out.out
    assert "Traceback" not in out.out + out.err
    assert history(ip)[-1].host_peak_bytes is None


def test_gpumem_says_plainly_when_host_memory_could_not_be_read(ip, capsys, monkeypatch):
    def broken(*args):
        raise OSError("proc went away")

    monkeypatch.setattr(probes.os, "pread", broken)
    monkeypatch.setattr(probes.os, "pwrite", broken)
    monkeypatch.setattr(probes, "rss_bytes", lambda: None)
    run(ip, "%%gpumem --device cpu\ni = 1")
    rows = capsys.readouterr().out.splitlines()
    assert [row.split() for row in rows if row.startswith("host RSS")] == [["host", "RSS", "n/a"]]


def test_a_fault_in_the_reporter_is_one_line(ip, capsys, monkeypatch):
    def boom(self):
        raise RuntimeError("boom")

    monkeypatch.setattr(Meter, "stop", boom)
    run(ip, "j = 1")
    out = capsys.readouterr()
    assert "torch_device_magic could not measure: RuntimeError: boom" in out.out
    assert "Traceback" not in out.out + out.err
    assert ip.user_ns["j"] == 1


def test_an_older_instances_callbacks_are_dropped(ip):
    stale = CellReporter()
    ip.events.register("pre_run_cell", stale.pre_run_cell)
    ip.events.register("post_run_cell", stale.post_run_cell)
    run(ip, "%reload_ext torch_device_magic")
    callbacks = [cb for e in ("pre_run_cell", "post_run_cell") for cb in ip.events.callbacks[e]]
    assert sum(is_ours(cb) for cb in callbacks) == 2
    assert all(cb.__self__ is not stale for cb in callbacks if is_ours(cb))


class CudaSpy:
    """Records every torch.cuda / torch.accelerator function called through the module."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for module in (torch.cuda, torch.accelerator):
            for name in dir(module):
                obj = getattr(module, name)
                if name.startswith("_") or not callable(obj) or isinstance(obj, type(torch)):
                    continue
                monkeypatch.setattr(module, name, self._wrap(f"{module.__name__}.{name}", obj))

    def _wrap(self, name, fn):
        def spy(*args, **kwargs):
            self.calls.append(name)
            return fn(*args, **kwargs)

        return spy


def test_loading_and_reporting_never_ask_cuda(shell, monkeypatch):
    if torch.cuda.is_initialized():
        pytest.skip("this session already uses CUDA")
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.8")  # as a CUDA build
    spy = CudaSpy(monkeypatch)
    run(shell, "%load_ext torch_device_magic")
    run(shell, "x = torch.ones(1000); y = x * 2")
    run(shell, "%%gpumem\nz = x + 1")
    run(shell, "%devhistory")
    run(shell, "%devreport status")
    assert set(spy.calls) <= {"torch.cuda.is_initialized"}
    assert "torch.cuda.is_initialized" in spy.calls  # the guard itself was exercised


@pytest.mark.parametrize(
    ("setting", "status"),
    [("auto_report = False", "per-cell report: off"), ("report_min_seconds = 60.0", "1 min")],
)
def test_report_traits_from_ipython_config(tmp_path, setting, status):
    from test_config_file import run_ipython

    config = (
        'c.InteractiveShellApp.extensions = ["torch_device_magic"]\n'
        f"c.TorchDeviceMagics.{setting}\n"
    )
    out = run_ipython(tmp_path, config, "x = 1\n%devreport status")
    assert status in out
    assert not report_lines(out)


def test_a_cuda_error_at_the_end_of_the_cell_is_always_said(shell, capsys, monkeypatch):
    loaded_with_gpu(shell, monkeypatch, Gpu("A"))
    run(shell, "%config TorchDeviceMagics.report_min_seconds = 60")  # this cell is not slow
    capsys.readouterr()
    run(shell, "machine.sticky = 'an illegal memory access was encountered'")
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) == 1
    assert lines[0].endswith(
        "| a CUDA error surfaced at the end of the cell: "
        "RuntimeError: CUDA error: an illegal memory access was encountered"
    )
    assert "Traceback" not in out.out + out.err
    assert history(shell)[-1].device_error.startswith("RuntimeError: CUDA error")


def test_ctrl_c_during_the_end_of_cell_sync_is_one_line(shell, capsys, monkeypatch):
    loaded_with_gpu(shell, monkeypatch, Gpu("A"))

    def interrupted(self):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(probes.Accelerator, "synchronize", interrupted)
        capsys.readouterr()
        run(shell, "k = 1")
        out = capsys.readouterr()
    assert out.out.splitlines() == [
        "torch_device_magic: interrupted at the end of the cell; not measured"
    ]
    assert "Error in callback" not in out.out + out.err
    assert "Traceback" not in out.out + out.err
    run(shell, "k = 2")  # the next cell is measured again
    assert len(report_lines(capsys.readouterr().out)) == 1


def test_what_a_hint_frees_after_a_failing_cell_is_no_later_cells_change(
    shell, monkeypatch
):
    """An out-of-memory cell's hint releases its traceback's frames after the cell's
    measurement stopped: the 1 GiB they held is freed then, and the next cell, which
    freed nothing, reads no change."""
    loaded_with_gpu(shell, monkeypatch, Gpu("A"))
    run(shell, "def step():\n"
               "    activations = machine.held(0, 2**30)\n"
               "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2 GiB.')")
    InteractiveShell.run_cell(shell, "step()", store_history=True)  # shown, not raised
    run(shell, "x = 1")
    failed, after = history(shell)[-2:]
    assert failed.device_delta_bytes == 2**30  # the frames held it at the cell's end
    assert (after.device_delta_bytes, after.device_peak_bytes) == (0, 0)
    assert shell.user_ns["machine"].stats[0]["allocated"] == 0  # the hint did free it


def test_devreport_is_one_switch_with_auto_report_across_reloads(ip, capsys):
    run(ip, "%config TorchDeviceMagics.auto_report = False")
    run(ip, "%reload_ext torch_device_magic")
    run(ip, "%devreport on")
    run(ip, "%reload_ext torch_device_magic")
    capsys.readouterr()
    run(ip, "m = 1")
    assert len(report_lines(capsys.readouterr().out)) == 1
    run(ip, "%devreport off")
    run(ip, "%reload_ext torch_device_magic")
    capsys.readouterr()
    run(ip, "m = 2")
    assert not report_lines(capsys.readouterr().out)
    run(ip, "%config TorchDeviceMagics.auto_report = True")  # the latest choice wins
    run(ip, "%reload_ext torch_device_magic")  # the reloading cell has its line
    capsys.readouterr()
    run(ip, "m = 3")
    assert len(report_lines(capsys.readouterr().out)) == 1


def test_the_line_starts_a_line_of_its_own(ip, capsys):
    capsys.readouterr()
    run(ip, "print('x', end='')")
    out = capsys.readouterr().out
    assert out.startswith("x\ntime "), out
    run(ip, "print('y')")
    assert capsys.readouterr().out.startswith("y\ntime ")  # no blank line between
    assert "CellReporter" not in getattr(sys.stdout.write, "__qualname__", "")  # unwrapped


def test_a_cell_run_inside_a_cell_reports_the_outer_cell_once(ip, capsys):
    capsys.readouterr()
    before = len(history(ip))
    n = ip.execution_count
    run(ip, "%%capture c\nprint('hi')")
    out = capsys.readouterr().out
    captured = ip.user_ns["c"]  # the inner cell's report is not in what was captured
    assert (captured.stdout, captured.outputs) == ("hi\n", [])
    assert len(report_lines(out)) == 1
    run(ip, "get_ipython().run_cell('a = 1'); get_ipython().run_cell('b = 2')")
    assert len(report_lines(capsys.readouterr().out)) == 1
    cells = [r.cell for r in history(ip)[before:]]
    assert cells == [n, n + 1]


def test_devreport_status_says_that_the_peak_counter_is_reset(ip, capsys):
    run(ip, "%devreport status")
    out = capsys.readouterr().out
    assert "resets torch's process-wide peak memory counter before each cell" in out
    assert "the session's peak is in %devhistory" in out
    run(ip, "%devreport off")
    assert "peak memory counter" not in capsys.readouterr().out  # off, it resets nothing


def test_a_cell_that_ipython_failed_to_finish_does_not_stop_the_report(ip, capsys):
    reporter = magics(ip).reporter
    reporter.pre_run_cell(object())
    reporter.post_run_cell(None)  # what IPython's run_cell sends when its own code raised
    capsys.readouterr()
    run(ip, "n = 1")
    assert len(report_lines(capsys.readouterr().out)) == 1
