"""Run notebooks on a real Jupyter kernel (nbclient), with scripts/run_demo.py's helpers."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from run_demo import REPORT_LINE, execute, output_text, run_demo, write_html  # noqa: E402

__all__ = ["REPORT_LINE", "ROOT", "execute", "notebook", "run_demo", "texts", "write_html"]


def notebook(*sources: str) -> nbformat.NotebookNode:
    """A notebook whose code cells are `sources`."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    return nb


def texts(cell: nbformat.NotebookNode) -> str:
    """Everything a cell showed as text: streams, plain-text results, error names."""
    return "".join(output_text(out) for out in cell.get("outputs", []))
