"""Host memory is credited to the cell that freed it, however quick that cell was.

These readings depend on the heap's history (which blocks glibc serves from its free
lists, how many free chunks a reading walks), so each scenario runs in a fresh
interpreter, as a notebook's kernel is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torch_device_magic import probes

MiB = 2**20

pytestmark = pytest.mark.skipif(
    probes.malloc_free_reader() is None, reason="needs glibc 2.33+ (mallinfo2)"
)

# A freed 4 MiB block raises glibc's mmap threshold above 4 MiB, so the next 4 MiB
# tensors come from the heap and go back to its free lists when deleted; `guard`, made
# after them, keeps the heap's top from being trimmed: RSS does not move at the `del`.
ROUNDS = '''
import json
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
cells = ["%load_ext torch_device_magic", "import torch", "w = torch.randn(2**20); del w"]
for _ in range(6):
    cells += ["t = [torch.randn(2**20) for _ in range(100)]; guard = torch.randn(2**20)",
              "del t",
              "y = sum(range(100_000))"]
for cell in cells:
    ip.run_cell(cell, store_history=True)
records = ip.run_line_magic("devhistory", "-o")[-18:]
print(json.dumps([[r.host_delta_bytes, r.wall_s] for r in records]))
'''


def in_fresh_interpreter(script: str) -> list:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_quick_cell_freeing_heap_tensors_reads_its_own_free_and_later_cells_nothing():
    records = in_fresh_interpreter(ROUNDS)
    frees, computes = records[1::3], records[2::3]
    for freed, wall_s in frees:  # 400 MiB in 100 blocks, in a few ms at most
        assert freed == pytest.approx(-400 * MiB, rel=0.05), (freed / MiB, wall_s)
    for change, _ in computes:
        assert abs(change) < 2 * MiB, change / MiB
