"""%%profile at the plain loop's pace (issue 38): what the cheaper tracer still covers, and
the one-time start of torch's profiler said where it happened."""

from __future__ import annotations

import json

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
    """The tracer's hot path skips the step count where no step begins: every line of every
    step still counts, a function of the cell and an -f function included, and a line
    after the loop too."""
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
