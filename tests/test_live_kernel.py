"""The live line on a real ipykernel, read from IOPub as a frontend gets it: a display with
a display_id under a long cell, updated in place, then replaced by the report line; every
message the cell's own, never a later cell's."""

from __future__ import annotations

import sys

import pytest
from pythonpath import child_env

pytestmark = pytest.mark.slow
jupyter_client = pytest.importorskip("jupyter_client.manager")

SETUP = "%load_ext torch_device_magic\n%config TorchDeviceMagics.live_delay = 0.2"
SHOWN = ("stream", "display_data", "update_display_data", "error")


class Kernel:
    """A real kernel of this Python, and its IOPub messages as a frontend reads them."""

    def __init__(self) -> None:
        self.km = jupyter_client.KernelManager(kernel_name="python3")
        self.km.kernel_spec.argv[0] = sys.executable
        self.km.start_kernel(env=child_env())
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, *cells: str) -> dict[str, list[dict]]:
        """Send `cells` at once (queued as a frontend does); each one's shown messages."""
        ids = [self.kc.execute(code) for code in cells]
        shown: dict[str, list[dict]] = {i: [] for i in ids}
        idle: set[str] = set()
        while idle != set(ids):
            msg = self.kc.get_iopub_msg(timeout=60)
            parent = msg["parent_header"].get("msg_id")
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                idle.add(parent)
            elif msg["msg_type"] in SHOWN:
                assert parent in shown, f"a message of no cell of ours: {msg}"
                shown[parent].append(msg)
        return shown

    def cell(self, code: str) -> list[dict]:
        return next(iter(self.run(code).values()))

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    k.cell(SETUP)
    yield k
    k.close()


def text(msg: dict) -> str:
    content = msg["content"]
    return content.get("text") or content.get("data", {}).get("text/plain", "")


def display_id(msg: dict) -> str | None:
    return msg["content"].get("transient", {}).get("display_id")


def outputs(messages: list[dict]) -> list[str]:
    """What a frontend shows at the end: each display updated in place, in its place."""
    shown: list[list[str]] = []
    by_id: dict[str, list[str]] = {}
    for msg in messages:
        kind, did = msg["msg_type"], display_id(msg)
        if kind == "update_display_data":
            by_id[did][0] = text(msg)
            continue
        slot = [text(msg)]
        shown.append(slot)
        if did is not None:
            by_id[did] = slot
    return [s[0] for s in shown]


def test_a_long_cell_gets_a_live_line_that_the_report_replaces_in_place(kernel):
    live = "get_ipython().magics_manager.registry['TorchDeviceMagics'].reporter.live"
    kernel.cell(f"{live}.period_s = 0.3")
    messages = kernel.cell("import time\nfor i in range(3):\n    time.sleep(0.3)\n")
    kernel.cell(f"{live}.period_s = 1.0")
    first, *updates = messages
    assert first["msg_type"] == "display_data" and display_id(first), messages
    assert text(first).startswith("running 0:00 | at line 3: time.sleep(0.3) | host "), first
    assert "tdm-live" in first["content"]["data"]["text/html"]
    assert "cores busy" in text(updates[0]), messages  # from the second tick on
    assert all(m["msg_type"] == "update_display_data" and display_id(m) == display_id(first)
               for m in updates), messages
    assert updates and text(updates[-1]).startswith("time "), messages  # the report, in place
    assert 'class="tdm-report"' in updates[-1]["content"]["data"]["text/html"]
    (shown,) = outputs(messages)  # nothing left over, nothing twice
    assert shown.startswith("time ") and "running" not in shown


def test_a_short_cell_shows_no_live_line(kernel):
    messages = kernel.cell("x = 1")
    assert [(m["msg_type"], display_id(m)) for m in messages] == [("display_data", None)]


def test_output_under_the_live_line_puts_the_report_last_and_empties_the_display(kernel):
    messages = kernel.cell("import time\nprint('a')\ntime.sleep(0.5)\nprint('b')")
    assert outputs(messages)[:2] == ["a\n", ""], messages  # the emptied live display
    assert outputs(messages)[2:3] == ["b\n"] and outputs(messages)[3].startswith("time ")
    assert not any(s.startswith("running") for s in outputs(messages))


def test_a_cell_that_ends_between_two_ticks_gets_no_message_in_the_next_cell(kernel):
    cell = "import time; time.sleep(0.45)"
    long, later = kernel.run(cell, cell).values()
    ids = {display_id(m) for m in long if display_id(m)}
    assert ids and not ids & {display_id(m) for m in later}, (long, later)
    assert outputs(long)[-1].startswith("time ") and outputs(later)[-1].startswith("time ")


def test_devreport_live_off_and_on(kernel):
    said = text(kernel.cell("%devreport live off")[0])
    assert "live line off" in said, said
    assert all(display_id(m) is None for m in kernel.cell("import time; time.sleep(0.45)"))
    said = text(kernel.cell("%devreport live on")[0])
    assert "live line after 200.0 ms" in said, said
    assert display_id(kernel.cell("import time; time.sleep(0.45)")[0])


def test_a_long_cells_report_carries_its_memory_as_a_small_svg(kernel):
    kernel.cell("import torch_device_magic.live.spark as s\n"
                "s.MIN_CELL_S, _min = 0.5, s.MIN_CELL_S\n"
                "live = get_ipython().magics_manager.registry['TorchDeviceMagics'].reporter.live\n"
                "live.period_s = 0.1")
    messages = kernel.cell("import time\nfor i in range(4):\n    time.sleep(0.2)")
    kernel.cell("s.MIN_CELL_S, live.period_s = _min, 1.0")
    report = messages[-1]["content"]["data"]
    assert report["text/plain"].startswith("time ") and "\nhost " in report["text/plain"]
    assert '<div class="tdm-spark">host <svg' in report["text/html"], report
