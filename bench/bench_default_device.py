"""What torch's default device, as `%device DEV` installs it, costs a small training step.

    python bench/bench_default_device.py            # about half a minute
    python bench/bench_default_device.py --quick    # fewer rounds

`torch.set_default_device` works through a TorchFunctionMode that every torch
call passes through, factory function or not; `%device DEV --no-default` (or
`set_torch_default = False`) installs none. The mode's cost does not depend on
the device it names, so it is measured here on the CPU: the default device is
installed as `%device` installs one (`DefaultDevice.install`), naming the CPU so
that the work itself stays the same.

The step: a 3-layer MLP (64 -> 128 -> 128 -> 10, batch 32), forward, cross-entropy,
backward, SGD step: small, as in a notebook's first experiments, where the
per-call cost weighs most. Blocks of steps with and without the mode alternate,
the order rotating each round; each figure is the median over rounds of the
ratio to the block without the mode next to it, in process CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch_device_magic.default_device import DefaultDevice

STEPS = 200


def training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step() -> None:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return step


def block(step, with_default: bool) -> float:
    """CPU seconds per step over STEPS steps, with our default device installed or not."""
    default = DefaultDevice()
    if with_default:
        default.install(torch.device("cpu"))
    try:
        start = time.process_time()
        for _ in range(STEPS):
            step()
        return (time.process_time() - start) / STEPS
    finally:
        default.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    rounds = 5 if parser.parse_args().quick else 30
    torch.set_num_threads(1)  # the per-call cost, not the scheduling of a thread pool
    step = training_step()
    for mode in (False, True, False, True):  # warm up both paths
        block(step, mode)
    ratios, bare, under = [], [], []
    for n in range(rounds):
        order = (False, True) if n % 2 == 0 else (True, False)
        seconds = {mode: block(step, mode) for mode in order}
        ratios.append(seconds[True] / seconds[False])
        bare.append(seconds[False])
        under.append(seconds[True])
    print(f"torch {torch.__version__}, {rounds} rounds of {STEPS} steps per mode, 1 thread")
    print(f"without a default device: {statistics.median(bare) * 1e6:7.1f} µs per step")
    print(f"with %device's default:   {statistics.median(under) * 1e6:7.1f} µs per step")
    print(
        f"ratio, median over rounds: {statistics.median(ratios):.2f}x "
        f"(rounds ranged {min(ratios):.2f}x-{max(ratios):.2f}x)"
    )


if __name__ == "__main__":
    main()
