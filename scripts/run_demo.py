"""Execute demo.ipynb on a real Jupyter kernel; save it and an HTML rendering under out/,
and print what each cell showed. Run through `python3 scripts/dev.py demo`."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbconvert import HTMLExporter

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out"


def show(nb: nbformat.NotebookNode) -> None:
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        first = cell.source.splitlines()[0] if cell.source else ""
        print(f"\n[{cell.get('execution_count') or ' '}] {first}")
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                text = out.text
            elif out.output_type == "error":
                text = f"{out.ename}: {out.evalue}\n"
            else:
                text = out.get("data", {}).get("text/plain", "") + "\n"
            print("    " + text.rstrip("\n").replace("\n", "\n    "))


def main() -> int:
    nb = nbformat.read(ROOT / "demo.ipynb", as_version=4)
    client = NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    failed = None
    try:
        client.execute()
    except CellExecutionError as err:
        failed = err
    OUT.mkdir(exist_ok=True)
    nbformat.write(nb, OUT / "demo.ipynb")
    html, _ = HTMLExporter().from_notebook_node(nb)
    (OUT / "demo.html").write_text(html, encoding="utf-8")
    show(nb)
    print(f"\nexecuted notebook: {OUT / 'demo.ipynb'}\nHTML rendering:    {OUT / 'demo.html'}")
    if failed is not None:
        print(f"\nthe demo stopped at an error:\n{failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
