"""What the default device, as `%device DEV` installs it, costs a small training step.

    python bench/bench_default_device.py                 # about a minute; --rounds N
    python bench/bench_default_device.py --device cuda   # the GPU case (the default there)
    python bench/bench_default_device.py --quick         # a smoke run

Each case runs one training step three ways, in the same process: with explicit
devices (the model made with `device=`, each batch drawn with `device=`: the
baseline), under `%device`'s default (`DefaultDevice.install`, each batch drawn
without `device=`), and under torch's own `torch.set_default_device` (a
TorchFunctionMode that every torch call passes through, factory or not: what
`%device` installed up to issue 27). Blocks of 10 steps of the three alternate,
the rounds going through the six orders in turn, so that each way comes first,
middle and last equally often. Each figure is the median over rounds of the
ratio to the explicit block of the same round (many short rounds: on a loaded
machine one round's ratio strays by a third either way); next to it, the ratio
of each way's fastest block to the fastest explicit one.

The cases (`--device`; by default cuda where there is one, else tdmdev and cpu):
- `tdmdev`, the test device (tests/testdevice, its kernels run on the host): a
  tiny MLP (16 -> 32 -> 32 -> 4, batch 8), where the per-call cost weighs most;
- `cuda`: a small MLP (64 -> 128 -> 128 -> 10, batch 32), the step of issue 27;
- `cpu`: the small MLP with the default naming the CPU (`%device cpu` itself
  installs none), so that the figure compares with the earlier ones.

Each step: a batch drawn (`randn`, `randint`), forward, cross-entropy, backward,
SGD step. One thread. CPU and tdmdev are timed in process CPU time; CUDA in wall
time, synchronised at the end of each block (the small step is launch-bound).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rotation import rotated

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torch_device_magic.default_device import DefaultDevice  # noqa: E402

WAYS = ("explicit", "%device", "torch's mode")
SIZES = {"tiny": (16, 32, 4, 8), "small": (64, 128, 10, 32)}  # in, hidden, out, batch


def training_step(dev: torch.device, size: str) -> Callable[[str], None]:
    """One step on `dev`; called with the way it runs (explicit devices or a default)."""
    n_in, hidden, n_out, batch = SIZES[size]
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(n_in, hidden, device=dev), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden, device=dev), torch.nn.ReLU(),
        torch.nn.Linear(hidden, n_out, device=dev),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(way: str) -> None:
        if way == "explicit":
            x = torch.randn(batch, n_in, device=dev)
            y = torch.randint(0, n_out, (batch,), device=dev)
        else:  # the default device fills in `device=`
            x, y = torch.randn(batch, n_in), torch.randint(0, n_out, (batch,))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return step


def block(step: Callable[[str], None], dev: torch.device, way: str, steps: int) -> float:
    """Seconds per step over `steps` steps run `way`."""
    ours = DefaultDevice()
    if way == "%device":
        ours.install(dev)
    elif way == "torch's mode":
        torch.set_default_device(dev)
    cuda = dev.type == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    try:
        start = clock()
        for _ in range(steps):
            step(way)
        if cuda:
            torch.cuda.synchronize(dev)
        return (clock() - start) / steps
    finally:
        if way == "%device":
            ours.release()
        elif way == "torch's mode":
            torch.set_default_device(None)


def measure(dev: torch.device, size: str, rounds: int, steps: int) -> None:
    step = training_step(dev, size)
    for way in WAYS * 2:  # warm up every path
        block(step, dev, way, 50)
    seconds, ratios = rotated(WAYS, rounds, lambda way: block(step, dev, way, steps))
    n_in, hidden, n_out, batch = SIZES[size]
    print(f"\n{dev.type}: {size} MLP {n_in}->{hidden}->{hidden}->{n_out}, batch {batch}, "
          f"{rounds} rounds of {steps} steps per way")
    for way in WAYS:
        line = f"  {way:<13} {statistics.median(seconds[way]) * 1e6:8.1f} µs per step"
        if way in ratios:
            r = ratios[way]
            line += (f"   {statistics.median(r):.3f}x explicit "
                     f"(rounds {min(r):.2f}x-{max(r):.2f}x; "
                     f"fastest blocks {min(seconds[way]) / min(seconds['explicit']):.3f}x)")
        print(line)


def available(name: str) -> bool:
    if name == "cuda":
        return torch.cuda.is_available()
    if name == "tdmdev":
        sys.path.insert(0, str(ROOT / "tests"))
        try:
            import testdevice

            testdevice.load()  # before any backward: autograd sizes its device queues then
        except Exception as error:  # no compiler, no ninja: the case is left out
            print(f"tdmdev: not measured ({type(error).__name__}: {error})")
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and steps")
    parser.add_argument("--rounds", type=int, default=300, help="rounds (default 300)")
    parser.add_argument("--device", action="append", choices=("tdmdev", "cuda", "cpu"),
                        help="a case to run (repeatable); default: cuda where there is "
                        "one, else tdmdev and cpu")
    args = parser.parse_args()
    rounds, steps = (6, 20) if args.quick else (args.rounds, 10)
    torch.set_num_threads(1)  # the per-call cost, not the scheduling of a thread pool
    print(f"torch {torch.__version__}, 1 thread")
    # On a GPU machine the GPU's case alone (the others say nothing new there, and the
    # test device is a C++ build of a minute).
    for name in args.device or (("cuda",) if torch.cuda.is_available() else ("tdmdev", "cpu")):
        if available(name):
            measure(torch.device(name), "tiny" if name == "tdmdev" else "small", rounds, steps)
        elif args.device:
            sys.exit(f"{name}: not available here")


if __name__ == "__main__":
    main()
