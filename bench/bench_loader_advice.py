"""`%%profile`'s advice followed: each remedy timed against the cell it was given for
(issue 36: 4, 5, 17, 17b).

    python bench/bench_loader_advice.py             # about a minute; --rounds N
    python bench/bench_loader_advice.py --quick     # a smoke run

One IPython shell with the extension loaded profiles each case's cell with
`%%profile -o`, takes the advice the rule gave (and its `example`, where it gives
one), and then times, plainly and alternating, the cell as it was and the cell
as the advice says to write it; each figure is the median over rounds of the
ratio of the advised cell to the cell as it was, in wall time (a worker's time is
the point of one of them). The input pipeline's in-memory case also times what
the rule advised before issue 36, one worker (`num_workers=1`). A case whose
advice is not the one expected fails the run, saying what was advised.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXTBOOK = """import torch, time
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, TensorDataset
torch.manual_seed(0)
X, Y = torch.randn(2048, 20), torch.randint(0, 2, (2048,))
ds = TensorDataset(X, Y)
loader = DataLoader(ds, batch_size=64, shuffle=True)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
class Files(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        time.sleep(0.002)  # reading and decoding a file
        return X[i], Y[i]
files = DataLoader(Files(), batch_size=8)
import random
random.seed(0)
words = [''.join(random.choice('abcdefghij') for _ in range(random.randint(3, 8)))
         for _ in range(2000)]
stoi = {s: i + 1 for i, s in enumerate('abcdefghij')}
stoi['.'] = 0
N = torch.zeros((11, 11), dtype=torch.int32)
chunks = list(torch.randn(3000, 8).unbind())
params = [torch.randn(8, 8, requires_grad=True) for _ in range(7)]
sum((p * p).sum() for p in params).backward()
"""
STEP = ("    loss = torch.nn.functional.cross_entropy(model(xb), yb)\n    opt.zero_grad()\n"
        "    loss.backward()\n    opt.step()\n")
BIGRAM = """for w in words:
    chs = ['.'] + list(w) + ['.']
    for ch1, ch2 in zip(chs, chs[1:]):
        ix1 = stoi[ch1]
        ix2 = stoi[ch2]
        N[ix1, ix2] += 1"""
# the indices of every run, as the scatter's advice says, then its example
BIGRAM_INDICES = ("I1 = torch.tensor([stoi[c] for w in words for c in '.' + w])\n"
                  "I2 = torch.tensor([stoi[c] for w in words for c in w + '.'])\n")
UPDATE = "for i in range(200):\n    for p in params:\n        p.data += -0.001 * p.grad"

# name: the cell profiled (and timed as it was), the rule, and the advised cell from the
# advice (its example; the text for workers)
CASES = {
    "TensorDataset loop: one index a batch": (
        f"for xb, yb in loader:\n{STEP}", "input pipeline",
        lambda a: f"for xb, yb in {a.example}:\n{STEP}"),
    "a loading dataset: workers": (
        "for batch in files:\n    time.sleep(0.02)", "input pipeline",
        lambda a: ("for batch in DataLoader(Files(), batch_size=8, num_workers="
                   f"{workers(a.text)}, persistent_workers=True):\n    time.sleep(0.02)")),
    "randint comprehension: one batched call": (
        "rows = [torch.randint(0, 100, (8,)) for _ in range(3000)]", "tiny ops",
        lambda a: f"rows = {a.example}"),
    "bigram count: one scatter": (BIGRAM, "tiny ops", lambda a: BIGRAM_INDICES + a.example),
    "slices of separate tensors: one stack": (
        "heads = [c[:4] for c in chunks]", "tiny ops", lambda a: f"heads = {a.example}"),
    "parameter update: one foreach call": (
        UPDATE, "tiny ops", lambda a: f"for i in range(200):\n    {a.example}"),
}
BEFORE = f"for xb, yb in DataLoader(ds, batch_size=64, shuffle=True, num_workers=1):\n{STEP}"


def workers(text: str) -> str:
    found = re.search(r"num_workers=(\d+)", text)
    return found.group(1) if found else "0"


def quiet(shell, cell: str):
    with contextlib.redirect_stdout(io.StringIO()):
        result = shell.run_cell(cell)
    result.raise_error()
    return result.result


def timed(shell, cell: str) -> float:
    start = time.perf_counter()
    quiet(shell, cell)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 rounds: a smoke run")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds
    import torch
    from IPython.core.interactiveshell import InteractiveShell

    torch.set_num_threads(1)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "torch_device_magic")
    quiet(shell, TEXTBOOK)
    print(f"torch {torch.__version__}, {rounds} rounds, wall time, the advised cell / the "
          "cell as it was (median; below 1: faster)")
    for name, (cell, rule, advised) in CASES.items():
        quiet(shell, cell)  # warm
        report = quiet(shell, f"%%profile -o\n{cell}")
        found = [a for a in report.advice if a.rule == rule]
        if not found:
            raise SystemExit(f"{name}: no {rule!r} advice; got {[a.text for a in report.advice]}")
        remedy = advised(found[0])
        ways = {"as it was": cell, "advised": remedy}
        if name.startswith("TensorDataset"):
            ways["num_workers=1 (the advice before)"] = BEFORE
        for way in ways.values():
            quiet(shell, way)  # warm
        ratios: dict[str, list[float]] = {w: [] for w in ways if w != "as it was"}
        for r in range(rounds):
            order = list(ways) if r % 2 == 0 else list(reversed(ways))
            took = {w: timed(shell, ways[w]) for w in order}
            for w in ratios:
                ratios[w].append(took[w] / took["as it was"])
        print(f"\n{name}\n  advice: {found[0].text}")
        for w, rs in ratios.items():
            print(f"  {w}: {statistics.median(rs):.3f}x (rounds {min(rs):.3f}-{max(rs):.3f}x)")


if __name__ == "__main__":
    main()
