"""The environment of a child Python that a test starts: this checkout first on its path.

    subprocess.run([sys.executable, "-c", code], env=child_env(TMPDIR=str(tmp_path)))

PYTHONPATH is prepended to, never replaced: dependencies installed with
`pip install --target` (the GPU machine's, see scripts/gpu-check) are found
through it.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child_env(*first: str | Path, **extra: str) -> dict[str, str]:
    """This process's environment with `first` and then this checkout at the head of
    PYTHONPATH (what was there kept after them), and `extra`."""
    path = os.pathsep.join(
        str(p) for p in (*first, ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
