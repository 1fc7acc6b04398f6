"""Move what a cell's names hold to a device, all or nothing, losing nothing.

    >>> result = move(user_ns, cell_names(code), torch.device("cuda:0"))
    >>> result.names, result.nbytes, result.seconds, result.not_followed

Three phases, so that a failure changes nothing:

1. *Plan*: walk the named objects (containers, modules and optimizers once
   each, memoised by `id`) and group the tensors by storage, which also finds
   a tensor reached twice: it is planned once.
2. *Copy*: one copy per storage (a singleton with `.to`, a shared storage as
   one span of bytes from which every tensor of the group is rebuilt with its
   own offset, sizes and strides, so views keep sharing storage). On failure
   the copies are dropped and a `DeviceMagicError` is raised from a frame that
   holds none of them (a traceback keeps its frames' tensors alive,
   pytorch#27600).
3. *Commit*: each tensor gets its copy in place. We swap only the C++ tensor
   (the last step of `torch.utils.swap_tensors`, under the same guards), so the
   Python object keeps its identity, class (a Parameter stays a Parameter) and
   attributes, and every reference sees the move. Where a swap is refused (a
   weak reference, or another tensor or an autograd graph holding it) we set
   `.data`; where torch refuses that too (to or from `meta`) the holders we
   walked are rebound to a new tensor and the others cannot follow: the result
   lists them. Leaves stay leaves with `requires_grad`, `.grad` is moved and
   reattached; a tensor with an autograd history arrives without it.

Optimizer state follows its parameters by torch's own rule: `step` stays where
it is unless the group is `capturable` or `fused`. Nothing here touches
`torch.cuda` unless a device involved is CUDA.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from weakref import getweakrefcount

import torch
from torch import Tensor

from .cells import cell_names  # re-exported: the move's callers find their names there
from .errors import DeviceMagicError, first_sentence
from .reports import Table
from .units import fmt_bytes, fmt_seconds

__all__ = ["MoveResult", "cell_names", "move", "restore"]

_BAR_MIN_BYTES = 1 << 30  # about a second of host-to-device copying: show a progress bar
_ALIGN = 16  # the largest element size
_swap_impl = getattr(torch._C, "_swap_tensor_impl", None)  # torch >= 2.3
# `t.untyped_storage()._cdata` without building a storage object on the way
_storage_id = getattr(torch._C, "_storage_id", lambda t: t.untyped_storage()._cdata)
_OOM = getattr(torch, "OutOfMemoryError", ())
_COMPRESSED = ("values", "crow_indices", "col_indices")
_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: _COMPRESSED,
    torch.sparse_bsr: _COMPRESSED,
    torch.sparse_csc: ("values", "ccol_indices", "row_indices"),
    torch.sparse_bsc: ("values", "ccol_indices", "row_indices"),
}
_SCALARS = frozenset({int, float, complex, bool, str, bytes, type(None)})

# Where a tensor was found, formatted only when a message needs it:
# (parent, key, is_attribute), the parent None at a root name.
_Where = tuple


@dataclass
class MoveResult:
    """What a move did: bytes per name, time taken, and references that could not follow."""

    device: torch.device
    names: dict[str, int]
    seconds: float
    not_followed: list[str] = field(default_factory=list)
    _undo: _Undo | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(self.names.values())

    def table(self) -> Table:
        title = (
            f"moved {fmt_bytes(self.nbytes)} to {self.device} in {fmt_seconds(self.seconds)}"
            if self.names
            else f"nothing to move to {self.device}"
        )
        rows = [(name, fmt_bytes(n)) for name, n in self.names.items()]
        notes = [f"could not follow: {n}" for n in self.not_followed]
        return Table(title, ("name", "bytes"), rows, notes)


@dataclass
class _Undo:
    """What `restore` needs: where things came from, or (from meta) the originals."""

    names: list[str]
    home: dict[int, torch.device]
    module_home: dict[int, torch.device]
    originals: list[tuple[Tensor, Tensor]] | None = None
    rebound: dict[int, Tensor] = field(default_factory=dict)
    grads: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    optimizer_state: list[tuple[torch.optim.Optimizer, dict]] = field(default_factory=list)
    values: list[tuple[Tensor, Tensor]] = field(default_factory=list)


def move(
    ns: dict, names: Iterable[str], device: torch.device, *, restorable: bool = False
) -> MoveResult:
    """Move to `device` what `names` hold in `ns`, all or nothing (`restorable`: for `restore`)."""
    device = _canonical(device)
    names = sorted(n for n in names if n in ns)
    plan = _Plan(device)
    plan.walk(ns, names)
    undo = None
    if restorable:
        undo = _Undo(names, {}, plan.module_home)
        if device.type == "meta":  # nothing comes back from meta: keep the originals
            undo.originals, undo.grads = [], list(plan.grads.values())
            undo.optimizer_state, undo.values = plan.optimizer_snapshots()
    return _execute(plan, ns, device, undo)


def restore(ns: dict, moved: MoveResult) -> MoveResult:
    """Send back what `move(..., restorable=True)` moved, carrying what was done to it since.

    Once only: `moved` then lets go of what it kept for this (from meta, the originals),
    which a traceback holding it would otherwise keep alive.
    """
    undo, moved._undo = moved._undo, None
    if undo is None:
        raise ValueError("restore() needs the result of move(..., restorable=True), once")
    start = time.perf_counter()
    if undo.originals is not None:
        return _put_back_originals(ns, moved, undo, start)
    plan = _Plan(None, undo)
    plan.walk(ns, [n for n in undo.names if n in ns])
    return _execute(plan, ns, None, None)


class _Plan:
    """Phase 1: every tensor to move, found once, with its target and what shares its storage."""

    def __init__(self, device: torch.device | None, undo: _Undo | None = None) -> None:
        # Moving, every tensor goes to `device`; restoring, each goes home and what
        # was added to a moved module goes with it (what else the cell made stays).
        self.device = device
        self.home = undo.home if device is None else None
        self.module_targets = undo.module_home if device is None else None
        self.seen: set[int] = set()  # containers, modules, optimizers walked already
        # One entry per tensor, in the order found; the lists below hold indices into them.
        self.tensors: list[Tensor] = []
        self.targets: list[torch.device] = []
        self.where: list[_Where] = []
        self.nbytes: list[int] = []  # what each copy takes (a shared storage: all on its first)
        self.shared: dict[int, list[int]] = {}  # a storage's first tensor -> all that share it
        self.requiring_grad: list[int] = []  # leaves whose copies must require grad too
        self.with_history: list[int] = []
        self.grads: dict[int, tuple[Tensor, Tensor]] = {}  # by the id of the tensor that has it
        self.names: list[tuple[str, int, int]] = []  # name -> its slice of `tensors`
        self.module_home: dict[int, torch.device] = {}
        self.optimizers: list[torch.optim.Optimizer] = []

    def walk(self, ns: dict, names: list[str]) -> None:
        for name in names:
            first = len(self.tensors)
            self._walk(ns[name], name)
            self.names.append((name, first, len(self.tensors)))
        self._group()

    def _walk(self, root: object, name: str) -> None:
        stack = self._entries([(name, root)], None, False, None)
        while stack:
            obj, where, inherited = stack.pop()
            if id(obj) in self.seen:  # containers, modules, optimizers
                continue
            self.seen.add(id(obj))
            if isinstance(obj, torch.nn.Module):
                self._module(obj, where, inherited)
            elif isinstance(obj, torch.optim.Optimizer):
                self._optimizer(obj, where, inherited)
            elif isinstance(obj, dict):
                stack += self._entries(obj.items(), where, False, inherited)
            elif isinstance(obj, (list, tuple)):
                stack += self._entries(enumerate(obj), where, False, inherited)
            elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
                fields = [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
                stack += self._entries(fields, where, True, inherited)

    def _entries(
        self, entries: Iterable[tuple], where: _Where | None, is_attr: bool, inherited
    ) -> list[tuple[object, _Where, torch.device | None]]:
        """Plan the tensors among `entries`, the (key, value) pairs of what was found at `where`;
        return the other values to walk, with where they are and the target they inherit."""
        # The hot path of a move, one pass per tensor with no call of its own: each torch
        # attribute read here costs about as much as the Python around it. A tensor found
        # again is planned again, and `_group` drops it (its storage key gives it away):
        # memoising ids here took 0.15 µs a tensor, a tenth of the move to meta.
        tensors, targets, found_at = self.tensors, self.targets, self.where
        device, home = self.device, self.home
        rest = []
        for key, t in entries:
            if not isinstance(t, Tensor):
                if type(t) not in _SCALARS:  # a list of a million ints stays cheap
                    rest.append((t, (where, key, is_attr), inherited))
                continue
            target = device if home is None else home.get(id(t), inherited)
            if target is None or t.device == target:
                continue
            label = (where, key, is_attr)
            tensors.append(t)
            targets.append(target)
            found_at.append(label)
            if t.requires_grad:  # else it is a leaf
                if not t.is_leaf:
                    self.with_history.append(len(tensors) - 1)
                    continue
                self.requiring_grad.append(len(tensors) - 1)
            grad = t.grad  # a tensor that does not require grad may still have one
            if grad is not None and id(t) not in self.grads:  # (grads can form a cycle)
                self.grads[id(t)] = (t, grad)
                self._entries([("grad", grad)], label, True, target)
        return rest

    def _module(self, module: torch.nn.Module, where: _Where, inherited) -> None:
        if self.module_targets is not None:
            inherited = self.module_targets.get(id(module), inherited)
        for prefix, sub in module.named_modules():
            label = (where, prefix, True) if prefix else where
            for kind in (sub._parameters, sub._buffers):
                found = [(k, t) for k, t in kind.items() if t is not None and not _is_lazy(t)]
                if found:
                    self.module_home.setdefault(id(module), found[0][1].device)
                    self._entries(found, label, True, inherited)

    def _optimizer(self, opt: torch.optim.Optimizer, where: _Where, inherited) -> None:
        self.optimizers.append(opt)
        for g, group in enumerate(opt.param_groups):
            step_stays = not (group.get("capturable") or group.get("fused"))
            params = group["params"]
            self._entries([(g, p) for p in params], (where, "param_groups", True), False, inherited)
            for k, p in enumerate(params):
                target = self.device if self.home is None else self.home.get(id(p), inherited)
                state = [
                    (key, value)
                    for key, value in opt.state.get(p, {}).items()
                    if not (key == "step" and step_stays)
                ]
                label = ((where, "state", True), f"<param {g}.{k}>", False)
                self._entries(state, label, False, target)

    def _group(self) -> None:
        """Drop the tensors found twice, find those that share a storage (views, `.data`
        aliases), and count each copy's bytes."""
        try:
            keys = [_storage_id(t) for t in self.tensors]
            stored = True  # so none is sparse, the only kind whose `nbytes` misleads
        except (RuntimeError, NotImplementedError):  # a sparse or other storage-less tensor
            keys = [_storage_key(t) for t in self.tensors]
            stored = False
        if len(set(keys)) < len(keys):  # a tensor found twice shares a storage with itself
            keys = self._drop_found_again(keys)
            first: dict[int, int] = {}
            for i, key in enumerate(keys):
                j = first.setdefault(key, i)
                if j != i:
                    self.shared.setdefault(j, [j]).append(i)
        tensors = self.tensors
        self.nbytes = [t.nbytes for t in tensors] if stored else [_nbytes(t) for t in tensors]
        for j, members in self.shared.items():
            self.nbytes[j] = _span([tensors[i] for i in members])[1]
            for i in members[1:]:
                self.nbytes[i] = 0

    def _drop_found_again(self, keys: list[int]) -> list[int]:
        """Keep the first of each tensor found more than once; return the keys of those kept."""
        first: dict[int, int] = {}
        keep = [first.setdefault(id(t), i) == i for i, t in enumerate(self.tensors)]
        if all(keep):
            return keys
        index = list(itertools.accumulate(keep, initial=0))  # each old index's new one
        self.tensors, self.targets, self.where, keys = (
            list(itertools.compress(column, keep))
            for column in (self.tensors, self.targets, self.where, keys)
        )
        self.names = [(name, index[a], index[b]) for name, a, b in self.names]
        self.requiring_grad = [index[i] for i in self.requiring_grad if keep[i]]
        self.with_history = [index[i] for i in self.with_history if keep[i]]
        return keys

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


def _nbytes(t: Tensor) -> int:
    """Bytes of `t`'s data; a sparse tensor's are those of its index and value tensors."""
    parts = _SPARSE_PARTS.get(t.layout)
    with contextlib.suppress(RuntimeError):
        return t.nbytes if parts is None else sum(getattr(t, name)().nbytes for name in parts)
    return 0


def _storage_key(t: Tensor) -> int:
    """What identifies the storage of `t`: tensors that share one get the same key."""
    try:
        return _storage_id(t)
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return id(t)


def _execute(plan: _Plan, ns: dict, device: torch.device | None, undo: _Undo | None) -> MoveResult:
    start = time.perf_counter()
    news = _copy_all(plan)
    if isinstance(news, str):
        raise DeviceMagicError(news)  # outside any except block: no tensors ride on it
    home = undo.home if undo is not None else None
    if home is not None:
        for t in plan.tensors:
            home[id(t)] = t.device
    history = [
        f"{_label(plan.where[i])}: moved without its autograd history" for i in plan.with_history
    ]
    notes, rebound = _commit(ns, plan, news, undo)
    if home is not None:
        for old, new in rebound.items():
            home[id(new)] = home.pop(old)
    _reattach_grads(plan.grads.values(), rebound)
    by_name = {name: sum(plan.nbytes[first:last]) for name, first, last in plan.names}
    target = device if device is not None else _first_target(plan)
    return MoveResult(
        target,
        {name: n for name, n in by_name.items() if n},
        time.perf_counter() - start,
        history + notes,
        undo,
    )


def _first_target(plan: _Plan) -> torch.device:
    return plan.targets[0] if plan.targets else torch.device("cpu")


def _copy_all(plan: _Plan) -> list[Tensor] | str:
    """Phase 2: a copy of each planned tensor, in plan order, or the one-sentence reason why not."""
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
                _copy_storage(plan, group, spans)
                if bar is not None:
                    bar.update(plan.nbytes[group[0]])
            group = None
            if spans or bar is not None:
                for i, (t, target) in enumerate(zip(tensors, targets)):
                    new = spans.pop(i, None)
                    if new is None:  # a tensor with a storage of its own
                        new = t.to(target)
                        if bar is not None:
                            bar.update(plan.nbytes[i])
                    news.append(new)
            else:  # the same without a Python step per tensor (about 0.15 µs a tensor less)
                news.extend(map(Tensor.to, tensors, targets))
            for j in plan.requiring_grad:
                news[j].requires_grad_(True)  # under no_grad, `.to` of a leaf gives one without
        return news
    except BaseException as exc:
        # What failed: a span, or the `.to` after the copies made (`extend` keeps those too).
        failed = group or [min(len(news), len(tensors) - 1)]
        news.clear()
        spans.clear()
        traceback.clear_frames(exc.__traceback__)  # the frames below hold copies too
        gc.collect()
        _empty_cache(targets[failed[0]])
        if not isinstance(exc, Exception):
            raise  # an interrupt goes on, holding no copies
        # out of memory, a dtype, data-less meta
        return _failure(plan, failed, targets[failed[0]], exc)
    finally:
        if bar is not None:
            bar.close()


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
    for t, j in zip(group, members, strict=True):
        size = t.element_size()
        new = torch.empty(0, dtype=t.dtype, device=target)
        new.set_(storage, t.storage_offset() - lo // size, t.size(), t.stride())
        spans[j] = new


def _span(group: list[Tensor]) -> tuple[int, int]:
    """The first byte and the number of bytes of storage that the tensors of `group` use."""
    lo, hi = None, 0
    for t in group:
        size = t.element_size()
        start = t.storage_offset() * size
        extent = sum((n - 1) * s for n, s in zip(t.size(), t.stride(), strict=True)) + 1
        lo = start if lo is None else min(lo, start)
        hi = max(hi, start + extent * size if t.numel() else start)
    lo = lo // _ALIGN * _ALIGN  # so that every dtype's offset from it stays whole
    return lo, hi - lo


def _failure(plan: _Plan, members: list[int], target, exc: Exception) -> str:
    t = plan.tensors[members[0]]
    what = _label(plan.where[members[0]])
    size = fmt_bytes(sum(_nbytes(plan.tensors[j]) for j in members))
    if t.device.type == "meta":
        reason = "it is on the meta device, which holds no data"
    elif isinstance(exc, _OOM) or "out of memory" in str(exc).lower():
        free = _free_bytes(target)
        reason = "out of memory" + (f" with {fmt_bytes(free)} free" if free is not None else "")
    else:
        reason = first_sentence(exc)
    return f"Could not move {what} ({size}) to {target}: {reason}; nothing was moved."


def _commit(
    ns: dict, plan: _Plan, news: list[Tensor], undo: _Undo | None
) -> tuple[list[str], dict[int, Tensor]]:
    """Phase 3: give every tensor its copy in place; rebind what torch will not change."""
    originals = undo.originals if undo is not None else None
    if originals is not None:
        for t in plan.tensors:
            alias = t.detach().requires_grad_(t.requires_grad and t.is_leaf)
            originals.append((t, alias))
    pending = _swap_all(plan.tensors, news)
    notes: list[str] = []
    replaced: dict[int, Tensor] = {}
    where = {id(t): w for t, w in zip(plan.tensors, plan.where, strict=True)} if pending else {}
    for t, new in pending:
        why = _swap_refusal(t) or "torch refused to swap it"
        if torch._has_compatible_shallow_copy_type(t, new):
            t.data = new
            notes.append(
                f"{_label(where[id(t)])}: moved with .data because {why}; "
                "views of its old storage and autograd graphs that saved it stay behind"
            )
        else:
            replaced[id(t)] = _like(t, new)
            notes.append(
                f"{_label(where[id(t)])}: replaced by a new tensor because {why}; "
                "references the cell does not name keep the old one"
            )
    if replaced:
        _rebind(ns, [name for name, _, _ in plan.names], replaced)
        if undo is not None:
            undo.rebound.update({id(replaced[id(t)]): t for t, _ in pending if id(t) in replaced})
            if originals is not None:
                originals[:] = [(t, a) for t, a in originals if id(t) not in replaced]
    return notes, replaced


def _swap_all(olds: list[Tensor], news: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """Swap each of `olds` with its copy where allowed, emptying `news`; return those refused."""
    # After a swap the copy holds the old tensor, which may still hold another
    # (a view its base, a leaf its grad) and block that one's swap: dropping
    # them (`news.clear()`, then each list of refused pairs) may unblock it, so
    # retry while passes make progress.
    refused = _swap_pass(zip(olds, news))
    news.clear()
    while refused:
        retry = _swap_pass(refused)
        if len(retry) == len(refused):
            break
        refused = retry
    return refused


def _swap_pass(pairs: Iterable[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """Swap every pair that can be swapped now; return the others."""
    if _swap_impl is None:
        return list(pairs)
    refused = []
    for t, new in pairs:  # the checks of `_swap_refusal`, inlined: this runs once a tensor
        if getweakrefcount(t) or t._use_count() > 1:
            refused.append((t, new))
            continue
        try:
            _swap_impl(t, new)  # `new` now holds the old tensor
        except RuntimeError:  # a C++ weak reference to it
            refused.append((t, new))
    return refused


def _swap_refusal(t: Tensor) -> str | None:
    """Why the C++ tensor under `t` cannot be swapped in place, or None if it can."""
    if _swap_impl is None:
        return f"torch {torch.__version__} cannot swap tensors"
    if getweakrefcount(t):
        return "a weak reference to it exists"
    if t._use_count() > 1:
        return "another tensor or an autograd graph holds it"
    return None


def _like(t: Tensor, new: Tensor) -> Tensor:
    """`new` as the same kind of object as `t`: Parameter class, attributes, leafness."""
    if isinstance(t, torch.nn.Parameter):
        new = type(t)(new.detach(), requires_grad=t.requires_grad)
    elif type(t) is not Tensor:
        new = new.as_subclass(type(t))
    new.__dict__.update(t.__dict__)
    return new


def _rebind(ns: dict, names: list[str], replaced: dict[int, Tensor]) -> None:
    """Point every holder reachable from `names` at the replacements (tuples are rebuilt)."""
    memo: dict[int, object] = {}
    for name in names:
        if name in ns:
            ns[name] = _rebound(ns[name], replaced, memo)


def _rebound(obj: object, replaced: dict[int, Tensor], memo: dict[int, object]) -> object:
    i = id(obj)
    if i in replaced:
        return replaced[i]
    if i in memo or isinstance(obj, Tensor):
        return memo.get(i, obj)
    memo[i] = obj

    def sub(v: object) -> object:
        return _rebound(v, replaced, memo)

    if isinstance(obj, torch.nn.Module):
        for m in obj.modules():
            for kind in (m._parameters, m._buffers):
                for k, t in kind.items():
                    if id(t) in replaced:
                        kind[k] = replaced[id(t)]
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            group["params"][:] = [sub(p) for p in group["params"]]
        for p in [p for p in obj.state if id(p) in replaced]:
            obj.state[replaced[id(p)]] = obj.state.pop(p)
        for state in obj.state.values():
            sub(state)
    elif isinstance(obj, dict):
        for k, v in list(obj.items()):
            if (new := sub(v)) is not v:
                obj[k] = new
    elif isinstance(obj, list):
        for k, v in enumerate(obj):
            if (new := sub(v)) is not v:
                obj[k] = new
    elif isinstance(obj, tuple):
        items = [sub(v) for v in obj]
        if any(a is not b for a, b in zip(items, obj, strict=True)):
            memo[i] = type(obj)._make(items) if hasattr(obj, "_fields") else type(obj)(items)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name, None)
            if (new := sub(v)) is not v:
                object.__setattr__(obj, f.name, new)  # frozen dataclasses too
    return memo[i]


def _reattach_grads(grads: Iterable[tuple[Tensor, Tensor]], replaced: dict[int, Tensor]) -> None:
    for t, g in grads:
        replaced.get(id(t), t).grad = replaced.get(id(g), g)


def _put_back_originals(ns: dict, moved: MoveResult, undo: _Undo, start: float) -> MoveResult:
    """Restore from a data-less device: the original tensors come back as they were."""
    olds, originals = [t for t, _ in undo.originals], [o for _, o in undo.originals]
    undo.originals = None  # so that `_swap_all` can drop what the swaps hand back
    refused = _swap_all(olds, originals)
    replaced = {id(t): _like(t, orig) for t, orig in refused}
    replaced.update(undo.rebound)
    if replaced:
        _rebind(ns, undo.names, replaced)
    _reattach_grads(undo.grads, replaced)
    for opt, state in undo.optimizer_state:
        opt.state.clear()
        opt.state.update({p: dict(s) for p, s in state.items()})
    with torch.no_grad():
        for t, value in undo.values:
            t.copy_(value)
    notes = [
        f"a tensor of {fmt_bytes(_nbytes(t))} came back as a new object: "
        f"{_swap_refusal(t) or 'torch refused to swap it'}"
        for t, _ in refused
    ]
    return MoveResult(
        next(iter(undo.home.values()), torch.device("cpu")),
        dict(moved.names),
        time.perf_counter() - start,
        notes,
    )


def _label(where: _Where) -> str:
    parent, key, is_attr = where
    if parent is None:
        return key
    return f"{_label(parent)}.{key}" if is_attr else f"{_label(parent)}[{key!r}]"


def _is_lazy(t: Tensor) -> bool:
    return isinstance(t, torch.nn.parameter.UninitializedTensorMixin)


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
    from tqdm.auto import tqdm

    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        desc=f"moving to {target}",
    )


def _free_bytes(device: torch.device) -> int | None:
    """Free memory on `device` where torch or the OS says, else None."""
    try:
        if device.type == "cpu":
            import psutil

            return psutil.virtual_memory().available
        if device.type == "mps":
            return torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory()
        backend = getattr(torch, device.type, None)
        if hasattr(backend, "mem_get_info"):
            return backend.mem_get_info(device)[0]
    except Exception:  # a probe that fails only loses the figure
        return None
    return None


def _empty_cache(device: torch.device) -> None:
    if device.type not in ("cpu", "meta"):
        backend = getattr(torch, device.type, None)
        if hasattr(backend, "empty_cache"):
            backend.empty_cache()
