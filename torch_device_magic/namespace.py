"""What the namespace holds in tensors, name by name: the engine of `%tensors`.

    >>> report = scan({"a": torch.ones(1024), "v": a[:8], "model": nn.Linear(4, 4)})
    >>> [(r.name, r.kind, r.nbytes) for r in report.rows]
    [('a', 'tensor', 4096), ('model', 'module Linear', 80), ('v', 'tensor', 4096)]
    >>> report.totals
    {'cpu': 4176}

A row is a name bound to a tensor, a Parameter, a module, an optimizer, or a
container (list, tuple, dict, namedtuple, dataclass) holding any of them. Its
bytes are the storages it keeps alive, each once: a view reads as its whole
base, because that is the memory it holds. A module's bytes are its parameters
and buffers; an optimizer's are its state (momentum, Adam moments), since its
parameters belong to their model; gradients have their own column. The totals
per device count every storage the listed rows reach once, gradients and an
optimizer's parameters included, so names sharing storage add nothing.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import Tensor

from .errors import first_sentence
from .reports import Table
from .tensors import WALK_LIMIT, children, is_container, is_lazy, storage_bytes, storage_key
from .units import fmt_bytes, plural

_T = TypeVar("_T")
_SCALARS = frozenset({int, float, complex, bool, str, bytes, type(None)})  # hold no tensor
# Their attributes are code and other modules, not the cell's data.
_NOT_HOLDERS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
                types.MethodType)

# Where a tensor sits in the object a row is named after. DATA and STATE count
# in the row's bytes; DATA, STATE and PARAM give its devices; every role counts
# in the totals, ASIDE only there.
DATA, STATE, GRAD, PARAM, ASIDE = "data", "state", "grad", "param", "aside"


@dataclass(frozen=True)
class TensorRow:
    """One name and the tensors it holds (what `%tensors -o` returns a list of)."""

    name: str
    kind: str  # tensor, Parameter, module Linear, optimizer AdamW, list, dict, Batch, ...
    device: str  # "cpu", or "cpu, cuda:0" when the object spans devices
    dtype: str
    shape: str  # a tensor's shape; what a module, optimizer or container holds
    nbytes: int
    requires_grad: bool
    grad_bytes: int | None  # None when no tensor of it has a .grad


@dataclass
class _Found:
    """What walking one name found: storages by role, and what looked wrong."""

    storages: dict[str, dict[tuple[str, int], int]] = field(
        default_factory=lambda: {DATA: {}, STATE: {}, GRAD: {}, PARAM: {}, ASIDE: {}}
    )
    dtypes: set[str] = field(default_factory=set)
    requires_grad: bool = False
    count: int = 0  # tensors held as data
    warnings: list[str] = field(default_factory=list)
    complete: bool = True
    seen: set[tuple[int, str]] = field(default_factory=set)
    graphs: list[Tensor] = field(default_factory=list)  # tensors held as data with a grad_fn

    def add(self, t: Tensor, role: str) -> None:
        if (id(t), role) in self.seen:
            return
        self.seen.add((id(t), role))
        self.storages[role].update([_storage(t)])
        if role in (DATA, STATE, PARAM):
            self.dtypes.add(str(t.dtype).removeprefix("torch."))
        if role == DATA:
            self.count += 1
            self.requires_grad |= t.requires_grad
            if t.grad_fn is not None:
                self.graphs.append(t)

    def devices(self) -> set[str]:
        return {dev for role in (DATA, STATE, PARAM) for dev, _ in self.storages[role]}

    def held(self) -> dict[tuple[str, int], int]:
        return {**self.storages[DATA], **self.storages[STATE]}


@dataclass
class TensorsReport:
    """The `%tensors` listing: rows by name, totals per device, warnings; text and HTML."""

    rows: list[TensorRow]
    totals: dict[str, int]
    shared: list[str]
    warnings: list[str]
    kept: str = ""  # what the filters kept: " on cuda, holding at least 1.0 MiB"

    def table(self) -> Table:
        if not self.rows:
            return Table(f"no tensors, modules or optimizers in the namespace{self.kept}", [], [])
        rows = [
            [r.name, r.kind, r.device, r.dtype, r.shape, fmt_bytes(r.nbytes), _grad_text(r)]
            for r in self.rows
        ]
        totals = ", ".join(f"{dev} {fmt_bytes(n)}" for dev, n in self.totals.items())
        notes = [f"total: {totals} (shared storage counted once, gradients included)"]
        notes += self.shared + [f"warning: {w}" for w in self.warnings]
        headers = ["name", "kind", "device", "dtype", "shape", "bytes", "grad"]
        names = f"{len(self.rows)} name{'s' if len(self.rows) > 1 else ''}"
        return Table(f"tensors in the namespace{self.kept} ({names})", headers, rows, notes)

    def __str__(self) -> str:
        return self.table().text()

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, str]:
        return self.table()._repr_mimebundle_()


def scan(
    namespace: dict[str, object],
    hidden: Iterable[str] = (),
    device: torch.device | None = None,
    min_bytes: int = 0,
) -> TensorsReport:
    """List what `namespace` holds in tensors; names in `hidden` or starting with `_` are skipped.

    `device` keeps the rows with a tensor on it (`cuda` matches every `cuda:N`),
    `min_bytes` the rows holding at least that many bytes.
    """
    skip = set(hidden)
    found: list[tuple[TensorRow, _Found]] = []
    unread: list[str] = []  # what could not be looked into, named even where it makes no row
    for name in sorted(namespace):
        if name.startswith("_") or name in skip:
            continue
        row, f = _row(name, namespace[name])
        if row is None:
            unread += f.warnings
        elif row.nbytes >= min_bytes and _on(f, device):
            found.append((row, f))
    totals: dict[str, dict[tuple[str, int], int]] = {}
    owners: dict[tuple[str, int], list[str]] = {}
    for row, f in found:
        for role in f.storages.values():
            for key, nbytes in role.items():
                totals.setdefault(key[0], {})[key] = nbytes
        for key in f.held():
            owners.setdefault(key, []).append(row.name)
    # one line per set of names sharing storage: a model's slice shares all its weights
    together: dict[tuple[str, ...], list[int]] = {}  # names: [storages, bytes]
    for key, names in owners.items():
        if len(names) > 1:
            counted = together.setdefault(tuple(names), [0, 0])
            counted[0] += 1
            counted[1] += totals[key[0]][key]
    shared = [
        f"{', '.join(names)} share {'one storage' if n == 1 else plural(n, 'storage')} "
        f"({fmt_bytes(nbytes)}, counted once)"
        for names, (n, nbytes) in together.items()
    ]
    return TensorsReport(
        rows=[row for row, _ in found],
        totals={dev: sum(s.values()) for dev, s in sorted(totals.items())},
        shared=shared,
        warnings=[w for _, f in found for w in f.warnings] + unread,
        kept=_kept(device, min_bytes),
    )


def storages(obj: object) -> tuple[dict[str, dict[tuple[str, int], int]], list[Tensor]]:
    """The storages `obj` keeps alive as `%tensors` counts them, by role ({DATA: {(device,
    storage key): bytes}, STATE: ..., GRAD, PARAM, ASIDE}), and the tensors it holds that
    carry an autograd graph."""
    f = _Found()
    _walk(obj, "", f)
    return f.storages, f.graphs


def holds_tensors(obj: object) -> bool:
    """Whether `obj` reaches a tensor, a module or an optimizer through containers or
    attributes (a TensorDataset, an LR scheduler holding its optimizer), looking at
    WALK_LIMIT objects at most; what raises when looked into counts as holding none."""
    return any(isinstance(item, _HOLDS) for item in _reached([obj], _HOLDS))


def found_in(objs: Iterable[object], *kinds: type[_T]) -> list[_T]:
    """The objects of `kinds` that `objs` reach through containers and attributes, not
    entering them, nor tensors, modules and optimizers; each once, WALK_LIMIT at most."""
    return [item for item in _reached(objs, (*_HOLDS, *kinds)) if isinstance(item, kinds)]


def tensors_in(objs: Iterable[object]) -> list[Tensor]:
    """The tensors that `objs` reach through containers and attributes (a module's, an
    optimizer's state), each once, looking at WALK_LIMIT objects at most."""
    return [item for item in _reached(objs, (Tensor,)) if isinstance(item, Tensor)]


_HOLDS = (Tensor, torch.nn.Module, torch.optim.Optimizer)


def _reached(objs: Iterable[object], leaves: tuple[type, ...]) -> Iterator[object]:
    """The objects `objs` reach (themselves included), not entering `leaves`; what raises
    when looked into is left as it is."""
    seen: set[int] = set()
    stack = list(objs)
    for _ in range(WALK_LIMIT):
        if not stack:
            return
        item = stack.pop()
        if type(item) in _SCALARS or id(item) in seen:
            continue
        seen.add(id(item))
        try:
            if isinstance(item, leaves):
                yield item
                continue
            stack.extend(_parts(item))
        except Exception:  # an unreadable object is left as it is
            continue


def _parts(obj: object) -> list[object]:
    """What an object holds: a container's items, an instance's attributes; a module,
    class or function holds nothing of the cell's."""
    if is_container(type(obj)):
        return _first(value for _, value in children(obj)[0])
    if isinstance(obj, (set, frozenset)):
        return _first(obj)
    if isinstance(obj, _NOT_HOLDERS):
        return []
    return _first(getattr(obj, "__dict__", {}).values())


def _kept(device: torch.device | None, min_bytes: int) -> str:
    parts = [] if device is None else [f"on {device}"]
    if min_bytes:
        parts.append(f"holding at least {fmt_bytes(min_bytes)}")
    return f" {', '.join(parts)}" if parts else ""


def _on(found: _Found, device: torch.device | None) -> bool:
    if device is None:
        return True
    for name in found.devices():
        dev = torch.device(name)
        if dev.type == device.type and device.index in (None, dev.index):
            return True
    return False


def _row(name: str, obj: object) -> tuple[TensorRow | None, _Found]:
    """The row for one name (None when it holds no tensor) and what the walk found."""
    f = _Found()
    _walk(obj, name, f)
    if not f.count and not f.storages[STATE] and not f.storages[PARAM]:
        return None, f
    grads = f.storages[GRAD]
    row = TensorRow(
        name=name,
        kind=_kind(obj) + ("" if f.complete else f" (first {WALK_LIMIT:,} items)"),
        device=", ".join(sorted(f.devices())),
        dtype=", ".join(sorted(f.dtypes)),
        shape=_shape(obj, f),
        nbytes=sum(f.held().values()),
        requires_grad=f.requires_grad,
        grad_bytes=sum(grads.values()) if grads else None,
    )
    return row, f


def _walk(root: object, name: str, f: _Found) -> None:
    """Add every tensor `root` holds to `f`, each object once, within WALK_LIMIT objects;
    an object that raises when looked into (a mapping whose `values()` raises, a
    property that raises) is skipped with a warning."""
    seen: set[int] = set()
    stack = [root]
    looked = 0
    while stack:
        looked += 1
        if looked > WALK_LIMIT:
            f.complete = False
            return
        obj = stack.pop()
        if type(obj) in _SCALARS or id(obj) in seen:
            continue
        seen.add(id(obj))
        try:
            if isinstance(obj, Tensor):
                _tensor(obj, DATA, f)
            elif isinstance(obj, torch.nn.Module):
                _module(obj, name, f)
            elif isinstance(obj, torch.optim.Optimizer):
                _optimizer(obj, name, f)
            elif is_container(type(obj)):
                stack.extend(_first(value for _, value in children(obj)[0]))
        except Exception as err:
            f.warnings.append(
                f"{name}: skipped a {type(obj).__name__} that could not be read "
                f"({type(err).__name__}: {first_sentence(err)})"
            )


def _first(items: Iterable[object]) -> list[object]:
    """The first WALK_LIMIT items, last first so that the stack pops them in order: a slice,
    not all, so that a list of a million samples is not copied whole."""
    return list(itertools.islice(items, WALK_LIMIT))[::-1]


def _tensor(t: Tensor, role: str, f: _Found) -> None:
    f.add(t, role)
    # reading .grad of a non-leaf warns, unless it retains its grad
    if (t.is_leaf or t.retains_grad) and t.grad is not None:
        f.add(t.grad, GRAD)


def _module(module: torch.nn.Module, name: str, f: _Found) -> None:
    devices = set()
    for t in _materialised([*module.parameters(), *module.buffers()]):
        _tensor(t, DATA, f)
        devices.add(str(t.device))
    if len(devices) > 1:
        f.warnings.append(
            f"{name}: the {type(module).__name__}'s parameters and buffers are on "
            f"{' and '.join(sorted(devices))} (move it whole: %%ondevice DEV or .to(device))"
        )


def _optimizer(opt: torch.optim.Optimizer, name: str, f: _Found) -> None:
    astray: set[tuple[str, str]] = set()
    for group in opt.param_groups:
        for p in group["params"]:
            f.add(p, PARAM)
            if p.grad is not None:
                f.add(p.grad, ASIDE)  # the model's row shows it
            for value in opt.state.get(p, {}).values():
                if not isinstance(value, Tensor):
                    continue
                if _bookkeeping(value):
                    f.add(value, ASIDE)
                    continue
                _tensor(value, STATE, f)
                if value.device != p.device:
                    astray.add((str(value.device), str(p.device)))
    for state_dev, param_dev in sorted(astray):
        f.warnings.append(
            f"{name}: the {type(opt).__name__}'s state is on {state_dev} for parameters on "
            f"{param_dev} (%%ondevice moves an optimizer with its state)"
        )


def _bookkeeping(state: Tensor) -> bool:
    """A 0-dim state tensor on the CPU: the scalars torch's optimizers keep there on
    purpose, whatever the parameters' device, unless capturable or fused (every one's
    `step`, NAdam's `mu_product`; a kernel launch for each would cost more). A
    per-parameter state (momentum, Adam's moments) has its parameter's shape."""
    return state.dim() == 0 and state.device.type == "cpu"


def _materialised(tensors: Iterable[Tensor]) -> list[Tensor]:
    """Leave out a lazy module's parameters: they have no shape nor storage yet."""
    return [t for t in tensors if not is_lazy(t)]


def _storage(t: Tensor) -> tuple[tuple[str, int], int]:
    """((device, storage key), bytes): views of one storage share the key."""
    return (str(t.device), storage_key(t)), storage_bytes(t)


def _kind(obj: object) -> str:
    if isinstance(obj, torch.nn.Parameter):
        return "Parameter"
    if isinstance(obj, Tensor):
        return "tensor"
    if isinstance(obj, torch.nn.Module):
        return f"module {type(obj).__name__}"
    if isinstance(obj, torch.optim.Optimizer):
        return f"optimizer {type(obj).__name__}"
    return type(obj).__name__


def shape_of(t: Tensor) -> tuple[int | None, ...]:
    """`t`'s sizes; a ragged dimension of a nested tensor, which has none, reads None."""
    try:
        return tuple(t.shape)
    except RuntimeError:  # a strided nested tensor refuses `.shape` ("irregular" dimensions)
        sizes: list[int | None] = []
        for dim in range(t.dim()):
            try:
                sizes.append(t.size(dim))
            except RuntimeError:
                sizes.append(None)
        return tuple(sizes)


def _shape(obj: object, f: _Found) -> str:
    if isinstance(obj, Tensor):
        return str(shape_of(obj))
    if isinstance(obj, torch.nn.Module):
        return f"{_count(sum(p.numel() for p in _materialised(obj.parameters())))} params"
    if isinstance(obj, torch.optim.Optimizer):
        return plural(sum(len(g["params"]) for g in obj.param_groups), "param tensor")
    return plural(f.count, "tensor")


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _grad_text(row: TensorRow) -> str:
    if row.grad_bytes is not None:
        return f"grad {fmt_bytes(row.grad_bytes)}"
    return "requires_grad" if row.requires_grad else ""
