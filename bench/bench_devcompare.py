"""Host memory of `%%devcompare` on a cell that only reads a large TensorDataset.

    python bench/bench_devcompare.py [--against REV] [--mib 256] [--rounds 3]

Two cells on a dataset of `--mib` MiB (float32 features, int64 labels): *reads*,
`x, y = ds[123]` and a small sum, well under a millisecond; *writes*, which
zeroes the first row of the features in place, so that its working set is a
copy of them. It runs under
`%%devcompare cpu meta -n 5` (meta: no GPU is needed here, and a copy to meta
costs the host nothing, so every host byte above the data is devcompare's).

Each measurement runs in a fresh Python process, with this checkout's package
or that of `--against REV` (default `main`, exported with `git archive` into a
temporary folder), alternating, `--rounds` times each. In the child the
high-water mark of its RSS is reset (`/proc/self/clear_refs`) once the data
exists, and read (`VmHWM`) after the cell; a `%%devcompare` on a small input has
run before, so that the modules the first meta kernels import (tens of MiB)
are not counted as copies. Figures:

- *peak / data*: the process's RSS peak during the cell, less its RSS before
  the data was made, over the data's size. The data once is 1.00x; target:
  the data once plus one device's working set (reads: 1.00x; writes: the
  dataset once more, since all that the written name reaches is copied: 2.00x).
- *extra / data*: the peak above the RSS just before the cell, over the data.
- the cell's wall time under `%%devcompare`, all devices and runs included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20

CHILD = r"""
import os, sys, time
import torch
from IPython.core.interactiveshell import InteractiveShell

def rss():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in f)
                if k in ("VmRSS", "VmHWM")}

mib, cell = int(sys.argv[1]), sys.argv[2]
ip = InteractiveShell.instance()
ip.run_cell("%load_ext torch_device_magic")
ip.run_cell("%devreport off")
# The first meta kernels import much of torch (its refs, dynamo): tens of MiB that are
# no copy. Pay them before anything is measured.
ip.run_cell("import torch\nsmall = (torch.randn(8, 64), torch.randint(0, 10, (8,)))")
ip.run_cell_magic("devcompare", "cpu meta -n 1 -o", "x, y = small[0][1], small[1][1]\nx.sum() + y")
start = rss()["VmRSS"]
rows = mib * (1 << 20) // (64 * 4 + 8)
ip.run_cell(
    "import torch\nfrom torch.utils.data import TensorDataset\n"
    f"ds = TensorDataset(torch.randn({rows}, 64), torch.randint(0, 10, ({rows},)))"
)
data = sum(t.nbytes for t in ip.user_ns["ds"].tensors)
before = rss()["VmRSS"]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
t0 = time.perf_counter()
ip.run_cell_magic("devcompare", "cpu meta -n 5 -o", cell)
wall = time.perf_counter() - t0
peak = rss()["VmHWM"]
import torch_device_magic
assert torch_device_magic.__file__.startswith(os.getcwd()), torch_device_magic.__file__
print(data, start, before, peak, wall)
"""


def exported(rev: str, into: Path) -> Path:
    """The package as it was at `rev`, in a folder of its own."""
    archive = subprocess.run(["git", "archive", rev, "torch_device_magic"], cwd=ROOT,
                             check=True, capture_output=True).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")
    return into


CELLS = {
    "reads": "x, y = ds[123]\nx.sum() + y",
    "writes": "ds.tensors[0][:1].zero_()\nds.tensors[0][:4].sum()",
}


def measure(package_root: Path, mib: int, cell: str) -> tuple[float, float, float]:
    """(peak / data, extra / data, wall seconds) of one child process."""
    env = {**os.environ, "PYTHONPATH": str(package_root)}
    # `-c` puts the working folder first on sys.path: it must be the package's own.
    done = subprocess.run([sys.executable, "-c", CHILD, str(mib), cell], env=env, cwd=package_root,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the measurement with {package_root} failed:\n{done.stderr}")
    out = done.stdout.split()
    data, start, before, peak, wall = (float(v) for v in out[-5:])
    return (peak - start) / data, (peak - before) / data, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="main", metavar="REV")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = exported(args.against, Path(tmp))
        found: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for _ in range(args.rounds):
            for case, cell in CELLS.items():
                for label, root in ((args.against, base), ("this", ROOT)):
                    found.setdefault((case, label), []).append(measure(root, args.mib, cell))
    print(f"%%devcompare cpu meta -n 5 on a {args.mib} MiB TensorDataset, {args.rounds} rounds: "
          "median (min-max)")
    print(f"{'cell':7} {'code':10}  {'peak / data':>18}  {'extra / data':>18}  {'wall s':>18}")
    for (case, label), rows in found.items():
        cols = []
        for i in range(3):
            values = [r[i] for r in rows]
            cols.append(f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"{case:7} {label:10}  {cols[0]:>18}  {cols[1]:>18}  {cols[2]:>18}")


if __name__ == "__main__":
    main()
