"""The live line in the IPython terminal, through a pseudo-terminal, with the screen read
by a terminal emulator (pyte), with --simple-prompt and with the default prompt
(prompt_toolkit): one status line while the cell runs, never mixed into what
the cell prints, and gone when the report line comes."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from collections.abc import Callable

import pexpect
import pytest
from pythonpath import ROOT, child_env
from test_terminal import PROMPT

pyte = pytest.importorskip("pyte")
pytestmark = pytest.mark.slow
COLUMNS, ROWS = 120, 40
SETUP = "%load_ext torch_device_magic\n%config TorchDeviceMagics.live_delay = 0.2\nimport time\n"


class Screen:
    """`python -m IPython --simple-prompt`, everything it writes fed to a pyte screen."""

    def __init__(self, ipython_dir: str) -> None:
        env = child_env(IPYTHONDIR=ipython_dir, TERM="xterm", PYTHONIOENCODING="utf-8")
        self.raw = io.StringIO()
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "IPython", "--simple-prompt", "--no-banner", "--colors=nocolor",
             "--HistoryManager.hist_file=:memory:"],
            cwd=str(ROOT), env=env, encoding="utf-8", timeout=90, dimensions=(ROWS, COLUMNS),
        )
        self.child.logfile_read = self.raw
        self.screen = pyte.Screen(COLUMNS, ROWS)
        self.stream = pyte.Stream(self.screen)
        self.child.expect(PROMPT)

    def cell(self, source: str, interrupt_at: str | None = None) -> tuple[list[str], str]:
        """Type `source` (one line), and Ctrl-C once `interrupt_at` shows; the screen's lines
        that the cell left, and what it wrote raw (escapes included)."""
        start = self.raw.tell()
        self.screen.reset()
        self.child.sendline(source)
        if interrupt_at is not None:
            self.child.expect(interrupt_at)
            self.child.sendintr()
        self.child.expect(PROMPT)
        raw = self.raw.getvalue()[start:]
        self.stream.feed(raw)
        lines = [ln.rstrip() for ln in self.screen.display]
        shown = [ln for ln in lines if ln and not ln.startswith("In [")]
        return [ln for ln in shown if ln != source.strip()], raw  # not the echo of the typing

    def close(self) -> None:
        self.child.sendline("exit()")
        self.child.expect(pexpect.EOF)


@pytest.fixture(scope="module")
def term(tmp_path_factory):
    t = Screen(str(tmp_path_factory.mktemp("ipython")))
    for line in SETUP.splitlines():
        t.cell(line)
    yield t
    t.close()


def test_a_long_cell_shows_a_live_line_that_the_report_takes_the_place_of(term):
    lines, raw = term.cell("import time; time.sleep(0.7)")
    assert "running 0:00 | at line 1: import time; time.sleep(0.7) | host " in raw, raw
    assert "\r\x1b[2K" in raw
    assert len(lines) == 1 and lines[0].startswith("time "), lines  # the line gone


def test_what_the_cell_prints_is_never_mixed_with_the_live_line(term):
    lines, raw = term.cell("for i in range(4): print(f'step {i}', flush=True); time.sleep(0.3)")
    assert "running" in raw, raw
    assert lines[:4] == ["step 0", "step 1", "step 2", "step 3"], lines
    assert len(lines) == 5 and lines[4].startswith("time "), lines


def test_a_line_left_open_is_not_drawn_over(term):
    lines, _raw = term.cell("print('part', end='', flush=True); time.sleep(0.6); print(' end')")
    assert lines[0] == "part end" and lines[1].startswith("time "), lines


def test_ctrl_c_ends_the_live_line_cleanly(term):
    lines, raw = term.cell("time.sleep(30)", interrupt_at="running 0:0")
    assert "KeyboardInterrupt:" in lines and lines[-1].startswith("time "), lines
    assert "(interrupted)" in lines[-1], lines
    assert not any("running" in ln for ln in lines), lines
    lines, raw = term.cell("1 + 1")
    assert lines[0].startswith("Out[") and "running" not in raw, lines


def test_no_live_line_where_stdout_is_not_a_terminal(tmp_path):
    cells = SETUP + "import time; time.sleep(0.7)\n"
    done = subprocess.run(
        [sys.executable, "-m", "IPython", "--simple-prompt", "--no-banner",
         "--colors=nocolor", "--HistoryManager.hist_file=:memory:"],
        input=cells, capture_output=True, text=True, cwd=str(ROOT), timeout=120,
        env=child_env(IPYTHONDIR=str(tmp_path)),
    )
    assert "time " in done.stdout, done.stdout
    assert "running" not in done.stdout and "\x1b[2K" not in done.stdout, done.stdout


class PromptScreen:
    """`python -m IPython` with its default prompt (prompt_toolkit): everything it writes is
    fed to a pyte screen as it comes, which answers its cursor position requests."""

    def __init__(self, ipython_dir: str) -> None:
        env = child_env(IPYTHONDIR=ipython_dir, TERM="xterm", PYTHONIOENCODING="utf-8")
        self.screen = pyte.Screen(COLUMNS, ROWS)
        stream = pyte.Stream(self.screen)
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "IPython", "--no-banner", "--colors=nocolor",
             "--HistoryManager.hist_file=:memory:"],
            cwd=str(ROOT), env=env, encoding="utf-8", timeout=90, dimensions=(ROWS, COLUMNS),
        )
        self.screen.write_process_input = self.child.send  # pyte answers ESC[6n
        self.child.logfile_read = type("Feed", (), {"write": staticmethod(stream.feed),
                                                   "flush": staticmethod(lambda: None)})()
        self.count = 1
        self.until(lambda lines: any(ln.startswith("In [1]:") for ln in lines))

    def until(self, seen: Callable[[list[str]], bool]) -> list[str]:
        """Read what IPython writes until the screen's lines are `seen` (90 s at most)."""
        for _ in range(450):
            lines = [ln.rstrip() for ln in self.screen.display]
            if seen(lines):
                return lines
            with contextlib.suppress(pexpect.TIMEOUT):
                self.child.read_nonblocking(1 << 16, timeout=0.2)
        raise AssertionError("\n".join(self.screen.display))

    def cell(self, source: str, while_running: str | None = None) -> tuple[list[str], list[str]]:
        """Type `source`; the screen once `while_running` shows (if given), and the lines
        between the cell's prompt and the next one at the end."""
        this, self.count = f"In [{self.count}]: {source}", self.count + 1
        self.child.sendline(source)
        during = ([] if while_running is None else
                  self.until(lambda lines: any(while_running in ln for ln in lines)))
        after = f"In [{self.count}]:"
        lines = self.until(lambda lines: any(ln.startswith(after) for ln in lines))
        start = lines.index(this) + 1
        return during, lines[start:lines.index(next(ln for ln in lines if ln.startswith(after)))]

    def close(self) -> None:
        self.child.sendline("exit()")
        self.child.expect(pexpect.EOF)


def test_with_the_default_prompt_the_line_shows_then_the_output_and_report_alone(tmp_path):
    term = PromptScreen(str(tmp_path))
    try:
        for line in SETUP.splitlines():
            term.cell(line)
        during, lines = term.cell(
            "for i in range(3): print(f'step {i}', flush=True); time.sleep(0.4)",
            while_running="running 0:0")
        (drawn,) = [ln for ln in during if "running 0:0" in ln]
        assert drawn.startswith("running 0:0") and "| at line 1: for i in range(3)" in drawn
        shown = [ln for ln in lines if ln]  # IPython leaves a blank line before the prompt
        assert shown[:3] == ["step 0", "step 1", "step 2"], lines
        assert len(shown) == 4 and shown[3].startswith("time ") and "running" not in shown[3]
    finally:
        term.close()
