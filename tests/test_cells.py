"""The cell runner and `cell_names`: which names a cell reads, and a body that cannot run."""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError

from torch_device_magic.cells import cell_names


@pytest.mark.parametrize(("code", "expected"), [
    # the roots of attribute and subscript chains, and `x += 1`, read the global
    ("y = model(x).sum()\nbatch['a'].data[0] += w.grad\nopt.step()\nz += 1\ndel gone",
     {"model", "x", "batch", "w", "opt", "z"}),
    # a parameter, a lambda's, a comprehension's variable, a function's local are not it
    ("def f(x):\n    return x * 2\nf(a)", {"f", "a"}),
    ("g = lambda x, *, w=w0: x + w", {"w0"}),
    ("ys = [x for x in data]\nzs = {k: v for k, v in pairs}\ns = sum(t for t in ts)",
     {"data", "pairs", "sum", "ts"}),
    ("def step():\n    x = torch.ones(2)\n    return x", {"torch"}),
    # a function that reads a global reads it; so does one that declares it global
    ("def train():\n    loss = model(batch).sum()\n    return loss", {"model", "batch"}),
    ("def bump():\n    global count\n    count += 1\n    local += 1", {"count"}),
    # a closure's variable belongs to its function; a method reads globals, not the class's
    ("def outer(x):\n    def inner():\n        return x + y\n    return inner", {"y"}),
    ("class Net:\n    k = 3\n    def forward(self, x):\n        return x * k", {"k"}),
    ("a = 1\nfor i in r: pass\ndef f():\n    return g(h)", {"r", "g", "h"}),
    ("for b in batches:\n    try:\n        total += b\n    except E:\n        n -= 1",
     {"batches", "b", "total", "E", "n"}),
    ("await fetch(x)", {"fetch", "x"}),
    ("x = (", set()),
])
def test_cell_names_are_the_free_global_names_the_cell_reads(code, expected):
    assert cell_names(code) == expected


def plain_run(ip, cell):
    """Run a cell as a kernel does: its error printed, not raised."""
    return super(type(ip), ip).run_cell(cell, store_history=True)


@pytest.mark.parametrize("magic", ["%%nograd", "%%devcompare cpu meta", "%%ondevice meta"])
def test_a_syntax_error_reads_as_a_plain_cells_and_runs_nothing(ip, capsys, magic):
    ip.run_cell("x = torch.ones(2)")
    capsys.readouterr()
    n = ip.execution_count
    result = plain_run(ip, f"{magic}\nran = True\nx +\n")
    out, err = capsys.readouterr()
    assert not result.success and type(result.error_in_exec) is UsageError
    assert "SyntaxError" in out and "x +" in out
    assert f"Cell In[{n}], line 2" in out or f'<ipython-input-{n}-' in out
    assert "Traceback" not in out and "torch_device_magic" not in out + err
    assert err.strip().splitlines() == [
        "UsageError: the cell did not run: it has the syntax error above"
    ]
    assert "ran" not in ip.user_ns and ip.user_ns["x"].device.type == "cpu"


@pytest.mark.parametrize("magic", ["%%nograd", "%%devcompare cpu meta", "%%ondevice meta"])
def test_top_level_await_is_refused_in_one_line(ip, magic):
    ip.run_cell("import asyncio\nx = torch.ones(2)")
    with pytest.raises(UsageError) as err:
        ip.run_cell(f"{magic}\nran = x.sum()\nawait asyncio.sleep(0)")
    assert type(err.value) is UsageError
    assert str(err.value) == (
        "`await` outside a function (line 2) cannot run under a cell magic: "
        "await it in a cell of its own"
    )
    assert "ran" not in ip.user_ns and ip.user_ns["x"].device == torch.device("cpu")
