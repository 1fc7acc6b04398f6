"""demo.ipynb, the tutorial: stored clean, prose before every cell, every magic used; on a
real kernel it runs through, says where it ran, teaches what it claims, reports every cell."""

from __future__ import annotations

import re

import nbformat
import pytest
import torch
from kernel import REPORT_LINE, ROOT, texts

from torch_device_magic.magics import GROUPS

pytestmark = pytest.mark.slow


def code_cells(nb: nbformat.NotebookNode) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code"]


def shown(nb: nbformat.NotebookNode, cell_id: str) -> str:
    """What the code cell with this id showed, as text."""
    return texts(next(c for c in nb.cells if c.get("id") == cell_id))


@pytest.fixture(scope="module")
def stored():
    return nbformat.read(ROOT / "demo.ipynb", as_version=4)


@pytest.fixture(scope="module")
def ran(demo):
    nb, failed = demo
    assert failed is None, f"the demo stopped at an error:\n{failed}"
    return nb


def test_it_is_stored_without_outputs(stored):
    for cell in code_cells(stored):
        assert cell.outputs == [] and cell.execution_count is None, cell.source


def test_a_sentence_of_prose_comes_before_every_code_cell(stored):
    for before, cell in zip(stored.cells, stored.cells[1:]):
        if cell.cell_type == "code":
            assert before.cell_type == "markdown" and before.source.strip(), cell.source
    assert stored.cells[0].cell_type == "markdown"


def test_it_uses_every_magic(stored):
    source = "\n".join(c.source for c in code_cells(stored))
    as_cell = set(re.findall(r"^%%(\w+)", source, re.M))
    as_line = set(re.findall(r"^%(\w+)", source, re.M))
    cell_magics = {name for group in GROUPS for name in group.magics["cell"]}
    assert cell_magics - as_cell == set()
    line_magics = {name for group in GROUPS for name in group.magics["line"]}
    assert line_magics - cell_magics - as_line == set()


def test_it_runs_through_and_only_the_hint_cell_fails_with_a_hint(ran):
    assert all(c.execution_count for c in code_cells(ran))
    for cell in code_cells(ran):
        failed = any(o.output_type == "error" for o in cell.outputs)
        expected = "raises-exception" in cell.metadata.get("tags", [])
        assert failed == expected, cell.source
        if failed:
            assert "Hint (torch_device_magic): the tensors this operation got are on " \
                   "different devices" in texts(cell)


def test_every_cell_after_loading_shows_a_report_line_or_the_gpumem_table(ran):
    load, *rest = code_cells(ran)
    assert "load_ext torch_device_magic" in load.source
    for cell in rest:
        if cell.source.startswith("%%gpumem"):
            assert not REPORT_LINE.search(texts(cell)), "a %%gpumem cell is reported once"
            assert re.search(r"^%%gpumem.*\n.*measure.*value", texts(cell), re.M)
            assert re.search(r"^wall time +\d", texts(cell), re.M), texts(cell)
        else:
            assert REPORT_LINE.search(texts(cell)), f"no report line under {cell.source!r}"


def ran_on(nb: nbformat.NotebookNode) -> str:
    """The device that the demo's closing cell says it ran on."""
    found = re.search(r"This notebook ran on (\S+?)[,:]", shown(nb, "where"))
    assert found, shown(nb, "where")
    return found[1]


def test_it_says_which_device_it_chose_and_where_it_ran(ran):
    chose = shown(ran, "auto").splitlines()[0]
    assert chose.startswith("device = "), chose
    if chose.endswith("using the CPU"):
        assert ran_on(ran) == "cpu"
    else:
        assert chose.startswith(f"device = {ran_on(ran)} ")


def test_the_model_its_optimizer_and_the_data_moved_together(ran):
    dev = ran_on(ran)
    assert f"model: {dev} | optimizer state: {dev} | data: {dev}" in shown(ran, "moved")
    assert "torch.from_numpy: cpu" in shown(ran, "factories")
    assert repr(torch.device(dev)) in shown(ran, "ondevice")  # the cell ran there


def test_devcompare_races_the_cpu_against_the_gpu_or_meta(ran):
    rival = "meta" if ran_on(ran) == "cpu" else ran_on(ran)
    table = shown(ran, "devcompare")
    assert re.search(r"^cpu +\d.* 1\.00×", table, re.M), table
    assert re.search(rf"^{re.escape(rival)} +\d", table, re.M), table


def test_what_the_tutorial_teaches_is_what_happens(ran):
    dev = ran_on(ran)
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", shown(ran, "train"))]
    assert len(losses) == 2 and losses[1] < losses[0] / 10
    assert "False" in shown(ran, "nograd") and "True" in shown(ran, "grad-back")
    assert "requires_grad: False" in shown(ran, "evaluate")
    assert "same predictions: True" in shown(ran, "checkpoint")
    # The batch built one sample at a time: 10,000 calls, 180-650 ms on a loaded 2-core
    # machine, where each later line can wait 10-100 ms for a core in its multithreaded
    # ops (not the tiny ones): that outweighed 2,000 calls (15-100 ms). Measured.
    assert "slowest: line 1, " in shown(ran, "profile")
    # the advice: batch it (one run of the line, its comprehension's calls)
    assert "line 1 ran 1 time: 10,000 calls of aten::randn (" in shown(ran, "profile")
    assert "one batched call: torch.randn(10000, 8), not torch.randn(8) 10,000 times" in shown(
        ran, "profile")
    assert re.search(r"^time .* \(profiled\) \| ", shown(ran, "profile"), re.M)
    assert re.search(r"^batch +\(65536, 8\) +float32", shown(ran, "gpumem"), re.M)
    assert shown(ran, "gpufree").startswith("garbage collected")
    assert re.search(rf"^model +module Sequential +{re.escape(dev)} ", shown(ran, "tensors"), re.M)
    assert re.search(rf"^optimizer +optimizer Adam +{re.escape(dev)} ", shown(ran, "tensors"), re.M)
    assert "True" in shown(ran, "materialise")
    cells, history = code_cells(ran), shown(ran, "history")
    measured = cells[1 : [c.get("id") for c in cells].index("history")]  # after loading
    for cell in measured:
        assert re.search(rf"^ *{cell.execution_count} +\d", history, re.M), cell.source
    assert shown(ran, "reset").startswith("device = cpu")


def test_the_compile_and_inference_cells_get_their_notes_and_the_fix_clears_them(ran):
    compiled = shown(ran, "compile")
    assert re.search(r"^time .*\ncompiled scale_and_sum: 1 frame in \d", compiled, re.M), compiled
    assert re.search(r"^recompiled scale_and_sum: .*size mismatch", compiled, re.M), compiled
    inference = shown(ran, "inference")
    assert re.search(r"^scores keeps an autograd graph holding \d+\.\d MiB: for inference run "
                     r"the cell under %%nograd", inference, re.M), inference
    fixed = shown(ran, "nograd")
    assert "False" in fixed and "autograd graph" not in fixed


@pytest.mark.cuda
def test_on_a_cuda_machine_it_runs_on_the_gpu(ran):
    assert shown(ran, "auto").startswith("device = cuda:")
    assert "This notebook ran on cuda:" in shown(ran, "where")
    assert "checkpoint loaded onto cuda:" in shown(ran, "checkpoint")
