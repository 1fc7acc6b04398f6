"""%%profile: the cell runs as a cell, and the report says where its time and memory went.

Shell tests profile tiny cells for real on the CPU (the first capture of a process
pays torch.profiler's own import, a few seconds); the device paths (kernels,
copies, synchronisations, CUPTI refused) are tested on plain events, and on the
fake CUDA machine where torch cannot record CUDA.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys

import pytest
import torch
from fakegpu import FakeMachine, Gpu
from IPython.core.error import UsageError

from torch_device_magic.kineto.analysis import analyse
from torch_device_magic.kineto.events import Event
from torch_device_magic.profile import ProfileReport, recording

SLOW = "big = torch.randn(300, 300) @ torch.randn(300, 300)"


def profile(ip, line: str, cell: str):
    """The cell's value, as the shell would show it in Out[n]."""
    return ip.run_cell(f"%%profile {line}\n{cell}").result


def line_of(report: ProfileReport, code: str):
    return next(r for r in report.lines if r.code == code)


def test_the_cell_runs_as_a_cell_and_the_report_names_its_lines(ip, capsys):
    result = ip.run_cell(f"%%profile\n{SLOW}\nsmall = big.sum()\nsmall.shape")
    assert result.result == torch.Size([])  # Out[n]: the last expression
    assert ip.user_ns["big"].shape == (300, 300) and "small" in ip.user_ns
    out = capsys.readouterr().out
    assert "by line" in out and "top ops by self CPU time" in out and "aten::mm" in out
    assert "slowest: line " in out and "trace /" in out


def test_the_line_table_gives_each_event_to_the_innermost_line(ip):
    report = profile(ip, "-o --steps 0", """def work(n):
    a = torch.randn(n, n) @ torch.randn(n, n)
    return a.sum()
total = 0
for _ in range(3):
    total += float(work(200))
light = torch.ones(2) + 1""")
    inner = line_of(report, "a = torch.randn(n, n) @ torch.randn(n, n)")
    assert inner.where == "2" and inner.hits == 3
    assert inner.allocated_bytes >= 3 * 3 * 200 * 200 * 4  # three 200x200 floats a call
    calls = line_of(report, "total += float(work(200))")
    assert calls.hits == 3 and calls.allocated_bytes < 200 * 200 * 4  # the matmul is not its
    mm = next(r for r in report.ops if r.name == "aten::mm")
    assert mm.calls == 3 and mm.shapes == "(200, 200), (200, 200)"
    assert {e.key: e.count for e in report.profiler.key_averages()}["aten::mm"] == 3  # torch's
    assert "total" in ip.user_ns and ip.user_ns["light"].tolist() == [2.0, 2.0]


def test_f_adds_the_lines_of_a_function_defined_in_another_cell(ip):
    ip.run_cell("def step(x):\n    y = x @ x\n    return y.relu()")
    report = profile(ip, "-o -f step", "out = step(torch.randn(50, 50))")
    where = {r.where for r in report.lines}
    assert any(w.startswith("step (In[") and w.endswith(") 2") for w in where), where
    assert "1" in where  # the cell's own line, which called it


def test_runs_and_warmups_repeat_the_side_effects(ip):
    ip.run_cell("runs = []")
    report = profile(ip, "-o -n 3 --warmup 2", "runs.append(1)\nlen(runs)")
    assert ip.user_ns["runs"] == [1] * 5
    assert report.runs == 3 and line_of(report, "runs.append(1)").hits == 3
    assert report.plain_from == "the last warm-up" and report.plain_wall_s is not None
    assert "3 runs" in report.overview() and "the plain run" in report.overview()


def test_sort_and_top_choose_the_op_table(ip):
    report = profile(ip, "-o --sort memory --top 2",
                     "a = torch.ones(1000)\nb = torch.ones(10) * 2\nc = a.sum()")
    assert len(report.ops) == 2
    assert report.ops[0].allocated_bytes >= 4000 + 40  # ones(1000), ones(10)
    assert report.ops[0].allocated_bytes >= report.ops[1].allocated_bytes
    assert "top ops by memory allocated" in str(report)
    html = report._repr_mimebundle_()["text/html"]  # Jupyter's rendering: the same tables
    assert html.count("<table>") == 2 and "<b>by line" in html and "aten::empty" in html


@pytest.mark.parametrize("line, message", [
    ("-n 0", "-n 1 or more"),
    ("--warmup -1", "--warmup 0 or more"),
    ("--sort fastest", "--sort takes self, total, device, memory, not 'fastest'"),
    ("--top 0", "--top needs 1 or more"),
    ("-f nowhere", "-f nowhere: cannot find it (NameError"),
    ("-f x", "-f x: Tensor is not a Python function"),
    ("--frobnicate", "%%profile: unrecognized arguments: --frobnicate"),
    ("--trace no/such/dir/t.json", "%%profile --trace no/such/dir/t.json: there is no folder "),
    ("--threads --memory", "%%profile --threads --memory: torch records no memory allocations "
                           "while it records every thread"),
])
def test_a_mistake_is_one_usage_error_and_runs_nothing(ip, line, message):
    ip.run_cell("x = torch.ones(2); ran = 0")
    with pytest.raises(UsageError, match=re.escape(message)):
        ip.run_cell(f"%%profile {line}\nran += 1")
    assert ip.user_ns["ran"] == 0
    assert not torch.autograd.profiler._is_profiler_enabled and sys.gettrace() is None


def test_the_trace_is_written_where_asked_and_stamped_rank_0(ip, tmp_path, capsys):
    path = tmp_path / "step.json"
    report = profile(ip, f"-o --trace {path}", "y = torch.ones(3) + 1")
    assert report.trace_path == str(path)
    trace = json.loads(path.read_text())
    assert trace["distributedInfo"]["rank"] == 0  # what Holistic Trace Analysis needs
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::add" in names and any(n and n.startswith("tdm:In[") for n in names)
    profile(ip, "", "y = torch.ones(3) + 1")  # no --trace: a temporary file, shown
    shown = capsys.readouterr().out.split("trace ", 1)[1].split()[0]
    with open(shown) as f:
        assert json.load(f)["distributedInfo"]["world_size"] == 1


def test_a_trace_that_fails_as_it_is_written_is_a_note_and_the_cell_still_ran(
    ip, tmp_path, monkeypatch
):
    def full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(recording.Pieces, "export_chrome_trace", full)
    report = profile(ip, f"-o --trace {tmp_path}/t.json", "made = torch.ones(2)")
    assert report.trace_path is None and "made" in ip.user_ns
    assert (f"the trace could not be written to {tmp_path}/t.json: No space left on device"
            in str(report))


@pytest.mark.parametrize("error", [ZeroDivisionError, KeyboardInterrupt])
def test_a_cell_that_raises_shows_its_traceback_and_a_partial_profile(ip, capsys, error):
    raising = "1 / 0" if error is ZeroDivisionError else "raise KeyboardInterrupt"
    with pytest.raises(error) as caught:
        ip.run_cell(f"%%profile --memory\nbefore = torch.ones(5) * 2\n{raising}\nafter = 1")
    tb = caught.value.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_lineno == 2 and tb.tb_frame.f_code.co_filename.startswith("<ipython-input-")
    out = capsys.readouterr().out
    why = "interrupted" if error is KeyboardInterrupt else "the cell raised ZeroDivisionError"
    assert f"PARTIAL: {why}" in out and "aten::mul" in out and "memory timeline of cpu" in out
    assert "before" in ip.user_ns and "after" not in ip.user_ns
    assert not torch.autograd.profiler._is_profiler_enabled and sys.gettrace() is None
    assert profile(ip, "-o", "z = 1").lines  # and the next capture works


def test_profile_under_profile_and_under_a_running_profiler_are_refused(ip):
    with pytest.raises(UsageError, match="cannot run inside %%profile"):
        ip.run_cell("%%profile\nget_ipython().run_cell_magic('profile', '', 'x = 1')")
    assert not torch.autograd.profiler._is_profiler_enabled
    with pytest.raises(UsageError, match=r"a torch\.profiler is already recording"):
        ip.run_cell("with torch.profiler.profile():\n"
                    "    get_ipython().run_cell_magic('profile', '', 'x = 1')")
    assert sys.gettrace() is None


def test_kinetos_lines_do_not_reach_the_output_but_the_cells_own_do(ip, capfd):
    ip.run_cell("import os")
    profile(ip, "", "os.write(2, b'the cell wrote this\\n')\ny = torch.ones(2) + 1")
    err = capfd.readouterr().err
    assert "the cell wrote this" in err
    assert "profiler_start" not in err and "profiler_stop" not in err
    assert "Memory block of unknown size" not in err


def test_a_cuda_builds_no_gpu_line_is_kept_out_and_other_lines_pass(capfd):
    """What torch 2.13's CUDA build printed at its profiler's first stop on a machine with no
    GPU (seen on the CPU machine, Python 3.12): dropped; any other line passes."""
    from torch_device_magic.profile.stderr import quiet_stderr

    heard: list[str] = []
    with quiet_stderr(heard):
        os.write(2, b"ERROR:2026-12-07 21:00:25 9441:9441 DeviceProperties.cpp:50] "
                    b"gpuGetDeviceCount failed with code 35\nsomething else\n")
    err = capfd.readouterr().err
    assert "gpuGetDeviceCount" not in err and "something else" in err
    assert "gpuGetDeviceCount" in heard[0]


def test_five_captures_of_one_cell_agree(ip):
    # What is deterministic must be equal (no timing is asserted: the machine is shared);
    # each capture's lines account for its own wall, not a shifted one.
    ip.run_cell("w = torch.randn(64, 64)")
    reports = [profile(ip, "-o --steps 0", "for _ in range(20):\n    y = (w @ w).relu()")
               for _ in range(5)]
    tables = [{r.name: (r.calls, r.allocated_bytes, r.shapes) for r in rep.ops} for rep in reports]
    assert all(t == tables[0] for t in tables)
    assert tables[0]["aten::mm"] == (20, 20 * 64 * 64 * 4, "(64, 64), (64, 64)")
    for rep in reports:
        assert line_of(rep, "y = (w @ w).relu()").hits == 20
        assert 0 < sum(r.wall_s for r in rep.lines) <= rep.wall_s


@pytest.mark.parametrize("output", ["", "-o"])
def test_the_profile_keeps_no_tensor_of_the_cell_alive(ip, output):
    ip.run_cell("import weakref\nt = torch.ones(1000)\nseen = weakref.ref(t)")
    ip.run_cell(f"%%profile {output}\ny = t * 2\ny.sum()")
    ip.run_cell("del t, y")
    gc.collect()
    assert ip.user_ns["seen"]() is None


def test_the_report_line_says_profiled_and_the_overview_compares_with_a_plain_run(ip, capsys):
    for _ in range(2):  # the second run is warm (test_profile_coverage: the first is not)
        ip.run_cell("y = torch.ones(3) + 1", store_history=True)
    capsys.readouterr()
    ip.run_cell("%%profile\ny = torch.ones(3) + 1", store_history=True)
    out = capsys.readouterr().out
    assert "(profiled) |" in out.splitlines()[-1]  # the per-cell line, after the profile
    assert "x the plain run (" in out and ", In[" in out


def test_on_a_gpu_without_recorded_activity_there_is_one_line_and_no_device_column(
    ip, monkeypatch
):
    # The fake machine has CUDA up, but this torch cannot record CUDA: as where CUPTI
    # is missing, the overview says so once and every table is the CPU's.
    machine = FakeMachine([Gpu()]).install(monkeypatch)
    machine.start_cuda()
    report = profile(ip, "-o --sort device", "y = torch.ones(3) + 1")
    assert not report.analysis.device_recorded
    text = str(report)
    assert "the device's activity could not be recorded" in text
    assert "device" not in report.tables()[2].headers  # the op table: no column of zeros
    assert "--sort device: no device activity was recorded" in text
    assert all(r.device_s is None for r in report.lines + report.ops)


def test_a_cell_that_starts_cuda_is_told_its_device_side_is_missing(ip, monkeypatch):
    machine = FakeMachine([Gpu()]).install(monkeypatch)
    ip.user_ns["machine"] = machine
    report = profile(ip, "-o", "machine.start_cuda()")
    assert "CUDA started in this cell, after recording began" in str(report)
    # issue 36, 6: both ways of running it again repeat its side effects, and it says so
    assert any("(run the cell again, or --warmup 1, which runs it once more first: either way "
               "a training cell trains once more)" in n for n in report.notes)
    assert not report.analysis.device_recorded
    assert "CUDA started" not in str(profile(ip, "-o", "y = 1"))  # the next cell records it


def test_memory_draws_the_cells_memory_over_time_labelled_by_line(ip):
    report = profile(ip, "-o --memory",
                     "big = torch.ones(2**20)\nsmall = torch.ones(10)\ndel big")
    timeline = report.timeline
    assert timeline.device == "cpu" and timeline.peak_bytes - timeline.start_bytes >= 4 * 2**20
    assert (timeline.largest[0].line, timeline.largest[0].bytes) == (1, 4 * 2**20)
    assert timeline.largest[0].text == "big = torch.ones(2**20)"
    assert "memory timeline of cpu" in str(report)
    assert "<svg" in report._repr_mimebundle_()["text/html"]  # drawn inline, no network
    assert profile(ip, "-o", "y = torch.ones(3)").timeline is None  # only when asked


# --- the device side, on plain events ---------------------------------------------------


def _gpu_step() -> tuple[list[Event], dict[str, tuple[str, str]]]:
    """A line that launches a matmul kernel, and a loop line that calls .item() 3 times."""
    line1, line2 = "tdm:In[1] 1: y = x @ x", "tdm:In[1] 2: for ...: s += y.sum().item()"
    events = [
        Event(line1, "line", 0, 100),
        Event("aten::mm", "op", 10, 90, correlation=1, shapes=((64, 64), (64, 64))),
        Event("cudaLaunchKernel", "runtime", 20, 30, linked=1),
        Event("sgemm_kernel", "kernel", 40, 400, linked=1),
        Event("[memory]", "memory", 15, nbytes=16384, on_device=True),
        Event("Memcpy HtoD (Pageable -> Device)", "memcpy", 0, 20, nbytes=4096),
    ]
    for i in range(3):
        t = 100 + 100 * i
        events += [
            Event(line2, "line", t, t + 100),
            Event("aten::item", "op", t + 10, t + 90, correlation=10 + i),
            Event("aten::_local_scalar_dense", "op", t + 20, t + 80, correlation=20 + i),
            Event("cudaMemcpyAsync", "runtime", t + 30, t + 40, linked=20 + i),
            Event("cudaStreamSynchronize", "runtime", t + 40, t + 70, linked=20 + i),
            Event("Memcpy DtoH (Device -> Pageable)", "memcpy", 410 + t, 420 + t,
                  linked=20 + i, nbytes=4),
        ]
    names = {line1: ("1", "y = x @ x"), line2: ("2", "for ...: s += y.sum().item()")}
    return events, names


def test_the_device_figures_come_from_kernels_copies_and_synchronisations():
    events, names = _gpu_step()
    a = analyse(events, names, device_in_use=True)
    assert a.device_recorded and a.launches == 1 and a.syncs == 3
    assert (a.copies, a.copy_bytes) == (4, 4096 + 3 * 4)
    assert a.device_busy_s == pytest.approx((20 + 360 + 3 * 10) / 1e9)
    [kernel] = [k for k in a.kernels if k.name == "sgemm_kernel"]
    assert kernel.launched_by == "aten::mm" and kernel.device_s == pytest.approx(360e-9)
    first = next(r for r in a.lines if r.where == "1")
    assert first.device_s == pytest.approx(380e-9)  # the kernel and the copy in its time
    assert first.allocated_bytes == 16384
    assert a.stalls == [".item() 3 times on line 2 (a loop: each waits for the device)"]


def test_the_report_on_a_gpu_has_device_columns_and_a_kernel_table():
    events, names = _gpu_step()
    a = analyse(events, names, device_in_use=True)
    report = ProfileReport("In[1]", 1, 1e-6, None, a, "/tmp/t.json")
    overview, lines, ops, kernels = report.tables()
    assert not any(t.title.startswith("PARTIAL") for t in report.tables())
    assert "1 kernel launch" in overview.title and "4 host-device copies" in overview.title
    assert "3 synchronisations" in overview.title
    assert "stall: .item() 3 times on line 2" in overview.text()
    assert "device" in lines.headers and "device" in ops.headers
    assert kernels.rows[0][0] == "sgemm_kernel" and kernels.rows[0][3] == "aten::mm"


def test_once_a_run_is_not_a_stall():
    events, names = _gpu_step()
    assert analyse(events, names, runs=3, device_in_use=True).stalls == []
    assert analyse(events, names).stalls == []  # on the CPU, .item() waits for nothing


@pytest.fixture(autouse=True)
def _nothing_left_recording():
    yield
    assert not torch.autograd.profiler._is_profiler_enabled
    assert sys.gettrace() is None


def test_on_another_accelerator_an_item_in_a_loop_is_named(ip, tdmdev):
    # tdmdev records no device activity, but its .item() waits for the device all the same.
    ip.run_cell("t = torch.ones(4, device='tdmdev:0')")
    report = profile(ip, "-o --steps 0", "s = 0.0\nfor _ in range(3):\n    s += t.sum().item()")
    assert report.measurement.device == "tdmdev:0" and not report.analysis.device_recorded
    assert report.analysis.stalls == [
        ".item() 3 times on line 3 (a loop: each waits for the device)"]
    assert ip.user_ns["s"] == 12.0


# --- on a GPU (scripts/gpu-check) ------------------------------------------------------------


@pytest.mark.cuda
def test_on_a_gpu_the_kernels_the_device_column_and_a_stall_in_a_loop(ip):
    ip.run_cell("x = torch.randn(256, 256, device='cuda')")  # CUDA up before the capture
    report = profile(ip, "-o", "y = x @ x\ns = 0.0\nfor _ in range(5):\n    s += y.sum().item()")
    a = report.analysis
    assert a.device_recorded and a.launches >= 6 and a.kernels
    assert a.syncs >= 5 and any(".item() 5 times on line 4" in s for s in a.stalls)
    assert line_of(report, "y = x @ x").device_s > 0
    assert 0 < a.device_busy_s <= report.wall_s


@pytest.mark.cuda
def test_on_a_gpu_five_captures_agree(ip):
    # torch issue 175790: device activity drifts in captures after the first.
    ip.run_cell("w = torch.randn(1024, 1024, device='cuda'); torch.cuda.synchronize()")
    reports = [profile(ip, "-o", "for _ in range(10):\n    y = w @ w") for _ in range(5)]
    device = sorted(sum(k.device_s for k in rep.kernels) for rep in reports)
    assert device[-1] < 1.5 * device[0]
    walls = [line_of(rep, "y = w @ w").device_s for rep in reports]
    assert all(0 < d <= rep.wall_s for d, rep in zip(walls, reports))


@pytest.mark.cuda
def test_on_a_gpu_memory_comes_from_the_allocators_history(ip):
    from torch_device_magic.profile.memtimeline import CUDA_SOURCE

    ip.run_cell("x = torch.randn(1024, 1024, device='cuda')")
    report = profile(ip, "-o --memory", "y = x @ x\nz = y.relu()")
    timeline = report.timeline
    assert timeline.source == CUDA_SOURCE and timeline.device.startswith("cuda")
    assert {a.line for a in timeline.largest} >= {1, 2} and timeline.snapshot_path
