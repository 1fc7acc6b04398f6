"""%%profile's cost in memory and disk: nothing of a capture outlives the cell unless -o
asked for it, unnamed traces do not pile up, and a long loop is recorded in full only
for its first steps while its lines are timed over all of them."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import weakref

import pytest
import torch
from IPython.core.error import UsageError
from pythonpath import child_env

from torch_device_magic.kineto.analysis import analyse
from torch_device_magic.profile import ProfileReport, capture, lines, tables

LOOP = ("w = torch.ones(8, 8)\n"
        "for i in range({n}):\n    y = (w @ w).relu()\n    z = y.sum()\ndone = i")



@pytest.fixture
def profilers(monkeypatch):
    """Weak references to each torch profiler %%profile makes, and to its record."""
    made: list[weakref.ref] = []
    real = capture._profiler

    def spy(*args, **kwargs):
        prof = real(*args, **kwargs)
        made.append(weakref.ref(prof))
        return prof

    monkeypatch.setattr(capture, "_profiler", spy)
    return made


@pytest.fixture
def no_gc(ip):
    """No garbage collection runs: what is freed is freed by reference counting.

    A first capture runs before: torch's first profile imports inductor, whose import
    leaves cycles through the frames below it for the collector to free."""
    ip.run_cell("%%profile\nx = 1")
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.fixture
def temp_dir(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def traces_in(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("tdm-profile-*"))


@pytest.fixture
def sessions(monkeypatch):
    """Weak references to each session torch's profilers record (each holds its kineto
    record): a `torch.autograd.profiler.profile`, one a start."""
    made: list[weakref.ref] = []
    real = torch.autograd.profiler.profile.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(torch.autograd.profiler.profile, "__init__", spy)
    return made


@pytest.mark.parametrize("cell", [
    "y = torch.ones(3) + 1",  # no loop
    "w = torch.ones(8, 8)\nfor i in range(3):\n    y = w @ w",  # a loop, recorded in full
    LOOP.format(n=40) + "\nfor j in range(40):\n    y = w + j",  # windowed: several sessions
    "w = torch.ones(8, 8)\nfor i in range(40):\n    y = w @ w\n    if i == 20:\n"
    "        1 / 0",  # raises in a windowed loop: its traceback is kept (sys.last_traceback)
], ids=["plain", "loop", "windowed", "raises"])
def test_nothing_of_the_capture_outlives_the_cell_without_a_garbage_collection(
    ip, profilers, no_gc, sessions, cell
):
    with contextlib.suppress(ZeroDivisionError):
        ip.run_cell("%%profile\n" + cell)
    ip.run_cell("a = 1")
    ip.run_cell("b = 2")
    assert profilers and profilers[-1]() is None  # torch's profiler
    assert sessions and not [s for s in sessions if s() is not None]  # nor kineto's records


def test_with_o_the_report_holds_the_profiler_until_it_goes(ip, profilers, no_gc):
    ip.run_cell("report = get_ipython().run_cell_magic('profile', '-o', 'y = torch.ones(3) + 1')")
    assert profilers[-1]() is ip.user_ns["report"].profiler  # for key_averages()
    del ip.user_ns["report"]
    assert profilers[-1]() is None


def test_only_the_last_unnamed_trace_is_kept_and_unload_deletes_it(ip, temp_dir, capsys):
    named = temp_dir / "mine.json"
    ip.run_cell(f"%%profile --trace {named}\ny = torch.ones(3) + 1")
    paths = []
    for _ in range(3):
        paths.append(profile_o(ip, "y = torch.ones(3) + 1").trace_path)
        assert traces_in(temp_dir) == [os.path.basename(paths[-1])]
    assert len(set(paths)) == 3
    ip.run_cell("%%profile\ny = torch.ones(3) + 1")
    assert "(until the next %%profile)" in capsys.readouterr().out
    ip.run_line_magic("unload_ext", "torch_device_magic")
    assert traces_in(temp_dir) == [] and named.exists()  # the user's own file stays


def test_no_unnamed_trace_is_left_after_the_interpreter_exits(tmp_path):
    script = textwrap.dedent("""
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config
        config = Config()
        config.HistoryManager.hist_file = ":memory:"
        ip = InteractiveShell.instance(config=config)
        ip.run_cell("%load_ext torch_device_magic")
        for _ in range(2):
            ip.run_cell("%%profile\\nimport torch\\ny = torch.ones(3) + 1").raise_error()
        import glob, tempfile
        print(len(glob.glob(tempfile.gettempdir() + "/tdm-profile-*")))
    """)
    done = subprocess.run([sys.executable, "-c", script], env=child_env(TMPDIR=str(tmp_path)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "1"  # while it ran: the last one
    assert traces_in(tmp_path) == []


def profile_o(ip, cell: str, line: str = "") -> ProfileReport:
    return ip.run_cell(f"%%profile -o {line}\n{cell}").result


def calls(report: ProfileReport, op: str) -> int:
    return next((r.calls for r in report.analysis.ops if r.name == op), 0)


def row(report: ProfileReport, code: str):
    return next(r for r in report.lines if r.code == code)


def test_a_long_loop_is_recorded_up_to_a_bound_and_its_lines_timed_over_every_step(ip):
    short, long = (profile_o(ip, LOOP.format(n=n)) for n in (200, 2000))
    assert short.analysis.op_calls == long.analysis.op_calls > 0  # bounded, not per step
    assert 0 < long.trace_bytes < 1.5 * short.trace_bytes  # the last one only is kept
    for report, n in ((short, 200), (long, 2000)):
        assert (report.steps, report.full_steps) == (n, 5)
        assert report.loops == [lines.LoopSteps("2", [n])]
        assert row(report, "y = (w @ w).relu()").hits == n
        assert row(report, "done = i").hits == 1  # after the loop
        assert sum(r.wall_s for r in report.lines) <= report.wall_s
        assert f"steps 1–6 (of {n:,}) of the loop on line 2" in report.overview()
    assert calls(long, "aten::mm") == 6  # steps 1 to 6
    assert ip.user_ns["done"] == 1999


def test_the_code_before_and_after_a_loop_is_recorded_in_full(ip):
    report = profile_o(ip, "before = torch.ones(8, 8) @ torch.ones(8, 8)\n"
                           "for i in range(40):\n    y = torch.ones(3) + i\n"
                           "after = torch.zeros(4)")
    assert calls(report, "aten::mm") == 1 and calls(report, "aten::zeros") == 1
    assert calls(report, "aten::add") == 6  # the loop's steps 1 to 6 only
    assert row(report, "before = torch.ones(8, 8) @ torch.ones(8, 8)").cpu_s > 0
    assert row(report, "after = torch.zeros(4)").cpu_s > 0


def test_each_top_level_loop_is_windowed_on_its_own_and_its_steps_said(ip):
    report = profile_o(ip, "for p in range(7):\n    a = torch.zeros(2)\n"
                           "for i in range(40):\n    b = torch.ones(2)")
    assert calls(report, "aten::zeros") == calls(report, "aten::ones") == 6
    assert report.loops == [lines.LoopSteps("1", [7]), lines.LoopSteps("3", [40])]
    assert row(report, "b = torch.ones(2)").cpu_s > 0  # the second loop is recorded too
    assert ("steps 1–6 (of 7) of the loop on line 1, 1–6 (of 40) of the loop on line 3"
            in report.overview())
    short = profile_o(ip, "for p in range(3):\n    a = torch.zeros(2)\n"
                          "for i in range(40):\n    b = torch.ones(2)")
    assert "all 3 of the loop on line 1, 1–6 (of 40)" in short.overview()


def test_each_run_of_n_is_windowed_alike(ip):
    report = profile_o(ip, LOOP.format(n=20), "-n 3")
    assert calls(report, "aten::mm") == 3 * 6
    assert report.loops == [lines.LoopSteps("2", [20, 20, 20])]
    assert ("steps 1–6 of each of 3 runs (20 each, 60 in all) of the loop on line 2"
            in report.overview())
    ip.user_ns["k"] = 10  # runs of different lengths: their total only
    report = profile_o(ip, "k += 10\nfor i in range(k):\n    y = torch.ones(2)", "-n 2")
    assert report.loops == [lines.LoopSteps("2", [20, 30])]
    assert "steps 1–6 of each of 2 runs (50 in all) of the loop on line 2" in report.overview()


def test_a_lines_first_run_is_recorded_wherever_it_falls(ip):
    report = profile_o(ip, "for i in range(300):\n    y = torch.ones(3) + 1\n"
                           "    if i % 100 == 99:\n        late = torch.zeros(5)")
    assert row(report, "late = torch.zeros(5)").hits == 3
    assert calls(report, "aten::zeros") == 1  # its first run, at step 100
    assert row(report, "late = torch.zeros(5)").cpu_s > 0
    assert calls(report, "aten::add") == 6


def test_the_profilers_own_stops_and_starts_are_charged_to_no_line(ip, monkeypatch):
    real = torch.profiler.profiler._KinetoProfile.stop_trace

    def slow_stop(self):  # a stop that reads many events
        time.sleep(0.3)
        real(self)

    monkeypatch.setattr(torch.profiler.profiler._KinetoProfile, "stop_trace", slow_stop)
    report = profile_o(ip, "total = 0\nfor i in range(50):\n    total += i\n"
                           "    y = torch.ones(2)\nafter = torch.zeros(2)")
    assert max(r.wall_s for r in report.lines) < 0.2
    assert report.analysis.recorded_s is not None and report.analysis.recorded_s < 0.2


def test_the_rules_set_the_recorded_steps_against_the_recorded_wall(ip):
    report = profile_o(ip, textwrap.dedent("""\
        import time
        from torch.utils.data import DataLoader, Dataset
        class Slow(Dataset):
            def __len__(self):
                return 200
            def __getitem__(self, i):
                time.sleep(0.002)
                return i
        total = 0
        for batch in DataLoader(Slow(), batch_size=1):
            time.sleep(0.002)  # a step as long as the loading: workers overlap them
            total += int(batch)"""))
    [pipe] = [a for a in report.advice if a.rule == "input pipeline"]
    assert pipe.line == "10" and pipe.figure > 0.3  # of the recorded wall: about half
    assert report.analysis.recorded_s < report.wall_s / 5


def test_a_leading_blank_line_does_not_shift_the_line_numbers(ip):
    report = profile_o(ip, "\n\ny = torch.ones(2)\nfor i in range(10):\n    z = y + i")
    assert [(r.where, r.code) for r in report.lines][:2] == [
        ("3", "y = torch.ones(2)"), ("4", "for i in range(10):")]
    assert report.loops == [lines.LoopSteps("4", [10])]


def test_the_pointer_to_more_steps_says_their_cost_and_bounds_it(ip, monkeypatch):
    report = profile_o(ip, LOOP.format(n=200))
    [note] = [n for n in report._line_table().notes if "--steps" in n]
    per_step = report.step_events / 6
    assert 0 < report.step_events < report.events  # the code outside the loop is not a step's
    assert f"about {per_step:,.0f} events a step" in note
    assert f"every step would be about {report.events + per_step * 194:,.0f} events" in note
    assert note.endswith("--steps 0")
    bound = int(per_step * 50)
    monkeypatch.setattr(tables, "FULL_EVENTS", bound)
    [note] = [n for n in report._line_table().notes if "--steps" in n]
    fits = int((bound - (report.events - report.step_events)) / per_step) - 1
    assert note.endswith(f"too many, --steps {fits} stays within {bound:,}")
    assert "--steps 0" not in note


def every_step(report: ProfileReport) -> int:
    """The events the line table says --steps 0 would record."""
    [note] = [n for n in report._line_table().notes if "--steps" in n]
    return int(re.search(r"every step would be about ([\d,]+) events", note)[1].replace(",", ""))


@pytest.mark.parametrize("outside", [
    "rows = [torch.randn(8) for _ in range(2000)]\n",  # recorded in full: no step's
    "for p in range(7):\n    q = torch.ones(2) * p\n",  # a short loop, recorded in full
], ids=["code before the loop", "a short loop before it"])
def test_the_cost_of_every_step_is_counted_from_the_windowed_steps_alone(ip, outside):
    """Issue 29, point 17: the events a step are the windowed steps' own, so the estimate
    is what --steps 0 records, whatever the code outside the loop records in full."""
    cell = outside + LOOP.format(n=100)
    profile_o(ip, cell)  # each run below then frees what a profiled run made: recorded
    estimate = every_step(profile_o(ip, cell))
    assert estimate == pytest.approx(profile_o(ip, cell, "--steps 0").events, rel=0.1)


def test_steps_sets_the_bound_and_0_records_every_step(ip):
    assert calls(profile_o(ip, LOOP.format(n=50), "--steps 2"), "aten::mm") == 3
    every = profile_o(ip, LOOP.format(n=50), "--steps 0")
    assert calls(every, "aten::mm") == 50
    assert every.full_steps == 0 and "in full" not in every.overview()


def test_a_loop_within_the_bound_is_recorded_in_full(ip):
    for n in (1, 3, 6):
        report = profile_o(ip, LOOP.format(n=n))
        assert calls(report, "aten::mm") == n and calls(report, "aten::ones") == 1
        assert report.full_steps == 0 and "in full" not in str(report)


def test_a_negative_steps_is_one_usage_error_and_runs_nothing(ip):
    with pytest.raises(UsageError, match="--steps needs 1 or more"):
        ip.run_cell("%%profile --steps -1\nran = 1")
    assert "ran" not in ip.user_ns


def test_the_outer_loops_are_found_outside_functions_and_other_loops():
    source = textwrap.dedent("""\
        x = 1
        for i in range(3):
            for j in range(2):
                pass
            y = i
        if x:
            while x < 3:
                x += 1
        def f():
            for k in range(2):
                pass
        with open(__file__) as fh:
            for line in fh:
                pass
    """)
    assert lines.outer_loops(source) == {2: range(3, 6), 7: range(8, 9), 13: range(14, 15)}
    assert lines.outer_loops("%time x = 1") == {}  # not Python: recorded in full


def test_a_large_trace_has_its_size_in_the_overview():
    report = ProfileReport("In[1]", 1, 1.0, None, analyse([]), "/tmp/t.json",
                           trace_bytes=300 * 2**20, trace_temporary=True)
    assert "trace /tmp/t.json (300.0 MiB, until the next %%profile)" in report.overview()
    report.trace_bytes, report.trace_temporary = 2**20, False
    assert report.overview().endswith("trace /tmp/t.json")


def test_a_forked_child_that_exits_leaves_the_kept_trace(ip, temp_dir):
    path = profile_o(ip, "y = torch.ones(3) + 1").trace_path
    traces = ip.magics_manager.registry["TorchDeviceMagics"].traces
    child = os.fork()
    if child == 0:  # what the child's exit would run of ours (sys.exit in an os.fork child)
        try:
            traces._exit()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert os.path.exists(path)
    traces._exit()  # the session's own exit
    assert not os.path.exists(path)


def test_a_loop_that_raises_after_its_recorded_steps_shows_them_and_stops_cleanly(ip, capsys):
    ip.run_cell("w = torch.ones(8, 8)")
    with pytest.raises(ValueError, match="step 40"):
        ip.run_cell("%%profile\nfor i in range(50):\n    y = (w @ w).relu()\n"
                    "    if i == 40:\n        raise ValueError('step 40')")
    out = capsys.readouterr().out
    assert "PARTIAL: the cell raised ValueError" in out
    assert "steps 1–6 (of 41) of the loop on line 1" in out
    assert not torch.autograd.profiler._is_profiler_enabled and sys.gettrace() is None
    assert profile_o(ip, LOOP.format(n=20)).full_steps == 5  # and the next one works


def test_a_resume_that_torch_refuses_leaves_its_flag_off_and_the_next_profile_works(
        ip, monkeypatch):
    """torch sets its 'a profiler is on' flag before kineto starts: a resume mid-cell that
    kineto refuses must not leave it on, or every later %%profile is refused."""
    real, starts = torch.autograd.profiler.profile._start_trace, []

    def refuse_the_second(self):
        starts.append(1)
        if len(starts) == 2:
            torch.autograd.profiler._is_profiler_enabled = True  # as torch's own does first
            raise RuntimeError("kineto refused a second session")
        return real(self)

    monkeypatch.setattr(torch.autograd.profiler.profile, "_start_trace", refuse_the_second)
    profile_o(ip, LOOP.format(n=20))
    assert len(starts) >= 2 and not torch.autograd.profiler._is_profiler_enabled
    monkeypatch.undo()
    assert profile_o(ip, LOOP.format(n=20)).full_steps == 5


def test_memory_draws_the_recorded_steps_of_a_long_loop(ip):
    report = profile_o(ip, LOOP.format(n=50), "--memory")
    assert report.full_steps == 5 and report.timeline is not None
    assert not any("could not" in note for note in report.notes)


def test_an_unnamed_trace_that_cannot_be_written_leaves_no_file(ip, temp_dir, monkeypatch):
    def refuse(self, path, *args, **kwargs):
        raise RuntimeError("kineto refused")

    monkeypatch.setattr(torch.autograd.profiler.profile, "export_chrome_trace", refuse)
    report = profile_o(ip, "made = torch.ones(2)")
    assert report.trace_path is None and "kineto refused" in str(report)
    assert traces_in(temp_dir) == [] and "made" in ip.user_ns


def test_the_device_busy_share_is_of_the_wall_the_events_cover():
    """Rule 2 and the overview set the recorded device time against the recorded wall."""
    from torch_device_magic.advice.profile_rules import Setting, advise
    from torch_device_magic.kineto.events import Event

    kernel = Event("gemm", "kernel", 0, 800_000_000)  # 0.8 s busy in 1 s recorded of 10 s
    analysis = analyse([kernel])
    analysis.recorded_s = 1.0
    report = ProfileReport("In[1]", 1, 10.0, None, analysis, None)
    assert "busy 800.0 ms (80% of the recorded wall)" in report.overview()
    assert not any(a.rule.startswith("device waits")
                   for a in advise([kernel], analysis, {}, Setting(wall_s=10.0)))


def test_the_cpu_threads_share_is_of_the_wall_the_events_cover():
    """Rule 7 sets torch's recorded CPU ops against the recorded wall, as rule 2 does."""
    from torch_device_magic.advice.profile_rules import Setting, advise
    from torch_device_magic.kineto.events import Event

    op = Event("aten::mm", "op", 0, 800_000_000)  # 0.8 s of ops in 1 s recorded of 10 s
    analysis = analyse([op])
    analysis.recorded_s = 1.0
    [got] = [a for a in advise([op], analysis, {}, Setting(wall_s=10.0, cores=8, threads=1))
             if a.rule == "CPU threads"]
    assert got.text.startswith("torch's CPU ops took 80% of the wall on 1 thread, far below")
    analysis.recorded_s = None  # everything recorded: the cell's own wall
    assert not any(a.rule == "CPU threads" for a in advise(
        [op], analysis, {}, Setting(wall_s=10.0, cores=8, threads=1)))


def test_a_cells_own_profiler_past_the_window_is_left_alone(ip, capsys):
    ip.run_cell("%%profile\nfor i in range(20):\n    y = torch.ones(2) + i\n    if i == 15:\n"
                "        with torch.profiler.profile() as own:\n            z = torch.zeros(3)")
    assert "the cell's own torch.profiler ended this recording" in capsys.readouterr().out
    assert any(e.key == "aten::zeros" for e in ip.user_ns["own"].key_averages())
    assert not torch.autograd.profiler._is_profiler_enabled
    assert profile_o(ip, LOOP.format(n=20)).full_steps == 5  # and the next one works


def test_the_trace_holds_every_recorded_session_and_a_gz_name_is_gzipped(ip, tmp_path):
    import gzip
    import json

    path = tmp_path / "loop.json.gz"
    profile_o(ip, "a = torch.zeros(2)\nfor i in range(20):\n    y = torch.ones(2)\n"
                  "b = torch.empty(2)", f"--trace {path}")
    with gzip.open(path, "rt") as f:
        names = [e.get("name") for e in json.load(f)["traceEvents"]]
    assert {"aten::zeros", "aten::empty"} <= set(names)  # before the loop, and after it
    assert names.count("aten::ones") == 6


def test_a_pause_on_cuda_waits_for_the_kernels_the_session_launched(ip, monkeypatch):
    from fakegpu import FakeMachine, Gpu

    machine = FakeMachine([Gpu()]).install(monkeypatch)
    machine.start_cuda()

    def syncs(steps: int) -> int:
        before = len(machine.calls)
        profile_o(ip, LOOP.format(n=steps))
        return sum(1 for call in machine.calls[before:] if call[0] == "synchronize")

    assert syncs(20) == syncs(3) + 1  # the one pause, past step 6
