"""What `%%profile` costs on training loops as notebooks write them: five loop shapes.

    python bench/bench_profile_shapes.py                    # shell and kernel, a few minutes
    python bench/bench_profile_shapes.py --against 471754b  # also that commit's %%profile
    python bench/bench_profile_shapes.py --steps 500 --rounds 3 --no-kernel   # a smoke run

The shapes (our own code, tiny sizes so that the Python and the profiler weigh most):
- `bigram`: counting the pairs of letters of synthetic words, one `+=` per pair
  (ten words a step: `--steps` times 10 words, about 8 pairs each);
- `mlp`: a character MLP, `p.grad = None` and `p.data += -lr * p.grad` over a
  parameter list, the loss appended;
- `batchnorm`: the same with a hand-written batch norm and its running statistics,
  about 20 lines a step;
- `stats`: the batch-norm loop over half the steps, with per-layer statistics each
  step (the update-to-data ratio of each parameter, the activations' saturation);
- `backprop`: the batch-norm MLP with its backward pass written out, about 60 short
  lines a step.

Each package (this checkout's, and each `--against` commit's, extracted under a name of
its own) runs in a process of its own, in a plain IPython shell (`run_cell`, output to
a null device) and, unless `--no-kernel`, on a real kernel (nbclient). In each, after
one first capture of a tiny cell (torch's profiler's first start in the process is in
it: timed and reported apart), `--rounds` rounds run every shape plain and under
`%%profile`, the order alternating. Per cell: the whole cell (pre_run_cell to
post_run_cell, the report's display included), and the loop inside it (the cell's own
first and last lines read the clock). Reported, medians over rounds: the whole-cell
ratio to the plain cell of the same round, the inside ratio, and the time around the
capture (the whole less the inside, less the same for the plain cell). Also, in the
shell, each loop plain after the profiler's stops against the same before any profiler
ran in the process ("after a profiler"): ours pauses by stopping torch's session, so this
is what the profiler leaves on between the recorded steps. One torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SETUP = """
import time, torch, random
import torch.nn.functional as F
torch.set_num_threads(1)
g = torch.Generator().manual_seed(2147483647)
random.seed(42)
words = ["".join(random.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(random.randint(3, 10)))
         for _ in range(10 * {steps})]
stoi = {{c: i + 1 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}}
stoi["."] = 0
Xtr = torch.randint(0, 27, (4000, 3), generator=g)
Ytr = torch.randint(0, 27, (4000,), generator=g)
n_emb, n_hidden, batch = 10, 64, 32
def init():
    global C, W1, b1, W2, b2, bngain, bnbias, bnmean, bnstd, parameters
    C = torch.randn((27, n_emb), generator=g)
    W1 = torch.randn((3 * n_emb, n_hidden), generator=g) * (5 / 3) / (3 * n_emb) ** 0.5
    b1 = torch.randn(n_hidden, generator=g) * 0.1
    W2 = torch.randn((n_hidden, 27), generator=g) * 0.1
    b2 = torch.randn(27, generator=g) * 0.1
    bngain = torch.ones((1, n_hidden)) * 1.0
    bnbias = torch.zeros((1, n_hidden))
    bnmean, bnstd = torch.zeros((1, n_hidden)), torch.ones((1, n_hidden))
    parameters = [C, W1, b1, W2, b2, bngain, bnbias]
    for p in parameters:
        p.requires_grad = True
"""

# One step of the batch-norm MLP (~20 lines): the "batchnorm" shape, and the "stats"
# shape with per-layer statistics after it.
BATCHNORM_STEP = """    ix = torch.randint(0, Xtr.shape[0], (batch,), generator=g)
    Xb, Yb = Xtr[ix], Ytr[ix]
    emb = C[Xb]
    embcat = emb.view(emb.shape[0], -1)
    hpreact = embcat @ W1 + b1
    bnmeani = hpreact.mean(0, keepdim=True)
    bnstdi = hpreact.std(0, keepdim=True)
    hpreact = bngain * (hpreact - bnmeani) / bnstdi + bnbias
    with torch.no_grad():
        bnmean = 0.999 * bnmean + 0.001 * bnmeani
        bnstd = 0.999 * bnstd + 0.001 * bnstdi
    h = torch.tanh(hpreact)
    logits = h @ W2 + b2
    loss = F.cross_entropy(logits, Yb)
    for p in parameters:
        p.grad = None
    loss.backward()
    lr = 0.1 if i < {half} else 0.01
    for p in parameters:
        p.data += -lr * p.grad
    lossi.append(loss.log10().item())
"""

SHAPES = {
    "bigram": """N = torch.zeros((27, 27), dtype=torch.int32)
for w in words:
    chs = ["."] + list(w) + ["."]
    for ch1, ch2 in zip(chs, chs[1:]):
        N[stoi[ch1], stoi[ch2]] += 1
""",
    "mlp": """init()
parameters = [C, W1, b1, W2, b2]
lossi = []
for i in range({steps}):
    ix = torch.randint(0, Xtr.shape[0], (batch,), generator=g)
    emb = C[Xtr[ix]]
    h = torch.tanh(emb.view(-1, 3 * n_emb) @ W1 + b1)
    logits = h @ W2 + b2
    loss = F.cross_entropy(logits, Ytr[ix])
    for p in parameters:
        p.grad = None
    loss.backward()
    lr = 0.1 if i < {half} else 0.01
    for p in parameters:
        p.data += -lr * p.grad
    lossi.append(loss.log10().item())
""",
    "batchnorm": "init()\nlossi = []\nfor i in range({steps}):\n" + BATCHNORM_STEP,
    "stats": "init()\nlossi, ud, saturated = [], [], []\nfor i in range({steps2}):\n"
    + BATCHNORM_STEP + """    with torch.no_grad():
        ud.append([((lr * p.grad).std() / p.data.std()).log10().item() for p in parameters])
        saturated.append((h.abs() > 0.97).float().mean().item())
""",
    "backprop": """init()
lossi = []
n = batch
for i in range({steps}):
    ix = torch.randint(0, Xtr.shape[0], (n,), generator=g)
    Xb, Yb = Xtr[ix], Ytr[ix]
    emb = C[Xb]
    embcat = emb.view(emb.shape[0], -1)
    hprebn = embcat @ W1 + b1
    bnmeani = 1 / n * hprebn.sum(0, keepdim=True)
    bndiff = hprebn - bnmeani
    bndiff2 = bndiff**2
    bnvar = 1 / (n - 1) * (bndiff2).sum(0, keepdim=True)
    bnvar_inv = (bnvar + 1e-5) ** -0.5
    bnraw = bndiff * bnvar_inv
    hpreact = bngain * bnraw + bnbias
    h = torch.tanh(hpreact)
    logits = h @ W2 + b2
    logit_maxes = logits.max(1, keepdim=True).values
    norm_logits = logits - logit_maxes
    counts = norm_logits.exp()
    counts_sum = counts.sum(1, keepdims=True)
    counts_sum_inv = counts_sum**-1
    probs = counts * counts_sum_inv
    logprobs = probs.log()
    loss = -logprobs[range(n), Yb].mean()
    with torch.no_grad():
        dlogprobs = torch.zeros_like(logprobs)
        dlogprobs[range(n), Yb] = -1.0 / n
        dprobs = (1.0 / probs) * dlogprobs
        dcounts_sum_inv = (counts * dprobs).sum(1, keepdim=True)
        dcounts = counts_sum_inv * dprobs
        dcounts_sum = (-counts_sum**-2) * dcounts_sum_inv
        dcounts += torch.ones_like(counts) * dcounts_sum
        dnorm_logits = counts * dcounts
        dlogits = dnorm_logits.clone()
        dlogit_maxes = (-dnorm_logits).sum(1, keepdim=True)
        dlogits += F.one_hot(logits.max(1).indices, num_classes=logits.shape[1]) * dlogit_maxes
        dh = dlogits @ W2.T
        dW2 = h.T @ dlogits
        db2 = dlogits.sum(0)
        dhpreact = (1.0 - h**2) * dh
        dbngain = (bnraw * dhpreact).sum(0, keepdim=True)
        dbnraw = bngain * dhpreact
        dbnbias = dhpreact.sum(0, keepdim=True)
        dbndiff = bnvar_inv * dbnraw
        dbnvar_inv = (bndiff * dbnraw).sum(0, keepdim=True)
        dbnvar = (-0.5 * (bnvar + 1e-5) ** -1.5) * dbnvar_inv
        dbndiff2 = (1.0 / (n - 1)) * torch.ones_like(bndiff2) * dbnvar
        dbndiff += (2 * bndiff) * dbndiff2
        dhprebn = dbndiff.clone()
        dbnmeani = (-dbndiff).sum(0)
        dhprebn += 1.0 / n * (torch.ones_like(hprebn) * dbnmeani)
        dembcat = dhprebn @ W1.T
        dW1 = embcat.T @ dhprebn
        db1 = dhprebn.sum(0)
        demb = dembcat.view(emb.shape)
        dC = torch.zeros_like(C)
        dC.index_add_(0, Xb.view(-1), demb.view(-1, n_emb))
        grads = [dC, dW1, db1, dW2, db2, dbngain, dbnbias]
        lr = 0.1 if i < {half} else 0.01
        for p, grad in zip(parameters, grads):
            p.data += -lr * grad
    lossi.append(loss.log10().item())
""",
}

HOOKS = """
import time as _bench_time
_bench = {"start": 0.0, "cells": []}
def _bench_pre(*args):
    _bench["start"] = _bench_time.perf_counter()
def _bench_post(*args):
    _bench["cells"].append(_bench_time.perf_counter() - _bench["start"])
get_ipython().events.register("pre_run_cell", _bench_pre)
get_ipython().events.register("post_run_cell", _bench_post)
"""


def timed(cell: str) -> str:
    """The cell with its first and last lines reading the clock: the loop inside."""
    return f"_t0 = time.perf_counter()\n{cell}_inside = time.perf_counter() - _t0\n"


def plan(steps: int, rounds: int, shapes: list[str], never: bool) -> list[tuple[str, str, str]]:
    """The cells, in order: (shape, way, source). Each shape once unmeasured (its first
    run), with `never` twice more plain before any profiler ran in the process (`never`);
    the first capture; then the rounds, plain and profiled alternating."""
    fmt = {"steps": steps, "steps2": steps // 2, "half": steps // 2}
    cells = [("-", "warm", SHAPES[shape].format(**fmt)) for shape in shapes]
    if never:
        cells += [(shape, "never", timed(SHAPES[shape].format(**fmt)))
                  for _ in range(2) for shape in shapes]
    cells.append(("-", "first", "%%profile\ny = torch.ones(3) + 1\n"))
    ways = ["plain", "profiled"]
    for n in range(rounds):
        for shape in shapes:
            for way in ways[n % 2:] + ways[:n % 2]:
                src = timed(SHAPES[shape].format(**fmt))
                cells.append((shape, way, "%%profile\n" + src if way == "profiled" else src))
    return cells


def worker(args: argparse.Namespace) -> None:
    """In this process (`--where shell`) or on a kernel: the plan's cells, the times as JSON."""
    shapes = args.shapes
    cells = plan(args.steps, args.rounds, shapes, args.where == "shell")
    head = [f"import sys; sys.path.insert(0, {args.path!r})", HOOKS,
            f"%load_ext {args.package}",
            f"%config {args.magics}.auto_report = False",
            SETUP.format(steps=args.steps)]
    sources = head + [src for _, _, src in cells]
    if args.where == "shell":
        import contextlib
        import io

        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        config = Config()
        config.HistoryManager.hist_file = ":memory:"
        ip = InteractiveShell.instance(config=config)
        tempfile.tempdir = tempfile.mkdtemp(prefix="bench_shapes_")
        insides = []
        for i, src in enumerate(sources):
            with contextlib.redirect_stdout(io.StringIO()) as out, \
                    contextlib.redirect_stderr(io.StringIO()):
                result = ip.run_cell(src)
            if not result.success:
                sys.exit(f"cell {i} failed:\n{src}\n{out.getvalue()[-3000:]}")
            insides.append(ip.user_ns.pop("_inside", None))
        times = ip.user_ns["_bench"]["cells"]
        first_text = ""
    else:
        sys.path.insert(0, str(ROOT / "tests"))
        from kernel import execute, notebook, texts

        collect = ("import json\nprint(json.dumps([_bench['cells'], _bench_insides]))")
        keep = "_bench_insides.append(globals().pop('_inside', None))\n"
        body = [sources[0] + "\n_bench_insides = []", *sources[1:len(head)]]
        body += [src + keep for src in sources[len(head):]]  # after the clock's last read
        nb = execute(notebook(*body, collect), timeout=1200)
        first_text = texts(nb.cells[len(head) + len(shapes)])
        got = json.loads(texts(nb.cells[-1]).strip().splitlines()[-1])
        times = got[0]
        insides = [None] * len(head) + got[1]
    times = [None, *times]  # the hooks came with the second cell
    first = len(head) + next(i for i, c in enumerate(cells) if c[1] == "first")
    out = {"first": times[first], "first_text": first_text, "cells": []}
    for (shape, way, _), whole, inside in zip(cells, times[len(head):], insides[len(head):]):
        out["cells"].append({"shape": shape, "way": way, "whole": whole, "inside": inside})
    print("BENCH " + json.dumps(out))


def run_worker(where: str, package: str, path: str, args: argparse.Namespace) -> dict:
    magics = "TorchDeviceMagics"
    cmd = [sys.executable, __file__, "--worker", "--where", where, "--package", package,
           "--path", path, "--magics", magics, "--steps", str(args.steps),
           "--rounds", str(args.rounds), "--shapes", *args.shapes]
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if line is None:
        sys.exit(f"{where} {package}: no result\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(line[6:])


def summary(name: str, got: dict, shapes: list[str]) -> None:
    import re

    said = re.search(r"[\d.]+ (µs|ms|s) of this cell's time was torch's profiler[^\n]*",
                     got["first_text"])
    print(f"  {name}: first capture (a tiny cell) {got['first']:.2f} s"
          + (f"; the report: \"{said.group(0)}\"" if said else ""))
    for shape in shapes:
        rows = [c for c in got["cells"] if c["shape"] == shape]
        plain = [c for c in rows if c["way"] == "plain"]
        prof = [c for c in rows if c["way"] == "profiled"]
        never = [c for c in rows if c["way"] == "never"]
        whole = [p["whole"] / q["whole"] for p, q in zip(prof, plain)]
        inside = [p["inside"] / q["inside"] for p, q in zip(prof, plain)]
        around = [(p["whole"] - p["inside"]) - (q["whole"] - q["inside"])
                  for p, q in zip(prof, plain)]
        line = (f"    {shape:<9} plain {statistics.median(q['whole'] for q in plain):6.2f} s | "
                f"whole {statistics.median(whole):.2f}x ({min(whole):.2f}-{max(whole):.2f}) | "
                f"inside {statistics.median(inside):.2f}x ({min(inside):.2f}-{max(inside):.2f}) | "
                f"around {statistics.median(around):.2f} s")
        if never:  # plain after the profiler's stops (as while ours is paused), against before
            r = statistics.median(q["inside"] for q in plain) / statistics.median(
                c["inside"] for c in never)
            line += f" | after a profiler {r:.2f}x before any"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--against", action="append", default=[], metavar="COMMIT")
    parser.add_argument("--no-kernel", action="store_true")
    parser.add_argument("--no-shell", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--where", default="shell", help=argparse.SUPPRESS)
    parser.add_argument("--package", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--magics", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_report import package_at

    packages = {"this checkout": ("torch_device_magic", str(ROOT))}
    for rev in args.against:
        name = package_at(rev)
        packages[f"at {rev}"] = (name, sys.path[0])
    print(f"{args.steps:,} steps ('stats': half), {args.rounds} rounds, one torch thread; "
          f"load average {os.getloadavg()[0]:.1f}")
    for where in ("shell", "kernel"):
        if (where == "kernel" and args.no_kernel) or (where == "shell" and args.no_shell):
            continue
        print(f"\n{where}:")
        for label, (package, path) in packages.items():
            summary(label, run_worker(where, package, path, args), args.shapes)


if __name__ == "__main__":
    main()
