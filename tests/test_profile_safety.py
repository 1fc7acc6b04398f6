"""%%profile never crashes the process, hides a fatal error, or leaves process-wide state
(torch's profiler, descriptor 2, a child's stderr, the SIGINT handler) other than it found
it, however the cell ends.

What could kill the process runs in a fresh IPython in a subprocess (tests marked slow),
whose real stderr is read afterwards; Ctrl-C is a real SIGINT in this process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from IPython.core.error import UsageError
from pythonpath import ROOT, child_env

SHELL = """\
import sys
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config
config = Config()
config.HistoryManager.hist_file = ":memory:"
ip = InteractiveShell.instance(config=config)
ip.run_line_magic("load_ext", "torch_device_magic")
for cell in CELLS:
    ip.run_cell(cell)
    sys.stdout.flush()
print("the session lives on")
"""


def ipython(*cells: str, faulthandler: bool = False) -> subprocess.CompletedProcess:
    """Run `cells` in a fresh IPython shell in another process: its exit code and what
    reached its real stdout and stderr."""
    script = f"CELLS = {[textwrap.dedent(c) for c in cells]!r}\n" + SHELL
    flags = ["-X", "faulthandler"] if faulthandler else []
    return subprocess.run([sys.executable, *flags, "-c", script], cwd=ROOT,
                          env=child_env(PYTHONUNBUFFERED="1"),
                          capture_output=True, text=True, timeout=300)


def recording() -> bool:
    return torch.autograd.profiler._is_profiler_enabled or torch.autograd._profiler_enabled()


@pytest.fixture(autouse=True)
def _left_as_found():
    """A test that fails here leaves no profiler on and no handler for the next ones."""
    yield
    if torch.autograd._profiler_enabled():
        torch.autograd._disable_profiler()
    torch.autograd.profiler._run_on_profiler_stop()
    signal.signal(signal.SIGINT, signal.default_int_handler)


# --- the cell's own torch.profiler --------------------------------------------------------


@pytest.mark.slow
def test_a_cell_with_its_own_profiler_keeps_the_session_and_its_profiler_works():
    run = ipython(
        "import torch\nkeep = 42",
        """\
        %%profile
        with torch.profiler.profile() as p:
            y = torch.ones(3) + 1
        z = torch.ones(2) * 2
        """,
        "theirs = {e.key for e in p.key_averages()}\n"
        "print('kept', keep, z.tolist(), sorted(theirs), any('tdm:' in k for k in theirs))",
        "%%profile -o\nw = torch.ones(2) - 1",
        "print('next', [r.name for r in _.ops if r.name == 'aten::sub'])",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "the cell's own torch.profiler ended this recording" in out
    assert "kept 42 [2.0, 2.0]" in out and "'aten::add'" in out
    assert "] False\n" in out  # none of %%profile's line ranges in the cell's own profile
    assert "next ['aten::sub']" in out and "the session lives on" in out


@pytest.mark.slow
def test_a_profiler_the_cell_leaves_recording_keeps_recording_for_the_user(tmp_path):
    trace = tmp_path / "theirs.json"
    run = ipython(
        "import torch",
        "%%profile\np = torch.profiler.profile()\np.start()\ny = torch.ones(3) + 1",
        f"z = torch.ones(3) * 5\np.stop()\np.export_chrome_trace({str(trace)!r})",
        "print('theirs', sorted({e.key for e in p.key_averages()} & {'aten::add', 'aten::mul'}))",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "theirs ['aten::add', 'aten::mul']" in run.stdout
    assert trace.stat().st_size


@pytest.mark.slow
@pytest.mark.parametrize("crash, said", [
    ("faulthandler._sigsegv()", "Fatal Python error: Segmentation fault"),
    ("os.write(2, b'terminate called after throwing c10::Error\\n'); os.abort()",
     "terminate called after throwing c10::Error"),
])
def test_a_fatal_error_while_recording_reaches_the_real_stderr(crash, said):
    run = ipython("import faulthandler, os, torch",
                  f"%%profile\nx = torch.ones(2) + 1\n{crash}", faulthandler=True)
    assert run.returncode < 0 and "the session lives on" not in run.stdout
    assert said in run.stderr and "Fatal Python error" in run.stderr


# --- a child started during a capture ---------------------------------------------------------


@pytest.mark.slow
def test_a_child_forked_or_spawned_in_a_profiled_cell_writes_to_the_real_stderr():
    run = ipython(
        "import os, subprocess, sys, torch",
        """\
        %%profile
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # a worker: it waits for a later cell, then says something
            os.read(r, 1)
            os.write(2, b"the forked child still speaks\\n")
            os._exit(0)
        spawned = subprocess.Popen([sys.executable, "-c",
                                    "import sys; sys.stdin.readline(); "
                                    "sys.stderr.write('the spawned child still speaks\\\\n')"],
                                   stdin=subprocess.PIPE)
        """,
        "os.write(w, b'x'); os.waitpid(pid, 0); spawned.communicate(b'go\\n')",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "the forked child still speaks" in run.stderr
    assert "the spawned child still speaks" in run.stderr


@pytest.mark.slow
def test_dataloader_workers_forked_in_a_profiled_cell_are_heard_in_later_epochs(tmp_path):
    flag = tmp_path / "epoch2"
    run = ipython(
        f"""\
        import os, torch
        from torch.utils.data import DataLoader, Dataset

        class Loud(Dataset):
            def __len__(self):
                return 2

            def __getitem__(self, i):
                epoch = 2 if os.path.exists({str(flag)!r}) else 1
                os.write(2, f"worker: epoch {{epoch}} item {{i}}\\n".encode())
                return i

        loader = DataLoader(Loud(), num_workers=2, persistent_workers=True,
                            multiprocessing_context="fork")
        """,
        "%%profile\nfirst = [int(b) for b in loader]",
        f"open({str(flag)!r}, 'w').close()\nsecond = [int(b) for b in loader]\ndel loader",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "worker: epoch 2 item 0" in run.stderr and "worker: epoch 2 item 1" in run.stderr


# --- Ctrl-C ---------------------------------------------------------------------------------


def _interrupt_around(monkeypatch, name: str, where: str, timers: list) -> None:
    """A real SIGINT at `torch.autograd.profiler.<name>`: just before it, just after it
    returns, or from another thread while it runs."""
    module = torch.autograd.profiler
    real = getattr(module, name)

    def interrupted(*args, **kwargs):
        if where == "during":
            timers.append(threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGINT)))
            timers[-1].start()
        if where == "before":
            os.kill(os.getpid(), signal.SIGINT)
        out = real(*args, **kwargs)
        if where == "after":
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(module, name, interrupted)


MANY_OPS = "x = torch.ones(4)\nfor _ in range(N):\n    x = x + 1"


@pytest.mark.parametrize("name, where", [
    ("_enable_profiler", "after"),
    ("_disable_profiler", "before"),
    ("_disable_profiler", "after"),
    ("_disable_profiler", "during"),
])
def test_ctrl_c_as_the_profiler_starts_or_stops_leaves_nothing_recording(
    ip, monkeypatch, name, where
):
    ip.user_ns["N"] = 20_000 if where == "during" else 10
    fd2 = os.fstat(2)
    timers: list = []
    _interrupt_around(monkeypatch, name, where, timers)
    with pytest.raises(KeyboardInterrupt):  # every step recorded: the stop is at the end
        ip.run_cell(f"%%profile --steps 0\n{MANY_OPS}")
    for timer in timers:
        timer.join()
    monkeypatch.undo()
    assert not recording()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert os.fstat(2).st_ino == fd2.st_ino and sys.gettrace() is None
    report = ip.run_cell("%%profile -o\ny = torch.ones(2) * 3").result
    assert {r.name for r in report.ops} >= {"aten::ones", "aten::mul"}
    assert "aten::add" not in {r.name for r in report.ops}  # nothing kept recording


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2, 0.6])
def test_ctrl_c_at_any_moment_of_a_capture_leaves_nothing_recording(ip, delay):
    ip.user_ns["N"] = 20_000
    timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
    try:  # the one KeyboardInterrupt comes wherever the signal finds the main thread
        try:
            timer.start()
            ip.run_cell(f"%%profile\n{MANY_OPS}")
        finally:
            timer.join()
            for _ in range(10_000):  # Python handles the signal between bytecodes
                pass
    except KeyboardInterrupt:
        pass
    assert not recording()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    report = ip.run_cell("%%profile -o\ny = torch.ones(2) * 3").result
    assert "aten::add" not in {r.name for r in report.ops}


def test_a_sigint_handler_of_the_users_own_sees_every_press_and_stays(ip, monkeypatch):
    presses: list[int] = []

    def stop_after_this_epoch(signum, frame):
        presses.append(signum)

    previous = signal.signal(signal.SIGINT, stop_after_this_epoch)
    try:
        _interrupt_around(monkeypatch, "_disable_profiler", "after", [])
        report = ip.run_cell("%%profile -o\nimport os, signal\n"
                             "os.kill(os.getpid(), signal.SIGINT)\nx = torch.ones(2) * 3").result
        for _ in range(10_000):
            pass
        assert len(presses) == 2  # one while the cell ran, one held while the profiler stopped
        assert "aten::mul" in {r.name for r in report.ops}
        assert signal.getsignal(signal.SIGINT) is stop_after_this_epoch and not recording()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_torch_profiler_running_is_refused_however_it_was_started(ip):
    other = torch.autograd.profiler.profile()  # started as torch's own internals can, not
    other._prepare_trace()                     # setting the flag its `with` block sets
    torch.autograd._enable_profiler(other.config(create_trace_id=False), other.kineto_activities)
    try:
        with pytest.raises(UsageError, match=r"a torch\.profiler is already recording"):
            ip.run_cell("%%profile\nx = 1")
    finally:
        torch.autograd._disable_profiler()
    assert "x" not in ip.user_ns


# --- descriptor 2 ---------------------------------------------------------------------------


def test_the_allocators_warning_stays_out_of_the_output_while_the_cell_has_the_real_stderr(
    ip, capfd
):
    ip.run_cell("import os\nold = [torch.ones(3) for _ in range(50)]")
    capfd.readouterr()
    ip.run_cell("%%profile\nos.write(2, b'the cell wrote this\\n')\nold = None")
    err = capfd.readouterr().err
    assert "the cell wrote this" in err
    assert "Memory block of unknown size" not in err and "profiler_st" not in err
