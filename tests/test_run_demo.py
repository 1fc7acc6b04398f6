"""`python3 scripts/dev.py demo` says first that a kernel is loading, then prints each
cell as soon as it has run, not all of them at the end."""

from __future__ import annotations

import importlib

import pytest
from kernel import execute, notebook

run_demo = importlib.import_module("run_demo")  # scripts/run_demo.py: kernel put it on the path


def test_main_says_the_kernel_is_loading_then_prints_each_cell_as_it_finishes(
        monkeypatch, capsys, tmp_path):
    nb = notebook("print('first')", "print('second')")
    printed_when_run: list[str] = []  # what had been printed when each cell ran

    def fake_execute(nb, timeout, on_cell):
        for cell in nb.cells:
            printed_when_run.append(capsys.readouterr().out)
            cell.execution_count = len(printed_when_run)
            cell.outputs = [run_demo.nbformat.v4.new_output("stream", text=text)
                            for text in ("one ", "piece\n")]
            on_cell(cell)
        return nb

    monkeypatch.setattr(run_demo.nbformat, "read", lambda *a, **k: nb)
    monkeypatch.setattr(run_demo, "execute", fake_execute)
    monkeypatch.setattr(run_demo, "write_html", lambda nb, path: path)
    monkeypatch.setattr(run_demo, "OUT", tmp_path)
    monkeypatch.setattr(run_demo.run_demo, "__defaults__", (tmp_path, 600, None))
    assert run_demo.main() == 0
    first, second = printed_when_run
    assert first.startswith("starting a Jupyter kernel") and "[1]" not in first
    assert second == "\n[1] print('first')\n    one piece\n"  # cell 1, before cell 2 ran


@pytest.mark.slow
def test_execute_hands_each_cell_over_before_the_next_one_runs(tmp_path):
    flag = tmp_path / "second-ran"
    nb = notebook("print('first')", f"open({str(flag)!r}, 'w').close()")
    seen: list[tuple[str, bool]] = []
    execute(nb, on_cell=lambda cell: seen.append((cell.source, flag.exists())))
    assert seen == [(nb.cells[0].source, False), (nb.cells[1].source, True)]
