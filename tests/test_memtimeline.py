"""The memory timeline behind `%%profile --memory`: from the profiler's memory events
(for real, on the CPU and on tdmdev), from the CUDA allocator's history (its snapshot
format on a fake allocator, and cuda-marked on a GPU), and drawn as SVG and text."""

from __future__ import annotations

import pickle
import re
import time
import xml.etree.ElementTree as ET
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from torch_device_magic import probes
from torch_device_magic.profile import memtimeline
from torch_device_magic.profile.memtimeline import Timeline, from_profiler, from_snapshot, recording

MiB = 2**20
SVG = "{http://www.w3.org/2000/svg}"
CELL = "<memtimeline-test-cell>"


def profiled(source: str, filename: str = CELL, **names: Any) -> Any:
    """Run `source`, compiled under `filename`, inside a memory profile; the profile."""
    code = compile(source, filename, "exec")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        exec(code, {"torch": torch, **names})
    return prof


BIG_THEN_SMALL = (
    "x = 1\n"
    "big = torch.empty(16 * 2**20); del big\n"
    "small = torch.ones(1024)\n"
)


def test_profiler_timeline_of_a_cpu_cell_peaks_at_the_big_line_and_comes_back_down():
    tl = from_profiler(profiled(BIG_THEN_SMALL), CELL, BIG_THEN_SMALL)
    assert (tl.device, tl.source) == ("cpu", memtimeline.PROFILER_SOURCE)
    assert 64 * MiB <= tl.peak_bytes - tl.start_bytes < 65 * MiB
    top, second = tl.largest[:2]
    assert (top.bytes, top.line, top.text) == (
        64 * MiB, 2, "big = torch.empty(16 * 2**20); del big")
    assert (second.bytes, second.line, second.text) == (4096, 3, "small = torch.ones(1024)")
    assert tl.end_bytes - tl.start_bytes == 4096  # the big one was freed, the small one lives
    times = [t for t, _ in tl.points]
    assert times == sorted(times) and times[0] == 0.0 and times[-1] == tl.duration_s
    assert 0 < top.at_s < second.at_s <= tl.duration_s
    assert tl.allocations == 2  # the profiler's own allocations are outside the cell's span


def test_a_line_of_a_function_defined_in_the_cell_is_named_and_other_files_are_skipped():
    source = (
        "layer = torch.nn.Linear(256, 4096)\n"
        "def forward(x):\n"
        "    return layer(x)\n"
        "out = forward(torch.ones(64, 256))\n"
    )
    tl = from_profiler(profiled(source), CELL, source)
    lines = {a.bytes: a.line for a in tl.largest}
    # the weight, made in torch/nn/modules/linear.py, called from line 1; the output, made
    # under Module.__call__ and Linear.forward, called from the function's line 3
    assert lines[4096 * 256 * 4] == 1
    assert lines[64 * 4096 * 4] == 3
    assert lines[64 * 256 * 4] == 4


def test_a_line_run_many_times_is_listed_once_with_its_count():
    source = "for n in range(1, 41):\n    t = torch.empty(n * 1024)\nlast = torch.empty(8)\n"
    tl = from_profiler(profiled(source), CELL, source)
    assert [(a.line, a.bytes, a.count) for a in tl.largest] == [(2, 40 * 4096, 40), (3, 32, 1)]
    assert tl.allocations == 41


def test_a_top_level_operator_has_no_line_on_the_stack_and_says_so():
    source = "a = torch.ones(2**20)\nb = a * 2\n"
    tl = from_profiler(profiled(source), CELL, source)
    lines = {a.line for a in tl.largest if a.bytes == 4 * MiB}
    assert lines == {1, None}  # torch.ones is a call of line 1; `a * 2` calls nothing
    assert any(n.startswith("line ?: made while no call of the cell's own was running")
               for n in tl.notes)


def test_an_allocation_off_the_cells_stack_goes_to_the_innermost_call_running_then():
    """As backward on a GPU runs in autograd's own thread (the profiler records a plain
    Python thread's allocations not at all, so this is the sweep alone; the GPU test
    below runs it for real): spans (start, end, line) of the cell's calls, nested."""
    spans = [(0, 100, 4), (10, 20, 5), (30, 90, 6), (40, 50, 7), (120, 130, 8)]
    assert memtimeline._open_line([5, 15, 25, 45, 60, 95, 125, 200], spans) == [
        4, 5, 4, 7, 6, 4, 8, None]


def test_the_line_ranges_of_profiles_tracer_name_the_line_even_of_an_operator():
    """%%profile's line tracer opens a record_function range per line, named
    `tdm:In[n] LINE: text` (a -f function's: `tdm:In[n] NAME LINE: text`); no Python stacks."""
    rng = torch.autograd.profiler.record_function
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with rng("tdm:In[5] 1: a = torch.ones(2**20)"):
            a = torch.ones(2**20)
        with rng("tdm:In[5] 2: b = helper(a)"), rng("tdm:In[5] helper 40: return a * 2"):
            b = a * 2
    del a, b
    tl = from_profiler(prof, CELL, "a = torch.ones(2**20)\nb = helper(a)\n")
    assert [(a.bytes, a.line, a.text) for a in tl.largest[:2]] == [
        (4 * MiB, 1, "a = torch.ones(2**20)"), (4 * MiB, 2, "b = helper(a)")]
    assert not any("lines are unknown" in n for n in tl.notes)
    assert 0 < tl.largest[0].at_s < tl.largest[1].at_s < tl.duration_s


# a loop past its steps window, that keeps nothing
WINDOWED = "for i in range(20):\n    a = torch.ones(2**20)\n    b = a * 2\ndel a, b"


def profile_memory(ip, options: str, cell: str) -> Timeline:
    ip.run_cell(f"r = get_ipython().run_cell_magic('profile', '-o --memory {options}', {cell!r})")
    return ip.user_ns["r"].timeline


def test_a_windowed_loops_timeline_says_what_it_left_out(ip):
    """Each step's frees of the step before fall, past the window, where nothing records."""
    tl = profile_memory(ip, "", WINDOWED)
    assert tl.start_bytes == 0 and 12 * MiB <= tl.peak_bytes < 12 * MiB + 4096
    # the window closes after step 6's `a` or its `b` (a loaded machine's run saw either):
    # what the last recorded step left alive is said as maybe freed, whichever it was
    assert re.search(r"0 B -> ([48])\.0 MiB \(\1\.0 MiB of it maybe freed in the steps left "
                     r"out\)", tl.headline())
    assert "a loop's steps past --steps were not recorded" in tl.text()


def test_the_blocks_a_window_did_not_see_freed_do_not_carry_into_the_next_capture(ip):
    """The profiler's own CPU count keeps them for the rest of the process."""
    profile_memory(ip, "", WINDOWED)
    tl = profile_memory(ip, "--steps 0", WINDOWED)
    assert (tl.start_bytes, tl.end_bytes) == (0, 0)  # it kept nothing
    assert 12 * MiB <= tl.peak_bytes < 12 * MiB + 4096 and "left out" not in tl.text()


def test_a_cell_compiled_as_ipython_compiles_it_is_found_by_its_filename(ip):
    """The filename IPython gives a cell (`<ipython-input-…>` in 7.34, a file path in 9),
    its top-level code and its trailing expression (compiled apart, for `Out[n]`)."""
    import inspect

    from torch_device_magic import cells

    cell = BIG_THEN_SMALL + "torch.zeros(2**18).sum()\n"
    ip.user_ns["torch"] = torch
    run = cells.compiled(ip, cell)
    filename = inspect.getclosurevars(run).nonlocals["body"].co_filename
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        run()
    tl = from_profiler(prof, filename, cell)
    assert [(a.bytes, a.line) for a in tl.largest[:3]] == [
        (64 * MiB, 2), (MiB, 4), (4096, 3)]


def test_the_profilers_stripped_filename_of_a_cell_still_matches(tmp_path, monkeypatch):
    """The profiler's tracer strips sys.path prefixes: IPython 9's kernel compiles cells
    as files under a folder that can be on sys.path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    filename = str(tmp_path / "cell_12.py")
    tl = from_profiler(profiled(BIG_THEN_SMALL, filename), filename, BIG_THEN_SMALL)
    assert [a.line for a in tl.largest[:2]] == [2, 3]


def test_the_chart_is_valid_svg_labelled_with_the_lines_and_the_text_is_compact():
    tl = from_profiler(profiled(BIG_THEN_SMALL), CELL, BIG_THEN_SMALL)
    bundle = tl._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    svg = ET.fromstring(tl.svg())
    labels = [t.text for g in svg.iter(f"{SVG}g") for t in g.iter(f"{SVG}text")]
    assert labels[:2] == ["line 2: 64.0 MiB", "line 3: 4.0 KiB"]
    hovers = [g.find(f"{SVG}title").text for g in svg.iter(f"{SVG}g")]
    assert hovers[0] == "line 2: big = torch.empty(16 * 2**20); del big"
    axis = [t.text for t in svg.findall(f"{SVG}text")]
    assert "0 B" in axis and "64.0 MiB" in axis and "0 µs" in axis
    page = bundle["text/html"]
    assert "<svg" in page and "<script" not in page and "src=" not in page  # nothing to fetch
    text = bundle["text/plain"].splitlines()
    assert text[0].startswith("memory timeline of cpu (profiler memory events): peak ")
    assert set(text[1].split("  ")[0]) <= set("▁▂▃▄▅▆▇█") and "█" in text[1]
    assert text[2] == "largest allocations (the largest of each line)"
    assert text[3].split() == ["size", "line", "at", "allocations", "source"]
    assert text[5].split()[:3] == ["64.0", "MiB", "2"] and text[5].endswith("del big")
    assert text[5].index("64.0 MiB") == text[6].index(" 4.0 KiB")  # aligned


def test_ipython_displays_the_timeline_as_html_with_the_chart_or_as_text(ip):
    tl = from_profiler(profiled(BIG_THEN_SMALL), CELL, BIG_THEN_SMALL)
    shown, _ = ip.display_formatter.format(tl)
    assert shown["text/plain"] == tl.text()
    assert shown["text/html"].startswith('<div class="tdm-memory">')
    assert "<svg" in shown["text/html"] and "line 2: 64.0 MiB" in shown["text/html"]


def _sawtooth(n: int) -> list[tuple[float, int]]:
    points = [(i / n, (i % 7) * MiB) for i in range(n)]
    points[n // 3] = (points[n // 3][0], 100 * MiB)  # one short spike
    return points


def test_many_points_are_drawn_downsampled_keeping_the_peak_and_the_lows():
    points = _sawtooth(20_000)
    drawn = memtimeline.downsample(points)
    assert len(drawn) <= 3 * memtimeline.MAX_DRAWN + 2
    assert max(v for _, v in drawn) == 100 * MiB and min(v for _, v in drawn) == 0
    assert drawn == sorted(drawn) and drawn[0] == points[0] and drawn[-1] == points[-1]
    tl = Timeline("cpu", points, [], memtimeline.PROFILER_SOURCE, 1.0, len(points))
    svg = tl.svg()
    ET.fromstring(svg)
    assert svg.count("H") <= 2 * (3 * memtimeline.MAX_DRAWN + 2) and len(svg) < 60_000
    assert "100.0 MiB" in tl.text().splitlines()[0] or "█" in tl.sparkline()


def test_a_profile_without_memory_events_says_so():
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        exec(compile(BIG_THEN_SMALL, CELL, "exec"), {"torch": torch})
    tl = from_profiler(prof, CELL, BIG_THEN_SMALL)
    assert tl.allocations == 0 and tl.largest == []
    assert "no memory events were recorded (profile with profile_memory=True)" in tl.notes
    assert "<svg" not in tl.html() and "no allocations recorded" in tl.text()


def test_a_profile_whose_events_cannot_be_read_gives_an_empty_timeline_that_says_so():
    def unreadable() -> list[Any]:
        raise RuntimeError("unreadable. More detail")

    broken = SimpleNamespace(profiler=SimpleNamespace(
        kineto_results=SimpleNamespace(experimental_event_tree=unreadable)))
    tl = from_profiler(broken, CELL, BIG_THEN_SMALL)
    assert tl.allocations == 0 and tl.points == []
    assert tl.notes == ["the profiler's memory events could not be read: "
                        "RuntimeError: unreadable. More detail"]
    assert "could not be read" in tl.text() and "<svg" not in tl.html()


def test_on_tdmdev_the_timeline_shows_only_what_the_profiler_saw(tdmdev):
    """tdmdev's allocator does not report to the profiler (docs/profile-memory.md): its
    64 MiB is not in the timeline, which is the CPU's (the CPU fallback's copies)."""
    source = (
        "big = torch.empty(16 * 2**20, device='tdmdev'); del big\n"
        "small = torch.ones(1024, device='tdmdev')\n"
    )
    tl = from_profiler(profiled(source), CELL, source)
    if tl.device.startswith("tdmdev"):  # it reports: then exactly as on the CPU
        assert (tl.largest[0].bytes, tl.largest[0].line) == (64 * MiB, 1)
    else:
        assert tl.device == "cpu" and tl.peak_bytes - tl.start_bytes < MiB
        assert all(a.bytes < MiB for a in tl.largest)


# --- the CUDA allocator's history, in the format of torch.cuda.memory._snapshot() ----------


def frames(*lines: int, inner: str = "torch/nn/functional.py") -> list[dict[str, Any]]:
    """A stack as the allocator records it with stacks="python": innermost first."""
    out = [{"filename": inner, "line": 2104, "name": "linear"}]
    out += [{"filename": CELL, "line": n, "name": "<module>"} for n in lines]
    return out


def entry(action: str, addr: int, size: int, t_us: int, stack: Any = ()) -> dict[str, Any]:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t_us,
            "frames": list(stack), "device_free": 0}


def block(addr: int, size: int) -> dict[str, Any]:
    return {"address": addr, "size": size, "requested_size": size,
            "state": "active_allocated", "frames": []}


T0 = 1_796_000_000_000_000  # microseconds since the epoch, as time_us is


def fake_snapshot() -> dict[str, Any]:
    """cuda:1 holds 1 MiB from before the cell; in the cell: 64 MiB at line 2 (freed),
    4 MiB in a function of the cell (line 5, called from line 7), the old 1 MiB freed;
    outside it, an older entry and a later one (a recording that went on)."""
    old, big, small, late = 0x7F00_0000_0000, 0x7F00_0010_0000, 0x7F00_0500_0000, 0x7F00_0600_0000
    dev0 = [entry("alloc", 0x10, 512, T0 + 10, frames(9))]
    dev1 = [
        entry("alloc", old, MiB, T0 - 10_000_000, frames(1)),
        entry("segment_alloc", big, 80 * MiB, T0 + 90),
        entry("alloc", big, 64 * MiB, T0 + 100, frames(2)),
        entry("free_requested", big, 64 * MiB, T0 + 200, frames(2)),
        entry("free_completed", big, 64 * MiB, T0 + 210),
        entry("alloc", small, 4 * MiB, T0 + 300, frames(5, 7)),
        entry("free_completed", old, MiB, T0 + 400),  # no request recorded: counts here
        entry("oom", 0, 2**40, T0 + 450, frames(8)),
        entry("alloc", late, 2 * MiB, T0 + 9_000_000, frames(4)),
    ]
    segments = [{"device": 1, "address": big, "total_size": 80 * MiB, "stream": 0,
                 "segment_type": "large", "blocks": [block(small, 4 * MiB), block(late, 2 * MiB)]},
                {"device": 0, "address": 0x10, "total_size": 2 * MiB, "stream": 0,
                 "segment_type": "small", "blocks": [block(0x10, 512)]}]
    return {"segments": segments, "device_traces": [dev0, dev1]}


def test_the_cells_part_of_a_cuda_snapshot_is_sliced_out_and_attributed():
    source = "\n".join(f"statement_{n}" for n in range(1, 10))
    found = from_snapshot(fake_snapshot(), CELL, T0, T0 + 500, cell_source=source)
    assert found is not None
    tl, sliced = found
    assert (tl.device, tl.source) == ("cuda:1", memtimeline.CUDA_SOURCE)
    assert tl.start_bytes == MiB  # held from before the cell
    assert tl.peak_bytes == 65 * MiB
    assert [b for _, b in tl.points] == [MiB, 65 * MiB, MiB, 5 * MiB, 4 * MiB, 4 * MiB]
    assert [(a.bytes, a.line, a.text) for a in tl.largest] == [
        (64 * MiB, 2, "statement_2"), (4 * MiB, 5, "statement_5")]
    assert [a.at_s for a in tl.largest] == [100e-6, 300e-6]
    assert tl.allocations == 2 and tl.duration_s == 500e-6
    assert any(n.startswith("out of memory: 1.0 TiB could not be allocated (line 8)")
               for n in tl.notes)
    assert [e["time_us"] - T0 for e in sliced["device_traces"][1]] == [90, 100, 200, 210, 300,
                                                                       400, 450]
    assert sliced["segments"] == fake_snapshot()["segments"]


def test_an_allocation_with_no_frame_of_the_cell_gets_the_line_last_seen_marked():
    """Backward on a GPU allocates in autograd's device thread, whose Python stack is
    empty: the line the cell was last seen on (`loss.backward()` made the first gradient
    on the cell's own thread), marked with a star."""
    trace = [
        entry("alloc", 0x100, 4096, T0 + 10, frames(4)),  # the loss's grad, on the cell's thread
        entry("alloc", 0x200, 16 * MiB, T0 + 20, []),  # a weight's gradient, off it
        entry("alloc", 0x300, 1024, T0 + 30, frames(5)),
    ]
    blocks = [block(0x100, 4096), block(0x200, 16 * MiB), block(0x300, 1024)]
    found = from_snapshot({"segments": [{"device": 0, "blocks": blocks}],
                           "device_traces": [trace]}, CELL, T0, T0 + 40,
                          cell_source="a\nb\nc\nloss.backward()\nopt.step()\n")
    assert found is not None
    tl = found[0]
    top = tl.largest[0]
    assert (top.bytes, top.line, top.inferred, top.line_label, top.text) == (
        16 * MiB, 4, True, "4*", "loss.backward()")
    assert [a.line_label for a in tl.largest] == ["4*", "5"]  # line 4's largest stands for it
    assert any(n.startswith("*: made with no frame of the cell") for n in tl.table().notes)
    labels = [t.text for t in ET.fromstring(tl.svg()).iter(f"{SVG}text")]
    assert "line 4*: 16.0 MiB" in labels


def test_a_snapshot_with_no_allocation_in_the_cell_gives_nothing():
    assert from_snapshot(fake_snapshot(), CELL, T0 + 1_000_000, T0 + 2_000_000) is None


class FakeHistory:
    """The CUDA caching allocator's recorder as torch.cuda.memory answers it: whether it
    records, the entries it keeps while it does, the blocks in use, and the calls made."""

    def __init__(self, initialised: bool = True, enabled: bool = False) -> None:
        self.initialised, self.enabled = initialised, enabled
        self.calls: list[tuple[Any, dict[str, Any]]] = []
        self.trace: list[dict[str, Any]] = []
        self.live: dict[int, int] = {}
        self._next = 0x7F00_0000_0000

    def install(self, monkeypatch) -> FakeHistory:
        monkeypatch.setattr(probes, "cuda_built", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: self.initialised)
        monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: self.enabled,
                            raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self.snapshot)
        self._queued_before = len(torch.cuda._queued_calls)
        return self

    def record(self, enabled: Any = "all", **kwargs: Any) -> None:
        self.calls.append((enabled, kwargs))
        self.enabled = enabled is not None

    def init(self) -> None:
        """CUDA initialises, as torch.cuda._lazy_init does: the queued calls run (those
        queued since `install`: an earlier test's fake GPUs may have left theirs)."""
        self.initialised = True
        for call, _ in torch.cuda._queued_calls[self._queued_before:]:
            call()

    def alloc(self, size: int, line: int) -> int:
        addr, self._next = self._next, self._next + size
        self.live[addr] = size
        self._log("alloc", addr, size, frames(line))
        return addr

    def free(self, addr: int) -> None:
        size = self.live.pop(addr)
        self._log("free_requested", addr, size)
        self._log("free_completed", addr, size)

    def _log(self, action: str, addr: int, size: int, stack: Any = ()) -> None:
        if self.enabled:
            self.trace.append(entry(action, addr, size, time.time_ns() // 1000, stack))

    def snapshot(self) -> dict[str, Any]:
        blocks = [block(a, s) for a, s in self.live.items()]
        return {"segments": [{"device": 0, "blocks": blocks}], "device_traces": [self.trace]}


def test_recording_records_the_block_alone_and_saves_a_loadable_snapshot(monkeypatch):
    fake = FakeHistory().install(monkeypatch)
    kept = fake.alloc(MiB, 1)  # before the block: not recorded, but held
    with recording(CELL, max_entries=5000) as rec:
        assert fake.calls == [
            ("all", {"context": "alloc", "stacks": "python", "max_entries": 5000})]
        big = fake.alloc(64 * MiB, 2)
        fake.free(big)
        fake.alloc(MiB // 2, 3)
    assert fake.calls[-1] == (None, {}) and not fake.enabled
    fake.alloc(MiB, 4)  # after: not recorded
    tl = rec.timeline()
    assert tl is not None and tl.device == "cuda:0"
    assert (tl.start_bytes, tl.peak_bytes, tl.end_bytes) == (MiB, 65 * MiB, MiB + MiB // 2)
    assert [(a.bytes, a.line) for a in tl.largest] == [(64 * MiB, 2), (MiB // 2, 3)]
    with open(tl.snapshot_path, "rb") as f:
        saved = pickle.load(f)
    assert [e["action"] for e in saved["device_traces"][0]] == [
        "alloc", "free_requested", "free_completed", "alloc"]
    assert {b["address"] for b in saved["segments"][0]["blocks"]} >= {kept}
    assert rec.timeline() is tl  # read once


@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt])
def test_recording_stops_however_the_block_ends(monkeypatch, raised):
    fake = FakeHistory().install(monkeypatch)
    with pytest.raises(raised), recording(CELL) as rec:
        fake.alloc(8 * MiB, 2)
        raise raised("the cell's own error")
    assert not fake.enabled and fake.calls[-1] == (None, {})
    tl = rec.timeline()  # the partial timeline is still there
    assert tl is not None and tl.largest[0].line == 2


def test_a_ctrl_c_during_the_snapshot_still_stops_the_recording(monkeypatch):
    fake = FakeHistory().install(monkeypatch)

    def interrupted() -> dict[str, Any]:
        raise KeyboardInterrupt

    monkeypatch.setattr(torch.cuda.memory, "_snapshot", interrupted)
    with pytest.raises(KeyboardInterrupt), recording(CELL):
        fake.alloc(MiB, 2)
    assert not fake.enabled and fake.calls[-1] == (None, {})


def test_an_allocator_that_cannot_record_leaves_the_cell_alone_and_says_why(monkeypatch):
    fake = FakeHistory().install(monkeypatch)

    def refused(*args: Any, **kwargs: Any) -> None:
        fake.calls.append(("refused", kwargs))
        raise RuntimeError("cudaMallocAsync does not yet support recordHistory. "
                           "If you need it, please file an issue describing your use case.")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", refused)
    with recording(CELL) as rec:
        fake.alloc(MiB, 2)
    assert len(fake.calls) == 1  # tried once, never "stopped"
    assert rec.timeline() is None
    assert rec.why == ("the allocator's history could not be recorded: cudaMallocAsync "
                       "does not yet support recordHistory")


def test_a_snapshot_in_an_unknown_format_gives_no_timeline_and_says_why(monkeypatch):
    fake = FakeHistory().install(monkeypatch)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot",
                        lambda: {"device_traces": [[{"time_us": time.time_ns() // 1000}]]})
    with recording(CELL) as rec:
        fake.alloc(MiB, 2)
    assert rec.timeline() is None and not fake.enabled
    assert rec.why == "the allocator's snapshot could not be read: KeyError: 'action'"


def test_the_users_own_recording_is_kept_running_and_read(monkeypatch):
    fake = FakeHistory(enabled=True).install(monkeypatch)
    with recording(CELL) as rec:
        fake.alloc(2 * MiB, 2)
    assert fake.calls == [] and fake.enabled  # neither started nor stopped
    tl = rec.timeline()
    assert tl is not None and tl.largest[0].line == 2
    assert any(n.startswith("your own memory recording was running: it is left running")
               for n in tl.notes)


def test_a_cell_that_initialises_cuda_is_recorded_from_its_initialisation(monkeypatch):
    fake = FakeHistory(initialised=False).install(monkeypatch)
    queued = list(torch.cuda._queued_calls)
    with recording(CELL) as rec:
        assert fake.calls == []  # nothing asked of CUDA before it starts
        fake.init()
        fake.alloc(3 * MiB, 2)
    assert fake.calls == [
        ("all", {"context": "alloc", "stacks": "python", "max_entries": 100_000}), (None, {})]
    assert torch.cuda._queued_calls == queued
    tl = rec.timeline()
    assert tl is not None and (tl.largest[0].bytes, tl.largest[0].line) == (3 * MiB, 2)


def test_a_cell_that_never_uses_cuda_starts_nothing_and_leaves_no_queued_call(monkeypatch):
    fake = FakeHistory(initialised=False).install(monkeypatch)
    queued = list(torch.cuda._queued_calls)
    with recording(CELL) as rec:
        pass
    assert fake.calls == [] and not fake.initialised
    assert torch.cuda._queued_calls == queued
    assert rec.timeline() is None and rec.why == "the cell did not use CUDA"


@pytest.mark.skipif(probes.cuda_built(), reason="needs a CPU-only build of torch")
def test_recording_on_a_cpu_only_build_records_and_starts_nothing():
    queued = list(torch.cuda._queued_calls)
    with recording(CELL) as rec:
        exec(compile(BIG_THEN_SMALL, CELL, "exec"), {"torch": torch})
    assert rec.timeline() is None and rec.why == "this torch has no CUDA"
    assert not torch.cuda.is_initialized() and torch.cuda._queued_calls == queued


# --- on a GPU -----------------------------------------------------------------------------


def run_on_cuda(source: str) -> dict[str, Any]:
    """Run `source` as the cell; its namespace, which the caller keeps (as a notebook's
    namespace outlives the cell, so that what the cell bound is not freed in it)."""
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(source, CELL, "exec"), namespace)
    return namespace


CUDA_CELL = (
    "x = 1\n"
    "big = torch.empty(16 * 2**20, device='cuda'); del big\n"
    "small = torch.ones(1024, device='cuda')\n"
)


@pytest.mark.cuda
def test_cuda_recording_of_a_real_cell():
    torch.ones(1, device="cuda")  # CUDA up before the block
    with recording(CELL) as rec:
        kept = run_on_cuda(CUDA_CELL)
    assert not torch._C._cuda_isHistoryEnabled()
    tl = rec.timeline()
    assert tl is not None and tl.device == f"cuda:{torch.cuda.current_device()}"
    assert tl.peak_bytes - tl.start_bytes >= 64 * MiB
    assert (tl.largest[0].bytes, tl.largest[0].line) == (64 * MiB, 2)
    assert tl.largest[1].line == 3 and tl.end_bytes - tl.start_bytes == 4096
    with open(tl.snapshot_path, "rb") as f:
        assert pickle.load(f)["device_traces"]
    assert kept["small"].device.type == "cuda"


_FRESH = """
import json, sys, torch
from torch_device_magic.profile.memtimeline import recording
cell = "x = 1\\nbig = torch.empty(16 * 2**20, device='cuda')\\n"
before = torch.cuda.is_initialized()
with recording("<fresh-cell>") as rec:
    namespace = {"torch": torch}
    exec(compile(cell, "<fresh-cell>", "exec"), namespace)
tl = rec.timeline()
print(json.dumps({"before": before, "recording": torch._C._cuda_isHistoryEnabled(),
                  "largest": [[a.bytes, a.line] for a in tl.largest] if tl else None,
                  "why": rec.why}))
"""


@pytest.mark.cuda
def test_a_cell_that_starts_cuda_is_recorded_from_its_start_in_a_fresh_process():
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", _FRESH], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert found == {"before": False, "recording": False, "largest": [[64 * MiB, 2]],
                     "why": None}


@pytest.mark.cuda
def test_backward_on_the_gpu_is_attributed_to_its_line_from_autograds_thread():
    source = (
        "model = torch.nn.Linear(1024, 4096, device='cuda')\n"
        "loss = model(torch.randn(512, 1024, device='cuda')).square().mean()\n"
        "loss.backward()\n"
    )
    code = compile(source, CELL, "exec")
    torch.ones(1, device="cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True,
                 with_stack=True) as prof:
        exec(code, {"torch": torch})
    tl = from_profiler(prof, CELL, source)
    assert tl.device.startswith("cuda")
    lines = {a.line: a.bytes for a in tl.largest}
    assert lines.get(3, 0) >= 4096 * 1024 * 4  # the weight's gradient, made by backward


@pytest.mark.cuda
def test_cuda_recording_puts_backwards_gradients_on_the_backward_line():
    source = (
        "model = torch.nn.Linear(1024, 4096, bias=False, device='cuda')\n"
        "loss = model(torch.randn(8, 1024, device='cuda')).square().mean()\n"
        "loss.backward()\n"
    )
    torch.ones(1, device="cuda")
    with recording(CELL) as rec:
        run_on_cuda(source)
    tl = rec.timeline()
    assert tl is not None
    grad = [a for a in tl.largest if a.line == 3]
    assert grad and grad[0].bytes >= 4096 * 1024 * 4


@pytest.mark.cuda
def test_cuda_recording_stops_on_an_error_and_keeps_the_users_own():
    torch.ones(1, device="cuda")
    with pytest.raises(ZeroDivisionError), recording(CELL):
        run_on_cuda(CUDA_CELL + "1 / 0\n")
    assert not torch._C._cuda_isHistoryEnabled()
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        with recording(CELL) as rec:
            run_on_cuda(CUDA_CELL)
        assert torch._C._cuda_isHistoryEnabled()
        tl = rec.timeline()
        assert tl is not None and tl.largest[0].line == 2
    finally:
        torch.cuda.memory._record_memory_history(None)
