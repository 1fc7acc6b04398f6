"""Loading and plain cells never call into torch.cuda: a notebook can still fork later."""

import json
import os
import subprocess
import sys
from pathlib import Path

SPY = Path(__file__).parent / "scripts" / "cuda_spy.py"
ROOT = Path(__file__).parent.parent


def test_loading_and_cells_call_no_torch_cuda_function():
    # is_initialized only reads a flag; it is how probes learn that a context exists.
    proc = subprocess.run(
        [sys.executable, str(SPY), "is_initialized"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"calls": [], "initialized": False}
