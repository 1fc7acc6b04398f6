"""On a real Jupyter kernel: the per-cell line is one HTML+text display after the output."""

from __future__ import annotations

import pytest
from kernel import execute, notebook

pytestmark = pytest.mark.slow


def displays(cell):
    return [o for o in cell.outputs if o.output_type == "display_data"]


def test_report_is_one_display_with_html_after_the_cells_own_output():
    nb = notebook(
        "%load_ext torch_device_magic\nimport torch",
        "print('hello')\nx = torch.ones(10)",
        "%%gpumem\ny = torch.ones(10)",
    )
    execute(nb)
    assert displays(nb.cells[0]) == []  # the loading cell is not reported
    outputs = nb.cells[1].outputs
    assert [o.output_type for o in outputs] == ["stream", "display_data"]
    assert outputs[0].text == "hello\n"
    line = outputs[1].data
    assert line["text/plain"].startswith("time ") and "host" in line["text/plain"]
    assert 'class="tdm-report"' in line["text/html"]
    gpumem = displays(nb.cells[2])
    assert len(gpumem) == 1 and "%%gpumem" in gpumem[0].data["text/plain"]
