"""Execute demo.ipynb on a real Jupyter kernel; save it and an HTML rendering under out/,
and print what each cell showed. Run through `python3 scripts/dev.py demo`.

The tests and scripts/gpu-check import `execute` and `run_demo` from here.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from traitlets.config import Config

ROOT = Path(__file__).resolve().parent.parent
OnCell = Callable[[nbformat.NotebookNode], None]
OUT = ROOT / "out"
# the line the per-cell report shows after each cell, e.g. "time 1.2 ms | host 0 B (peak 0 B)"
REPORT_LINE = re.compile(r"^time \d+(\.\d+)? (µs|ms|s|min)\b.* \| .*host ", re.M)


def execute(
    nb: nbformat.NotebookNode, timeout: int = 600, on_cell: OnCell | None = None
) -> nbformat.NotebookNode:
    """Execute `nb` on a fresh python3 kernel started in the repository root; `on_cell`
    gets each code cell as soon as it has run, its outputs in it.

    Raises CellExecutionError at the first failing cell; `nb` keeps what ran.
    """
    hooks = {} if on_cell is None else {"on_cell_executed": lambda cell, **_: on_cell(cell)}
    with tempfile.TemporaryDirectory() as sockets:
        client = NotebookClient(
            nb, timeout=timeout, kernel_name="python3", config=_local_sockets(sockets),
            resources={"metadata": {"path": str(ROOT)}}, **hooks,
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
    out: Path = OUT, timeout: int = 600, on_cell: OnCell | None = None
) -> tuple[nbformat.NotebookNode, CellExecutionError | None]:
    """Execute demo.ipynb (`timeout` seconds a cell; `on_cell` as `execute`'s) and write
    it to `out`/demo.ipynb; return it and the error that stopped it (None when it ran
    through)."""
    nb = nbformat.read(ROOT / "demo.ipynb", as_version=4)
    failed = None
    try:
        execute(nb, timeout, on_cell)
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
    """Print each code cell of an executed notebook as `show_cell` does."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            show_cell(cell)


def show_cell(cell: nbformat.NotebookNode) -> None:
    """Print a code cell's first line and what it showed, report lines included, at once."""
    first = cell.source.splitlines()[0] if cell.source else ""
    print(f"\n[{cell.get('execution_count') or ' '}] {first}")
    shown: list[str] = []
    previous = None
    for out in cell.get("outputs", []):
        # The kernel sends a stream in pieces: one piece after another is one text.
        stream = out.get("name") if out.output_type == "stream" else None
        if stream is not None and stream == previous:
            shown[-1] += output_text(out)
        else:
            shown.append(output_text(out))
        previous = stream
    for text in shown:
        print("    " + text.rstrip("\n").replace("\n", "\n    "))
    sys.stdout.flush()


def main() -> int:
    print("starting a Jupyter kernel for demo.ipynb (its first cell loads torch: some "
          "seconds); each cell shows here as it finishes", flush=True)
    nb, failed = run_demo(on_cell=show_cell)
    html = write_html(nb, OUT / "demo.html")
    print(f"\nexecuted notebook: {OUT / 'demo.ipynb'}\nHTML rendering:    {html}")
    if failed is not None:
        print(f"\nthe demo stopped at an error:\n{failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
