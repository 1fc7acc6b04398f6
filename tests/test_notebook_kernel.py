"""On a real Jupyter kernel: a failing magic cell stops the run like any failing cell."""

from __future__ import annotations

import pytest
from kernel import execute, notebook, texts
from nbclient.exceptions import CellExecutionError

pytestmark = pytest.mark.slow


def test_failing_nograd_cell_stops_the_run_with_its_own_error():
    nb = notebook(
        "%load_ext torch_device_magic\nimport torch",
        "%%nograd\nx = torch.ones(2)\nraise ValueError('boom in the cell')",
        "after = 1",
    )
    with pytest.raises(CellExecutionError) as err:
        execute(nb)
    assert "ValueError" in str(err.value) and "boom in the cell" in str(err.value)
    assert "torch.is_grad_enabled" not in texts(nb.cells[1])
    assert nb.cells[2].get("outputs", []) == [] and nb.cells[2].get("execution_count") is None


def test_out_and_usage_error_on_a_kernel():
    nb = notebook(
        "%load_ext torch_device_magic\nimport torch",
        "%%nograd\nt = torch.ones(2, requires_grad=True) * 3\nt.requires_grad",
        "%%nograd\n41 + 1;",
        "try:\n    get_ipython().run_line_magic('device', 'banana')\n"
        "except Exception as e:\n    print(type(e).__name__, e)",
    )
    execute(nb)
    results = [o for o in nb.cells[1].outputs if o.output_type == "execute_result"]
    assert [r.data["text/plain"] for r in results] == ["False"]
    assert not [o for o in nb.cells[2].outputs if o.output_type == "execute_result"]
    assert "UsageError 'banana' is not a device" in texts(nb.cells[3])
