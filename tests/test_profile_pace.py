"""%%profile at the plain loop's pace (issue 38): what the cheaper tracer still covers, and
the one-time start of torch's profiler said where it happened."""

from __future__ import annotations

import json
import re
import sys
import threading

import pytest
from kernel import execute, notebook, texts

from torch_device_magic.profile import reading

FIRST = "torch's profiler starting for the first time in this kernel"

WINDOWED = """w = torch.ones(8, 8)
def inner(k):
    return [k + j for j in range(3)]
for i in range(300):
    y = (w @ w).relu()
    if i % 3 == 0:
        v = inner(i)
    t = helper(y)
done = [i for i in range(4)]"""

HELPER = """def helper(y):
    s = y.sum()
    return s"""


def rows(report):
    return {r.code: r for r in report.lines}


def test_every_line_past_the_steps_window_keeps_its_hits(ip):
    """Past the window the lines are not timed but their hits are counted: every line of
    every step, a function of the cell and an -f function included, and a line after the
    loop, timed again; the report says where the wall was sampled."""
    ip.run_cell("import torch")
    ip.run_cell(HELPER)
    report = ip.run_cell(f"%%profile -o -f helper\n{WINDOWED}").result
    got = rows(report)
    assert report.loops[0].steps == [300] and report.full_steps == 5
    assert got["y = (w @ w).relu()"].hits == 300
    assert got["if i % 3 == 0:"].hits == 300
    assert got["v = inner(i)"].hits == 100
    # the line's own event and its comprehension's (a code object of its own in 3.11)
    assert got["return [k + j for j in range(3)]"].hits == 500
    assert got["s = y.sum()"].hits == got["return s"].hits == 300
    assert got["done = [i for i in range(4)]"].hits == 6
    assert all(r.wall_s > 0 for r in got.values())
    assert sum(r.wall_s for r in report.lines) <= report.wall_s
    assert ip.user_ns["done"] == [0, 1, 2, 3]
    assert any(n.startswith(PAST) for n in report.notes)


PAST = "lines' wall past the recorded steps (their hits counted there): "


def test_a_line_past_the_window_has_its_sampled_share_of_the_wall(ip):
    """A loop whose one line takes nearly all of each step: past the window the samples
    give that line most of the wall, the note says how many samples there were, and the
    lines' wall adds up to no more than the cell's."""
    ip.run_cell("import torch\na = torch.ones(200, 200)")
    report = ip.run_cell("%%profile -o\nfor i in range(100):\n    b = a @ a @ a @ a\n"
                         "    c = i + 1").result
    got = rows(report)
    (note,) = [n for n in report.notes if n.startswith(PAST)]
    assert re.search(r": from [\d,]+ samples? of the main thread, one every 5 ms", note)
    assert got["b = a @ a @ a @ a"].hits == got["c = i + 1"].hits == 100
    assert got["b = a @ a @ a @ a"].wall_s > 10 * got["c = i + 1"].wall_s
    assert sum(r.wall_s for r in report.lines) <= report.wall_s


def test_lines_after_the_loop_and_a_first_run_past_the_window_are_timed_exactly(ip):
    """Past the window a line never run before is timed (and recorded) for its first run,
    a function first called there (from a line that ran before) too, and the recording
    pauses again after it; once the loop ends, the lines after it are timed again, a
    second loop's steps within the window exactly."""
    ip.run_cell("import torch\ndef late(x):\n    return x * 2\nearly = lambda x: x")
    report = ip.run_cell(
        "%%profile -o -f late\nw = torch.ones(4)\nfor i in range(200):\n    y = w + i\n"
        "    z = (late if i == 150 else early)(y)\n    if i == 180:\n        u = w - 1\n"
        "after = torch.zeros(2)\nfor j in range(3):\n    q = w * j\nend = 1").result
    got = rows(report)
    assert [loop.steps for loop in report.loops] == [[200], [3]]
    assert got["z = (late if i == 150 else early)(y)"].hits == 200
    assert got["return x * 2"].hits == got["u = w - 1"].hits == 1
    assert got["return x * 2"].cpu_s > 0 and got["u = w - 1"].cpu_s > 0  # recorded
    # and the recording paused again after each: of the loop, its steps 1-6 alone
    ops = {op.name: op.calls for op in report.analysis.ops}
    assert ops["aten::add"] == 6 and ops["aten::mul"] == 1 + 3 and ops["aten::sub"] == 1
    assert got["after = torch.zeros(2)"].hits == got["end = 1"].hits == 1
    assert got["q = w * j"].hits == 3 and got["for j in range(3):"].hits == 4
    assert got["y = w + i"].hits == 200 and got["for i in range(200):"].hits == 201
    assert ip.user_ns["end"] == 1 and not any("started 1 thread" in n for n in report.notes)


def test_a_functions_line_first_run_past_the_window_keeps_its_hits(ip):
    """A function the timed steps called, whose one line runs only past the window: the
    line is in the table, every line's hits counted, a branch's included."""
    ip.run_cell("def pick(i):\n    if i >= 180:\n        return 3\n    return 2")
    report = ip.run_cell("%%profile -o -f pick\ntotal = 0\nfor i in range(200):\n"
                         "    total += pick(i)").result
    got = rows(report)
    assert got["return 3"].hits == 20 and got["return 2"].hits == 180
    assert got["if i >= 180:"].hits == got["total += pick(i)"].hits == 200
    assert ip.user_ns["total"] == 2 * 180 + 3 * 20


def test_a_cell_with_every_step_recorded_is_timed_exactly_without_samples(ip):
    ip.run_cell("import torch")
    report = ip.run_cell("%%profile -o --steps 0\nfor i in range(40):\n    y = torch.ones(2)\n"
                         "    if i % 4 == 0:\n        z = y + 1").result
    got = rows(report)
    assert got["y = torch.ones(2)"].hits == 40 and got["z = y + 1"].hits == 10
    assert not any(n.startswith(PAST) for n in report.notes)


def test_ctrl_c_past_the_window_leaves_the_trace_function_and_threads_as_found(ip, capsys):
    """Interrupted while the steps past the window run untimed: a partial profile, the
    trace function (none, or the user's own) put back, the sampler thread gone."""
    ip.run_cell("import torch")
    seen = []

    def users_tracer(frame, event, arg):
        seen.append(event)

    cell = ("%%profile\nfor i in range(100):\n    y = torch.ones(2)\n"
            "    if i == 60:\n        raise KeyboardInterrupt")
    with pytest.raises(KeyboardInterrupt):
        ip.run_cell(cell)
    assert "PARTIAL: interrupted" in capsys.readouterr().out
    assert sys.gettrace() is None and ip.user_ns["i"] == 60
    assert not [t for t in threading.enumerate() if t.name == "tdm-line-sampler"]
    sys.settrace(users_tracer)
    try:
        with pytest.raises(KeyboardInterrupt):
            ip.run_cell(cell)
        ip.run_cell("%%profile\nfor i in range(100):\n    y = torch.ones(2)")
        assert sys.gettrace() is users_tracer
    finally:
        sys.settrace(None)


def test_a_first_start_faster_than_the_bound_is_not_said():
    assert reading._first_start(None) == []
    assert reading._first_start(reading.FIRST_START_S / 2) == []
    (line,) = reading._first_start(1.25)
    assert line.startswith("1.2") and "of this cell's time was torch's profiler starting" in line


@pytest.mark.slow
def test_the_first_start_of_torchs_profiler_is_said_once_in_a_kernel():
    """A fresh kernel: its first capture says how much of the cell torch's profiler's first
    start took; the next captures say nothing of it."""
    cell = "%%profile\ny = torch.ones(3) + 1"
    nb = execute(notebook("import torch\n%load_ext torch_device_magic", cell, cell, cell))
    first, *later = (texts(c) for c in nb.cells[1:])
    assert first.count(FIRST) == 1
    assert "%%profile In[2]" in first
    assert all(FIRST not in text and "%%profile In[" in text for text in later)


def test_the_trace_of_several_sessions_is_one_json_file_written_before_the_report(ip, tmp_path):
    """The later sessions' events are spliced into kineto's first file: one JSON document
    with every session's ops, the metadata once, a `]` in the path no matter; the file is
    complete when the report is there."""
    path = tmp_path / "run[1].json"
    ip.run_cell("import torch")
    report = ip.run_cell(
        f"%%profile -o --trace {path}\na = torch.zeros(2)\nfor i in range(20):\n"
        "    y = torch.ones(2)\nb = torch.empty(2)\nfor j in range(20):\n"
        "    z = torch.full((2,), 1.0)\nc = torch.eye(2)").result
    assert report.trace_path == str(path) and report.trace_bytes == path.stat().st_size
    events = json.loads(path.read_text())["traceEvents"]
    names = [e.get("name") for e in events]
    assert {"aten::zeros", "aten::empty", "aten::eye"} <= set(names)  # each session's
    assert names.count("aten::ones") == names.count("aten::full") == 6
    assert names.count("process_name") == 1
