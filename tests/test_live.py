"""The live line in a shell (in-process): its words, its one thread, unloading, a read that
fails, forks, the trait and %devreport live. What a kernel and a terminal show is in
test_live_kernel.py and test_live_terminal.py."""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest
from fakegpu import GIB, FakeMachine, Gpu, GpuIsLost, loaded_with_gpu
from IPython.core.error import UsageError
from pythonpath import ROOT

from torch_device_magic.live import engine, reads, sampler, spark
from torch_device_magic.live.text import Reading, clock_text, line

LONG = "import time\ntime.sleep(0.35)\nx = 1"


def live_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torch_device_magic live line"]


@pytest.fixture
def term(ip, monkeypatch):
    """The shell as a terminal: its stdout (pytest's capture) taken for a tty."""
    monkeypatch.setattr(engine, "_is_tty", lambda stream: True)
    ip.run_line_magic("config", "TorchDeviceMagics.live_delay = 0.2")
    return ip


def test_the_words_of_the_line_as_the_docs_show_them():
    gib = 2**30
    reading = Reading(42.4, "at line 7: loss.backward()", int(3.1 * gib), int(1.2 * gib), 1.04,
                      "cuda:0", int(12.4 * gib), int(14.1 * gib), 80 * gib, None, 97.2)
    shown = line("running", reading)
    for doc in ("README.md", "docs/report.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert shown in text, doc
    assert clock_text(3723.9) == "1:02:03" and clock_text(59.99) == "0:59"
    assert line("profiling", Reading(1.2)) == "profiling 0:01"
    near = Reading(5.0, device="cuda:0", device_bytes=75 * gib, device_peak_bytes=76 * gib,
                   device_total_bytes=80 * gib, near_capacity=0.95)
    assert line("running", near) == (
        "running 0:05 | cuda:0 75.0 GiB allocated (peak 76.0 GiB of 80.0 GiB) | NEAR CAPACITY: "
        "peak at 95% of the device's memory")


def test_a_long_cell_draws_then_erases_the_line_before_the_report(term, capsys):
    capsys.readouterr()
    term.run_cell(LONG, store_history=True)
    out = capsys.readouterr().out
    drawn = out.index("\r\x1b[2Krunning 0:00 | at line 2: time.sleep(0.35) | host ")
    report = out.index("time ")
    assert drawn < out.rindex("\r\x1b[2K") < report, repr(out)
    assert out.endswith("\n") and out[report:].count("\n") == 1, repr(out)


def test_a_short_cell_draws_nothing(term, capsys):
    capsys.readouterr()
    term.run_cell("y = 2", store_history=True)
    out = capsys.readouterr().out
    assert "\x1b" not in out and out.startswith("time "), repr(out)


def test_a_short_cell_calls_nothing_of_the_live_line(term):
    """Its cost is a few attribute stores: no function of live/ runs on the cell's thread."""
    term.run_cell(LONG)  # the thread is started and awake
    live = term.magics_manager.registry["TorchDeviceMagics"].reporter.live
    assert live.thread_alive and not live.idle
    ran: list[str] = []

    def heard(frame, event, arg):
        if event == "call" and "/torch_device_magic/live/" in frame.f_code.co_filename:
            ran.append(frame.f_code.co_name)

    sys.setprofile(heard)
    try:
        for _ in range(3):
            term.run_cell("y = 2")
    finally:
        sys.setprofile(None)
    assert ran == [] and term.user_ns["y"] == 2


def test_an_idle_thread_sleeps_and_the_next_long_cell_wakes_it(term, capsys, monkeypatch):
    monkeypatch.setattr(sampler, "IDLE_POLLS", 2)
    live = term.magics_manager.registry["TorchDeviceMagics"].reporter.live
    term.run_cell("y = 2")  # starts the thread, which finds no cell after it
    for _ in range(100):
        if live.idle:
            break
        time.sleep(0.05)
    assert live.idle and live.thread_alive  # 2 looks of 0.2 s, then asleep
    capsys.readouterr()
    term.run_cell(LONG, store_history=True)
    out = capsys.readouterr().out
    assert "\r\x1b[2Krunning 0:00 | at line 2: time.sleep(0.35)" in out, repr(out)
    assert len(live_threads()) == 1 and not live.idle


def test_a_delay_made_shorter_is_followed_at_once(term, capsys):
    term.run_line_magic("config", "TorchDeviceMagics.live_delay = 30")
    term.run_cell("y = 2")  # the thread now sleeps 30 s between its looks
    term.run_line_magic("config", "TorchDeviceMagics.live_delay = 0.2")
    capsys.readouterr()
    term.run_cell(LONG, store_history=True)
    assert "\r\x1b[2Krunning 0:00" in capsys.readouterr().out


def test_one_thread_for_the_session_stopped_at_unload(term):
    before = live_threads()
    for _ in range(2):
        term.run_cell(LONG)
    assert len(live_threads()) == len(before) + 1
    term.run_line_magic("unload_ext", "torch_device_magic")
    assert live_threads() == []


def test_reload_leaves_one_thread(term):
    before = len(live_threads())
    term.run_cell(LONG)
    term.run_line_magic("reload_ext", "torch_device_magic")
    term.run_line_magic("config", "TorchDeviceMagics.live_delay = 0.2")
    term.run_cell(LONG)
    assert len(live_threads()) == before + 1


def test_a_read_that_fails_is_dropped_once_and_the_report_says_why(term, capsys, monkeypatch):
    calls = []

    def gone():
        calls.append(1)
        raise OSError("proc went away")

    monkeypatch.setattr(reads, "rss_bytes", gone)
    term.magics_manager.registry["TorchDeviceMagics"].reporter.live.period_s = 0.1
    capsys.readouterr()
    term.run_cell("import time\ntime.sleep(0.5)", store_history=True)
    out = capsys.readouterr().out
    assert len(calls) == 1, calls
    first, *later = out.split("\r\x1b[2K")[1:-1]
    assert first == "running 0:00 | at line 2: time.sleep(0.5)", repr(out)  # no cores yet
    assert later[0].startswith("running 0:00 | at line 2: time.sleep(0.5) | 0."), repr(out)
    assert "live line: host memory was not read (OSError: proc went away)" in out, repr(out)


def test_a_c_call_holding_the_gil_freezes_the_line_which_then_says_the_clocks_time(
        term, capsys):
    # usleep through ctypes.PyDLL keeps the GIL for its 1.5 s: no Python thread runs
    term.magics_manager.registry["TorchDeviceMagics"].reporter.live.period_s = 0.1
    capsys.readouterr()
    term.run_cell("import ctypes, time\nlibc = ctypes.PyDLL(None)\ntime.sleep(0.3)\n"
                  "libc.usleep(1500000)\ntime.sleep(0.5)\ndone = True", store_history=True)
    out = capsys.readouterr().out
    assert term.user_ns["done"] is True
    drawn = re.findall(r"\r\x1b\[2K(running \d:\d\d \| at line \d)", out)
    assert "running 0:00 | at line 3" in drawn, repr(out)  # before the freeze
    after = [d for d in drawn if d.endswith("at line 5")]
    # from the clock: 1.8 s in at least; 12 ticks of 0.1 s would still say 0:00
    assert after and not any(d.startswith("running 0:00") for d in after), repr(out)
    assert re.match(r"time [2-9]\.\d\d s", out.rsplit("\r\x1b[2K", 1)[1]), repr(out)


def test_a_fork_in_a_live_cell_works(term, capsys):
    term.run_cell(
        "import multiprocessing, time\n"
        "time.sleep(0.3)\n"
        "with multiprocessing.get_context('fork').Pool(2) as pool:\n"
        "    got = pool.map(abs, [-1, -2, -3])\n"
        "time.sleep(0.3)", store_history=True)
    assert term.user_ns["got"] == [1, 2, 3]
    assert "Warning" not in capsys.readouterr().err


@pytest.mark.parametrize("value, said", [
    ("-1.0", "live_delay must be 0 (off) or more"),
    ("float('nan')", "live_delay must be a finite number, 0 (off) or more, not nan")])
def test_a_bad_delay_is_refused_and_changes_nothing(ip, value, said, caplog):
    ip.run_line_magic("config", f"TorchDeviceMagics.live_delay = {value}")
    assert said in caplog.text
    magics = ip.magics_manager.registry["TorchDeviceMagics"]
    assert magics.live_delay == 1.0 and magics.reporter.live.delay_s == 1.0


def test_devreport_live_switches_and_says_how_it_is_set(ip, capsys):
    ip.run_line_magic("config", "TorchDeviceMagics.live_delay = 2.5")
    ip.run_line_magic("devreport", "live off")
    assert "live line off" in capsys.readouterr().out
    magics = ip.magics_manager.registry["TorchDeviceMagics"]
    assert magics.live_delay == 0 and magics.reporter.live.delay_s == 0
    ip.run_line_magic("devreport", "live on")
    assert "live line after 2.50 s" in capsys.readouterr().out
    assert magics.live_delay == 2.5 and magics.auto_report
    ip.run_line_magic("devreport", "")
    assert "live line after 2.50 s" in capsys.readouterr().out


@pytest.mark.parametrize(("line_", "message"), [
    ("live maybe", "%devreport live takes on or off, not 'maybe'"),
    ("live", "%devreport live takes on or off, not nothing"),
    ("on live", "%devreport on takes nothing after it, not 'live'"),
])
def test_devreport_live_mistakes_are_one_usage_error(ip, line_, message):
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("devreport", line_)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(("cell", "label"), [
    ("%%profile\nimport time\ntime.sleep(0.5)", "profiling 0:00"),
    ("%%nograd\nimport time\ntime.sleep(0.4)", "running without autograd 0:00"),
    ("%%gpumem\nimport time\ntime.sleep(0.4)", "measuring 0:00"),
    ("%%ondevice cpu\nimport time\ntime.sleep(0.4)", "running on cpu 0:00"),
])
def test_a_magic_says_what_it_is_doing(term, capsys, cell, label):
    capsys.readouterr()
    term.run_cell(cell, store_history=True)
    out = capsys.readouterr().out
    assert f"\r\x1b[2K{label} | " in out, repr(out)
    term.run_cell(LONG, store_history=True)  # the next cell: the label is the cell's only
    assert "\r\x1b[2Krunning 0:00 | at line 2" in capsys.readouterr().out


def test_the_sparkline_and_its_svg():
    samples = [(t, b << 20) for t, b in enumerate([100, 200, 400, 800, 600, 300])]
    text, svg = spark.picture("host", samples)
    assert text == "host ▁▂▄█▆▃ peak 800.0 MiB at 0:03"
    assert svg.startswith('<div class="tdm-spark">host <svg ') and "<polyline" in svg
    assert spark.picture("host", samples[:1]) is None
    assert len(spark.sparkline(list(range(1000)))) == spark.WIDTH


def test_a_cell_of_five_seconds_gets_its_memory_picture_under_the_report(
        term, capsys, monkeypatch):
    monkeypatch.setattr(spark, "MIN_CELL_S", 0.5)  # a 5 s cell, made short for the test
    term.magics_manager.registry["TorchDeviceMagics"].reporter.live.period_s = 0.1
    capsys.readouterr()
    term.run_cell("import time\nfor i in range(4):\n    time.sleep(0.2)", store_history=True)
    out = capsys.readouterr().out.rsplit("\r\x1b[2K", 1)[1]  # after the line's last erase
    report, picture = out.splitlines()
    assert report.startswith("time "), out
    assert picture.startswith("host ") and " peak " in picture, out
    assert set(picture.split()[1]) <= set(spark.BARS), out
    term.run_cell(LONG, store_history=True)  # 0.35 s: under the (patched) 0.5 s, no picture
    assert len(capsys.readouterr().out.rsplit("\r\x1b[2K", 1)[1].splitlines()) == 1


def test_on_a_gpu_busy_allocated_and_near_capacity(shell, monkeypatch, capsys):
    machine = loaded_with_gpu(shell, monkeypatch, Gpu("A", total=80 * GIB))
    monkeypatch.setattr(engine, "_is_tty", lambda stream: True)
    shell.run_line_magic("config", "TorchDeviceMagics.live_delay = 0.2")
    monkeypatch.setenv("COLUMNS", "300")  # the whole line: none cut at the width
    machine.allocate(0, 75 * GIB)
    capsys.readouterr()
    shell.run_cell("import time, os\ntime.sleep(0.1)\n"
                   "machine.sample(0, [97, 97, 97], pid=os.getpid())\ntime.sleep(0.3)",
                   store_history=True)
    out = capsys.readouterr().out
    assert ("| GPU 97% busy | cuda:0 75.0 GiB allocated (peak 75.0 GiB of 80.0 GiB) | NEAR "
            "CAPACITY: peak at 94% of the device's memory | host ") in out, repr(out)
    assert machine.contexts == {0}, machine.contexts  # no context made anywhere else


def test_on_a_gpu_far_from_capacity_and_nvml_gone(shell, monkeypatch, capsys):
    machine = loaded_with_gpu(shell, monkeypatch, Gpu("A", total=80 * GIB, fail=GpuIsLost))
    monkeypatch.setattr(engine, "_is_tty", lambda stream: True)
    shell.run_line_magic("config", "TorchDeviceMagics.live_delay = 0.2")
    monkeypatch.setenv("COLUMNS", "300")
    machine.allocate(0, 2 * GIB)
    capsys.readouterr()
    shell.run_cell("import time\ntime.sleep(0.4)", store_history=True)
    out = capsys.readouterr().out
    assert ("running 0:00 | at line 2: time.sleep(0.4) | cuda:0 2.0 GiB allocated (peak 2.0 "
            "GiB of 80.0 GiB) | host ") in out, repr(out)
    assert "busy" not in out.split("cuda:0")[0] and "NEAR CAPACITY" not in out, repr(out)


def test_without_nvml_the_busy_part_is_dropped_and_the_report_says_why(
        shell, monkeypatch, capsys):
    machine = FakeMachine([Gpu("A", total=80 * GIB)], nvml=False).install(monkeypatch)
    machine.start_cuda(0)
    shell.run_line_magic("load_ext", "torch_device_magic")
    monkeypatch.setattr(engine, "_is_tty", lambda stream: True)
    monkeypatch.setenv("COLUMNS", "300")
    shell.run_line_magic("config", "TorchDeviceMagics.live_delay = 0.2")
    capsys.readouterr()
    shell.run_cell("import time\ntime.sleep(0.4)", store_history=True)
    out = capsys.readouterr().out
    assert "running 0:00 | at line 2: time.sleep(0.4) | cuda:0 0 B allocated" in out, repr(out)
    assert "GPU" not in out.split("\r\x1b[2Ktime ")[0], repr(out)
    assert "live line: GPU busy was not read (not available (" in out, repr(out)


@pytest.fixture
def gpu_term(shell, monkeypatch):
    """A shell with a fake GPU whose CUDA is up, as a terminal, the whole line shown."""
    machine = loaded_with_gpu(shell, monkeypatch, Gpu("A", total=80 * GIB))
    monkeypatch.setattr(engine, "_is_tty", lambda stream: True)
    monkeypatch.setenv("COLUMNS", "300")
    shell.run_line_magic("config", "TorchDeviceMagics.live_delay = 0.2")
    shell.magics_manager.registry["TorchDeviceMagics"].reporter.live.period_s = 0.1
    return shell, machine


def test_nvml_giving_no_samples_drops_the_busy_part_and_the_report_says_why_once(
        gpu_term, capsys):
    shell, _machine = gpu_term
    capsys.readouterr()
    shell.run_cell("import time\ntime.sleep(0.6)", store_history=True)
    out = capsys.readouterr().out
    line_, report = out.rsplit("\r\x1b[2K", 2)[1:]
    assert line_.startswith("running 0:00 | at line 2: time.sleep(0.6) | cuda:0 "), repr(out)
    assert "busy |" not in out, repr(out)
    said = "live line: GPU busy was not read (NVML gave no samples; an idle GPU gives none)"
    assert report.count(said) == 1 and report.startswith("time "), repr(out)


def test_nvml_failing_mid_cell_drops_the_busy_part_and_the_report_says_why_once(
        gpu_term, capsys):
    shell, _machine = gpu_term
    shell.user_ns["GpuIsLost"] = GpuIsLost
    capsys.readouterr()
    shell.run_cell("import time, os\nmachine.sample(0, [97] * 3, pid=os.getpid())\n"
                   "time.sleep(0.35)\nmachine.cuda[0].samples_fail = GpuIsLost\n"
                   "time.sleep(0.4)", store_history=True)
    out = capsys.readouterr().out
    drawn = out.split("\r\x1b[2K")[1:-1]
    assert "| GPU 97% busy |" in drawn[0], repr(out)
    after = [d for d in drawn if "at line 5" in d]
    assert after and not any("busy |" in d for d in after), repr(out)
    said = "live line: GPU busy was not read (NVML failed: GpuIsLost)"
    assert out.count("live line: GPU busy") == 1 and said in out, repr(out)
