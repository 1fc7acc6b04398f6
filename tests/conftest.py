"""Fixtures: a fresh IPython shell per test whose `run_cell` re-raises (as jupysql does)."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import functools
import signal
import threading

import IPython
import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

import torch_device_magic
import torch_device_magic.probes  # the fixture reads it before any test imports it

_LIBC = None
with contextlib.suppress(OSError):
    _LIBC = ctypes.CDLL("libc.so.6")


@pytest.fixture(autouse=True)
def _fresh_heap():
    """Each test starts with the heap's free memory given back to the system.

    Freed tensors leave free, still resident chunks in glibc's heap (a test that
    moves 300,000 tensors leaves many MiB), and a later tensor of a few MiB can
    be carved out of them without RSS moving: the tests that measure host memory
    would then depend on which tests ran before them. `malloc_trim(0)` releases
    those pages, so new memory is memory the system sees again.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class RaisingShell(InteractiveShell):
    """An InteractiveShell whose run_cell raises the cell's error instead of printing it."""

    def run_cell(self, raw_cell, *args, **kwargs):
        result = super().run_cell(raw_cell, *args, **kwargs)
        result.raise_error()
        return result


def pytest_addoption(parser):
    """`pytest --update-golden` rewrites tests/golden/ from what the tables render now
    (as torchinfo's `--overwrite`); review the diff before committing it.
    `--test-timeout S` fails a test whose setup, call or teardown runs past S seconds
    (scripts/gpu-check gives one, so that a hang costs one test and not the run)."""
    parser.addoption(
        "--update-golden", action="store_true", default=False,
        help="rewrite the expected outputs in tests/golden/ instead of comparing with them",
    )
    parser.addoption(
        "--test-timeout", type=float, default=0.0, metavar="S",
        help="fail a test phase (setup, call, teardown) that runs past S seconds (0: never)",
    )


class TimedOut(BaseException):
    """A test's phase ran past `--test-timeout`. Not an Exception, as KeyboardInterrupt is
    not: a broad `except Exception` in the code under test must not swallow it."""


def _time_limited(item, phase):
    """Run a phase under `--test-timeout`: SIGALRM raises TimedOut in the test's own code
    (a wait on a lock, a pipe or a child is interrupted too, and a `subprocess.run` kills
    its child); a hang in C code that holds the GIL cannot be interrupted, so every
    thread's stack is dumped a little later, to say where it hangs. pytest-timeout's
    signal method does the same; it need not be installed."""
    limit = item.config.getoption("--test-timeout")
    if not limit or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimedOut(f"the test's {phase} ran past --test-timeout={limit:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit)
    faulthandler.dump_traceback_later(limit + 15)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _time_limited(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _time_limited(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _time_limited(item, "teardown")


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` skip, saying why, where torch sees no CUDA GPU.

    Tests on the test device go last: naming it cannot be undone in a process (from
    then on torch.accelerator names it), and the other tests expect no accelerator.
    Its library is loaded now, before any test runs a backward (see `tdmdev`)."""
    on_tdmdev = [item for item in items if "tdmdev" in getattr(item, "fixturenames", ())]
    if on_tdmdev:
        items.sort(key=lambda item: "tdmdev" in getattr(item, "fixturenames", ()))  # stable
        _tdmdev_library()
    needs_cuda = [item for item in items if item.get_closest_marker("cuda")]
    if not needs_cuda or torch.cuda.is_available():
        return
    from torch_device_magic.devices import take_inventory

    why = "; ".join(take_inventory().notes) or "torch sees none"
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU ({why})")
    for item in needs_cuda:
        item.add_marker(skip)


@pytest.fixture
def shell():
    """A fresh shell, not yet loaded with the extension."""
    RaisingShell.clear_instance()
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    ip = RaisingShell.instance(config=config)
    ip.run_line_magic("colors", "nocolor" if IPython.version_info[0] >= 9 else "NoColor")
    ip.run_cell("import torch")
    grad, default = torch.is_grad_enabled(), torch_device_magic.probes.torch_default_device()
    yield ip
    torch_device_magic.unload_ipython_extension(ip)
    # IPython registers every shell's exit operations with atexit, which would keep each
    # test's shell and namespace alive to the end and gc.collect() once per shell at exit
    # (minutes, on a heap that large).
    atexit.unregister(ip.atexit_operations)
    RaisingShell.clear_instance()
    torch.set_grad_enabled(grad)
    torch.set_default_device(default)


@pytest.fixture
def ip(shell):
    """A fresh shell with the extension loaded."""
    shell.run_line_magic("load_ext", "torch_device_magic")
    return shell


@pytest.fixture(scope="session")
def demo():
    """demo.ipynb, executed once per session on a real kernel and saved as out/demo.ipynb:
    the notebook and the CellExecutionError that stopped it (None when it ran through)."""
    from kernel import run_demo

    return run_demo()


@functools.cache
def _tdmdev_library() -> str | None:
    """Build (or reuse) and load the test device's library: None, or why it cannot be."""
    if not hasattr(getattr(torch, "accelerator", None), "memory_stats"):
        return f"the tdmdev test device needs torch >= 2.9 (this is {torch.__version__})"
    import testdevice

    try:
        testdevice.load_library()
    except Exception as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        why = next((line for line in lines if " error: " in line), lines[0])[:200]  # gcc's
        return f"the tdmdev test device could not be built: {why}"
    return None


@pytest.fixture(scope="session")
def tdmdev():
    """The project's PrivateUse1 test device (tests/testdevice), built once into a cache:
    "tdmdev:0" and "tdmdev:1" become devices and torch.accelerator's current accelerator.
    Tests that use it skip, saying why, where it cannot be built. Its library is loaded
    at collection, since autograd sizes its device queues at the first backward."""
    why = _tdmdev_library()
    if why:
        pytest.skip(why)
    import testdevice

    testdevice.load()
    return testdevice
