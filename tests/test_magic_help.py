"""What `%name?` shows and what a magic's usage says is what the magics accept."""

from __future__ import annotations

import pytest
import torch
from IPython.core.error import UsageError


@pytest.mark.parametrize("name", ["gpumem", "profile"])
def test_the_single_percent_form_of_a_cell_magic_shows_its_help(ip, capsys, name):
    ip.run_cell(f"%{name}?")
    out = capsys.readouterr().out
    assert f"Object `%{name}` not found" not in out
    assert f"%%{name} [-" in out  # its usage, under the cell magic's name


@pytest.mark.parametrize(("line", "body"), [("gpumem", "the code to measure"),
                                            ("profile -n 2", "the code to profile")])
def test_a_cell_magic_used_as_a_line_magic_says_so_in_one_sentence(ip, line, body):
    name = line.split()[0]
    with pytest.raises(UsageError) as err:
        ip.run_cell(f"ran = True\n%{line}")
    assert type(err.value) is UsageError
    assert str(err.value) == (
        f"%{name} is a cell magic: put %%{name} on a cell's first line and {body} under it"
    )


def test_a_cell_magics_option_mistake_names_the_cell_form(ip):
    with pytest.raises(UsageError, match=r"^%%gpumem: unrecognized arguments: --bogus "
                                         r"\(see %gpumem\? for its options\)$"):
        ip.run_cell("%%gpumem --bogus\nx = 1")
    assert "x" not in ip.user_ns


def test_nograd_usage_says_what_the_line_and_the_cell_form_take(ip, capsys):
    ip.run_cell("%nograd?")
    out = capsys.readouterr().out
    assert "%nograd on|off\n  %%nograd [--inference]\n" in out
    assert "%nograd [--inference] [mode]" not in out


def test_nograd_inference_on_as_a_line_is_refused_saying_why_and_changes_nothing(ip):
    with pytest.raises(UsageError, match=r"^%nograd takes no --inference: inference mode is "
                                         r"for one cell \(%%nograd --inference\)"):
        ip.run_cell("%nograd --inference on")
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_gpumem_on_meta_is_refused_in_one_sentence_and_runs_nothing(ip):
    with pytest.raises(UsageError, match=r"^%%gpumem --device meta: meta tensors hold no memory"):
        ip.run_cell("%%gpumem --device meta\nran = True")
    assert "ran" not in ip.user_ns


def test_gpumem_on_the_cpu_measures_host_memory(ip):
    report = ip.run_cell("%%gpumem --device cpu -o\nran = True").result
    assert ip.user_ns["ran"] and report.device is None and report.host_peak_bytes is not None
