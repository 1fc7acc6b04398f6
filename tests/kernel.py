"""Run notebooks on a real Jupyter kernel (nbclient), from the repository root."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def notebook(*sources: str) -> nbformat.NotebookNode:
    """A notebook whose code cells are `sources`."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 120) -> nbformat.NotebookNode:
    """Execute `nb` on a fresh python3 kernel started in the repository root."""
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()
    return nb


def texts(cell: nbformat.NotebookNode) -> str:
    """Everything a cell showed as text: streams, plain-text results, error names."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
    return "".join(parts)
