"""Move what a cell's names hold to a device, all or nothing, losing nothing.

    >>> result = move(user_ns, cells.cell_names(code), torch.device("cuda:0"))
    >>> result.names, result.nbytes, result.seconds, result.not_followed

Three phases, so that a failure changes nothing:

1. *Plan*: walk the named objects (containers, modules and optimizers once
   each, memoised by `id`; at most `WALK_LIMIT` other objects a name, as
   `%tensors` does; an object that raises when read is skipped; the result
   names both) and group the tensors by storage, which also finds a tensor
   reached twice: it is planned once.
2. *Copy*: one copy per storage (a singleton with `.to`, a shared storage as
   one span of bytes from which every tensor of the group is rebuilt with its
   own offset, sizes and strides, so views keep sharing storage, and its lazy
   conjugate and negative bits). On failure
   the copies are dropped and a `DeviceMagicError` is raised from a frame that
   holds none of them (a traceback keeps its frames' tensors alive,
   pytorch#27600).
3. *Commit*: each tensor gets its copy in place. We swap only the C++ tensor
   (the last step of `torch.utils.swap_tensors`), so the Python object keeps
   its identity, class (a Parameter stays a Parameter), attributes and
   autograd hooks, and every reference to it, weak ones too, sees the move.
   Where something else holds the old C++ tensor (a view the cell does not
   name, an autograd graph), the tensor gets it back with the new data
   (`.data`) once the commit is done, so that those holders see the move; to
   or from meta, where torch refuses that, they keep the old one, and a
   backward pass through such a graph fails saying why. Where torch cannot
   swap (before 2.3) `.data` is set, or else the holders we walked are rebound
   to a new tensor; the result lists each of these. A tensor that nothing can
   observe but the one plain dict or list that holds it (no other reference,
   no weak one, no view or graph, a plain tensor without attributes, not
   restorable) is not swapped: its entry is rebound to the copy, which nobody
   can tell apart and costs less (`_lone`). Leaves stay leaves with
   `requires_grad`, `.grad` is moved and reattached; a tensor with an autograd
   history arrives without it.
   The commit is all or nothing too: an error in it undoes what it did, and
   SIGINT (Ctrl-C, a notebook's stop button) waits until it ends, then cancels
   the move; a handler of the user's own gets it then instead, cancelling nothing.

`restore` from `meta` needs no data: after the swap, each copy holds the
original C++ tensor, which is swapped back into the very object it came from,
with its data, `grad_fn`, hooks and `.grad`. Whatever the cell left holding the
meta ones (a kept graph, `Out`, a traceback, a view) keeps those, but a name the
cell bound to meta tensors gets its original back. A restore holds SIGINT from
start to end: it is never left half done. Each tensor goes back where it was;
what the cell added to a module, where the submodule it joined came from.

Optimizer state follows its parameters by torch's own rule: `step` stays where
it is unless the group is `capturable` or `fused`. Nothing here touches
`torch.cuda` unless a device involved is CUDA.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import gc
import importlib.util
import itertools
import logging
import math
import operator
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import probes
from .errors import DeviceMagicError, first_sentence
from .reports import Table
from .tensors import (
    PLAIN_MAPPINGS,
    WALK_LIMIT,
    children,
    is_container,
    is_lazy,
    storage_id,
    storage_key,
    stored_bytes,
)
from .units import fmt_bytes, fmt_seconds, plural

__all__ = ["MoveResult", "move", "restore"]

_BAR_MIN_BYTES = 1 << 30  # about a second of host-to-device copying: show a progress bar
_log = logging.getLogger(__name__)
_ALIGN = 16  # the largest element size
_swap_impl: Callable[[Tensor, Tensor], None] | None = getattr(
    torch._C, "_swap_tensor_impl", None
)  # torch >= 2.3
_USE_COUNT: Callable[[Tensor], int] = Tensor._use_count  # type: ignore[attr-defined]  # unstubbed
_NBYTES = operator.attrgetter("nbytes")
_GRAD = operator.attrgetter("grad")
_IS_META = operator.attrgetter("is_meta")
_DEVICE = operator.attrgetter("device")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_OOM = getattr(torch, "OutOfMemoryError", ())
# Whether the walk enters an object of a type: the builtin ones; a plan learns the others
# once a type (`_walkable`), and forgets them with the plan, so that no class of the user's
# is kept alive (a class defined in a cell, run again, `%reload_ext`).
_WALKABLE = dict.fromkeys((int, float, complex, bool, str, bytes, type(None)), False)
# The holders whose entries a move may rebind: their `__setitem__` runs no code of the user's.
_REBINDABLE = PLAIN_MAPPINGS | {list}
# What `sys.getrefcount` reads, in a `map` over the plan's list, for a tensor with one holder.
_HELD_ONCE = next(map(sys.getrefcount, [object()])) + 1
_PLAIN_REFERENTS = len(gc.get_referents(torch.empty(0)))  # a tensor without attributes
_PLAIN_TENSORS = frozenset({Tensor, torch.nn.Parameter})
_MISSING = object()


@dataclass
class MoveResult:
    """What a move did: bytes per name, time taken, references that could not follow,
    and what the walk did not look into (`skipped`)."""

    device: torch.device
    names: dict[str, int]
    seconds: float
    not_followed: list[str] = field(default_factory=list)
    _undo: _Undo | None = field(default=None, repr=False)
    skipped: list[str] = field(default_factory=list)
    restored: int | None = None  # a restore from meta: how many originals were put back
    # A Ctrl-C that came once a restorable move was done, or during a restore: held back so
    # that the caller has this result (and can restore, or show it) before it raises
    # KeyboardInterrupt itself. Only under Python's own handler: a user's gets the signal.
    interrupted: bool = False
    said: list[str] = field(default_factory=list)  # a restore: lines to show even without -v
    to: str = ""  # a restore to several devices: all of them ("cpu, cuda:0")
    # Bytes a name holds that are counted under another (a model's parameters, which its
    # optimizer holds too): one line each.
    counted_under: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(self.names.values())

    def table(self) -> Table:
        if self.restored is not None:  # nothing was copied: saying "moved in 1 ms" would mislead
            title = f"restored {plural(self.restored, 'tensor')} from meta (the originals put back)"
        elif self.names:
            took = fmt_seconds(self.seconds)
            title = f"moved {fmt_bytes(self.nbytes)} to {self.to or self.device} in {took}"
        else:
            title = f"nothing to move to {self.device}"
        rows = [(name, fmt_bytes(n)) for name, n in self.names.items()]
        notes = list(self.counted_under)
        notes += [f"could not follow: {n}" for n in self.not_followed]
        notes += [f"not walked: {n}" for n in self.skipped]
        return Table(title, ("name", "bytes"), rows, notes)


@dataclass
class _Undo:
    """What `restore` needs: where things came from, or (from meta) the originals."""

    names: list[str]
    home: dict[int, torch.device]
    module_home: dict[int, torch.device]
    # From meta: each moved tensor and the copy that, once swapped, holds its original.
    originals: list[tuple[Tensor, Tensor]] | None = None
    rebound: dict[int, Tensor] = field(default_factory=dict)
    optimizer_state: list[tuple[torch.optim.Optimizer, dict]] = field(default_factory=list)
    values: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    bindings: dict[str, object] = field(default_factory=dict)  # from meta: what each name held


def move(
    ns: dict, names: Iterable[str], device: torch.device, *, restorable: bool = False
) -> MoveResult:
    """Move to `device` what `names` hold in `ns`, all or nothing (`restorable`: for `restore`).

    Each tensor's bytes count once, under the first name that reaches it, taking the names
    in alphabetical order but those bound to an optimizer last: a model's parameters count
    under the model, an optimizer's under it only where no name of a model reaches them.
    The result says what a name holds that is counted under another (`counted_under`)."""
    device = _canonical(device)
    names = sorted(n for n in names if n in ns)
    names.sort(key=lambda n: isinstance(ns[n], torch.optim.Optimizer))  # stable
    plan = _Plan.to(device)
    plan.walk(ns, names)
    undo = None
    if restorable:
        undo = _Undo(names, {}, plan.module_home)
        if device.type == "meta":  # nothing comes back from meta: keep the originals
            undo.originals = []
            undo.optimizer_state, undo.values = plan.optimizer_snapshots()
            undo.bindings = {name: ns[name] for name in names}
    return _execute(plan, ns, device, undo)


def restore(ns: dict, moved: MoveResult) -> MoveResult:
    """Send back what `move(..., restorable=True)` moved, carrying what was done to it since.

    Once only: `moved` then lets go of what it kept for this (from meta, the originals),
    which a traceback holding it would otherwise keep alive. SIGINT waits until it is done:
    a Ctrl-C neither cancels it nor leaves it half done.
    """
    with _sigint_held() as interrupted:
        undo, moved._undo = moved._undo, None
        if undo is None:
            raise ValueError("restore() needs the result of move(..., restorable=True), once")
        start = time.perf_counter()
        if undo.originals is not None:
            result = _put_back_originals(ns, moved, undo, start)
        else:
            plan = _Plan.back(undo)
            plan.walk(ns, [n for n in undo.names if n in ns])
            result = _execute(plan, ns, None, None, held=True)
        if interrupted:
            result.said.append("Ctrl-C during --restore: it finished first, everything went back")
            if interrupted.raises:  # the caller raises KeyboardInterrupt, with this result
                result.interrupted = True
                interrupted.clear()
    return result


class _Where(NamedTuple):
    """Where a tensor or container was found: at `key` of what is at `parent`, an
    attribute if `is_attr`; `parent` None for a name of the namespace."""

    parent: _Where | None
    key: object
    is_attr: bool


class _Run(NamedTuple):
    """Tensors found one after the other in one holder: the plan's `start` to `end`."""

    start: int
    end: int
    where: _Where | None  # where the holder is (None: the namespace)
    is_attr: bool  # whether the tensors' keys are attribute names
    # A plain dict or list whose entries may be rebound; the optimizer whose state it is
    # (which keeps its tensors, however deep); else None.
    holder: dict | list | torch.optim.Optimizer | None


class _Frame(NamedTuple):
    """What the walk has still to read of a holder."""

    entries: Iterator[tuple[object, object]]  # (key, value) pairs
    where: _Where | None
    is_attr: bool
    inherited: torch.device | None  # restoring: the target its tensors inherit
    holder: dict | list | torch.optim.Optimizer | None  # as in `_Run`


# The plan's columns: one entry per tensor, in the order found, dropped together (a list).
_COLUMNS = ("tensors", "keys", "targets")
# Lists of indices into the columns.
_INDICES = ("requiring_grad", "with_history", "special")


class _Plan:
    """Phase 1: every tensor to move, found once, with its target and what shares its storage.

    Made by `_Plan.to(device)` for a move, or by `_Plan.back(undo)` for a restore, where each
    tensor goes home and what was added to a moved module goes with it."""

    def __init__(
        self,
        device: torch.device | None,
        home: dict[int, torch.device] | None,
        module_targets: dict[int, torch.device] | None,
    ) -> None:
        self.device = device
        self.home = home
        self.module_targets = module_targets
        self.seen: set[int] = set()  # containers, modules, optimizers walked already
        self.tensors: list[Tensor] = []
        self.keys: list[object] = []  # where each tensor is in its run's holder
        # Each tensor's target: a list when restoring, else one device for all.
        self.targets: list[torch.device] | _Same = [] if device is None else _Same(device)
        self.runs: list[_Run] = []  # where the tensors were found, holder by holder
        self.nbytes: list[int] = []  # what each copy takes (a shared storage: all on its first)
        self.shared: dict[int, list[int]] = {}  # a storage's first tensor -> all that share it
        self.requiring_grad: list[int] = []  # leaves whose copies must require grad too
        self.with_history: list[int] = []
        self.grads: dict[int, tuple[Tensor, Tensor]] = {}  # by the id of the tensor that has it
        self.names: list[tuple[str, int, int]] = []  # name -> its slice of `tensors`
        self.module_home: dict[int, torch.device] = {}
        self.optimizers: list[torch.optim.Optimizer] = []
        self.skipped: list[str] = []  # what the walk did not look into, and why
        # Subclasses that keep their data in Python attributes (a jagged nested tensor, a
        # MaskedTensor, `__tensor_flatten__` wrappers): copied by their own `.to`, and their
        # attributes are swapped with the C++ tensor.
        self.special: list[int] = []
        self.exact = 0  # how many were planned at once (`_all_tensors`): plain tensors
        self.budget = 0  # objects other than tensors the walk may still look at for this name
        self.counted_under: dict[tuple[str, str], int] = {}  # (name, earlier name): bytes
        self.walkable = dict(_WALKABLE)  # by type: whether the walk enters its objects

    @classmethod
    def to(cls, device: torch.device) -> _Plan:
        """A plan that sends every tensor to `device`."""
        return cls(device, None, None)

    @classmethod
    def back(cls, undo: _Undo) -> _Plan:
        """A plan that sends every tensor where `undo` says it came from."""
        return cls(None, undo.home, undo.module_home)

    def where(self, i: int) -> _Where:
        """Where the tensor at `i` was found (first)."""
        run = self.runs[bisect.bisect_right(self.runs, (i, math.inf)) - 1]
        return _Where(run.where, self.keys[i], run.is_attr)

    def walk(self, ns: dict, names: list[str]) -> None:
        for name in names:
            first = len(self.tensors)
            self.budget = WALK_LIMIT
            self._walk(ns, name)
            self._autograd(first)
            if self.budget < 0:
                self.skipped.append(
                    f"{name} past its first {WALK_LIMIT:,} objects other than tensors"
                )
            self.names.append((name, first, len(self.tensors)))
        if self.exact < len(self.tensors):
            self._find_special()
        self._group()

    def _find_special(self) -> None:
        """Find the subclasses that keep their data in Python attributes (`special`)."""
        tensors = self.tensors
        kinds = set(map(type, tensors)) - _PLAIN_TENSORS
        if kinds:
            self.special = [
                i for i, t in enumerate(tensors) if type(t) in kinds and _keeps_data(t)
            ]

    def _walk(self, ns: dict, name: str) -> None:
        # Depth first, in order, one holder's entries at a time: the stack holds an
        # iterator a holder (not every entry), so a list of a million samples costs
        # nothing until it is read, and the walk stops where its budget runs out.
        stack = [_Frame(iter([(name, ns[name])]), None, False, None, ns)]
        while stack and self.budget >= 0:
            frame = stack[-1]
            try:
                found = self._entries(*frame)
            except Exception as exc:  # reading on raised: what was read is planned
                stack.pop()
                self._skip(frame.where, "reading its entries", exc)
                continue
            if found is None:
                stack.pop()
                continue
            obj, at, target = found
            if id(obj) in self.seen:  # containers, modules, optimizers
                continue
            self.seen.add(id(obj))
            try:
                stack += reversed(self._expand(obj, at, target, frame.holder))
            except Exception as exc:  # a mapping whose items() raises, a property that does
                self._skip(at, f"its {type(obj).__name__}", exc)

    def _autograd(self, first: int) -> None:
        """Note which tensors planned since `first` require grad, and plan their grads (a
        tensor that does not require grad may still have one), reading each in C while
        none has any."""
        start = first
        while start < len(self.tensors):
            end = len(self.tensors)
            leaves: Sequence[int] = range(start, end)
            tensors = _pick(self.tensors, leaves)
            if any(map(_REQUIRES_GRAD, tensors)):
                for i, t in enumerate(tensors, start):
                    if t.requires_grad:
                        (self.requiring_grad if t.is_leaf else self.with_history).append(i)
                if self.with_history:  # a non-leaf's `.grad` warns: not read
                    history = set(self.with_history)
                    leaves = [i for i in leaves if i not in history]
                    tensors = _pick(self.tensors, leaves)
            if operator.countOf(map(_GRAD, tensors), None) == len(tensors):
                break
            for i, t in zip(leaves, tensors):
                grad = t.grad
                if grad is not None and id(t) not in self.grads:  # (grads can form a cycle)
                    self.grads[id(t)] = (t, grad)
                    self._entries(iter([("grad", grad)]), self.where(i), True, self.targets[i])
            start = end

    def _skip(self, where: _Where | None, what: str, exc: Exception) -> None:
        self.skipped.append(
            f"{_label(where)}, where {what} raised {type(exc).__name__}: {first_sentence(exc)}"
        )

    def _expand(self, obj: object, where: _Where, inherited, outer: object = None) -> list[_Frame]:
        """Plan the tensors of a module or optimizer; return the entries to walk (frames)."""
        if isinstance(obj, torch.nn.Module):
            return self._module(obj, where, inherited)
        if isinstance(obj, torch.optim.Optimizer):
            return self._optimizer(obj, where, inherited)
        plain = obj if isinstance(obj, (dict, list)) and type(obj) in _REBINDABLE else None
        holder: dict | list | torch.optim.Optimizer | None = plain
        if isinstance(outer, torch.optim.Optimizer):  # its state (LBFGS's lists) stays its own
            holder = outer
        if plain is not None and self.home is None and self._all_tensors(plain, holder, where):
            return []
        entries, is_attr = children(obj)
        return [_Frame(entries, where, is_attr, inherited, holder)]

    def _all_tensors(
        self, obj: dict | list, holder: dict | list | torch.optim.Optimizer | None, where: _Where
    ) -> bool:
        """Plan at once, in C, the entries of a plain dict or list when all are plain tensors
        still to move (the hot case: `{name: tensor}`); else plan nothing, and say so."""
        values = obj.values() if isinstance(obj, dict) else obj
        assert self.device is not None  # only a move to one device plans at once
        if self.device.type == "meta":
            there = map(_IS_META, values)
        else:
            there = map(operator.eq, map(_DEVICE, values), itertools.repeat(self.device))
        # Each test stops at the first that fails: a list of samples, or of tensors already
        # moved (every %%ondevice cell after the first), costs nothing.
        if not values or type(next(iter(values))) is not Tensor:
            return False
        if next(there) or not all(map(operator.is_, map(type, values), itertools.repeat(Tensor))):
            return False
        if any(there):  # from the second on
            return False
        start = len(self.tensors)
        self.tensors += values
        self.exact += len(values)
        self.keys += obj.keys() if isinstance(obj, dict) else range(len(obj))
        self.runs.append(_Run(start, len(self.tensors), where, False, holder))
        return True

    def _entries(
        self,
        entries: Iterator[tuple],
        where: _Where | None,
        is_attr: bool,
        inherited,
        holder: dict | list | torch.optim.Optimizer | None = None,
    ) -> tuple[object, _Where, torch.device | None] | None:
        """Plan the tensors among `entries`, the (key, value) pairs of what was found at `where`,
        up to the next value to walk: return it, with where it is and the target it inherits,
        or None when none is left (or the budget is spent)."""
        # The hot path of a move, one pass per tensor with no call of its own: each torch
        # attribute read here costs about as much as the Python around it, so autograd's
        # are read afterwards in C (`_autograd`). A tensor found again is planned again, and
        # `_group` drops it (its storage key gives it away): memoising ids here took 0.15 µs
        # a tensor, a tenth of the move to meta.
        tensors, targets, keys = self.tensors, self.targets, self.keys
        device, home = self.device, self.home
        walkable, budget = self.walkable, self.budget
        to_meta = device is not None and device.type == "meta"
        start = len(tensors)
        found = None
        for key, t in entries:
            if not isinstance(t, Tensor):
                budget -= 1  # a list of a million (array, label) pairs stops here
                if budget < 0:
                    break
                entered = walkable.get(type(t))
                if entered is None:
                    entered = walkable[type(t)] = _walkable(type(t))
                if entered:
                    found = t, _Where(where, key, is_attr), inherited
                    break
                continue
            if home is None:
                if t.is_meta if to_meta else t.device == device:  # is_meta: 30 ns less
                    continue
                target = device
            else:
                target = home.get(id(t), inherited)
                if target is None or t.device == target:
                    continue
                targets.append(target)  # type: ignore[union-attr]  # restoring: a list
            tensors.append(t)
            keys.append(key)
        if len(tensors) > start:
            self.runs.append(_Run(start, len(tensors), where, is_attr, holder))
        self.budget = budget
        return found

    def _module(self, module: torch.nn.Module, where: _Where, inherited) -> list[_Frame]:
        """Plan a module's tensors. Moving, note each submodule's home: where its first tensor
        is (one without any of its own: its first child's), so that restoring, what the cell
        added to a model split across devices goes where the part it joined came from."""
        targets, own = self.module_targets, set()
        subs = dict(module.named_modules())
        inherits: dict[str, torch.device | None] = {}  # restoring: by prefix
        for prefix, sub in subs.items():
            label = _Where(where, prefix, True) if prefix else where
            target = inherited
            if targets is not None:
                above = inherits.get(prefix.rpartition(".")[0], inherited) if prefix else inherited
                target = inherits[prefix] = targets.get(id(sub), above)
            for kind in (sub._parameters, sub._buffers):
                found = [(k, t) for k, t in kind.items() if t is not None and not is_lazy(t)]
                if found:
                    if targets is None and id(sub) not in own:
                        own.add(id(sub))
                        self.module_home[id(sub)] = found[0][1].device
                    self._entries(iter(found), label, True, target)
        for prefix, sub in reversed(subs.items()) if targets is None else ():
            home, parent = self.module_home.get(id(sub)), subs[prefix.rpartition(".")[0]]
            if prefix and home is not None and id(parent) not in own:
                self.module_home[id(parent)] = home  # the first child's wins: it comes last
        return []

    def _optimizer(self, opt: torch.optim.Optimizer, where: _Where, inherited) -> list[_Frame]:
        self.optimizers.append(opt)
        frames = []
        for g, group in enumerate(opt.param_groups):
            step_stays = not (group.get("capturable") or group.get("fused"))
            params = group["params"]
            found = [(g, p) for p in params]
            self._entries(iter(found), _Where(where, "param_groups", True), False, inherited)
            for k, p in enumerate(params):
                target = self.device if self.home is None else self.home.get(id(p), inherited)
                state = [
                    (key, value)
                    for key, value in opt.state.get(p, {}).items()
                    if not (key == "step" and step_stays)
                ]
                label = _Where(_Where(where, "state", True), f"<param {g}.{k}>", False)
                # LBFGS keeps lists of them
                frames.append(_Frame(iter(state), label, False, target, opt))
        return frames

    def _group(self) -> None:
        """Drop the tensors found twice, find those that share a storage (views, `.data`
        aliases), and count each copy's bytes."""
        try:
            keys = list(map(storage_id, self.tensors))
            stored = True  # so none is sparse, the only kind whose `nbytes` misleads
        except (RuntimeError, NotImplementedError):  # a sparse or other storage-less tensor
            keys = [storage_key(t) for t in self.tensors]
            stored = False
        if len(set(keys)) < len(keys):  # a tensor found twice shares a storage with itself
            self._count_shared(keys)
            keys = self._drop_found_again(keys)
            first: dict[int, int] = {}
            for i, key in enumerate(keys):
                j = first.setdefault(key, i)
                if j != i:
                    self.shared.setdefault(j, [j]).append(i)
        tensors = self.tensors
        self.nbytes = list(map(_NBYTES if stored else stored_bytes, tensors))
        for j, members in self.shared.items():
            self.nbytes[j] = _span([tensors[i] for i in members])[1]
            for i in members[1:]:
                self.nbytes[i] = 0

    def _count_shared(self, storages: list[int]) -> None:
        """Note the bytes each name reaches that an earlier name reached first (the same
        tensor, or one sharing its storage): counted there, and said so (`counted_under`)."""
        owner: list[str] = []
        for name, first, last in self.names:
            owner += [name] * (last - first)
        found: dict[int, int] = {}
        for i, key in enumerate(storages):
            j = found.setdefault(key, i)
            if owner[j] != owner[i]:
                pair = owner[i], owner[j]
                self.counted_under[pair] = (
                    self.counted_under.get(pair, 0) + stored_bytes(self.tensors[i])
                )

    def counted_notes(self) -> list[str]:
        """One line for each name that holds bytes counted under an earlier name."""
        return [
            f"{name} also holds {fmt_bytes(n)} counted under {earlier}"
            for (name, earlier), n in self.counted_under.items()
        ]

    def _drop_found_again(self, storages: list[int]) -> list[int]:
        """Keep the first of each tensor found more than once, in every column; return the
        storage keys of those kept."""
        first: dict[int, int] = {}
        keep = [first.setdefault(id(t), i) == i for i, t in enumerate(self.tensors)]
        if all(keep):
            return storages
        index = list(itertools.accumulate(keep, initial=0))  # each old index's new one
        for name in _COLUMNS:
            column = getattr(self, name)
            if isinstance(column, list):
                setattr(self, name, list(itertools.compress(column, keep)))
        for name in _INDICES:
            setattr(self, name, [index[i] for i in getattr(self, name) if keep[i]])
        self.names = [(name, index[a], index[b]) for name, a, b in self.names]
        self.runs = [
            run._replace(start=index[run.start], end=index[run.end])
            for run in self.runs
            if index[run.start] < index[run.end]
        ]
        return list(itertools.compress(storages, keep))

    def optimizer_snapshots(self) -> tuple[list, list[tuple[Tensor, Tensor]]]:
        """Each walked optimizer's state mapping, and a copy of its tensors that stay put."""
        # A cell on meta still advances the `step` counters left on the CPU.
        mappings = [(opt, {p: dict(s) for p, s in opt.state.items()}) for opt in self.optimizers]
        planned = {id(t) for t in self.tensors}
        values = [
            (v, v.clone())
            for _, state in mappings
            for s in state.values()
            for v in s.values()
            if isinstance(v, Tensor) and id(v) not in planned
        ]
        return mappings, values


class _Same:
    """The targets of a move that sends everything to one device, without a list."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __getitem__(self, i: int) -> torch.device:
        return self.device

    def __iter__(self) -> Iterator[torch.device]:
        return itertools.repeat(self.device)


def _walkable(cls: type) -> bool:
    """Whether the walk enters objects of type `cls` (learnt once a type a plan: the walk's
    hot path)."""
    return issubclass(cls, (torch.nn.Module, torch.optim.Optimizer)) or is_container(cls)


def _execute(
    plan: _Plan, ns: dict, device: torch.device | None, undo: _Undo | None, held: bool = False
) -> MoveResult:
    """Copy, then commit; `held`: the caller holds SIGINT (a restore), so nothing cancels it."""
    # In inference mode (`%%nograd --inference`) copies would be inference tensors, which
    # autograd and optimizers refuse for good: the move makes the kind it finds.
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return _execute_as_found(plan, ns, device, undo, held, _inference(plan.tensors))
    return _execute_as_found(plan, ns, device, undo, held, ())


def _inference(tensors: list[Tensor]) -> set[int]:
    """The indices of the inference tensors among `tensors` (read only in inference mode:
    outside it no copy is one, and an inference tensor's copy is a normal tensor)."""
    return set(itertools.compress(itertools.count(), map(Tensor.is_inference, tensors)))


def _execute_as_found(
    plan: _Plan,
    ns: dict,
    device: torch.device | None,
    undo: _Undo | None,
    held: bool,
    inference: Collection[int],
) -> MoveResult:
    start = time.perf_counter()
    if plan.device is None or plan.device.type != "meta":  # (the plan leaves meta ones out)
        # Nothing can be copied out of meta: refused before any copy is made.
        on_meta = next(itertools.compress(itertools.count(), map(_IS_META, plan.tensors)), None)
        if on_meta is not None:
            raise DeviceMagicError(_failure(plan, [on_meta], plan.targets[on_meta], None))
    news = _copy_all(plan, inference)
    if isinstance(news, str):
        raise DeviceMagicError(news)  # outside any except block: no tensors ride on it
    home = undo.home if undo is not None else None
    if home is not None:
        for t in plan.tensors:
            home[id(t)] = t.device
    history = [
        f"{_label(plan.where(i))}: moved without its autograd history" for i in plan.with_history
    ]
    hold = _sigint_held() if not held else contextlib.nullcontext(_Caught())
    with hold as interrupted:  # from the commit until the result is made
        notes, rebound = _commit(ns, plan, news, undo, interrupted)
        if home is not None:
            for old, new in rebound.items():
                home[id(new)] = home.pop(old)
        by_name = {name: sum(plan.nbytes[first:last]) for name, first, last in plan.names}
        target = device if device is not None else _first_target(plan)
        try:  # the copies may still be queued: the time is the time they took
            probes.synchronize(target)
        except Exception:  # a sticky CUDA error: the cell's next CUDA call raises it again
            _log.debug("synchronising after the move failed", exc_info=True)
        result = MoveResult(
            target,
            {name: n for name, n in by_name.items() if n},
            time.perf_counter() - start,
            history + notes,
            undo,
            plan.skipped,
            to=", ".join(sorted(set(map(str, plan.targets)))) if device is None else "",
            counted_under=plan.counted_notes(),
        )
        if interrupted.raises and interrupted and undo is not None:  # only it can undo this
            result.interrupted = True
            interrupted.clear()
    return result


def _first_target(plan: _Plan) -> torch.device:
    return plan.targets[0] if plan.tensors else torch.device("cpu")


def _copy_all(plan: _Plan, inference: Collection[int] = ()) -> list[Tensor] | str:
    """Phase 2: a copy of each planned tensor, in plan order, or the one-sentence reason why
    not; those at the indices `inference` are copied in inference mode."""
    tensors, targets = plan.tensors, plan.targets
    if not tensors:
        return []
    news: list = []
    spans: dict[int, Tensor] = {}  # the copies of the tensors that share a storage, by index
    bar = _progress_bar(sum(plan.nbytes), _first_target(plan))
    group = None  # the shared storage being copied
    try:
        with torch.no_grad():
            for group in plan.shared.values():  # each as one span
                with _kind(group[0] in inference):
                    _copy_storage(plan, group, spans)
                if bar is not None:
                    probes.synchronize(targets[group[0]])
                    bar.update(plan.nbytes[group[0]])
            group = None
            if spans or bar is not None or inference or plan.special:  # (`t.to`: its own)
                for i, (t, target) in enumerate(zip(tensors, targets)):
                    new = spans.pop(i, None)
                    if new is None:  # a tensor with a storage of its own
                        with _kind(i in inference):
                            new = t.to(target)
                        if bar is not None:
                            probes.synchronize(target)
                            bar.update(plan.nbytes[i])
                    news.append(new)
            else:  # the same without a Python step per tensor (about 0.15 µs a tensor less)
                news.extend(map(Tensor.to, tensors, targets))
            for j in plan.requiring_grad:
                news[j].requires_grad_(True)  # under no_grad, `.to` of a leaf gives one without
            for j in plan.special:
                _check_followed(tensors[j], news[j], targets[j], j)
        return news
    except BaseException as exc:
        # What failed: a span, or the `.to` after the copies made (`extend` keeps those too).
        failed = group or [min(len(news), len(tensors) - 1)]
        if isinstance(exc, _LeftBehind):
            failed = [exc.index]
        news.clear()
        spans.clear()
        traceback.clear_frames(exc.__traceback__)  # the frames below hold copies too
        gc.collect()
        probes.empty_cache(targets[failed[0]])
        if not isinstance(exc, Exception):
            raise  # an interrupt goes on, holding no copies
        # out of memory, a dtype, data-less meta
        return _failure(plan, failed, targets[failed[0]], exc)
    finally:
        if bar is not None:
            bar.close()


def _kind(inference: bool) -> contextlib.AbstractContextManager:
    """Where a copy is made: in inference mode for an inference tensor's, else as it is."""
    return torch.inference_mode() if inference else contextlib.nullcontext()


def _copy_storage(plan: _Plan, members: list[int], spans: dict[int, Tensor]) -> None:
    """Copy the tensors `members` of `plan`, which share a storage, as one span of bytes."""
    # Each is rebuilt on the copied span at its own offset, so that they still share it.
    group = [plan.tensors[j] for j in members]
    target = plan.targets[members[0]]
    lo, n = _span(group)
    first = group[0]
    src = torch.empty(0, dtype=torch.uint8, device=first.device)
    src.set_(first.untyped_storage(), lo, (n,), (1,))
    storage = src.to(target).untyped_storage()
    bases = {  # (a lazy bit would be set twice on a view of its copy)
        id(t): j
        for t, j in zip(group, members, strict=True)
        if t._base is None and not (t.is_conj() or t.is_neg())
    }
    views = []  # a view of a tensor of the group: made a view of its base's copy, below
    for t, j in zip(group, members, strict=True):
        if id(t._base) in bases:
            views.append((t, j))
            continue
        new = torch.empty(0, dtype=t.dtype, device=target)
        new.set_(storage, t.storage_offset() - lo // t.element_size(), t.size(), t.stride())
        spans[j] = _lazy_bits(t, new)
    for t, j in views:
        # So that, once swapped, `t._base` is its base's object, and they share the version
        # counter that lets autograd see an in-place change to either.
        base = spans[bases[id(t._base)]]
        offset = t.storage_offset() - lo // t.element_size()
        if t.dtype == base.dtype:
            new = base.as_strided(t.size(), t.stride(), offset)
        else:  # `view(dtype)`, which torch does not make a view of its base either
            new = torch.empty(0, dtype=t.dtype, device=target)
            new.set_(storage, offset, t.size(), t.stride())
        spans[j] = _lazy_bits(t, new)


def _lazy_bits(t: Tensor, new: Tensor) -> Tensor:
    """`new` with the lazy bits of `t`: a lazy view (`c.conj()`, `r._neg_view()`) is its
    bytes and a bit, which a copy of its bytes does not carry."""
    if t.is_neg():
        new = new._neg_view()
    if t.is_conj():
        new = new.conj()
    return new


def _span(group: list[Tensor]) -> tuple[int, int]:
    """The first byte and the number of bytes of storage that the tensors of `group` use."""
    lo: int | None = None
    hi = 0
    for t in group:
        size = t.element_size()
        start = int(t.storage_offset()) * size
        extent = sum((n - 1) * s for n, s in zip(t.size(), t.stride(), strict=True)) + 1
        lo = start if lo is None else min(lo, start)
        hi = max(hi, start + extent * size if t.numel() else start)
    assert lo is not None, "a group has tensors"
    lo = lo // _ALIGN * _ALIGN  # so that every dtype's offset from it stays whole
    return lo, hi - lo


class _LeftBehind(Exception):
    """A subclass's own `.to` left some of its data behind: the copy at `index`."""

    def __init__(self, reason: str, index: int) -> None:
        super().__init__(reason)
        self.index = index


def _check_followed(t: Tensor, new: Tensor, target: torch.device, index: int) -> None:
    """Raise `_LeftBehind` unless `new`, the copy of `t` made by its class's own `.to`, is of
    its class and holds its data on `target`: its C++ tensor says so, its attributes too."""
    kind = type(t).__name__
    if type(new) is not type(t):
        raise _LeftBehind(f"its class {kind} copies itself as a {type(new).__name__}", index)
    inner = vars(new)
    if hasattr(new, "__tensor_flatten__"):
        inner = {name: getattr(new, name) for name in new.__tensor_flatten__()[0]}
    # ... and what only the original has, which stays with it
    kept = {k: v for k, v in vars(t).items() if k not in vars(new)}
    left = sorted(
        name
        for name, v in itertools.chain(inner.items(), kept.items())
        if isinstance(v, Tensor) and v.device != target and not _host_metadata(t, name)
    )
    if left or new.device != target:
        where = ", ".join(left) or "its data"
        raise _LeftBehind(
            f"it is a {kind}, which keeps tensors in Python attributes, and its own .to "
            f"left {where} on {t.device}",
            index,
        )


def _host_metadata(t: Tensor, name: str) -> bool:
    """Whether the inner tensor `name` of `t` is metadata its class keeps on the host
    whatever its device (a jagged nested tensor's cached sequence lengths)."""
    return t.is_nested and name in ("_min_seqlen_tensor", "_max_seqlen_tensor")


def _failure(plan: _Plan, members: list[int], target, exc: Exception | None) -> str:
    t = plan.tensors[members[0]]
    what = _label(plan.where(members[0]))
    size = fmt_bytes(sum(stored_bytes(plan.tensors[j]) for j in members))
    if exc is None or t.device.type == "meta":  # None: refused in the plan, for that
        reason = "it is on the meta device, which holds no data"
    elif isinstance(exc, _OOM) or "out of memory" in str(exc).lower():
        free = probes.free_bytes(target)
        reason = "out of memory" + (f" with {fmt_bytes(free)} free" if free is not None else "")
    elif isinstance(exc, _LeftBehind):
        reason = str(exc)
    else:
        reason = _reason(t, exc)
    return f"Could not move {what} ({size}) to {target}: {reason}; nothing was moved."


def _reason(t: Tensor, exc: Exception) -> str:
    """Why copying `t` raised `exc`, as a sentence: a KeyError's message is the key it
    missed (a jagged nested tensor's `.to` says `<weakref at 0x...>`), which tells nothing."""
    line = first_sentence(exc)
    if isinstance(exc, KeyError) or line.startswith("<") or line == type(exc).__name__:
        if type(t) in _PLAIN_TENSORS:
            return f"copying it failed with a {type(exc).__name__}"
        return f"its class's own .to ({type(t).__name__}.to) failed with a {type(exc).__name__}"
    return line


def _commit(
    ns: dict, plan: _Plan, news: list[Tensor], undo: _Undo | None, interrupted: _Caught
) -> tuple[list[str], dict[int, Tensor]]:
    """Phase 3, all or nothing: give every tensor its copy in place; rebind what torch will
    not change. An error undoes what was done and says so in one line; so does SIGINT under
    Python's own handler, which waits for the commit to end, then goes on (a user's own
    handler gets it once the commit is done)."""
    undo_log: list[Callable[[], object]] = []  # what undoes each change made, run last first
    keep_originals = undo is not None and undo.originals is not None
    failure = None
    # Under `_execute`'s SIGINT hold: `interrupted` holds what it caught so far.
    try:
        # Once restorable, the move keeps the very objects: none is rebound.
        notes, replaced, swapped = _apply(
            ns, plan, news, undo_log, rebind=undo is None, keep_originals=keep_originals
        )
    except Exception as exc:
        failure = (
            f"Could not move to {_first_target(plan)}: {type(exc).__name__}: "
            f"{first_sentence(exc)}; nothing was moved."
        )
    rolled_back = failure is None and interrupted.raises and bool(interrupted)
    if failure is not None or rolled_back:
        for step in reversed(undo_log):
            step()
    elif keep_originals:  # each swapped copy holds an original
        assert undo is not None and undo.originals is not None
        undo.originals.extend(zip(_pick(plan.tensors, swapped), _pick(news, swapped)))
        undo.rebound.update({id(new): plan.tensors[i] for i, new in replaced.items()})
    else:  # done: what follows needs no undoing
        notes += _held_elsewhere(plan, news, swapped)
    news.clear()  # frees the old data
    if failure is not None:
        raise DeviceMagicError(failure)  # outside the except block: no tensors ride on it
    if rolled_back:
        raise KeyboardInterrupt  # Ctrl-C during the commit: nothing was moved
    return notes, {id(plan.tensors[i]): new for i, new in replaced.items()}


def _apply(
    ns: dict,
    plan: _Plan,
    news: list[Tensor],
    undo_log: list[Callable[[], object]],
    rebind: bool,
    keep_originals: bool = False,
) -> tuple[list[str], dict[int, Tensor], Sequence[int]]:
    """The commit's changes, each logged in `undo_log` with what undoes it; returns the notes,
    the new tensors that replace those (by index) that could not be changed in place, and
    the indices of those swapped. With `rebind`, what nothing else can observe is rebound.
    With `keep_originals` (a restorable move to meta), a subclass that keeps its data in
    Python attributes is replaced for the cell, so that its original object comes back."""
    tensors = plan.tensors
    undo_log.append(functools.partial(_reattach_grads, list(plan.grads.values()), {}))
    lone = _lone(plan) if rebind else []
    at = _others(len(tensors), lone)
    special = set(plan.special)
    if keep_originals and special:
        at = [i for i in at if i not in special]
    refused = _swap_all(tensors, news, at)
    swapped = at if not refused else [i for i in at if i not in set(refused)]
    undo_log.append(functools.partial(_swap_all, tensors, news, swapped))
    if special:  # their data is in their attributes: those follow the C++ tensor
        states = [i for i in swapped if i in special]
        undo_log.append(functools.partial(_swap_states, tensors, news, states))
        _swap_states(tensors, news, states)
        if keep_originals:
            refused += sorted(special)
    for holder, run in lone:  # in C, one holder at a time
        keys = _pick(plan.keys, run)
        undo_log.append(functools.partial(_set_all, holder, keys, _pick(tensors, run)))
        _set_all(holder, keys, _pick(news, run))
    skip = set(refused)
    for i in plan.requiring_grad:
        if i not in skip:
            _carry_hooks(tensors[i])
    notes: list[str] = []
    replaced: dict[int, Tensor] = {}
    for i in refused:
        t, new = tensors[i], news[i]
        why = "torch cannot swap it" if _swap_impl is None else "torch refused to swap it"
        if keep_originals and i in special:
            replaced[i] = _like(t, new)
            notes.append(
                f"{_label(plan.where(i))}: a {type(t).__name__} keeps its data in Python "
                f"attributes: the cell sees a copy on {new.device}, the restore gives back "
                "the original object"
            )
        elif i not in special and torch._has_compatible_shallow_copy_type(t, new):
            undo_log.append(functools.partial(setattr, t, "data", t.data))
            t.data = new
            notes.append(
                f"{_label(plan.where(i))}: moved with .data because {why}; "
                "views of its old storage and autograd graphs that saved it stay behind"
            )
        else:
            replaced[i] = _like(t, new)
            notes.append(
                f"{_label(plan.where(i))}: replaced by a new tensor because {why}; "
                "references the cell does not name keep the old one"
            )
    by_id = {id(tensors[i]): new for i, new in replaced.items()}
    if replaced:
        _rebind(ns, [name for name, _, _ in plan.names], by_id, undo_log)
    _reattach_grads(plan.grads.values(), by_id)
    return notes, replaced, swapped


def _lone(plan: _Plan) -> list[tuple[dict | list, Sequence[int]]]:
    """The tensors that nothing can observe but one plain dict or list that holds them,
    by holder: rebinding their entries to the copies is then the same as swapping, and
    cheaper. Each fact is read over the whole plan in C."""
    tensors = plan.tensors
    n = len(tensors)
    lone: list[bool] | None = None  # None: all
    unlike = [plan.requiring_grad, plan.with_history, *plan.shared.values()]
    facts = _lone_facts(tensors)
    every = not any(unlike) and all(operator.countOf(v, want) == n for v, want in facts[:-1])
    # The last fact for all at once, in one list: each has its type at least, so n types
    # and nothing else means that none has attributes.
    if not every or len(gc.get_referents(*tensors)) != n * _PLAIN_REFERENTS:
        lone = [True] * n
        for values, want in _lone_facts(tensors):
            lone = list(map(operator.and_, lone, map(operator.eq, values, itertools.repeat(want))))
        # Autograd hooks; views, whose old ones would keep the old storage until the end
        for i in itertools.chain.from_iterable(unlike):
            lone[i] = False
    found: list[tuple[dict | list, Sequence[int]]] = []
    for run in plan.runs:
        holder = run.holder
        if isinstance(holder, (dict, list)) and type(holder) in _REBINDABLE:
            at: Sequence[int] = range(run.start, run.end)
            if lone is not None:
                at = list(itertools.compress(at, lone[run.start : run.end]))
            if at:
                found.append((holder, at))
    return found


def _lone_facts(tensors: list[Tensor]) -> list[tuple[Iterator[object], object]]:
    """What makes each of `tensors` unobservable but through one holder, lazily, the
    cheapest first: (each one's value, the value needed)."""
    return [
        (map(sys.getrefcount, tensors), _HELD_ONCE),  # no name, module, optimizer, list...
        (map(weakref.getweakrefcount, tensors), 0),
        (map(_USE_COUNT, tensors), 1),  # its C++ tensor: no view, graph or grad
        (map(type, tensors), Tensor),  # not a Parameter, nor a subclass
        # No attributes of its own: nothing but its type, read without making its `__dict__`
        (map(len, map(gc.get_referents, tensors)), _PLAIN_REFERENTS),
    ]


def _others(n: int, lone: list[tuple[dict | list, Sequence[int]]]) -> Sequence[int]:
    """The indices below `n` that are not in `lone`'s."""
    if not lone:
        return range(n)
    if sum(len(at) for _, at in lone) == n:  # each index is in one run at most
        return []
    taken = set(itertools.chain.from_iterable(at for _, at in lone))
    return [i for i in range(n) if i not in taken]


def _pick(column: list, at: Sequence[int]) -> list:
    """The entries of `column` at the indices `at` (all of it: the list itself, not a copy)."""
    if isinstance(at, range):
        return column if at.start == 0 and at.stop == len(column) else column[at.start : at.stop]
    return [column[i] for i in at]


def _set_all(holder: dict | list, keys: list, values: list) -> None:
    if isinstance(holder, dict):
        holder.update(zip(keys, values))  # each key is there: the order stays
    else:
        collections.deque(map(holder.__setitem__, keys, values), maxlen=0)  # the loop in C


def _held_elsewhere(plan: _Plan, olds: list[Any], swapped: Sequence[int]) -> list[str]:
    """After a commit, the old C++ tensors (held by the swapped copies, `olds`, at the
    indices `swapped`) that something outside the move holds (an autograd graph, a view the
    move does not include): where torch allows it (not to or from meta), their tensors get
    them back with the new data (`.data`), so that those holders see the move too; else a
    backward pass through such a graph fails, saying why. Returns the notes."""
    # Each old one is held once by its copy; more means another holder, unless it is a
    # view's base or a grad that the move holds as well: those go once the others go.
    counts = map(_USE_COUNT, _pick(olds, swapped))
    held = [swapped[j] for j, n in enumerate(counts) if n > 1]
    if not held:
        return []
    keep = set(held)
    olds[:] = [old if i in keep else None for i, old in enumerate(olds)]
    special = set(plan.special)
    notes = []
    for i in held:
        t, old, what = plan.tensors[i], olds[i], _label(plan.where(i))
        if _USE_COUNT(old) == 1:
            continue
        if i not in special and torch._has_compatible_shallow_copy_type(t, old):
            assert _swap_impl is not None  # it swapped them in the commit
            _swap_impl(t, old)  # `t` gets its old C++ tensor back, then the new data
            t.data = old
            _reattach_grads([plan.grads[id(t)]] if id(t) in plan.grads else [], {})
            notes.append(
                f"{what}: moved with .data because an autograd graph or a view holds it; "
                "views of its old storage and autograd graphs that saved it stay behind"
            )
        else:
            _poison(old, what)
            notes.append(
                f"{what}: moved, but a view or an autograd graph made before still holds "
                f"its old data on {old.device}"
            )
    return notes


def _swap_all(
    olds: list[Tensor], news: list[Tensor], at: Sequence[int] | None = None
) -> list[int]:
    """Swap the C++ tensors of each of `olds` and its copy (those at the indices `at`, else
    all): the copy then holds the old one. Returns the indices torch refused. Swapping
    again undoes it."""
    if at is None:
        at = range(len(olds))
    if _swap_impl is None:  # torch < 2.3
        return list(at)
    olds, news = _pick(olds, at), _pick(news, at)
    # Unlike `torch.utils.swap_tensors`, with no check that nothing else holds the old C++
    # tensor: whatever does (a view, an autograd graph) keeps it, as it was.
    refused: list[int] = []
    done: collections.deque = collections.deque(maxlen=1)  # the last position swapped
    start = 0
    while start < len(olds):
        done.clear()
        rest = (itertools.islice(column, start, None) for column in (olds, news))
        pairs = map(_swap_impl, *rest)
        try:  # the loop in C: about 40 ns a tensor less than in Python
            done.extend(zip(itertools.count(start), pairs))
        except RuntimeError:  # a C++ weak reference to it
            failed = done[0][0] + 1 if done else start
            refused.append(at[failed])
            start = failed + 1
            continue
        break
    return refused


def _carry_hooks(t: Tensor) -> None:
    """Register again on `t`'s new C++ tensor the autograd hooks that the old one held."""
    # They are kept on the Python object too; setting them registers them with autograd.
    for name in ("_backward_hooks", "_post_accumulate_grad_hooks"):
        hooks = getattr(t, name, None)
        if hooks:
            setattr(t, name, hooks)


def _poison(old: Tensor, what: str) -> None:
    """Make a backward pass through a graph made before the move fail, saying why, instead
    of putting its gradient into the old tensor that nobody sees (as swap_tensors does)."""
    edge = getattr(torch.autograd.graph, "get_gradient_edge", None)  # torch >= 2.2
    if edge is None or not (old.is_leaf and old.requires_grad):
        return

    def refuse(grad_outputs: object) -> None:
        raise RuntimeError(
            f"{what} was moved to another device after this autograd graph was made; "
            "run the forward pass again"
        )

    edge(old).node.register_prehook(refuse)


def _like(t: Tensor, new: Tensor) -> Tensor:
    """`new` as the same kind of object as `t`: Parameter class, attributes, leafness (the
    attributes a subclass's own `.to` gave `new` stay: they hold its moved data)."""
    if isinstance(t, torch.nn.Parameter):
        new = type(t)(new.detach(), requires_grad=t.requires_grad)
    elif type(new) is not type(t):
        new = new.as_subclass(type(t))
    mine = new.__dict__
    for key, value in t.__dict__.items():
        mine.setdefault(key, value)
    return new


def _keeps_data(t: Tensor) -> bool:
    """Whether `t`, a tensor subclass, keeps tensors in its Python attributes (its data,
    which its C++ tensor does not hold), or flattens into inner tensors."""
    return hasattr(t, "__tensor_flatten__") or any(
        isinstance(v, Tensor) for v in getattr(t, "__dict__", {}).values()
    )


def _swap_states(olds: list[Tensor], news: list[Tensor], at: Iterable[int]) -> None:
    """Swap the Python attributes that each copy at the indices `at` has (what its class's
    own `.to` gave it: its data) with its tensor's; those only the tensor has (the user's
    own) stay. Swapping again undoes it."""
    for i in at:
        mine, theirs = olds[i].__dict__, news[i].__dict__
        for key in list(theirs):
            a, b = mine.pop(key, _MISSING), theirs.pop(key, _MISSING)
            if b is not _MISSING:
                mine[key] = b
            if a is not _MISSING:
                theirs[key] = a


def _rebind(
    ns: dict, names: list[str], replaced: dict[int, Tensor], undo_log: list[Callable[[], object]]
) -> None:
    """Point every holder reachable from `names` at the replacements (tuples are rebuilt),
    logging in `undo_log` what puts each holder back."""
    memo: dict[int, object] = {}
    for name in names:
        if name in ns:
            old = ns[name]
            if (new := _rebound(old, replaced, memo, undo_log)) is not old:
                undo_log.append(functools.partial(ns.__setitem__, name, old))
                ns[name] = new


def _rebound(
    obj: object, replaced: dict[int, Tensor], memo: dict[int, object], log: list
) -> object:
    i = id(obj)
    if i in replaced:
        return replaced[i]
    if i in memo or isinstance(obj, Tensor):
        return memo.get(i, obj)
    memo[i] = obj

    def sub(v: object) -> object:
        return _rebound(v, replaced, memo, log)

    def put(holder: Any, key: object, new: object) -> None:
        log.append(functools.partial(holder.__setitem__, key, holder[key]))
        holder[key] = new

    if isinstance(obj, torch.nn.Module):
        for m in obj.modules():
            for kind in (m._parameters, m._buffers):
                for k, t in list(kind.items()):
                    if id(t) in replaced:
                        put(kind, k, replaced[id(t)])
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            put(group["params"], slice(None), [sub(p) for p in group["params"]])
        for p in [p for p in obj.state if id(p) in replaced]:
            moved = replaced[id(p)]
            log.append(functools.partial(_rekey, obj.state, moved, p))
            obj.state[moved] = obj.state.pop(p)
        for state in obj.state.values():
            sub(state)
    elif isinstance(obj, tuple):
        items = [sub(v) for v in obj]
        if any(a is not b for a, b in zip(items, obj, strict=True)):
            made: Any = type(obj)
            memo[i] = made._make(items) if hasattr(obj, "_fields") else made(items)
    elif is_container(type(obj)):
        entries, is_attr = children(obj)
        for key, entry in list(entries):
            if (new := sub(entry)) is entry:
                continue
            if is_attr:  # a dataclass's field, frozen ones too
                field_name = str(key)
                log.append(functools.partial(object.__setattr__, obj, field_name, entry))
                object.__setattr__(obj, field_name, new)
            else:
                put(obj, key, new)
    return memo[i]


def _rekey(mapping: dict, old: object, new: object) -> None:
    mapping[new] = mapping.pop(old)


def _reattach_grads(grads: Iterable[tuple[Tensor, Tensor]], replaced: dict[int, Tensor]) -> None:
    for t, g in grads:
        t = replaced.get(id(t), t)
        g = replaced.get(id(g), g)
        if t.grad is not g:
            t.grad = g


def _put_back_originals(ns: dict, moved: MoveResult, undo: _Undo, start: float) -> MoveResult:
    """Restore from a data-less device: the original C++ tensors go back into their objects."""
    pairs, undo.originals = undo.originals, None
    assert pairs is not None, "a restore from meta keeps the originals"
    olds, keepers = [t for t, _ in pairs], [k for _, k in pairs]
    pairs.clear()
    refused = _swap_all(olds, keepers)  # the keepers now hold the meta ones
    replaced = {id(olds[i]): _like(olds[i], keepers[i]) for i in refused}
    replaced.update(undo.rebound)
    if replaced:
        _rebind(ns, undo.names, replaced, [])
    for opt, state in undo.optimizer_state:
        opt.state.clear()
        opt.state.update({p: dict(s) for p, s in state.items()})
    with torch.no_grad():
        for t, value in undo.values:
            t.copy_(value)
    # A name the cell bound to meta tensors (`x = x.flatten(1)`) holds no data: its own comes back.
    given = [n for n, obj in undo.bindings.items() if ns.get(n, obj) is not obj and _on_meta(ns[n])]
    for name in given:
        ns[name] = undo.bindings[name]
    notes = [
        f"a tensor of {fmt_bytes(stored_bytes(olds[i]))} came back as a new object: "
        "torch refused to swap it"
        for i in refused
    ]
    count = len(olds) + len(undo.rebound)
    keepers.clear()  # what the cell left holding the meta tensors keeps them; we let go
    return MoveResult(
        next(iter(undo.home.values()), torch.device("cpu")),
        dict(moved.names),
        time.perf_counter() - start,
        notes,
        restored=count,
        said=[_given_back(given)] if given else [],
    )


def _given_back(names: list[str]) -> str:
    which = f"the name {names[0]}" if len(names) == 1 else f"the names {', '.join(names)}"
    return (f"--restore from meta gave back what {which} held: the cell bound "
            f"{'it' if len(names) == 1 else 'them'} to meta tensors, which hold no data")


def _on_meta(obj: object) -> bool:
    """Whether `obj` is or holds (as a move would find it) a tensor on meta."""
    plan = _Plan.to(torch.device("cpu"))  # plans every tensor not on the CPU
    plan.walk({"": obj}, [""])
    return any(map(_IS_META, plan.tensors))


class _Caught(list):
    """The frames of the SIGINTs caught while held; `raises`: whether the handler they go to
    is Python's own, which raises KeyboardInterrupt (a user's "stop after this epoch" one
    does not: what it is sent must not cancel anything)."""

    raises = True


@contextlib.contextmanager
def _sigint_held() -> Iterator[_Caught]:
    """Hold SIGINT (Ctrl-C, a notebook's stop button) until the block ends, then deliver each
    signal the block left to the handler in force before (Python's raises at the first; a
    user's own sees every press, as it would have).

    Only in the main thread (where Python handles signals) and where a Python handler is in
    force."""
    caught = _Caught()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    if not callable(previous):  # ignored, the OS default, or set outside Python
        yield caught
        return
    caught.raises = previous is signal.default_int_handler
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)
    for frame in caught:
        previous(signal.SIGINT, frame)


def _label(where: _Where | None) -> str:
    if where is None:
        return "the namespace"
    parent, key, is_attr = where
    if parent is None:
        return str(key)
    return f"{_label(parent)}.{key}" if is_attr else f"{_label(parent)}[{key!r}]"


def _canonical(device: torch.device) -> torch.device:
    """`cuda` as `cuda:0` (the current one), so that tensors already there are not copied."""
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        device = torch.empty(0, device=device).device
    return device


def _progress_bar(total_bytes: int, target: torch.device):  # -> tqdm | None
    """A bar in bytes for moves long enough to wait for; gone when done (leave=False)."""
    if total_bytes < _BAR_MIN_BYTES:
        return None
    if _has_widgets():  # a widget in Jupyter, text elsewhere
        from tqdm.auto import tqdm
    else:  # tqdm.auto warns "IProgress not found" in Jupyter without ipywidgets
        from tqdm.std import tqdm

    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        desc=f"moving to {target}",
    )


def _has_widgets() -> bool:
    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except (ImportError, ValueError):  # a broken install, or one blocked in sys.modules
        return False
