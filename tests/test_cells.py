"""The cell runner, directly and under the magics: a body's value, `;`, the cell's number,
`cell_names` (which names a cell reads), and a body that cannot run."""

from __future__ import annotations

import types

import pytest
import torch
from IPython.core.error import UsageError

from torch_device_magic import cells
from torch_device_magic.cells import (
    cell_names,
    cell_number,
    compiled,
    ends_with_semicolon,
    names_bound,
    names_changed,
)
from torch_device_magic.errors import DeviceMagicError


@pytest.mark.parametrize(("code", "expected"), [
    # the roots of attribute and subscript chains, and `x += 1`, read the global
    ("y = model(x).sum()\nbatch['a'].data[0] += w.grad\nopt.step()\nz += 1\ndel gone",
     {"model", "x", "batch", "w", "opt", "z"}),
    # a parameter, a lambda's, a comprehension's variable, a function's local are not it
    ("def f(x):\n    return x * 2\nf(a)", {"f", "a"}),
    ("g = lambda x, *, w=w0: x + w", {"w0"}),
    ("ys = [x for x in data]\nzs = {k: v for k, v in pairs}\ns = sum(t for t in ts)",
     {"data", "pairs", "sum", "ts"}),
    # (3.12 inlines comprehensions, PEP 709: its symtable puts their variables at the top)
    ("[y for x in xs for y in x if y]\nprint(x)", {"xs", "print", "x"}),
    ("[x for x in x]\n[(n := v) for v in vs]\nm = [k for k in ks]", {"x", "vs", "ks"}),
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


@pytest.mark.parametrize(("cell", "silent"), [
    ("x", False), ("x;", True), ("x;  # quiet", True), ("x;\n\n", True), ("a = 1; b", False),
    ("'a;'", False), ("f(';')", False), ("x = (", False), ("", False), ("# only;", False),
])
def test_a_trailing_semicolon_is_the_last_token_not_a_character(cell, silent):
    assert ends_with_semicolon(cell) is silent


def test_the_cell_number_is_the_displayhooks_when_it_has_one():
    result = types.SimpleNamespace(execution_count=7)
    shell = types.SimpleNamespace(displayhook=types.SimpleNamespace(exec_result=result),
                                  execution_count=8)
    assert cell_number(shell) == 7
    shell.displayhook.exec_result = None  # outside a cell: the shell's counter
    assert cell_number(shell) == 8


def test_the_cell_number_inside_a_cell_is_its_in_number(shell):
    n = shell.execution_count
    shell.run_cell("from torch_device_magic.cells import cell_number\n"
                   "n = cell_number(get_ipython())", store_history=True)
    assert shell.user_ns["n"] == n


def test_run_binds_in_the_namespace_and_returns_the_last_expression(shell):
    assert cells.run(shell, "x = 2\ndef f():\n    return x * 21\nf()") == 42
    assert shell.user_ns["x"] == 2 and callable(shell.user_ns["f"])
    assert cells.run(shell, "x + 1;") is None  # silenced, as Out[n] is
    assert cells.run(shell, "y = x") is None and shell.user_ns["y"] == 2


def test_run_transforms_the_cell_as_ipython_does(shell):
    assert cells.run(shell, "z = %pwd\nlen(z) > 0") is True


def test_run_lets_the_users_exception_through_unchanged(shell):
    shell.user_ns["error"] = KeyError("mine")
    with pytest.raises(KeyError) as err:
        cells.run(shell, "ran = True\nraise error")
    assert err.value is shell.user_ns["error"] and shell.user_ns["ran"] is True


def test_compiled_compiles_once_and_runs_at_each_call(shell, monkeypatch):
    shell.user_ns["runs"] = []
    execute = compiled(shell, "runs.append(1)\nlen(runs)")
    monkeypatch.setattr(shell, "transform_cell", None)  # it is not transformed again
    assert [execute(), execute(), execute()] == [1, 2, 3]


def test_compiled_refuses_a_syntax_error_before_anything_runs(shell, capsys):
    with pytest.raises(DeviceMagicError, match="the cell did not run: it has the syntax error"):
        compiled(shell, "ran = True\nx +")
    assert "SyntaxError" in capsys.readouterr().out and "ran" not in shell.user_ns


@pytest.mark.parametrize("source, bound", [
    ("ys = [x for x in data]\nimport os\n[os for os in ()]", {"ys", "os"}),
    ("def x(): pass\n{x: 1 for x in ()}", {"x"}),
    ("z = sum(t for t in ts)\nfor i in r: pass", {"z", "i"}),
])
def test_names_bound_are_the_top_levels_not_a_comprehensions(source, bound):
    assert names_bound(source) == bound


@pytest.mark.parametrize("source, changed", [
    ("x.data = torch.randn(3)", {"x"}),
    ("x.resize_(3, 3)", {"x"}),
    ("del x.grad", {"x"}),
    ("a, x.data = 1, y", {"x"}),
    ("m.cuda()", {"m"}),
    ("m.to('meta')", {"m"}),
    ("m[0] = layer", {"m"}),
    ("m.layer.weight.requires_grad_(False)", {"m"}),
    ("x.to('cuda')", set()),  # a tensor's .to returns a copy
    ("x[0] = 1", set()),  # a tensor's values, not its shape
    ("y = x.double() + m(x)", set()),
    ("torch.nn.init.zeros_(x)", set()),  # values only
    ("x = x.double()", set()),  # a binding: names_bound's
    ("other.data = x", set()),
    ("this is not python", set()),
])
def test_names_changed_are_those_changed_where_they_stand(source, changed):
    assert names_changed(source, {"x", "m"}, modules={"m"}) == changed
