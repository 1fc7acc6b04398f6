"""`%%devcompare`: one cell on several devices, timed, and how far the results differ.

    >>> run, reads = cells.compiled(shell, "a @ b"), {"a", "b"}  # the cell, the names it reads
    >>> result = compare(shell.user_ns, run, reads, [torch.device("cpu"), torch.device("cuda")])
    >>> [(d.device, d.median_s, d.speedup, d.max_abs_diff) for d in result.devices]
    [('cpu', 0.3124, 1.0, None), ('cuda', 0.0041, 76.2, 3.1e-05)]

For each device in turn the names the cell reads that hold tensors (in
containers or in any object's attributes: a dataset, an LR scheduler) are
deep-copied together (aliases and views stay shared among the copies), tensors
on an accelerator straight to the device, and the copies moved there with the
`%%ondevice` mover; the cell runs with that device as torch's default and as
`device` (the CPU under no device mode, which would slow every torch call);
then the namespace gets back exactly the bindings it had, so neither the copies
nor anything the cell bound leak out, and the random states are put back. The
cell is compiled once, run `warmup` times, then timed `runs` times, the device
synchronised around each timed run where its runtime is up.
"""

from __future__ import annotations

import cmath
import contextlib
import copy
import math
import statistics
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .default_device import lifted
from .devices import Inventory, resolve
from .errors import DeviceMagicError, first_sentence
from .moving import move
from .namespace import holds_tensors
from .probes import active_accelerator, clock
from .reports import Table
from .units import fmt_seconds


@dataclass(frozen=True)
class DeviceTiming:
    """One device's timed runs, speed-up over the first device, and difference from its result."""

    device: str
    runs_s: list[float]
    speedup: float | None  # None: meta, which computes nothing, has no meaningful speed
    max_abs_diff: float | None  # None: not comparable (meta, other shapes, no value);
    # NaN: one device has NaN where the other has a number

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
    namespace: dict[str, Any],
    run: Callable[[], Any],
    reads: Iterable[str],
    devices: Sequence[torch.device],
    runs: int = 5,
    warmup: int = 1,
) -> Comparison:
    """Call `run` (a cell compiled by `cells.compiled`) on each device in turn, with copies of
    those of `reads` (the user's names it reads) that hold tensors; the namespace ends as it
    began."""
    __tracebackhide__ = True
    names = _tensor_names(namespace, reads)
    timings: list[DeviceTiming] = []
    reference = None
    for i, dev in enumerate(devices):
        try:
            with _rng_kept(devices):  # each device starts from the notebook's random state
                runs_s, value = _on_device(namespace, run, dev, names, runs, warmup)
        except BaseException:
            reference = None  # IPython keeps the traceback, and this frame with it
            raise
        if i == 0:
            reference = value
        speedup: float | None = (
            timings[0].median_s / statistics.median(runs_s) if timings else 1.0
        )
        if "meta" in (dev.type, devices[0].type):
            speedup = None if i else 1.0
        diff = None if i == 0 else difference(reference, value)
        timings.append(DeviceTiming(str(dev), runs_s, speedup, diff))
        del value  # before the next device runs: it may hold that device's memory
    return Comparison(timings, warmup)


def _tensor_names(ns: dict, read: Iterable[str]) -> list[str]:
    """Those of the names the cell reads that hold tensors, modules or optimizers, in
    containers or in any object's attributes (a TensorDataset, an LR scheduler)."""
    return sorted(n for n in read if n in ns and holds_tensors(ns[n]))


@contextlib.contextmanager
def _rng_kept(devices: Sequence[torch.device]) -> Iterator[None]:
    """Save the random state of the CPU and of each device compared, and put it back,
    so that a seeded notebook draws the same numbers after the comparison as before."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[], device_type="cuda"))  # the CPU's
        for kind in sorted({d.type for d in devices} - {"cpu", "meta"}):
            module = getattr(torch, kind, None)
            if not hasattr(module, "get_rng_state"):  # a backend without a generator of its own
                continue
            current = getattr(module, "current_device", lambda: 0)  # MPS has one device
            indices = {current() if d.index is None else d.index for d in devices if d.type == kind}
            stack.enter_context(torch.random.fork_rng(devices=sorted(indices), device_type=kind))
        yield


@contextlib.contextmanager
def _default_device(dev: torch.device) -> Iterator[None]:
    """`dev` as torch's default device; for the CPU, no device mode at all (a session
    default is lifted): a mode costs on every torch call and would slow the CPU's times."""
    if dev.type != "cpu":
        with torch.device(dev):
            yield
        return
    with lifted():
        yield


def _on_device(
    ns: dict[str, Any], run: Callable[[], Any], dev: torch.device, names: list[str], runs: int,
    warmup: int,
) -> tuple[list[float], Any]:
    __tracebackhide__ = True
    bindings = dict(ns)
    value = None
    try:
        ns.update(_copies(ns, names, dev))
        move(ns, names, dev)
        ns["device"] = dev
        with _default_device(dev), warnings.catch_warnings():
            # A copied optimizer loses the step wrapper its LR scheduler put on the original,
            # and torch would blame the user for "overriding" it.
            warnings.filterwarnings("ignore", message=_UNWRAPPED_STEP)
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


def _copies(ns: dict, names: list[str], dev: torch.device) -> dict[str, object]:
    """Deep copies of `names`, made together so that aliases and views stay shared; what
    lives on an accelerator is copied straight to `dev`."""
    try:
        with _StraightTo(dev):
            return copy.deepcopy({n: ns[n] for n in names})
    except Exception as err:
        reason = first_sentence(err)
        raise DeviceMagicError(f"%%devcompare could not copy the cell's inputs: {reason}") from None


_UNWRAPPED_STEP = r"Seems like `optimizer\.step\(\)` has been overridden after learning rate"
_DEEPCOPIED = ("cpu", "meta")  # where a deep copy is cheap; elsewhere it would be a same-GPU copy


class _StraightTo(TorchFunctionMode):
    """Inside `copy.deepcopy`: a tensor on an accelerator is copied straight to `device`
    (the move then has nothing to do), not cloned where it is first, which on a full
    GPU would need twice its memory; a tensor with an autograd history, which deepcopy
    refuses, is copied detached."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is Tensor.clone and args[0].device.type not in _DEEPCOPIED:
            return args[0].to(self.device, copy=True, **kwargs)  # a Parameter's deepcopy
        if func is not Tensor.__deepcopy__:
            return func(*args, **kwargs)
        t, memo = args
        if id(t) in memo:
            return memo[id(t)]
        if t.device.type in _DEEPCOPIED:
            if t.is_leaf:
                return func(t, memo)
            memo[id(t)] = t.detach().clone()
        elif t.layout != torch.strided or type(t) is not Tensor:
            return func(t, memo)  # sparse, subclasses: deepcopy's own way, then the move
        else:
            memo[id(t)] = self._straight(t, memo)
        return memo[id(t)]

    def _straight(self, t: Tensor, memo: dict) -> Tensor:
        # The whole storage once, each tensor on it a view of the copy: views stay views.
        key = ("storage", t.untyped_storage()._cdata)
        if key not in memo:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            memo[key] = whole.to(self.device, copy=True).untyped_storage()
        new = torch.empty(0, dtype=t.dtype, device=self.device)
        new.set_(memo[key], t.storage_offset(), t.size(), t.stride())
        if t.is_conj():  # lazy views: the storage holds what they negate or conjugate
            new = new.conj()
        if t.is_neg():
            new = new._neg_view()
        if t.is_leaf:
            new.requires_grad_(t.requires_grad)
            if t.grad is not None:
                new.grad = self._straight(t.grad, memo)
        return new


def _synchronize(dev: torch.device) -> None:
    """Wait for `dev`'s queued work where its runtime is up (the first run may start it)."""
    accelerator = active_accelerator(dev)
    if accelerator is not None:
        accelerator.synchronize()


def difference(a: object, b: object) -> float | None:
    """The largest absolute difference between two results (tensors, numbers, or matching
    lists, tuples and dicts of them); None when they cannot be compared (meta, shapes).
    NaN in the same places on both is no difference; NaN where the other has a number
    makes the difference NaN."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.is_meta or b.is_meta or a.shape != b.shape:
            return None
        if a.numel() == 0:
            return 0.0
        wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
        x, y = (t.detach().to("cpu", wide) for t in (a, b))
        if not torch.equal(x.isnan(), y.isnan()):
            return math.nan
        # NaN on both, or the same infinity, is no difference (inf - inf would be NaN).
        same = (x == y) | x.isnan()
        return torch.where(same, 0.0, (x - y).abs()).max().item()
    if isinstance(a, (int, float, complex)) and isinstance(b, (int, float, complex)):
        if cmath.isnan(a) or cmath.isnan(b):
            return 0.0 if cmath.isnan(a) and cmath.isnan(b) else math.nan
        return 0.0 if a == b else float(abs(a - b))
    if isinstance(a, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        parts = [difference(x, y) for x, y in zip(a, b)]
    elif isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        parts = [difference(a[k], b[k]) for k in a]
    else:
        return None
    known = [part for part in parts if part is not None]
    if len(known) < len(parts):
        return None
    return math.nan if any(map(math.isnan, known)) else max(known, default=0.0)


def _diff_text(diff: float | None) -> str:
    if diff is None:
        return "not comparable"
    return "NaN in different places" if math.isnan(diff) else f"{diff:.3g}"
