"""A long cell's memory over time, from the samples its live line took (nothing more is
measured for it), under the report line: a sparkline in text, and a small SVG in HTML.

    host ▁▂▃▅▇█▇▅ peak 3.4 GiB at 0:41
"""

from __future__ import annotations

import html

from ..units import fmt_bytes
from .text import clock_text

MIN_CELL_S = 5.0  # shorter cells get no picture: too few samples to say anything
BARS = "▁▂▃▄▅▆▇█"
WIDTH = 24  # characters of the sparkline (and points of the SVG's line)


def _buckets(values: list[int], width: int) -> list[int]:
    """`values` in at most `width` buckets, each its most (a peak is never averaged away)."""
    if len(values) <= width:
        return values
    step = len(values) / width
    return [max(values[int(i * step):max(int((i + 1) * step), int(i * step) + 1)])
            for i in range(width)]


def sparkline(values: list[int]) -> str:
    """▁▂▃▅▇█: the lowest reading lowest, the highest highest."""
    shown = _buckets(values, WIDTH)
    low, high = min(shown), max(shown)
    span = (high - low) or 1
    return "".join(BARS[(v - low) * (len(BARS) - 1) // span] for v in shown)


def picture(name: str, samples: list[tuple[float, int]]) -> tuple[str, str] | None:
    """The text and the HTML of `name`'s memory over (elapsed, bytes) `samples`; None with
    fewer than two."""
    if len(samples) < 2:
        return None
    values = [b for _, b in samples]
    at, peak = max(samples, key=lambda s: s[1])
    said = f"peak {fmt_bytes(peak)} at {clock_text(at)}"
    text = f"{name} {sparkline(values)} {said}"
    shown = _buckets(values, WIDTH)
    low, high = min(shown), max(shown)
    span = (high - low) or 1
    step = 100 / max(len(shown) - 1, 1)
    points = " ".join(f"{i * step:.1f},{14 - 12 * (v - low) / span:.1f}"
                      for i, v in enumerate(shown))
    svg = (f'<div class="tdm-spark">{html.escape(name)} '
           f'<svg width="100" height="16" viewBox="0 0 100 16" role="img" '
           f'aria-label="{html.escape(text)}" style="vertical-align:middle">'
           f'<polyline points="{points}" fill="none" stroke="currentColor" '
           f'stroke-width="1.5"/></svg> {html.escape(said)}</div>')
    return text, svg
