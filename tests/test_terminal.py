"""The IPython terminal, driven through a pseudo-terminal as a user types into it."""

from __future__ import annotations

import os
import re
import sys

import pexpect
import pytest
from pythonpath import ROOT, child_env

pytestmark = pytest.mark.slow

PROMPT = r"In \[\d+\]: "
DURATION = re.compile(r"\d+(\.\d+)? (µs|ms|s)\b")


class Terminal:
    """`python -m IPython --simple-prompt` in a fresh IPYTHONDIR, without colors."""

    def __init__(self, ipython_dir: str) -> None:
        env = child_env(IPYTHONDIR=ipython_dir, TERM="dumb", PYTHONIOENCODING="utf-8")
        self.child = pexpect.spawn(
            sys.executable,
            ["-m", "IPython", "--simple-prompt", "--no-banner", "--colors=nocolor",
             "--HistoryManager.hist_file=:memory:"],
            cwd=str(ROOT), env=env, encoding="utf-8", timeout=90, dimensions=(50, 200),
        )
        self.child.expect(PROMPT)

    def cell(self, *lines: str) -> str:
        """Type `lines`; return what the cell printed, without the echo of what was typed."""
        for line in lines:
            self.child.sendline(line)
        self.child.expect(PROMPT)
        typed = {line.strip() for line in lines}
        shown = self.child.before.replace("\r\n", "\n").splitlines()
        return "\n".join(ln for ln in shown if ln.strip() and ln.strip() not in typed)


def test_a_session_in_the_ipython_terminal(tmp_path):
    term = Terminal(str(tmp_path))
    assert "Error" not in term.cell("%load_ext torch_device_magic")

    auto = term.cell("%device auto")
    assert auto.splitlines()[0].startswith("device = "), auto

    term.cell("import torch; w = torch.ones(3, requires_grad=True)")
    report = term.cell("z = w * 2")
    assert len(report.splitlines()) == 1 and DURATION.search(report), report
    assert "<" not in report, f"the terminal got HTML: {report!r}"

    glued = term.cell('print("x", end="")')  # the line starts on a line of its own
    assert glued.splitlines()[0] == "x" and DURATION.search(glued.splitlines()[1]), glued

    # --simple-prompt reads a cell magic until its joined lines end with a blank line
    nograd = term.cell("%%nograd", "y = w * 2", "y.requires_grad", "", "")
    assert re.search(r"Out\[\d+\]: False", nograd), nograd
    assert re.search(r"Out\[\d+\]: True", term.cell("torch.is_grad_enabled()"))

    error = term.cell("%device banana")
    assert error.splitlines()[0].startswith("UsageError: 'banana' is not a device"), error
    assert "Traceback" not in error

    term.child.sendline("exit()")
    term.child.expect(pexpect.EOF)
    term.child.close()
    assert term.child.exitstatus == 0, term.child.before


def test_devhistory_plot_in_the_terminal_saves_a_png_and_says_where(tmp_path):
    pytest.importorskip("matplotlib")
    term = Terminal(str(tmp_path))
    term.cell("%load_ext torch_device_magic")
    said = term.cell("%devhistory --plot")
    assert "<Figure" not in said, said
    found = re.search(r"the plot is in (\S+\.png)", said)
    assert found, said
    with open(found.group(1), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    os.remove(found.group(1))
    term.child.sendline("exit()")
    term.child.expect(pexpect.EOF)
