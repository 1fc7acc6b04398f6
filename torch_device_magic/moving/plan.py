"""Phase 1, the plan: walk the named objects, find every tensor once, group them by storage."""

from __future__ import annotations

import bisect
import collections
import itertools
import math
import operator
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import first_sentence
from ..tensors import (
    PLAIN_MAPPINGS,
    WALK_LIMIT,
    children,
    is_container,
    is_lazy,
    storage_id,
    storage_key,
    stored_bytes,
)
from ..units import fmt_bytes
from .result import _Undo

_ALIGN = 16  # the largest element size
_NBYTES = operator.attrgetter("nbytes")
_GRAD = operator.attrgetter("grad")
_BASE = operator.attrgetter("_base")
_IS_META = operator.attrgetter("is_meta")
_DEVICE = operator.attrgetter("device")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
# Whether the walk enters an object of a type: the builtin ones; a plan learns the others
# once a type (`_walkable`), and forgets them with the plan, so that no class of the user's
# is kept alive (a class defined in a cell, run again, `%reload_ext`).
_WALKABLE = dict.fromkeys((int, float, complex, bool, str, bytes, type(None)), False)
# The holders whose entries a move may rebind: their `__setitem__` runs no code of the user's.
_REBINDABLE = PLAIN_MAPPINGS | {list}
_PLAIN_TENSORS = frozenset({Tensor, torch.nn.Parameter})
# How many tensors share a storage (by `storage_id`): each holds it once.
_STORAGE_USERS = getattr(torch._C, "_storage_Use_Count", None)
# What `sys.getrefcount` reads, in a `map` over a list, for an object nothing else holds.
UNHELD = next(map(sys.getrefcount, [object()]))


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
        # The storages of planned tensors that tensors outside the plan share too (a base or
        # a view under another name, a `detach`ed alias), by `storage_id`
        self.outside: set[int] = set()
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
        if stored and _STORAGE_USERS is not None:
            users = list(map(_STORAGE_USERS, keys))
            if operator.countOf(users, 1) < len(users):  # (in C: the hot case stops here)
                self._views(keys, users)
        tensors = self.tensors
        self.nbytes = list(map(_NBYTES if stored else stored_bytes, tensors))
        for j, members in self.shared.items():
            self.nbytes[j] = _span([tensors[i] for i in members])[1]
            for i in members[1:]:
                self.nbytes[i] = 0

    def _views(self, keys: list[int], users: list[int]) -> None:
        """Given each planned tensor's storage (`keys`) and how many tensors use it (`users`),
        note the storages that tensors outside the plan use too (`outside`), and copy as a
        span of its storage a tensor that overlaps itself (an `expand`ed or `unfold`ed view:
        copied out it would take many times its storage)."""
        tensors = self.tensors
        many = [i for i, n in enumerate(users) if n > 1]
        planned = collections.Counter(keys[i] for i in many)
        ids = {id(tensors[i]) for i in many}
        # The views' bases that the plan has not, by id, held by this dict alone
        bases = {
            id(b): b for b in map(_BASE, _pick(tensors, many)) if b is not None and id(b) not in ids
        }
        # A base that no Python object holds lives only in its views: not outside
        held = map(sys.getrefcount, bases.values())
        for key, refs in zip(map(storage_id, bases.values()), held):
            if refs == UNHELD:
                planned[key] += 1
        bases.clear()
        self.outside = {keys[i] for i in many if users[i] > planned[keys[i]]}
        grouped = set(itertools.chain.from_iterable(self.shared.values()))
        special = set(self.special)
        for i in many:
            t = tensors[i]
            if i not in grouped and i not in special and _extent(t) < t.nbytes:
                self.shared[i] = [i]

    def storages(self) -> dict[str, dict[int, int]]:
        """The storage of each tensor a name reaches first (by the tensor's id), by name."""
        found: dict[str, dict[int, int]] = {}
        for name, first, last in self.names:
            tensors = self.tensors[first:last]
            found[name] = dict(zip(map(id, tensors), map(storage_key, tensors)))
        return found

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
                    self.counted_under.get(pair, 0) + _held_bytes(self.tensors[i])
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


def _plan_move(
    ns: dict,
    names: Iterable[str],
    device: torch.device,
    others: Callable[[], Iterable[str]] | None = None,
) -> tuple[_Plan, list[str]]:
    """The plan that moves what `names` hold to `device`, with the names among `others()`
    that hold a tensor sharing storage with it (a base, a view, a `detach`ed alias), so that
    the storage moves once with everything that sees it; and those names, in their order.

    The names are taken in alphabetical order but those bound to an optimizer last, those of
    `others` after those of `names` (what is found twice counts under the first name that
    reaches it)."""
    names = _ordered(ns, names)
    plan = _Plan.to(device)
    plan.walk(ns, names)
    if not plan.outside or others is None:
        return plan, []
    planned = set(names)
    probe = _Plan.to(device)  # what each other name holds
    probe.walk(ns, [n for n in others() if n in ns and n not in planned])
    holds = probe.storages()
    del probe
    joined: list[str] = []
    while True:
        ids = set(map(id, plan.tensors))  # (a name holding a planned tensor itself need not)
        shares = plan.outside.__contains__
        more = [
            name
            for name, held in holds.items()
            if any(shares(key) for i, key in held.items() if i not in ids)
        ]
        if not more:
            return plan, joined
        for name in more:  # and what they share with still others, in turn
            del holds[name]
        joined += more
        plan = _Plan.to(device)
        plan.walk(ns, [*names, *_ordered(ns, joined)])  # counted under those asked for first


def _ordered(ns: dict, names: Iterable[str]) -> list[str]:
    """`names` in `ns`, in alphabetical order but those bound to an optimizer last."""
    ordered = sorted(n for n in names if n in ns)
    ordered.sort(key=lambda n: isinstance(ns[n], torch.optim.Optimizer))  # stable
    return ordered


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


def _first_target(plan: _Plan) -> torch.device:
    return plan.targets[0] if plan.tensors else torch.device("cpu")


def _span(group: list[Tensor]) -> tuple[int, int]:
    """The first byte and the number of bytes of storage that the tensors of `group` use."""
    lo: int | None = None
    hi = 0
    for t in group:
        start = int(t.storage_offset()) * t.element_size()
        lo = start if lo is None else min(lo, start)
        hi = max(hi, start + _extent(t))
    assert lo is not None, "a group has tensors"
    lo = lo // _ALIGN * _ALIGN  # so that every dtype's offset from it stays whole
    return lo, hi - lo


def _held_bytes(t: Tensor) -> int:
    """The bytes of storage `t` reads: an `expand`ed view, fewer than its `nbytes`."""
    return _extent(t) if t.layout == torch.strided else stored_bytes(t)


def _extent(t: Tensor) -> int:
    """The bytes from the first element of `t` to past its last, in its storage."""
    if not t.numel():
        return 0
    return (sum((n - 1) * s for n, s in zip(t.size(), t.stride(), strict=True)) + 1) * (
        t.element_size()
    )


def _pick(column: list, at: Sequence[int]) -> list:
    """The entries of `column` at the indices `at` (all of it: the list itself, not a copy)."""
    if isinstance(at, range):
        return column if at.start == 0 and at.stop == len(column) else column[at.start : at.stop]
    return [column[i] for i in at]


def _keeps_data(t: Tensor) -> bool:
    """Whether `t`, a tensor subclass, keeps tensors in its Python attributes (its data,
    which its C++ tensor does not hold), or flattens into inner tensors."""
    return hasattr(t, "__tensor_flatten__") or any(
        isinstance(v, Tensor) for v in getattr(t, "__dict__", {}).values()
    )


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
