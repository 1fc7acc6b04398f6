"""`%%devcompare`: one cell on several devices, timed, and how far the results differ.

    >>> result = compare(shell, "a @ b", [torch.device("cpu"), torch.device("cuda")])
    >>> [(d.device, d.median_s, d.speedup, d.max_abs_diff) for d in result.devices]
    [('cpu', 0.3124, 1.0, None), ('cuda', 0.0041, 76.2, 3.1e-05)]

For each device in turn the names the cell reads that hold tensors are
deep-copied together (aliases and views stay shared among the copies) and the
copies moved there with the `%%ondevice` mover; the cell runs with that device
as torch's default and as `device`; then the namespace gets back exactly the
bindings it had, so neither the copies nor anything the cell bound leak out.
The cell is compiled once, run `warmup` times, then timed `runs` times, the
device synchronised around each timed run where its runtime is up.
"""

from __future__ import annotations

import copy
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from . import cells
from .devices import Inventory, resolve
from .errors import DeviceMagicError, first_sentence
from .moving import cell_names, move
from .namespace import scan
from .probes import active_accelerator, clock
from .reports import Table
from .units import fmt_seconds


@dataclass(frozen=True)
class DeviceTiming:
    """One device's timed runs, speed-up over the first device, and difference from its result."""

    device: str
    runs_s: list[float]
    speedup: float | None  # None: meta, which computes nothing, has no meaningful speed
    max_abs_diff: float | None  # None: not comparable (meta, other shapes, no value)

    @property
    def median_s(self) -> float:
        return statistics.median(self.runs_s)

    @property
    def min_s(self) -> float:
        return min(self.runs_s)

    @property
    def max_s(self) -> float:
        return max(self.runs_s)


@dataclass(frozen=True)
class Comparison:
    """What `%%devcompare -o` returns: a timing per device, first device first."""

    devices: list[DeviceTiming]
    warmup: int

    def table(self) -> Table:
        first = self.devices[0]
        rows = [
            [
                d.device,
                fmt_seconds(d.median_s),
                f"{fmt_seconds(d.min_s)} … {fmt_seconds(d.max_s)}",
                "n/a" if d.speedup is None else f"{d.speedup:.2f}×",
                "" if d is first else _diff_text(d.max_abs_diff),
            ]
            for d in self.devices
        ]
        headers = ["device", "median", "spread (min … max)", "speed-up",
                   f"max |difference| vs {first.device}"]
        runs = len(first.runs_s)
        title = (f"%%devcompare: {runs} run{'s' if runs > 1 else ''} per device after "
                 f"{self.warmup} warm-up{'' if self.warmup == 1 else 's'}")
        return Table(title, headers, rows)

    def __str__(self) -> str:
        return self.table().text()

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        return self.table()._repr_mimebundle_()


def devices_to_compare(specs: Sequence[str], inventory: Inventory) -> list[torch.device]:
    """The devices `specs` name, each available and different; at least two."""
    found = [resolve(spec, inventory)[0] for spec in specs]  # canonical: cpu:0 is cpu
    for i, dev in enumerate(found):
        if dev in found[:i]:
            same = f"{specs[found.index(dev)]} and {specs[i]}"
            raise DeviceMagicError(
                f"%%devcompare got one device twice: {same} are the same device ({dev}); "
                "compare different devices, e.g. %%devcompare cpu cuda"
            )
    if len(found) < 2:
        raise DeviceMagicError(
            "%%devcompare needs at least two devices, e.g. %%devcompare cpu cuda"
        )
    return found


def compare(
    shell: Any, cell: str, devices: Sequence[torch.device], runs: int = 5, warmup: int = 1
) -> Comparison:
    """Run `cell` on each device in turn (copies of its inputs); the namespace ends as it began."""
    __tracebackhide__ = True
    ns = shell.user_ns
    source = shell.transform_cell(cell)  # `!cmd` and `%magic` lines become Python
    names = _tensor_names(ns, cell_names(source), shell.user_ns_hidden)
    run = cells.compiled(shell, cell)
    timings, reference = [], None
    for i, dev in enumerate(devices):
        try:
            runs_s, value = _on_device(shell, run, dev, names, runs, warmup)
        except BaseException:
            reference = None  # IPython keeps the traceback, and this frame with it
            raise
        if i == 0:
            reference = value
        speedup = timings[0].median_s / statistics.median(runs_s) if timings else 1.0
        if "meta" in (dev.type, devices[0].type):
            speedup = None if i else 1.0
        diff = None if i == 0 else difference(reference, value)
        timings.append(DeviceTiming(str(dev), runs_s, speedup, diff))
        del value  # before the next device runs: it may hold that device's memory
    return Comparison(timings, warmup)


def _tensor_names(ns: dict, read: set[str], hidden: Any) -> list[str]:
    """Those of the names the cell reads that hold tensors, modules or optimizers."""
    return [row.name for row in scan({n: ns[n] for n in read if n in ns}, hidden).rows]


def _on_device(
    shell: Any, run: Any, dev: torch.device, names: list[str], runs: int, warmup: int
) -> tuple[list[float], Any]:
    __tracebackhide__ = True
    ns = shell.user_ns
    bindings = dict(ns)
    value = None
    try:
        ns.update(_copies(ns, names))
        move(ns, names, dev)
        ns["device"] = dev
        with torch.device(dev):
            for _ in range(warmup):
                run()
            runs_s = []
            for _ in range(runs):
                _synchronize(dev)
                start = clock()
                value = run()
                _synchronize(dev)
                runs_s.append(clock() - start)
        return runs_s, value
    except DeviceMagicError:  # the inputs could not be copied or moved: the cell did not run
        raise
    except Exception:
        print(f"%%devcompare: the cell failed on {dev}", file=sys.stderr)
        raise
    finally:
        ns.clear()
        ns.update(bindings)
        # On an error IPython keeps the traceback, and this frame with it, until the next
        # one: it must not keep the old bindings (the user's tensors) nor a result.
        bindings.clear()
        value = None


def _copies(ns: dict, names: list[str]) -> dict[str, object]:
    """Deep copies of `names`, made together so that aliases and views stay shared."""
    # A tensor with autograd history refuses deepcopy: its copy starts a new graph.
    memo = {id(ns[n]): ns[n].detach().clone() for n in names
            if isinstance(ns[n], Tensor) and not ns[n].is_leaf}
    try:
        return copy.deepcopy({n: ns[n] for n in names}, memo)
    except Exception as err:
        reason = first_sentence(err)
        raise DeviceMagicError(f"%%devcompare could not copy the cell's inputs: {reason}") from None


def _synchronize(dev: torch.device) -> None:
    """Wait for `dev`'s queued work where its runtime is up (the first run may start it)."""
    accelerator = active_accelerator(dev)
    if accelerator is not None:
        accelerator.synchronize()


def difference(a: object, b: object) -> float | None:
    """The largest absolute difference between two results (tensors, numbers, or matching
    lists, tuples and dicts of them); None when they cannot be compared (meta, shapes)."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.is_meta or b.is_meta or a.shape != b.shape:
            return None
        if a.numel() == 0:
            return 0.0
        wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
        x, y = (t.detach().to("cpu", wide) for t in (a, b))
        return (x - y).abs().max().item()
    if isinstance(a, (int, float, complex)) and isinstance(b, (int, float, complex)):
        return float(abs(a - b))
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        parts = [difference(x, y) for x, y in zip(a, b)]
    elif isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        parts = [difference(a[k], b[k]) for k in a]
    else:
        return None
    return None if None in parts else max(parts, default=0.0)


def _diff_text(diff: float | None) -> str:
    return "not comparable" if diff is None else f"{diff:.3g}"
