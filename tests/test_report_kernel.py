"""On a real Jupyter kernel: the per-cell line is one HTML+text display after the output."""

from __future__ import annotations

import pytest
from kernel import execute, notebook

pytestmark = pytest.mark.slow

PRINTS = """\
import sys, time
print('first')
time.sleep(0.3)  # ipykernel sends buffered output every 0.2 s: 'first' goes alone
print('x' * 100_000)
print('oops', file=sys.stderr)
display('shown')
print('last')"""

# Counts the cells whose report went through ZMQDisplayPublisher.publish, which waits
# for two stream flushes; ours queues the flushes and its message without waiting.
COUNT_PUBLISH = """\
from ipykernel.zmqshell import ZMQDisplayPublisher
_plain = ZMQDisplayPublisher.publish
published = []
def _counting(self, data, *args, **kwargs):
    published.append(data.get('text/plain', ''))
    return _plain(self, data, *args, **kwargs)
ZMQDisplayPublisher.publish = _counting"""


def displays(cell):
    return [o for o in cell.outputs if o.output_type == "display_data"]


def streams(cell, name):
    return "".join(o.text for o in cell.outputs if o.get("name") == name)


def assert_report_last(cell):
    *before, report = cell.outputs
    assert report.output_type == "display_data"
    assert report.data["text/plain"].startswith("time ")
    assert 'class="tdm-report"' in report.data["text/html"]
    assert all(not o.get("data", {}).get("text/plain", "").startswith("time ") for o in before)


def test_report_is_one_display_with_html_after_the_cells_own_output():
    nb = notebook(
        "%load_ext torch_device_magic\nimport torch",
        "print('hello')\nx = torch.ones(10)",
        "%%gpumem\ny = torch.ones(10)",
        COUNT_PUBLISH,
        PRINTS,
        "published",
        # A transform hook is something only ZMQDisplayPublisher.publish applies:
        # with one registered the report takes the plain path, in the same order.
        "get_ipython().display_pub.register_hook(lambda msg: msg)",
        PRINTS,
    )
    execute(nb)
    (loaded,) = displays(nb.cells[0])  # the loading cell's line: importing torch, mostly
    assert loaded.data["text/plain"].startswith("time ") and "host +" in loaded.data["text/plain"]
    outputs = nb.cells[1].outputs
    assert [o.output_type for o in outputs] == ["stream", "display_data"]
    assert outputs[0].text == "hello\n"
    line = outputs[1].data
    assert line["text/plain"].startswith("time ") and "host" in line["text/plain"]
    assert 'class="tdm-report"' in line["text/html"]
    gpumem = displays(nb.cells[2])
    assert len(gpumem) == 1 and "%%gpumem" in gpumem[0].data["text/plain"]

    for cell in nb.cells[4], nb.cells[7]:
        assert_report_last(cell)
        assert streams(cell, "stdout") == "first\n" + "x" * 100_000 + "\nlast\n"
        assert streams(cell, "stderr") == "oops\n"
        shown, _report = displays(cell)
        assert shown.data["text/plain"] == "'shown'"
    # the queued path was taken: only display('shown') went through publish
    assert nb.cells[5].outputs[0].data["text/plain"] == "[\"'shown'\"]"
