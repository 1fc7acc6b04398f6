"""Execute demo.ipynb on a real Jupyter kernel; save it and an HTML rendering under out/,
and print what each cell showed. Run through `python3 scripts/dev.py demo`.

The tests and scripts/gpu-check import `execute` and `run_demo` from here.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from traitlets.config import Config

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out"
# the line the per-cell report shows after each cell, e.g. "time 1.2 ms | host 0 B (peak 0 B)"
REPORT_LINE = re.compile(r"^time \d+(\.\d+)? (µs|ms|s|min)\b.* \| .*host ", re.M)


def execute(nb: nbformat.NotebookNode, timeout: int = 600) -> nbformat.NotebookNode:
    """Execute `nb` on a fresh python3 kernel started in the repository root.

    Raises CellExecutionError at the first failing cell; `nb` keeps what ran.
    """
    with tempfile.TemporaryDirectory() as sockets:
        client = NotebookClient(
            nb, timeout=timeout, kernel_name="python3", config=_local_sockets(sockets),
            resources={"metadata": {"path": str(ROOT)}},
        )
        client.execute()
    return nb


def _local_sockets(folder: str) -> Config:
    """On POSIX, talk to the kernel over local sockets in `folder`, which ipykernel 7
    does not warn about (over TCP it prints that the kernel's traffic is unencrypted)."""
    config = Config()
    if os.name == "posix":
        config.KernelManager.transport = "ipc"
        config.KernelManager.ip = os.path.join(folder, "kernel")
    return config


def run_demo(
    out: Path = OUT, timeout: int = 600
) -> tuple[nbformat.NotebookNode, CellExecutionError | None]:
    """Execute demo.ipynb (`timeout` seconds a cell) and write it to `out`/demo.ipynb;
    return it and the error that stopped it (None when it ran through)."""
    nb = nbformat.read(ROOT / "demo.ipynb", as_version=4)
    failed = None
    try:
        execute(nb, timeout)
    except CellExecutionError as err:
        failed = err
    out.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out / "demo.ipynb")
    return nb, failed


def write_html(nb: nbformat.NotebookNode, path: Path) -> Path:
    """Render `nb` to `path` with nbconvert's HTML exporter (imported only here)."""
    from nbconvert import HTMLExporter

    html, _ = HTMLExporter().from_notebook_node(nb)
    path.write_text(html, encoding="utf-8")
    return path


def output_text(out: nbformat.NotebookNode) -> str:
    """What one output shows as text: a stream, a plain-text result, an error's name and value."""
    if out.output_type == "stream":
        return out.text
    if out.output_type == "error":
        return f"{out.ename}: {out.evalue}\n"
    return out.get("data", {}).get("text/plain", "") + "\n"


def show(nb: nbformat.NotebookNode) -> None:
    """Print each code cell's first line and what it showed, report lines included."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        first = cell.source.splitlines()[0] if cell.source else ""
        print(f"\n[{cell.get('execution_count') or ' '}] {first}")
        for out in cell.get("outputs", []):
            print("    " + output_text(out).rstrip("\n").replace("\n", "\n    "))


def main() -> int:
    nb, failed = run_demo()
    html = write_html(nb, OUT / "demo.html")
    show(nb)
    print(f"\nexecuted notebook: {OUT / 'demo.ipynb'}\nHTML rendering:    {html}")
    if failed is not None:
        print(f"\nthe demo stopped at an error:\n{failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
