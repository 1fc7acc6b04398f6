"""Who keeps tensors alive that no name of the user's holds: the engine of `%tensors --hidden`.

    >>> # after the cells `big = torch.ones(2**28)`, `big` (Out[3]) and `del big`
    >>> report = hidden(ip.user_ns, ip.user_ns_hidden)
    >>> [(h.name, h.nbytes) for h in report.holders]
    [('Out[3]', {'cpu': 1073741824})]

The holders, in this order: the displayed results (`Out[n]` with its alias `_n`,
and `_`, `__`, `___`), the last traceback (its frames' locals), the autograd graph a
tensor keeps (a stored `loss` keeps its graph's saved activations), and optimizer
state. Each storage counts once: not at all when a user's name holds it, else for
the first holder that reaches it (a graph a name keeps before a result showing it).
On an accelerator the total is set against the allocator's allocated bytes, and
what stays unaccounted is said.
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from torch import Tensor

from .. import namespace as ns
from ..devices import accelerators_in_use
from ..reports import Table
from ..tensors import WALK_LIMIT, storage_bytes, storage_key
from ..units import fmt_bytes, fmt_per_device

Key = tuple[str, int]  # (device, storage key), as `%tensors` counts storages
_RESULTS = ("_", "__", "___")  # IPython's last three displayed results
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

    @property
    def total(self) -> int:
        return sum(self.nbytes.values())


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
) -> HiddenReport:
    """What keeps tensors alive in `namespace` apart from the user's names (those not in
    `skip`, and not IPython's: `_`, `_3`, `_i3`, ...). `error` is the last
    traceback's (default: `sys.last_value`); `counters` gives each accelerator's
    allocated bytes (None where unreadable) to reconcile the totals with (default: those
    of the accelerators in use)."""
    users = _UserHeld(namespace, skip)
    taken = dict(users.keys)
    found: dict[str, list[Holder]] = {RESULT: [], TRACEBACK: [], GRAPH: [], STATE: []}

    def add(name: str, keys: dict[Key, int], fix: str, kind: str) -> None:
        mine = {k: n for k, n in keys.items() if k not in taken}
        taken.update(mine)
        if mine:
            found[kind].append(Holder(name, _by_device(mine), fix, kind))

    # The graphs of the user's tensors first: a displayed `pred` that a name still
    # holds keeps its graph through the name, not through Out.
    for name, tensors in users.graphs:
        add(f"{name}'s autograd graph", _keys(graph_tensors(tensors)),
            f"del {name}, or keep {name}.detach()", GRAPH)
    for name, obj in displayed(namespace):
        add(name, _reached([obj]), "%gpufree", RESULT)
    if error is None:
        error = getattr(sys, "last_value", None)
    if error is not None:
        add("the last traceback", _reached(traceback_locals(error)), "%gpufree", TRACEBACK)
    for name, keys in users.states:
        add(f"{name}'s state", keys, f"del {name} (or {name}.state.clear())", STATE)
    holders = [h for kind in found.values() for h in kind]
    if counters is None:
        counters = {a.name: a.counters().allocated_bytes for a in accelerators_in_use()}
    reconciled = [
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


def displayed(namespace: dict[str, object]) -> list[tuple[str, object]]:
    """IPython's displayed results: `Out[n]` (its alias `_n` holds the same), then `_`,
    `__`, `___` (which repeat the last ones unless a result was deleted)."""
    out = namespace.get("Out")
    found: list[tuple[str, object]] = []
    if isinstance(out, dict):
        found += [(f"Out[{n}]", value) for n, value in sorted(out.items())
                  if isinstance(n, int)]
    return found + [(name, namespace[name]) for name in _RESULTS if name in namespace]


def traceback_locals(error: BaseException) -> list[object]:
    """The local variables that `error`'s traceback (and those it chains to) keep alive,
    in the frames of functions: a module's frame (the cell's) holds the user's own
    names, and IPython's frames hold the shell, not the cell's data."""
    values: list[object] = []
    for frame in _frames(error):
        module = str(frame.f_globals.get("__name__", ""))
        if frame.f_locals is frame.f_globals or module.split(".")[0] in ("IPython", _PACKAGE):
            continue
        values += frame.f_locals.values()
    return values


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


def _reached(objs: list[object]) -> dict[Key, int]:
    """The storages `objs` hold as `%tensors` counts them, with the autograd graphs of
    their tensors."""
    keys: dict[Key, int] = {}
    graphs: list[Tensor] = []
    for obj in objs:
        roles, roots = ns.storages(obj)
        for found in roles.values():
            keys.update(found)
        graphs += roots
    keys.update(_keys(graph_tensors(graphs)))
    return keys


def _keys(tensors: Iterable[Tensor]) -> dict[Key, int]:
    return {(str(t.device), storage_key(t)): storage_bytes(t) for t in tensors}


def _by_device(keys: dict[Key, int]) -> dict[str, int]:
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
    namespace: dict[str, object], hidden_ns: dict[str, object], displayhook: Any = None
) -> list[Holder]:
    """Let go of the displayed results and the last traceback where they keep tensors
    alive that no name holds (the user's own graphs and optimizer state stay); return
    every holder found, those of kind RESULT and TRACEBACK let go of. An `Out[n]` goes
    with its aliases: `_n`, and `_`, `__`, `___` where they are the same object, in
    `namespace`, in `hidden_ns` (IPython's `user_ns_hidden`, which keeps a copy of each)
    and in `displayhook` (which keeps its own `_`, `__`, `___`)."""
    error = getattr(sys, "last_value", None)
    found = hidden(namespace, hidden_ns, error, counters={}).holders
    gone = [h for h in found if h.kind in (RESULT, TRACEBACK)]
    out = namespace.get("Out")
    dropped: list[object] = []
    for holder in gone:
        if holder.kind == TRACEBACK and error is not None:
            release_frames(error)
        elif holder.name.startswith("Out[") and isinstance(out, dict):
            dropped.append(out.pop(int(holder.name[4:-1]), None))
        else:
            dropped.append(namespace[holder.name])
    dropped = [obj for obj in dropped if obj is not None]
    for names in (namespace, hidden_ns):
        for name in [n for n in names if n[:1] == "_" and n[1:].isdigit()]:
            if any(names[name] is obj for obj in dropped):
                del names[name]
        for name in _RESULTS:
            if any(names.get(name) is obj for obj in dropped):
                names[name] = ""
    for name in _RESULTS:
        if any(getattr(displayhook, name, None) is obj for obj in dropped):
            setattr(displayhook, name, "")
    return found


def traceback_bytes(
    error: BaseException,
    namespace: dict[str, object],
    skip: Iterable[str] = (),
    minimum: int = 0,
) -> dict[str, int]:
    """Bytes per device of tensors that `error`'s traceback keeps alive in its frames'
    locals and that no name in `namespace` (apart from those in `skip`) holds; {} where
    they come to less than `minimum` (notes.py's note says when they are worth saying)."""
    keys = _reached(traceback_locals(error))
    if sum(keys.values()) < minimum:  # the usual failing cell: the namespace is not walked
        return {}
    held = _UserHeld(namespace, skip).keys
    keys = {k: n for k, n in keys.items() if k not in held}
    return _by_device(keys) if sum(keys.values()) >= minimum else {}
