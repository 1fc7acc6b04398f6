"""Who keeps tensors alive that no name of the user's holds: the engine of `%tensors --hidden`.

    >>> # after the cells `big = torch.ones(2**28)`, `big` (Out[3]) and `del big`
    >>> report = hidden(ip.user_ns, ip.user_ns_hidden)
    >>> [(h.name, h.nbytes) for h in report.holders]
    [('Out[3]', {'cpu': 1073741824})]

The holders, in this order: the autograd graph a tensor keeps (a stored `loss` keeps
its graph's saved activations), the displayed results (IPython's references: `Out[n]`,
`_n`, `_`, `__`, `___`, its displayhook's and its last execution result's), the last
traceback (its functions' locals), and optimizer state. A result and the traceback count
only what they alone keep alive, found from reference counts (`_Alone`): what a name, a
Dataset, a Trainer or another view also holds would not come back by letting go of
them; what only their tensors' C++ holds does (what their autograd graphs saved, the
base of a view no Python object holds). Each storage counts once: not at all when a
user's name holds it, else for the first holder that reaches it.
On an accelerator the total is set against the allocator's allocated bytes, and
what stays unaccounted is said.
"""

from __future__ import annotations

import gc
import re
import sys
import traceback
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from inspect import CO_OPTIMIZED
from types import CodeType, FrameType, FunctionType
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from .. import namespace as ns
from ..devices import accelerators_in_use
from ..reports import Table
from ..tensors import WALK_LIMIT, storage_bytes, storage_key
from ..units import fmt_bytes, fmt_per_device

Key = tuple[str, int]  # (device, storage key), as `%tensors` counts storages
_RESULTS = ("_", "__", "___")  # IPython's last three displayed results
_RESULT_NAMES = re.compile(r"_{1,3}|_\d+")  # its names for results in the namespace
_SCALARS = frozenset({int, float, complex, bool, str, bytes, type(None)})  # hold no tensor
_NOT_LOCALS = (FrameType, FunctionType, CodeType)  # what a frame holds besides its locals
_IPYTHONS = re.compile(r"_+|_\d+|_i+\d*|_[oid]h|_exit_code")  # its names in the namespace
RESULT, TRACEBACK, GRAPH, STATE = "result", "traceback", "graph", "state"
_PACKAGE = __name__.split(".")[0]  # our frames hold the shell, not the cell's data
_SAVED: dict[type, tuple[str, ...]] = {}  # a graph node's type: its saved-tensor attributes


@dataclass(frozen=True)
class Holder:
    """One thing that keeps tensors alive behind the user's names, and how to let go of it."""

    name: str  # Out[3], _, the last traceback, loss's autograd graph, opt's state
    nbytes: dict[str, int]  # bytes per device, each storage counted once over all holders
    fix: str
    kind: str  # RESULT, TRACEBACK, GRAPH, STATE
    # each storage counted: (device, bytes, a weak reference), to measure what came back
    watch: tuple[tuple[str, int, Any], ...] = field(default=(), compare=False, repr=False)
    ident: int | None = field(default=None, compare=False, repr=False)  # a result's id()

    @property
    def total(self) -> int:
        return sum(self.nbytes.values())

    def came_back(self) -> dict[str, int]:
        """Bytes per device of the storages counted here that are gone now: after
        letting go of the holder and collecting garbage, what it freed, measured."""
        gone: dict[str, int] = {}
        for device, nbytes, ref in self.watch:
            if ref.expired():
                gone[device] = gone.get(device, 0) + nbytes
        return gone


@dataclass
class HiddenReport:
    """The `%tensors --hidden` section: the holders, and per accelerator what is unaccounted."""

    holders: list[Holder]
    reconciled: list[str] = field(default_factory=list)

    def table(self) -> Table:
        rows = [[h.name, fmt_per_device(h.nbytes), h.fix] for h in self.holders]
        title = "held where no name shows it" + ("" if rows else ": nothing")
        return Table(title, ["holder", "bytes", "to let go"] if rows else [], rows,
                     self.reconciled)

    def __str__(self) -> str:
        return self.table().text()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return self.table()._repr_mimebundle_()


def hidden(
    namespace: dict[str, object],
    skip: Iterable[str] = (),
    error: BaseException | None = None,
    counters: dict[str, int | None] | None = None,
    shell: Any = None,
) -> HiddenReport:
    """What keeps tensors alive in `namespace` apart from the user's names (those not in
    `skip`, and not IPython's: `_`, `_3`, `_i3`, ...). `error` is the last
    traceback's (default: `sys.last_value`); `counters` gives each accelerator's
    allocated bytes (None where unreadable) to reconcile the totals with (default: those
    of the accelerators in use); `shell` (default: the namespace's `get_ipython()`) has
    IPython's other references to results (its displayhook's, its last result's)."""
    users = _UserHeld(namespace, skip)
    taken = dict(users.keys)
    found: dict[str, list[Holder]] = {RESULT: [], TRACEBACK: [], GRAPH: [], STATE: []}
    unread: list[str] = []

    def add(name: str, keys: dict[Key, int], fix: str, kind: str,
            walk: _Alone | None = None, ident: int | None = None) -> None:
        mine = {k: n for k, n in keys.items() if k not in taken}
        taken.update(mine)
        if mine:
            watch = walk.watch(mine) if walk is not None else ()
            found[kind].append(Holder(name, bytes_by_device(mine), fix, kind, watch, ident))

    # The graphs of the user's tensors first: a displayed `pred` that a name still
    # holds keeps its graph through the name, not through Out.
    for name, tensors in users.graphs:
        add(f"{name}'s autograd graph", storage_keys(graph_tensors(tensors)),
            f"del {name}, or keep {name}.detach()", GRAPH)
    for names, ident, walk in results(namespace, skip, shell):
        add(names[0], walk.kept(), let_go_of(names), RESULT, walk, ident)
    if error is None:
        error = getattr(sys, "last_value", None)
    if error is not None:
        walk = traceback_walk(error)
        add("the last traceback", walk.kept(), "%gpufree", TRACEBACK, walk)
        if walk.over:
            unread.append(f"the last traceback: not counted, its frames hold more than "
                          f"{walk.budget:,} objects; %gpufree leaves it")
    for name, keys in users.states:
        add(f"{name}'s state", keys, f"del {name} (or {name}.state.clear())", STATE)
    holders = [h for kind in found.values() for h in kind]
    if counters is None:
        counters = {a.name: a.counters().allocated_bytes for a in accelerators_in_use()}
    reconciled = unread + [
        _reconcile(dev, allocated, taken)
        for dev, allocated in (counters or {}).items()
        if allocated is not None
    ]
    return HiddenReport(holders, reconciled)


class _UserHeld:
    """What the user's names hold (`_x` too: only IPython's own names are left out):
    their storages (optimizer state apart, which is a holder of its own), each
    optimizer's state, and the tensors that carry a graph."""

    def __init__(self, namespace: dict[str, object], skip: Iterable[str]) -> None:
        skipped = set(skip)
        self.keys: dict[Key, int] = {}
        self.states: list[tuple[str, dict[Key, int]]] = []
        self.graphs: list[tuple[str, list[Tensor]]] = []
        for name in sorted(namespace):
            if name in skipped or _IPYTHONS.fullmatch(name):
                continue
            roles, roots = ns.storages(namespace[name])
            for role, found in roles.items():
                if role != ns.STATE:
                    self.keys.update(found)
            if roles[ns.STATE]:
                self.states.append((name, roles[ns.STATE]))
            if roots:
                self.graphs.append((name, roots))


class _Alone:
    """What some references keep alive by themselves, found from reference counts.

    An object counts when every reference to it (`sys.getrefcount`) comes from those
    references or from objects that count: one a name, a Dataset or a Trainer also holds
    never does, and is never entered, so the walk costs only what the references alone
    hold. A storage counts when every tensor using it counts and no C++ object (an
    autograd graph, another view) holds one: the memory that letting go frees. Past
    `budget` objects the walk stops (`over`) and counts nothing."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.over = False
        self._missing: dict[int, int] = {}  # object's id: its references not yet accounted for
        self._todo: list[object] = []
        self._tensors: list[Tensor] = []
        self._first: dict[Key, Tensor] = {}  # a tensor of each storage `kept` counted

    def add(self, refs: list[object]) -> _Alone:
        """Count the references in `refs` (an object as often as the holder refers to
        it), then walk what they alone hold."""
        self._reach(refs)
        while self._todo and not self.over:
            self._reach(gc.get_referents(self._todo.pop()))
        return self

    def _reach(self, kids: list[object]) -> None:
        if len(self._missing) + len(kids) > self.budget:  # a list of ten million floats
            self.over = True
            return
        times = Counter(map(id, kids))
        for kid in kids:
            c = times.pop(id(kid), 0)
            if not c or type(kid) in _SCALARS:
                continue
            missing = self._missing.get(id(kid))
            if missing is None:
                # getrefcount counts `kids`' c references, the loop's and its argument's;
                # and a tensor that C++ holds too (a view's base) is held by its C++ self
                missing = sys.getrefcount(kid) - 2 - c - _held_by_cpp(kid)
            missing -= c
            self._missing[id(kid)] = missing
            if missing == 0:
                if isinstance(kid, Tensor):
                    self._tensors.append(kid)
                self._todo.append(kid)

    def kept(self) -> dict[Key, int]:
        """The storages only the counted tensors keep alive ({} past the budget), and
        those that only their autograd graphs saved: a displayed `x.sigmoid()` whose graph
        saved the result itself, a prediction's activations."""
        if self.over:
            return {}
        by_storage: dict[Key, list[Tensor]] = {}
        for t in self._tensors:
            by_storage.setdefault(_key(t), []).append(t)
        # each saved tensor as often as the graphs hold it (a reference each), once a user
        saved = Counter[int]()
        savers: dict[Key, dict[int, Tensor]] = {}
        for t in graph_tensors(t for t in self._tensors if t.grad_fn is not None):
            saved[id(t)] += 1
            savers.setdefault(_key(t), {})[id(t)] = t
        kept: dict[Key, int] = {}
        for key in by_storage.keys() | savers.keys():
            ts = by_storage.get(key, [])
            ts += _bases_only_views_hold(ts)
            users = {id(t): t for t in ts} | savers.get(key, {})
            first = next(iter(users.values()))
            if _only_views_share(ts, saved) and _storage_users(first) == len(users):
                kept[key] = storage_bytes(first)
                self._first[key] = first
        return kept

    def watch(self, keys: dict[Key, int]) -> tuple[tuple[str, int, Any], ...]:
        """A weak reference to each storage of `keys` that `kept` counted."""
        return tuple((key[0], n, StorageWeakRef(self._first[key].untyped_storage()))
                     for key, n in keys.items() if key in self._first)


def _key(t: Tensor) -> Key:
    return (str(t.device), storage_key(t))


def _held_by_cpp(obj: object) -> int:
    """1 for a tensor that C++ holds too (torch then keeps its Python object alive)."""
    return int(isinstance(obj, Tensor) and obj._use_count() > 1)  # type: ignore[attr-defined]


def _bases_only_views_hold(views: list[Tensor]) -> list[Tensor]:
    """The bases of `views` (not among them) that no Python object holds, only their
    views' C++: the tensor `torch.ones(n)[::2]` views, which its displayed view keeps."""
    found: dict[int, Tensor] = {id(t): t for t in views}
    for view in views:
        base = view._base
        # getrefcount counts `base`, its argument and the C++ view's hold on the object
        if base is not None and id(base) not in found and sys.getrefcount(base) == 3:
            found[id(base)] = base
    return list(found.values())[len(views):]


def _only_views_share(tensors: list[Tensor], saved: Counter[int]) -> bool:
    """Whether C++ holds these tensors (of one storage) only as the bases of their views
    and as the tensors that the graphs walked saved (`saved`: how often, by id): not as
    another graph's saved tensor, nor as another object's base."""
    bases = Counter(id(t._base) for t in tensors if t._base is not None)
    return all(t._use_count() == 1 + bases[id(t)] + saved[id(t)]  # type: ignore[attr-defined]
               for t in tensors)


def _storage_users(t: Tensor) -> int:
    """How many tensors use `t`'s storage (views, a graph's saved copy); 1 for a layout
    that has none."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return 1
    return int(torch._C._storage_Use_Count(storage._cdata)) - 1  # less `storage` itself


def results(
    namespace: dict[str, object], hidden_ns: Iterable[str] = (), shell: Any = None,
    only: int | None = None,
) -> list[tuple[list[str], int, _Alone]]:
    """IPython's displayed results, each with what IPython's references alone keep alive
    of it: (its names, `_result_names`, its id, the walk). IPython refers to a result
    from `Out[n]`, `_n`, `_`, `__`, `___` (in the namespace and in `hidden_ns`, its
    copy), its displayhook's `_`, `__`, `___` and its last execution result: a result
    that a name (or anything else) holds too keeps nothing here. `only`: the result with
    that id alone."""
    places = _result_places(namespace, hidden_ns, shell)
    sites: dict[int, list[tuple[dict[Any, Any], Any]]] = {}
    for names, key in places:
        if type(names[key]) not in _SCALARS and only in (None, id(names[key])):
            sites.setdefault(id(names[key]), []).append((names, key))
    return [(_result_names(where), ident,
             _Alone(WALK_LIMIT).add([names[key] for names, key in where]))
            for ident, where in sites.items()]


def _result_places(
    namespace: dict[str, object], hidden_ns: Iterable[str], shell: Any
) -> list[tuple[dict[Any, Any], Any]]:
    """Where IPython refers to its results: (a dict, its key), `Out`'s first."""
    if shell is None:  # the namespace's own shell, where the caller has none at hand
        shell = getattr(namespace.get("get_ipython"), "__self__", None)
    out = namespace.get("Out")
    places: list[tuple[dict[Any, Any], Any]] = []
    if isinstance(out, dict):
        places += [(out, n) for n in sorted(k for k in out if isinstance(k, int))]
    for names in (namespace, hidden_ns):
        if isinstance(names, dict):
            places += [(names, k) for k in names if _RESULT_NAMES.fullmatch(k)]
    displayhook = getattr(shell, "displayhook", None)
    for owner, attrs in ((displayhook, _RESULTS),
                         (getattr(shell, "last_execution_result", None), ("result",)),
                         (getattr(displayhook, "exec_result", None), ("result",))):
        attributes = getattr(owner, "__dict__", {})
        places += [(attributes, a) for a in attrs if a in attributes]
    return list({(id(names), key): (names, key) for names, key in places}.values())


def _result_names(where: list[tuple[dict[Any, Any], Any]]) -> list[str]:
    """The names a result goes by, each once: `Out[3]`, then `_3`, then `_` (`__`,
    `___`); ["the last result"] where IPython's own attributes alone hold it."""
    keys = [key for _, key in where]
    numbered = [f"Out[{k}]" for k in keys if isinstance(k, int)]
    names = sorted({k for k in keys if isinstance(k, str) and k != "result"},
                   key=lambda k: (k in _RESULTS, k))
    return numbered + names or ["the last result"]


def let_go_of(names: list[str]) -> str:
    """How to let go of a result IPython holds under `names` (`_result_names`): `del` of
    one name frees nothing while another holds it (and IPython's hidden copy of `_3`,
    its displayhook's `_` and its last result hold it too), so %gpufree, which lets go of
    them all."""
    return f"%gpufree ({held_too(names)})" if len(names) > 1 else "%gpufree"


def held_too(names: list[str]) -> str:
    """"_3 and _ hold it too": the names after the first (at least one)."""
    others = names[1:]
    if len(others) == 1:
        return f"{others[0]} holds it too"
    return f"{', '.join(others[:-1])} and {others[-1]} hold it too"


def traceback_walk(error: BaseException, budget: int = WALK_LIMIT) -> _Alone:
    """What `error`'s traceback (and those it chains to) alone keeps alive through the
    locals of its functions' frames: a module's frame (the cell's) holds the user's own
    names, and IPython's frames and ours hold the shell, not the cell's data. Each frame
    is walked once, each object at most once, `budget` objects at most."""
    frames = {id(frame): frame for frame in _frames(error)
              if frame.f_code.co_flags & CO_OPTIMIZED
              and str(frame.f_globals.get("__name__", "")).split(".")[0]
              not in ("IPython", _PACKAGE)}
    return _Alone(budget).add([
        kid for frame in frames.values() for kid in gc.get_referents(frame)
        if not isinstance(kid, _NOT_LOCALS)
        and kid is not frame.f_globals and kid is not frame.f_builtins])


def _frames(error: BaseException) -> Iterator[FrameType]:
    for chained in _chain(error):
        for frame, _ in traceback.walk_tb(chained.__traceback__):
            yield frame


def _chain(error: BaseException) -> Iterator[BaseException]:
    """`error` and those it chains to (its cause, else its context), each once."""
    seen: set[int] = set()
    chained: BaseException | None = error
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        yield chained
        chained = chained.__cause__ or chained.__context__


def release_frames(error: BaseException) -> None:
    """Drop what `error`'s traceback (and those it chains to) keep alive: the frames'
    locals and `sys.last_*`."""
    for chained in _chain(error):
        traceback.clear_frames(chained.__traceback__)
        for frame, _ in traceback.walk_tb(chained.__traceback__):
            # Before Python 3.13 a frame keeps the dict of locals that a traceback
            # printer read; reading f_locals again syncs it with the cleared frame.
            frame.f_locals  # noqa: B018
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)


def graph_tensors(roots: Iterable[Tensor]) -> Iterator[Tensor]:
    """The tensors that the autograd graphs of `roots` saved for backward (activations,
    and the inputs and weights they need), looking at WALK_LIMIT nodes at most; a graph
    that backward already freed has none.

    Saved tensors are read packed (`_raw_saved_*`), never unpacked: unpacking runs the
    saved-tensor hooks, which recompute a checkpointed region or copy an offloaded
    tensor back. What a hook packed counts where it is a tensor or a tuple of them."""
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen: set[int] = set()
    while stack and len(seen) < WALK_LIMIT:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for attr in _saved_names(type(node)):
            value = getattr(node, attr, None)
            for saved in value if isinstance(value, (tuple, list)) else (value,):
                packed = getattr(saved, "data", None)  # None once backward freed it
                for item in packed if isinstance(packed, (tuple, list)) else (packed,):
                    if isinstance(item, Tensor):
                        yield item
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)


def _saved_names(node_type: type) -> tuple[str, ...]:
    """A node type's packed saved-tensor attributes (a custom Function's among them),
    looked up once per type (`dir` is slow)."""
    names = _SAVED.get(node_type)
    if names is None:
        names = tuple(a for a in dir(node_type) if a.startswith("_raw_saved_"))
        _SAVED[node_type] = names
    return names


def storage_keys(tensors: Iterable[Tensor]) -> dict[Key, int]:
    """Each storage the tensors keep alive, keyed by device and storage, with its bytes."""
    return {_key(t): storage_bytes(t) for t in tensors}


def bytes_by_device(keys: dict[Key, int]) -> dict[str, int]:
    """The bytes of `storage_keys`, summed per device."""
    totals: dict[str, int] = {}
    for (dev, _), nbytes in keys.items():
        totals[dev] = totals.get(dev, 0) + nbytes
    return dict(sorted(totals.items()))


def _reconcile(device: str, allocated: int, keys: dict[Key, int]) -> str:
    counted = sum(n for (dev, _), n in keys.items() if dev == device)
    return (
        f"{device}: the allocator holds {fmt_bytes(allocated)} in tensors; names and the "
        f"holders above account for {fmt_bytes(counted)}, "
        f"{fmt_bytes(max(0, allocated - counted))} unaccounted (tensors reached only "
        "through closures, modules' globals or C++ code)"
    )


def release(
    namespace: dict[str, object], hidden_ns: dict[str, object], displayhook: Any = None,
    shell: Any = None,
) -> list[Holder]:
    """Let go of the displayed results and the last traceback where they alone keep
    tensors alive (the user's own graphs and optimizer state stay, and a traceback that
    keeps nothing stays for %debug); return every holder found, those of kind RESULT and
    TRACEBACK let go of (`Holder.came_back` then measures what that freed). A result
    goes as IPython's `%xdel` lets go of an object: from `Out`, `_n`, `_`, `__`, `___` in
    `namespace` and `hidden_ns`, from `displayhook` and the shell's last result."""
    if shell is None:
        shell = getattr(namespace.get("get_ipython"), "__self__", None)
    if displayhook is None:
        displayhook = getattr(shell, "displayhook", None)
    error = getattr(sys, "last_value", None)
    found = hidden(namespace, hidden_ns, error, counters={}, shell=shell).holders
    dropped = {h.ident for h in found if h.kind == RESULT}
    if error is not None and any(h.kind == TRACEBACK for h in found):
        release_frames(error)
    for names, key in _result_places(namespace, hidden_ns, shell):
        if id(names[key]) not in dropped:
            continue
        if names is getattr(displayhook, "__dict__", None) or key in _RESULTS:
            names[key] = ""  # as IPython leaves them before any result
        elif key == "result":
            names[key] = None
        else:
            del names[key]
    return found


def traceback_bytes(error: BaseException, budget: int = WALK_LIMIT) -> dict[str, int] | None:
    """Bytes per device of tensors that `error`'s traceback alone keeps alive in its
    frames' locals; None where its frames hold more than `budget` objects."""
    walk = traceback_walk(error, budget)
    return None if walk.over else bytes_by_device(walk.kept())


def result_bytes(
    namespace: dict[str, object], hidden_ns: Iterable[str], shell: Any, ident: int
) -> tuple[list[str], dict[str, int]] | None:
    """The names IPython gives the result with id `ident` (`_result_names`) and the bytes
    per device that IPython's references alone keep alive of it; None where IPython holds
    no such result."""
    found = results(namespace, hidden_ns, shell, only=ident)
    return (found[0][0], bytes_by_device(found[0][2].kept())) if found else None
