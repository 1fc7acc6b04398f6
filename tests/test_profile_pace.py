"""%%profile at the plain loop's pace (issue 38): what the cheaper tracer still covers, and
the one-time start of torch's profiler said where it happened."""

from __future__ import annotations

import json
import sys

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
    # the line's own event and its comprehension's: in 3.11 a code object of its own (its
    # start and 3 items), inlined from 3.12 on (PEP 709: the 3 jumps back to the line)
    assert got["return [k + j for j in range(3)]"].hits == (
        500 if sys.version_info < (3, 12) else 400)
    assert got["s = y.sum()"].hits == got["return s"].hits == 300
    assert got["done = [i for i in range(4)]"].hits == (6 if sys.version_info < (3, 12) else 5)
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


# --- the line events by sys.monitoring (Python 3.12+) --------------------------------------

EVENTS_CELL = """import threading
def gen(n):
    for k in range(n):
        yield k
def fails():
    raise KeyError('x')
def twice(f):
    return [f(), f()]
total = sum([j for j in gen(3)])
for i in range(2): total += i
try:
    fails()
except KeyError:
    pass
twice(lambda: 1)
t = threading.Thread(target=lambda: [j for j in range(50)]); t.start(); t.join()
def deep(k):
    return k if k == 0 else deep(k - 1)
deep(3)
"""


def _heard(make) -> list[tuple]:
    """What the tracer's side hears of EVENTS_CELL's frames, by the event source `make` gives."""
    from torch_device_magic.profile.line_events import Frames

    code = compile(EVENTS_CELL, "<tdm-events-cell>", "exec")
    got: list[tuple] = []
    frames = Frames(lambda c: got.append(("enter", c.co_name)),
                    lambda c, n: got.append(("line", c.co_name, n)),
                    lambda: got.append(("leave",)))
    source = make(lambda c: c.co_filename == "<tdm-events-cell>", frames)
    source.start()
    try:
        exec(code, {})
    finally:
        source.stop()
    return got


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring: Python 3.12+")
def test_sys_monitoring_hears_what_settrace_hears():
    """3.12+: every start, line and end of the watched code that sys.settrace gives, in its
    order (generators, a comprehension's and a one-line loop's passes, an exception through
    frames, recursion), on the thread that started it only; the tool id freed after."""
    from torch_device_magic.profile import line_events

    tool = next(t for t in line_events.TOOL_IDS if sys.monitoring.get_tool(t) is None)
    by_monitoring = _heard(lambda w, f: line_events.Monitoring(w, f, tool))
    assert sys.monitoring.get_tool(tool) is None and sys.monitoring.get_events(tool) == 0
    by_settrace = _heard(line_events.SetTrace)
    assert by_monitoring == by_settrace
    assert by_settrace.count(("enter", "deep")) == 4 and ("line", "<module>", 10) in by_settrace
    assert sum(e[0] == "enter" for e in by_settrace) == by_settrace.count(("leave",))
    # the lambda on line 15 runs here, the one on line 16 in the thread: not heard
    assert ("line", "<lambda>", 15) in by_monitoring
    assert ("line", "<lambda>", 16) not in by_monitoring


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring: Python 3.12+")
def test_the_tracer_uses_sys_monitoring_and_leaves_a_users_settrace_on(ip):
    """3.12+: %%profile's lines come by sys.monitoring (a tool of ours while the cell runs),
    a user's sys.settrace (a debugger, coverage) keeps tracing the cell, and where no tool
    id is free the cell is traced by sys.settrace with the same lines."""
    from torch_device_magic.profile import line_events

    seen: list[str] = []

    def users(frame, event, arg):
        seen.append(frame.f_code.co_name)
        return None

    ip.run_cell("import sys, torch")
    sys.settrace(users)
    try:
        report = ip.run_cell(  # cProfile (%prun) takes the profilers' id, 2: free
            "%%profile -o\ntools = list(map(sys.monitoring.get_tool, range(6)))\n"
            "y = torch.ones(3) + 1\nimport cProfile; cProfile.Profile().runcall(sum, [1])"
        ).result
        assert sys.gettrace() is users
    finally:
        sys.settrace(None)
    assert line_events.TOOL_NAME in ip.user_ns["tools"] and "<module>" in seen
    assert all(sys.monitoring.get_tool(t) is None for t in line_events.TOOL_IDS)
    # (the line that turns cProfile on may be heard twice: its tool's start re-instruments)
    assert [r.hits for r in report.lines][:2] == [1, 1] and len(report.lines) == 3
    taken = [t for t in line_events.TOOL_IDS]
    for t in taken:
        sys.monitoring.use_tool_id(t, "someone else's")
    try:
        report = ip.run_cell(
            "%%profile -o\ntools = list(map(sys.monitoring.get_tool, range(6)))\n"
            "y = torch.ones(3) + 1").result
    finally:
        for t in taken:
            sys.monitoring.free_tool_id(t)
    assert line_events.TOOL_NAME not in ip.user_ns["tools"]
    assert [r.hits for r in report.lines] == [1, 1] and sys.gettrace() is None
