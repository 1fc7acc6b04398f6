"""Result objects that render once into plain text (terminal) and HTML (Jupyter).

A `Table` is what every magic shows: a title line, aligned columns, notes under
it. `_repr_mimebundle_` hands IPython both renderings at once, so the frontend
picks: HTML in Jupyter, JupyterLab and Colab; text in the terminal.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Table:
    """A titled table, numbers aligned right and text left, with notes underneath."""

    title: str
    headers: Sequence[str]
    rows: Sequence[Sequence[object]]
    notes: Sequence[str] = field(default_factory=list)

    def _cells(self) -> list[list[str]]:
        return [[str(c) for c in row] for row in self.rows]

    def _numeric(self, cells: list[list[str]]) -> list[bool]:
        """Per column: whether every cell in it is a number (aligned right, text left)."""
        return [bool(cells) and all(_is_number(r[i]) for r in cells)
                for i in range(len(self.headers))]

    def text(self) -> str:
        cells = self._cells()
        widths = [len(h) for h in self.headers]
        for row in cells:
            widths = [max(w, len(c)) for w, c in zip(widths, row)]
        numeric = self._numeric(cells)

        def line(row: Sequence[str]) -> str:
            parts = [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)]
            return "  ".join(parts).rstrip()

        out = [self.title] if self.title else []
        if self.headers and cells:  # a table with no rows is its title alone
            out.append(line(self.headers))
            out.append("  ".join("-" * w for w in widths))
        out.extend(line(row) for row in cells)
        out.extend(self.notes)
        return "\n".join(out)

    def html(self) -> str:
        esc = html.escape
        cells = self._cells()
        # Jupyter's CSS right-aligns every cell; the alignment goes in the HTML itself so
        # that code and names read from the left wherever the table is shown.
        align = [f' style="text-align:{"right" if num else "left"}"'
                 for num in self._numeric(cells)]
        head = "".join(f"<th{a}>{esc(h)}</th>" for h, a in zip(self.headers, align))
        body = "".join(
            "<tr>" + "".join(f"<td{a}>{esc(c)}</td>" for c, a in zip(row, align)) + "</tr>"
            for row in cells
        )
        notes = "".join(f"<div>{esc(n)}</div>" for n in self.notes)
        title = f"<div><b>{esc(self.title)}</b></div>" if self.title else ""
        table = f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
        table = table if body else ""
        return f'<div class="tdm-table">{title}{table}{notes}</div>'

    def __str__(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        return {"text/plain": self.text(), "text/html": self.html()}


def _is_number(cell: str) -> bool:
    head = cell.split(" ", 1)[0].lstrip("+-")
    return head.replace(".", "", 1).isdigit() or cell in ("", "n/a", "-")
