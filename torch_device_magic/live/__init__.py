"""The live line: one line under a long cell's output, updated about once a second.

    In [4]: train(model, epochs=3)
    running 0:42 | at line 7: loss.backward() | host 3.1 GiB (+1.2 GiB) | 1.0 cores busy

`LiveLine` (engine.py) is what the per-cell report holds: one sampler thread for the
session (sampler.py), what it reads (reads.py, through `probes`), where the cell is
(where.py), the line's words (text.py), and where it is drawn: a display updated in
place on an ipykernel (kernel.py) or a status line in a terminal (terminal.py).
"""

from .engine import LiveLine

__all__ = ["LiveLine"]
