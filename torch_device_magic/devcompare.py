"""`%%devcompare`: one cell on several devices, timed, and how far the results differ.

    >>> run, reads = cells.compiled(shell, "a @ b"), {"a", "b"}  # the cell, the names it reads
    >>> result = compare(shell.user_ns, run, reads, [torch.device("cpu"), torch.device("cuda")])
    >>> [(d.device, d.median_s, d.speedup, d.max_abs_diff) for d in result.devices]
    [('cpu', 0.3124, 1.0, None), ('cuda', 0.0041, 76.2, 3.1e-05)]

The names the cell reads, and those the code it can call reads
(`reach.reach`), are its inputs; a function that reaches tensors through no
name of the notebook (its own module's globals, a closure) is refused before
anything runs. For each device in turn the inputs that hold tensors (in
containers or in any object's attributes: a dataset, an LR scheduler) are
deep-copied together (aliases and views stay shared among the copies), the
memo seeded with each tensor's copy: a tensor on another device is copied
straight to the device, one already there is *shared* (a new tensor on its
storage), unless `--warmup 0`; what a DataLoader's worker processes read is
shared where it is. The first warm-up runs under `_WriteGuard`,
which stops it before any operator writes into a shared storage; what the
name that reached it holds is then copied and the warm-up made again. The copies
are moved there with the `%%ondevice` mover; the cell runs with that device as
torch's default and as `device` (the CPU under no device mode, which would slow
every torch call); then the namespace gets back exactly the bindings it had,
the copies are freed before the next device's are made, and the random states
(torch's, Python's and NumPy's global ones, and the user's generators of all three
that the cell reaches) are put back. A checksum of each shared storage, before and
after a device's runs, catches the writes no version counter sees (through `.data`,
a storage, a raw pointer) and says so. The cell is compiled once, run `warmup`
times, then timed `runs` times, the device synchronised around each timed run
where its runtime is up.
"""

from __future__ import annotations

import cmath
import contextlib
import copy
import functools
import gc
import math
import random
import statistics
import sys
import warnings
import weakref
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from .default_device import for_cell
from .devices import Inventory, resolve
from .errors import DeviceMagicError, first_sentence
from .moving import move
from .namespace import found_in, holds_tensors, tensors_in
from .probes import active_accelerator, clock, empty_cache, free_bytes
from .reach import reach
from .reports import Table
from .tensors import storage_bytes, storage_key
from .units import fmt_bytes, fmt_seconds


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
    """The devices `specs` name, each available and different; at least two, the first
    one that computes (not meta)."""
    found = [resolve(spec, inventory)[0] for spec in specs]  # canonical: cpu:0 is cpu
    for i, dev in enumerate(found):
        twin = next((j for j in range(i) if _same_device(found[j], dev)), None)
        if twin is not None:
            same = f"{specs[twin]} and {specs[i]}"
            shown = dev if dev.index is not None else found[twin]  # the one with its index
            raise DeviceMagicError(
                f"%%devcompare got one device twice: {same} are the same device ({shown}); "
                "compare different devices, e.g. %%devcompare cpu cuda"
            )
    if len(found) < 2:
        raise DeviceMagicError(
            "%%devcompare needs at least two devices, e.g. %%devcompare cpu cuda"
        )
    if found[0].type == "meta":
        raise DeviceMagicError(
            "%%devcompare cannot take meta as the reference, since it computes nothing: "
            f"put a device that does first, e.g. %%devcompare {specs[1]} {specs[0]}"
        )
    return found


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether `a` and `b` are one device: `cuda` is `cuda:0` where cuda:0 is the current
    one (asked only then, which starts the runtime, as the comparison would)."""
    if a.type != b.type or a == b:
        return a == b
    return _concrete(a) == _concrete(b)


def _concrete(dev: torch.device) -> torch.device:
    """`dev` with the index of the device it means (`tdmdev` as `tdmdev:0`)."""
    if dev.index is not None or dev.type in ("cpu", "meta"):
        return dev
    return torch.empty(0, device=dev).device


def compare(
    namespace: dict[str, Any],
    run: Callable[[], Any],
    reads: Iterable[str],
    devices: Sequence[torch.device],
    runs: int = 5,
    warmup: int = 1,
    hidden: Container[str] = (),
    attributes: Iterable[str] = (),
) -> Comparison:
    """Call `run` (a cell compiled by `cells.compiled`) on each device in turn, with copies of
    those of `reads` (the user's names it reads), and of the names the code it can call reads
    (`reach`, given the attribute names the cell names), that hold tensors; the namespace
    ends as it began. `hidden`: names never copied (IPython's own)."""
    __tracebackhide__ = True
    reads = set(reads)
    found = reach(namespace, reads, attributes)
    if found.unfollowed:
        raise DeviceMagicError(
            f"%%devcompare cannot run this cell on copies: {found.unfollowed[0]}, which it "
            "would change for real; nothing ran (pass them as arguments, or define the "
            "function in the notebook)"
        )
    read = {n for n in reads | found.names if n in namespace and n not in hidden}
    # What a hook fills (`activations = {}`) is copied even while it holds no tensor yet:
    # the copies of a module call their hooks, which must not write into the user's dict.
    names = sorted(n for n in read if holds_tensors(namespace[n])
                   or (n in found.hooked and isinstance(namespace[n], (dict, list, set))))
    kept = _generators(namespace[n] for n in sorted(read))
    timings: list[DeviceTiming] = []
    reference = None
    for i, dev in enumerate(devices):
        made: list[weakref.ref] = []
        try:
            # Each device (and each new start of a stopped warm-up) starts from the notebook's
            # random state, which is put back after.
            rng = functools.partial(_rng_kept, devices, kept)
            runs_s, value = _on_device(namespace, run, dev, names, runs, warmup, made, rng)
        except BaseException:
            reference = None  # IPython keeps the traceback, and this frame with it
            raise
        if i == 0:
            reference = value
        speedup: float | None = (
            timings[0].median_s / statistics.median(runs_s) if timings else 1.0
        )
        if dev.type == "meta":  # it computes nothing: its times are no speed
            speedup = None
        diff = None if i == 0 else difference(reference, value)
        timings.append(DeviceTiming(str(dev), runs_s, speedup, diff))
        del value  # before the next device runs: it may hold that device's memory
        _free(made, dev, kept=reference)  # and so may its copies
    return Comparison(timings, warmup)


def _generators(objs: Iterable[object]) -> list[Any]:
    """The random generators `objs` reach: torch's, Python's (`random.Random`) and, where
    NumPy is imported, NumPy's."""
    np = sys.modules.get("numpy")
    kinds: tuple[type, ...] = (torch.Generator, random.Random)
    if np is not None:
        kinds += (np.random.Generator, np.random.BitGenerator, np.random.RandomState)
    found: list[Any] = found_in(objs, *kinds)
    return [g for g in found if not isinstance(g, random.SystemRandom)]  # the OS's: no state


@contextlib.contextmanager
def _rng_kept(devices: Sequence[torch.device], kept: Sequence[Any]) -> Iterator[None]:
    """Save the random state of the CPU, of each device compared, Python's and NumPy's
    global ones and those of the generators `kept` (the user's own, which the cell reaches),
    and put it back, so that a seeded notebook draws the same numbers after the comparison
    as before, and each device's runs draw the same numbers."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[], device_type="cuda"))  # the CPU's
        for kind in sorted({d.type for d in devices} - {"cpu", "meta"}):
            module = getattr(torch, kind, None)
            if not hasattr(module, "get_rng_state"):  # a backend without a generator of its own
                continue
            current = getattr(module, "current_device", lambda: 0)  # MPS has one device
            indices = {current() if d.index is None else d.index for d in devices if d.type == kind}
            stack.enter_context(torch.random.fork_rng(devices=sorted(indices), device_type=kind))
        stack.callback(random.setstate, random.getstate())
        np = sys.modules.get("numpy")  # not imported: the cell has drawn nothing from it
        if np is not None:
            stack.callback(np.random.set_state, np.random.get_state())
        for generator in kept:
            if isinstance(generator, random.Random):
                stack.callback(generator.setstate, generator.getstate())
            elif hasattr(generator, "get_state"):  # torch's Generator, NumPy's RandomState
                stack.callback(generator.set_state, generator.get_state())
            else:  # NumPy's Generator and BitGenerator
                bits = getattr(generator, "bit_generator", generator)
                stack.callback(setattr, bits, "state", bits.state)
        yield


def _on_device(
    ns: dict[str, Any], run: Callable[[], Any], dev: torch.device, names: list[str], runs: int,
    warmup: int, made: list[weakref.ref], rng: Callable[[], contextlib.AbstractContextManager],
) -> tuple[list[float], Any]:
    """The runs on `dev`. With a warm-up, tensors already on `dev` are shared, and the first
    warm-up runs under a guard that stops it before it writes one; what that run would have
    written (all a name reaches) is then copied, and the run made again."""
    __tracebackhide__ = True
    written: set[str] = set() if warmup else set(names)  # names whose tensors are all copied
    while True:
        try:
            with rng():
                return _runs(ns, run, dev, names, written, runs, warmup, made)
        except _SharedWrite as hit:
            written |= hit.names
        _free(made, dev)  # the stopped run's copies, before the next ones are made
        made.clear()


def _free(made: list[weakref.ref], dev: torch.device, kept: object = None) -> None:
    """Make sure the copies `made` for `dev` are gone, but those in `kept` (a result):
    the collector runs only where something (a cycle among the copied objects) still
    holds one, since a full collection takes a while in a large notebook."""
    alive = [t for t in (ref() for ref in made) if t is not None]
    if alive:
        mine = {id(t) for t in tensors_in([kept])} if kept is not None else set()
        if any(id(t) not in mine for t in alive):
            del alive
            gc.collect()
    if made:
        empty_cache(dev)


def _runs(
    ns: dict[str, Any], run: Callable[[], Any], dev: torch.device, names: list[str],
    written: set[str], runs: int, warmup: int, made: list[weakref.ref],
) -> tuple[list[float], Any]:
    __tracebackhide__ = True
    bindings = dict(ns)
    value = None
    inputs: _Inputs | None = None
    try:
        inputs = _copies(ns, names, dev, written)
        made.extend(inputs.made)
        ns.update(inputs.copies)
        move(ns, names, dev)
        ns["device"] = dev
        sums = inputs.checksums()
        with for_cell(dev), warnings.catch_warnings():
            # A copied optimizer loses the step wrapper its LR scheduler put on the original,
            # and torch would blame the user for "overriding" it.
            warnings.filterwarnings("ignore", message=_UNWRAPPED_STEP)
            for k in range(warmup):
                if k == 0 and inputs.shared:
                    with _WriteGuard(inputs.shared) as guard:
                        run()
                    guard.check()  # a write the cell caught and swallowed
                else:
                    run()
            versions = inputs.versions()
            runs_s = []
            for _ in range(runs):
                _synchronize(dev)
                start = clock()
                value = run()
                _synchronize(dev)
                runs_s.append(clock() - start)
                if inputs.versions() != versions:
                    raise DeviceMagicError(_WROTE_LATE.format(
                        ", ".join(inputs.changed(versions)), dev))
            unseen = inputs.unseen(sums)  # once, after the runs: it reads every shared byte
            if unseen:
                raise DeviceMagicError(_WROTE_UNSEEN.format(", ".join(unseen), dev))
        return runs_s, value
    except (DeviceMagicError, _SharedWrite):  # the inputs could not be copied: it did not run
        raise
    except Exception:
        print(f"%%devcompare: the cell failed on {dev}", file=sys.stderr)
        raise
    finally:
        ns.clear()
        ns.update(bindings)
        # On an error IPython keeps the traceback, and this frame with it, until the next
        # one: it must not keep the old bindings (the user's tensors), the copies nor a result.
        bindings.clear()
        value = inputs = None


_WROTE_LATE = (
    "%%devcompare stopped: a timed run on {1} wrote into {0}, which the guarded warm-up run "
    "did not; those values have changed (run it with --warmup 0, which copies everything)"
)
_WROTE_UNSEEN = (
    "%%devcompare stopped: a run on {1} wrote into {0} unseen by the guarded warm-up run and "
    "by torch's version counters (through .data, a storage, apply_ or a raw pointer); those values "
    "have changed (run it with --warmup 0, which copies everything)"
)


@dataclass
class _Inputs:
    """The copies one device's runs get, and the user's storages they share."""

    copies: dict[str, object]
    shared: dict[int, set[str]]  # storage key -> the names that reach it
    aliases: list[Tensor]  # the copies that share a storage of the user's
    made: list[weakref.ref]  # the copies that hold memory of their own

    def versions(self) -> list[int]:
        return [t._version for t in self.aliases]

    def changed(self, before: list[int]) -> list[str]:
        return self._names(storage_key(t) for t, v in zip(self.aliases, before) if t._version != v)

    def checksums(self) -> dict[int, tuple[int, int]]:
        """A checksum of each shared storage that holds bytes (not meta's): it sees the writes
        that version counters miss (through `.data`, a storage, a raw pointer)."""
        storages = {storage_key(t): t.untyped_storage() for t in self.aliases if not t.is_meta}
        return {key: _checksum(storage) for key, storage in storages.items()}

    def unseen(self, before: dict[int, tuple[int, int]]) -> list[str]:
        """The names that reach a shared storage whose checksum is no longer `before`'s."""
        now = self.checksums()
        return self._names(key for key, sums in before.items() if now[key] != sums)

    def _names(self, keys: Iterable[int]) -> list[str]:
        return sorted({n for k in keys for n in self.shared.get(k, ())})


def _checksum(storage: torch.UntypedStorage) -> tuple[int, int]:
    """The sums of a storage's bytes read as 64-bit words, and of the bytes after the last
    word: one pass, no copy (a 256 MiB storage takes milliseconds)."""
    n, dev = storage.nbytes(), storage.device
    words = torch.empty(0, dtype=torch.int64, device=dev).set_(storage, 0, (n // 8,), (1,))
    rest = torch.empty(0, dtype=torch.uint8, device=dev).set_(storage, n - n % 8, (n % 8,), (1,))
    return int(words.sum()), int(rest.sum())


def _copies(ns: dict, names: list[str], dev: torch.device, written: set[str]) -> _Inputs:
    """Copies of `names`, made together so that aliases and views stay shared. A tensor is
    copied straight to `dev`; one already there that no name of `written` reaches is not
    copied but shared (a new tensor on the same storage)."""
    try:
        plan = _SharePlan(dev, {n: ns[n] for n in names}, written)
        plan.check_fits()
        memo = plan.memo()
        with _StraightTo(dev):
            copies = copy.deepcopy({n: ns[n] for n in names}, memo)
    except DeviceMagicError:
        raise
    except Exception as err:
        reason = first_sentence(err)
        raise DeviceMagicError(f"%%devcompare could not copy the cell's inputs: {reason}") from None
    return _Inputs(copies, plan.shared_names(), plan.aliases, plan.made)


_LIVE_ITERATOR = (
    "%%devcompare cannot copy an iterator over a DataLoader that the cell reads (`iter(loader)`"
    ": its place in the epoch and its worker processes cannot be copied); nothing ran "
    "(iterate the DataLoader itself in the cell: for batch in loader)"
)


class _SharePlan:
    """Which tensors `objs` reach are shared and which copied, and what the copies weigh."""

    def __init__(self, dev: torch.device, objs: dict[str, object], written: set[str]) -> None:
        self.dev = dev
        self.tensors: dict[int, Tensor] = {}  # id -> tensor; the rest is deepcopy's
        self.reached: dict[int, set[str]] = {}  # storage key -> the names that reach it
        for name, obj in objs.items():
            for t in tensors_in([obj]):
                grad = t.grad if t.is_leaf else None
                if not _plain(t) or (grad is not None and not _plain(grad)):
                    continue
                if t.is_meta and dev.type != "meta":
                    continue  # nothing comes off meta: the move says so
                for part in (t, grad) if grad is not None else (t,):
                    self.tensors.setdefault(id(part), part)
                    self.reached.setdefault(storage_key(part), set()).add(name)
        self.copied = {k for k, reach in self.reached.items() if reach & written}
        # A DataLoader with persistent workers keeps their live iterator, which cannot be
        # copied (nor pickled): its copy starts workers of its own, on the dataset's copy.
        # An iterator bound apart from its loader is the cell's place in an epoch: refused.
        loaders = found_in(objs.values(), DataLoader, _BaseDataLoaderIter)
        if any(isinstance(it, _BaseDataLoaderIter) for it in loaders):
            raise DeviceMagicError(_LIVE_ITERATOR)
        self.iterators = [loader._iterator for loader in loaders
                          if isinstance(loader, DataLoader) and loader._iterator is not None]
        # What a loader's worker processes read stays where it is: a forked worker cannot
        # use CUDA, and the cell's loop moves the batches it gets itself.
        self.stay = {storage_key(t) for t in tensors_in(
            loader.dataset for loader in loaders
            if isinstance(loader, DataLoader) and loader.num_workers > 0)}
        self.aliases: list[Tensor] = []
        self.made: list[weakref.ref] = []

    def shareable(self, t: Tensor) -> bool:
        key = storage_key(t)
        return (t.device == self.dev or key in self.stay) and key not in self.copied

    def _where(self, t: Tensor) -> torch.device:
        """Where `t`'s copy goes: `dev`, but for what a loader's workers read, and a scalar
        (an optimizer's `step`), copied where it is: the move then applies torch's rule,
        which keeps `step` on the CPU."""
        return t.device if t.dim() == 0 or storage_key(t) in self.stay else self.dev

    def check_fits(self) -> None:
        """Refuse before copying what the target has no room for."""
        sizes = {storage_key(t): storage_bytes(t) for t in self.tensors.values()
                 if not self.shareable(t) and not t.is_meta}
        need = sum(sizes.values())
        if not need or self.dev.type == "meta":
            return
        if self.dev.type != "cpu":
            torch.empty(0, device=self.dev)  # its runtime up, so that its free memory reads
        free = free_bytes(self.dev)
        if free is not None and need > free:
            where = "the host" if self.dev.type == "cpu" else str(self.dev)
            raise DeviceMagicError(
                f"%%devcompare needs {fmt_bytes(need)} on {where} for its copies of the "
                f"cell's inputs, and {fmt_bytes(free)} is free there: nothing ran"
            )

    def memo(self) -> dict[int, Any]:
        """A deepcopy memo that already holds each tensor's copy or alias."""
        memo: dict[int, Any] = {id(it): None for it in self.iterators}
        for t in self.tensors.values():
            self._made(t, memo)
        return memo

    def _made(self, t: Tensor, memo: dict) -> Tensor:
        if id(t) in memo:
            return memo[id(t)]
        share = self.shareable(t)
        new = _rebuilt(t, memo, self._where(t), share)
        if t.is_leaf:
            grad = None if t.grad is None else self._made(t.grad, memo)
            if type(t) is torch.nn.Parameter:
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            else:
                new.requires_grad_(t.requires_grad)
            new.grad = grad
        if t.__dict__:
            new.__dict__.update(copy.deepcopy(t.__dict__, memo))
        if share:
            self.aliases.append(new)
        else:
            self.made.append(weakref.ref(new))
        memo[id(t)] = new
        return new

    def shared_names(self) -> dict[int, set[str]]:
        return {storage_key(t): self.reached[storage_key(t)] for t in self.aliases}


def _plain(t: Tensor) -> bool:
    """A strided tensor or Parameter, which the plan copies or shares itself."""
    return (t.layout == torch.strided and type(t) in (Tensor, torch.nn.Parameter)
            and not t.is_nested)


def _rebuilt(t: Tensor, memo: dict, dev: torch.device, share: bool) -> Tensor:
    """`t` on a storage of `dev`: its own (`share`), or one copy of its whole storage, made
    once per storage, so that views stay views; detached, with its lazy conj/neg bits."""
    key = ("storage", storage_key(t))
    if key not in memo:
        if share:
            memo[key] = t.untyped_storage()
        else:
            storage = t.untyped_storage()  # with its size: a backend may know set_ only so
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                storage, 0, (storage.nbytes(),), (1,))
            memo[key] = whole.to(dev, copy=True).untyped_storage()
    new = torch.empty(0, dtype=t.dtype, device=dev)
    new.set_(memo[key], t.storage_offset(), t.size(), t.stride())
    if t.is_conj():  # lazy views: the storage holds what they negate or conjugate
        new = new.conj()
    if t.is_neg():
        new = new._neg_view()
    return new


_UNWRAPPED_STEP = r"Seems like `optimizer\.step\(\)` has been overridden after learning rate"


class _StraightTo(TorchFunctionMode):
    """Inside `copy.deepcopy`, for tensors the plan did not reach (in an object's
    `__slots__`, behind a `__getstate__`): a tensor is copied straight to `device`, not
    cloned where it is first, which on a full GPU would need twice its memory; a tensor
    with an autograd history, which deepcopy refuses, is copied detached."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is Tensor.clone and _plain(args[0]) and not args[0].is_meta:
            return args[0].to(self.device, copy=True, **kwargs)  # a Parameter's deepcopy
        if func is not Tensor.__deepcopy__:
            return func(*args, **kwargs)
        t, memo = args
        if id(t) in memo:
            return memo[id(t)]
        if not _plain(t) or type(t) is not Tensor or t.is_meta:
            return func(t, memo)  # sparse, subclasses, meta: deepcopy's own way, then the move
        memo[id(t)] = new = _rebuilt(t, memo, self.device, share=False)
        if t.is_leaf:
            new.requires_grad_(t.requires_grad)
            if t.grad is not None:
                new.grad = copy.deepcopy(t.grad, memo)
        return new


class _SharedWrite(BaseException):
    """The guarded run was about to write into a storage of the user's: it stops there.

    A BaseException, so that a cell's `except Exception` does not swallow it."""

    def __init__(self, names: set[str]) -> None:
        super().__init__(", ".join(sorted(names)))
        self.names = names


# What hands a tensor's memory to code torch cannot watch (NumPy, DLPack, a raw pointer), or
# writes it through no operator (`apply_`, `map_`, `map2_` call Python on each element).
_ESCAPES = frozenset({Tensor.numpy, Tensor.__array__, Tensor.data_ptr, Tensor.__dlpack__,
                      Tensor.__cuda_array_interface__.__get__,
                      Tensor.apply_, Tensor.map_, Tensor.map2_})


class _WriteGuard(TorchDispatchMode):
    """Stops a run before any operator writes into one of `shared`'s storages (an argument
    its schema marks as written, `out=` included), hands one to NumPy or to a raw pointer,
    which torch cannot watch, or writes one through no operator (`apply_`)."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # else the first run imports torch._dynamo to wrap this mode: seconds

    def __init__(self, shared: dict[int, set[str]]) -> None:
        super().__init__()
        self.shared = shared
        self.hit: set[str] = set()
        self._escapes = _EscapeGuard(self)

    def __enter__(self):
        self._escapes.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._escapes.__exit__(*exc)

    def stop(self, t: object) -> None:
        if isinstance(t, Tensor) and t.layout == torch.strided:
            names = self.shared.get(storage_key(t))
            if names is not None:
                self.hit |= names
                raise _SharedWrite(names)

    def check(self) -> None:
        if self.hit:
            raise _SharedWrite(self.hit)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    self.stop(t)
        return func(*args, **kwargs)


class _EscapeGuard(TorchFunctionMode):
    def __init__(self, guard: _WriteGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _ESCAPES and args:
            self.guard.stop(args[0])
        return func(*args, **(kwargs or {}))


def _synchronize(dev: torch.device) -> None:
    """Wait for `dev`'s queued work where its runtime is up (the first run may start it)."""
    accelerator = active_accelerator(dev)
    if accelerator is not None:
        accelerator.synchronize()


def difference(a: object, b: object) -> float | None:
    """The largest absolute difference between two results (tensors, numbers, NumPy arrays
    and scalars, or matching lists, tuples and dicts of them); None when they cannot be
    compared (meta, shapes). NaN in the same places on both is no difference; NaN where the
    other has a number makes the difference NaN."""
    a, b = _from_numpy(a), _from_numpy(b)
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


def _from_numpy(value: object) -> object:
    """A NumPy scalar as the Python number it holds, a NumPy array of numbers as a tensor
    (compared as tensors are); anything else as it is."""
    np = sys.modules.get("numpy")  # not imported: no result of the cell is NumPy's
    if np is None or not isinstance(value, (np.ndarray, np.generic)):
        return value
    if value.dtype.kind not in "biufc":  # strings, objects, dates: not numbers
        return value
    if isinstance(value, np.generic):
        return value.item()
    return torch.tensor(np.ascontiguousarray(value))  # torch takes no negative strides


def _diff_text(diff: float | None) -> str:
    if diff is None:
        return "not comparable"
    return "NaN in different places" if math.isnan(diff) else f"{diff:.3g}"
