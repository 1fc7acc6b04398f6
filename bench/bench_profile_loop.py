"""What `%%profile` costs over a whole training loop: time, host memory, trace size.

    python bench/bench_profile_loop.py                       # a few minutes
    python bench/bench_profile_loop.py --against ba9f480     # also that commit's %%profile
    python bench/bench_profile_loop.py --against HEAD        # an A/A: a copy of this one
    python bench/bench_profile_loop.py --device cuda         # on the GPU (its default there)

The cell: a makemore-like character MLP (part 2: a 27-letter embedding of 10, a
context of 3, a tanh layer of 200, cross-entropy), trained on synthetic data by a
loop of `--loop-steps` steps (default 200 and 2,000), written as a notebook has it:
minibatch, forward, `p.grad = None` for each parameter, backward, SGD update
`p.data += -lr * p.grad`, `lossi.append(loss.log10().item())`. On `--device`:
`cpu`, or `cuda` (the default where torch sees a CUDA GPU; there `%%profile` records
the kernels too, and each step's `.item()` waits for them), the data, parameters
and generator made there.

Each round runs, in one IPython shell with the extension loaded, the order rotating:
the plain cell, the cell under `%%profile` (its output formatted and sent to a null
device), and the same under each `--against` commit's package (extracted with
`git archive` under a name of its own, loaded with `%load_ext` in place of this one).
Every run starts from the same parameters, after `gc.collect()` and `malloc_trim(0)`.

Per run: the whole cell's wall time (`time.perf_counter` around `run_cell`:
everything after the loop included), its ratio to the plain run of the same round
(and the same in the process's CPU time, which the load of other processes
inflates less),
the wall the overview reports (the loop itself), the host peak above the RSS at the
cell's start (the kernel's high-water mark, reset before the cell), and the trace's
size. Figures are medians over rounds (ratios: of each round's ratio). One torch
thread. The first capture of a process (torch.profiler's import of inductor) is
timed apart, before the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_report import package_at, rotated
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

SETUP = """
import torch
import torch.nn.functional as F
dev = torch.device("{device}")
g = torch.Generator(device=dev).manual_seed(2147483647)
Xtr = torch.randint(0, 27, (20000, 3), generator=g, device=dev)
Ytr = torch.randint(0, 27, (20000,), generator=g, device=dev)
C = torch.randn((27, 10), generator=g, device=dev)
W1 = torch.randn((30, 200), generator=g, device=dev) * (5 / 3) / 30**0.5
b1 = torch.randn(200, generator=g, device=dev) * 0.01
W2 = torch.randn((200, 27), generator=g, device=dev) * 0.01
b2 = torch.randn(27, generator=g, device=dev) * 0
parameters = [C, W1, b1, W2, b2]
for p in parameters:
    p.requires_grad = True
lossi = []
"""
LOOP = """for i in range({steps}):
    ix = torch.randint(0, Xtr.shape[0], (32,), generator=g, device=dev)
    emb = C[Xtr[ix]]
    h = torch.tanh(emb.view(-1, 30) @ W1 + b1)
    logits = h @ W2 + b2
    loss = F.cross_entropy(logits, Ytr[ix])
    for p in parameters:
        p.grad = None
    loss.backward()
    lr = 0.1 if i < {half} else 0.01
    for p in parameters:
        p.data += -lr * p.grad
    lossi.append(loss.log10().item())
"""
_LIBC = ctypes.CDLL("libc.so.6")


def shell() -> InteractiveShell:
    torch.set_num_threads(1)  # two threads on a shared 2-core machine spin and skew
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    return InteractiveShell.instance(config=config)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def run(ip: InteractiveShell, package: str | None, steps: int, traces: Path,
        device: str = "cpu") -> dict:
    """One run of the loop on `device`, plain (`package` None) or under that package's
    %%profile, its unnamed traces going to the folder `traces`."""
    tempfile.tempdir = str(traces)
    with contextlib.redirect_stdout(io.StringIO()):
        if package is not None:
            ip.run_cell(f"%load_ext {package}")
            ip.run_cell("%config TorchDeviceMagics.auto_report = False")  # the profile alone
        ip.run_cell(SETUP.format(device=device)).raise_error()
    gc.collect()
    _LIBC.malloc_trim(0)
    before = set(traces.iterdir())
    cell = LOOP.format(steps=steps, half=steps // 2)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = rss_bytes()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        t0, cpu0 = time.perf_counter(), time.process_time()
        ip.run_cell(cell if package is None else f"%%profile\n{cell}")
        cell_s, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    found = {"cell_s": cell_s, "cpu_s": cpu_s, "peak_bytes": peak_bytes() - rss0}
    if package is not None:
        wall = re.search(r"wall ([\d.]+) (µs|ms|s)\b", out.getvalue())
        if wall is None:
            raise RuntimeError(f"no overview in the output:\n{out.getvalue()[-2000:]}")
        scale = {"µs": 1e-6, "ms": 1e-3, "s": 1.0}[wall.group(2)]
        found["loop_s"] = float(wall.group(1)) * scale
        new = [p for p in traces.iterdir() if p not in before]
        found["trace_bytes"] = max((p.stat().st_size for p in new), default=0)
        found["traces_on_disk"] = len(list(traces.iterdir()))
        with contextlib.redirect_stdout(io.StringIO()):
            ip.run_cell(f"%unload_ext {package}")
    ip.run_cell("del lossi")
    gc.collect()
    _LIBC.malloc_trim(0)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loop-steps", type=int, nargs="+", default=[200, 2000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", action="append", default=[], metavar="REV")
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="where the loop trains (default: cuda where torch sees a CUDA "
                        "GPU, else cpu); cuda fails without one")
    args = parser.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_profile_loop.py --device cuda: torch sees no CUDA GPU here")
    ip = shell()
    modes = {"plain": None, "ours": "torch_device_magic"}
    for rev in args.against:
        modes[f"at {rev}"] = package_at(rev)
    # each mode's unnamed traces in a folder of its own, where they are counted
    traces = {m: Path(tempfile.mkdtemp(prefix="bench_profile_loop_")) for m in modes}
    for mode, package in modes.items():  # the first capture of the process, apart
        if package is not None:
            t0 = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                ip.run_cell(f"%load_ext {package}")
                ip.run_cell(f"%%profile\nimport torch\ny = torch.ones(3, device='{device}') + 1")
                ip.run_cell(f"%unload_ext {package}")
            print(f"first capture of the process ({mode}, on {device}): "
                  f"{time.perf_counter() - t0:.2f} s (torch.profiler's imports)")
            break
    print(f"load average {os.getloadavg()[0]:.1f}; {args.rounds} rounds on {device}")
    try:
        measure(ip, modes, traces, args.loop_steps, args.rounds, device)
    finally:  # what an older %%profile left there
        for folder in traces.values():
            shutil.rmtree(folder, ignore_errors=True)


def measure(ip: InteractiveShell, modes: dict[str, str | None], traces: dict[str, Path],
            loop_steps: list[int], rounds: int, device: str) -> None:
    """Rounds of every mode at each number of steps on `device`; a summary per number of
    steps."""
    for steps in loop_steps:
        found: dict[str, list[dict]] = {m: [] for m in modes}
        for n in range(rounds):
            for mode in rotated(list(modes), n):
                found[mode].append(run(ip, modes[mode], steps, traces[mode], device))
        plain = [r["cell_s"] for r in found["plain"]]
        print(f"\n{steps:,} steps: plain cell {statistics.median(plain):.2f} s "
              f"(rounds {min(plain):.2f}-{max(plain):.2f} s)")
        for mode in modes:
            if mode == "plain":
                continue
            rs = found[mode]
            ratio = [r["cell_s"] / p for r, p in zip(rs, plain)]
            cpu = [r["cpu_s"] / p["cpu_s"] for r, p in zip(rs, found["plain"])]
            loop = [r["loop_s"] / p for r, p in zip(rs, plain)]
            after = [(r["cell_s"] - r["loop_s"]) / r["cell_s"] for r in rs]
            peak = statistics.median(r["peak_bytes"] for r in rs) / 2**20
            trace = statistics.median(r["trace_bytes"] for r in rs) / 1e6
            print(f"  {mode}: cell {statistics.median(ratio):.2f}x the plain cell (rounds "
                  f"{min(ratio):.2f}-{max(ratio):.2f}x; CPU time {statistics.median(cpu):.2f}x, "
                  f"{min(cpu):.2f}-{max(cpu):.2f}x); loop {statistics.median(loop):.2f}x; "
                  f"after the loop {statistics.median(after):.0%} of the cell; host peak "
                  f"+{peak:.0f} MiB; trace {trace:.1f} MB; "
                  f"{rs[-1]['traces_on_disk']} unnamed trace(s) on disk")
        plain_peak = statistics.median(r["peak_bytes"] for r in found["plain"]) / 2**20
        print(f"  plain: host peak +{plain_peak:.0f} MiB")


if __name__ == "__main__":
    main()
