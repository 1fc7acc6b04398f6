"""What a cell reaches through the code it can call: the namespace names that code reads.

    >>> cell = "out = model(x)"
    >>> found = reach(user_ns, cells.cell_names(cell), cells.cell_attributes(cell))
    >>> found.followed
    {'Net.forward': ['mask'], 'save (forward hook of model.fc1)': ['activations']}

`%%ondevice` moves, and `%%devcompare` copies, what a cell reads by name
(`cells.cell_names`) and what the code it can call reads. That code is found
from the names, transitively:

- a function, lambda, `functools.partial` or decorated function the notebook
  defines, named by the cell or by code already followed: its code's global
  loads and stores (`dis`), nested functions and comprehensions included; and
  what it may call without naming it: the callables in its closure, its default
  arguments (`def score(v, metric=weighted)`), a partial's function and arguments;
- a method of the notebook's classes only where the code followed names it
  (`trainer.fit()` names `fit`; so does `self.fit` in a method followed), and
  the dunder methods, which Python calls from syntax (`ds[i]`, `len(ds)`);
  `__init__` and `__new__` only where the class itself is reached (`Net()`),
  not through an instance made before;
- an `nn.Module` reached counts as called: its `forward` and those of its
  submodules, and their hooks (forward, forward-pre, backward, backward-pre,
  the global module hooks, and the hooks of their parameters and buffers);
  a tensor's own hooks too. Not its other methods: `Net.fit`, which reads
  the training set, is followed only where some code names `fit`;
- a module of the user's own (`utils.py`, not installed) by the attributes
  read from it: `utils.standardize(x)` follows `standardize`, and only a
  tensor that is read (`utils.MEAN`) cannot be followed;
- callables kept in an object's attributes: an installed class's (a
  DataLoader's `collate_fn`) always, since code not looked into calls them;
  a notebook class's where named.

Where the code followed reaches tensors that no name of the notebook holds
(its own module's globals, a closure, a default argument, a partial), that is
`unfollowed`: a mover cannot move them, a comparison cannot give them copies.
Installed code (the standard library, site-packages: torch, numpy; and a
distribution installed in any other `sys.path` folder, `pip install --target
DIR` found through PYTHONPATH, where its `*.dist-info` or `*.egg-info` stands)
is not looked into: its module state is no notebook's. The user's own code is
the notebook's folder (the working directory) and what no distribution lists.
Methods are matched by name, whatever object they are called on; code that
calls one by a computed name (`getattr(obj, name)`) is not seen.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import itertools
import os
import site
import sys
import sysconfig
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .namespace import holds_tensors

_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})
_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR",
                            "IMPORT_FROM", "LOAD_SUPER_ATTR"})
REACH_LIMIT = 10_000  # objects looked at per cell: the functions' code, classes, containers
_ITEMS_LOOKED_AT = 1_000  # entries of one container looked at for functions kept in it

# What calling a module runs besides its forward: its hooks (torch keeps them in these
# dicts on each module, and in module-level dicts for every module's calls).
_MODULE_HOOKS = (("_forward_pre_hooks", "forward-pre"), ("_forward_hooks", "forward"),
                 ("_backward_pre_hooks", "backward-pre"), ("_backward_hooks", "backward"))
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


@dataclass(frozen=True)
class Unfollowed:
    """A function whose tensors a cell reaches where a name of the notebook cannot stand
    in for them: its own module's globals, a closure, a default argument, a partial."""

    function: str  # as the user knows it: `train.fit`, `step`
    names: tuple[str, ...]  # what holds the tensors there
    where: str  # the module whose globals hold them, or <module>, <closure>, <defaults>, <partial>

    def __str__(self) -> str:
        held = ", ".join(self.names)
        if self.where == "<module>":
            return f"{self.function} is a module of your own that holds {held}"
        if self.where == "<closure>":
            return f"{self.function} keeps {held} in a closure"
        if self.where == "<defaults>":
            return f"{self.function} holds {held} as default arguments"
        if self.where == "<partial>":
            return f"{self.function} is a functools.partial bound to {held}"
        return f"{self.function} reads {held} from its module {self.where}"


@dataclass
class Reach:
    """What the code a cell can call reads from the namespace."""

    names: set[str] = field(default_factory=set)  # the namespace's names they read
    # function -> the names it reads that hold tensors, modules or optimizers (what moves)
    followed: dict[str, list[str]] = field(default_factory=dict)
    unfollowed: list[Unfollowed] = field(default_factory=list)
    hooked: set[str] = field(default_factory=set)  # names hooks read: a dict a hook fills
    truncated: bool = False  # REACH_LIMIT objects were looked at: there may be more

    def notes(self) -> list[str]:
        """Lines for `-v`: the globals followed into functions, and what could not be."""
        lines = [f"followed into {fn}: {', '.join(names)}"
                 for fn, names in self.followed.items() if names]
        lines += [f"could not follow: {u}" for u in self.unfollowed]
        if self.truncated:
            lines.append(f"functions looked into: the first {REACH_LIMIT:,} objects only")
        return lines


def reach(ns: dict, names: Iterable[str], attributes: Iterable[str] = ()) -> Reach:
    """What `names` (the namespace names a cell reads) reach through the code the cell can
    call, where `attributes` are the attribute names the cell names (`cells.cell_attributes`):
    see the module's docstring."""
    walker = _Reacher(ns)
    walker.name(attributes)
    for name in sorted(names):
        if name in ns:
            walker.push(ns[name], name)
    walker.run()
    return walker.found


class _Reacher:
    def __init__(self, ns: dict) -> None:
        self.ns = ns
        self.found = Reach()
        self.seen: set[int] = set()
        self.stack: list[tuple[object, str]] = []
        self.named: set[str] = set()  # attribute names the code followed names
        self.waiting: dict[str, list[Callable[[], None]]] = {}  # what follows once named
        self.roles: dict[int, str] = {}  # a hook -> what it hooks: "forward hook of model"
        self.holding: dict[int, bool] = {}  # holds_tensors, asked once an object
        self.classes: set[type] = set()  # whose methods wait on their names
        self.users: dict[type, bool] = {}  # _users, asked once a class
        self.called = False  # whether a module was reached (and so may be called)

    def push(self, obj: object, label: str) -> None:
        if type(obj) in _ATOMS or id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        self.stack.append((obj, label))

    def name(self, attributes: Iterable[str]) -> None:
        """Note attribute names the code followed names; what waited on one is followed."""
        for attr in attributes:
            if attr not in self.named:
                self.named.add(attr)
                for follow in self.waiting.pop(attr, ()):
                    follow()

    def when_named(self, attr: str, follow: Callable[[], None]) -> None:
        if attr in self.named:
            follow()
        else:
            self.waiting.setdefault(attr, []).append(follow)

    def holds(self, obj: object) -> bool:
        if id(obj) not in self.holding:
            self.holding[id(obj)] = holds_tensors(obj)
        return self.holding[id(obj)]

    def run(self) -> None:
        looked = 0
        while self.stack:
            if looked >= REACH_LIMIT:
                self.found.truncated = True
                return
            looked += 1
            obj, label = self.stack.pop()
            try:
                self._visit(obj, label)
            except Exception:  # a user's object that raises when read reaches nothing
                continue

    def _visit(self, obj: object, label: str) -> None:
        if isinstance(obj, types.FunctionType):
            self._function(obj, label)
        elif isinstance(obj, types.MethodType):
            self.push(obj.__func__, label)
            self.push(obj.__self__, label)
        elif isinstance(obj, functools.partial):
            self.push(obj.func, label)
            held = [f"argument {i}" for i, a in enumerate(obj.args) if self.holds(a)]
            held += [f"{k}=" for k, v in obj.keywords.items() if self.holds(v)]
            if held:
                self.found.unfollowed.append(Unfollowed(label, tuple(held), "<partial>"))
            for value in itertools.chain(obj.args, obj.keywords.values()):
                self.push(value, label)  # the function is called with them: `metric=weighted`
        elif isinstance(obj, types.ModuleType):
            self._module(obj, label)
        elif isinstance(obj, type):  # named: it may be called, which runs its constructors
            self._class(obj)
            self.name((_constructed(obj),))
        elif isinstance(obj, (list, tuple, dict)):
            items = obj.values() if isinstance(obj, dict) else obj
            for item in itertools.islice(items, _ITEMS_LOOKED_AT):
                self.push(item, label)
        elif isinstance(obj, Tensor):
            self._hooks(obj, _TENSOR_HOOKS, f"hook of tensor {label}")
        elif not isinstance(obj, torch.Generator):
            self._instance(obj, label)

    def _function(self, fn: types.FunctionType, label: str) -> None:
        wrapped = getattr(fn, "__wrapped__", None)  # functools.wraps: the function it wraps
        if wrapped is not None:
            self.push(wrapped, _label(wrapped, self.ns))
        g = fn.__globals__
        own = g is self.ns
        if not own and _installed(g):
            for cell in fn.__closure__ or ():  # a decorator's wrapper: the user's function
                with contextlib.suppress(ValueError):  # an empty cell
                    if callable(cell.cell_contents):
                        self.push(cell.cell_contents, _label(cell.cell_contents, self.ns))
            return
        if not (own and self.ns.get(label) is fn):  # by the name it is called by, if any
            label = _label(fn, self.ns)
        names, attributes = code_names(fn.__code__)
        read = [n for n in names if n in g]
        if id(fn) in self.roles:
            label = f"{label} ({self.roles[id(fn)]})"
            if own:
                self.found.hooked.update(read)
        if own:
            self.found.names.update(read)
            followed = self.found.followed.setdefault(label, [])
            followed.extend(n for n in read if n not in followed and self.holds(g[n]))
        held = []
        for n in read:
            if not own and self.holds(g[n]):
                held.append(n)
            self.push(g[n], n if own else label)
        if held:
            where = f"{g.get('__name__', '?')}"
            self.found.unfollowed.append(Unfollowed(label, tuple(held), where))
        self._captured(fn, label)
        self.name(attributes)

    def _captured(self, fn: types.FunctionType, label: str) -> None:
        """What a function holds itself, which no name of the namespace can stand in for."""
        closure = []
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # not yet assigned
                continue
            if self.holds(value):
                closure.append(var)
            self.push(value, label)
        if closure:
            self.found.unfollowed.append(Unfollowed(label, tuple(closure), "<closure>"))
        params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        defaults = dict(zip(params[len(params) - len(fn.__defaults__ or ()):],
                            fn.__defaults__ or ()))
        defaults.update(fn.__kwdefaults__ or {})
        held = tuple(k for k, v in defaults.items() if self.holds(v))
        if held:
            self.found.unfollowed.append(Unfollowed(label, held, "<defaults>"))
        for value in defaults.values():
            self.push(value, label)  # a callable default runs where it is left out

    def _module(self, module: types.ModuleType, label: str) -> None:
        """A module of the user's own: what the code followed reads from it."""
        g = vars(module)
        if g is self.ns or _installed(g):
            return
        for attr, value in list(g.items()):
            if not attr.startswith("__"):
                self.when_named(attr, functools.partial(self._module_global, label, attr, value))

    def _module_global(self, module: str, attr: str, value: object) -> None:
        if self.holds(value):
            self.found.unfollowed.append(Unfollowed(module, (attr,), "<module>"))
        self.push(value, f"{module}.{attr}")

    def _class(self, cls: type) -> None:
        """A class's methods that can be called: those named, the dunder methods, and its
        constructors where the class itself is reached (an instance's are done)."""
        if cls in self.classes:
            return
        self.classes.add(cls)
        for klass in cls.__mro__:
            if not self._users(klass):
                continue  # torch's, the standard library's: no notebook's globals
            methods = [(attr, fn) for attr, value in vars(klass).items()
                       for fn in (value, getattr(value, "__func__", None),
                                  getattr(value, "fget", None), getattr(value, "fset", None))
                       if isinstance(fn, types.FunctionType)]
            for attr, fn in methods:
                follow = functools.partial(self.push, fn, _label(fn, self.ns))
                if attr in _CONSTRUCTORS:
                    self.when_named(_constructed(cls), follow)
                elif attr.startswith("__") and attr.endswith("__"):
                    follow()  # Python calls them from syntax: `Net()`, `ds[i]`, `len(ds)`
                else:
                    self.when_named(attr, follow)

    def _instance(self, obj: object, label: str) -> None:
        self._class(type(obj))
        # Callbacks kept on it: a notebook class's run where named; an installed class's
        # (a DataLoader's collate_fn) are called by code not looked into, so always.
        installed = not self._users(type(obj))
        for attr, value in getattr(obj, "__dict__", {}).items():
            if callable(value):
                follow = functools.partial(self.push, value, label)
                if installed:
                    follow()
                else:
                    self.when_named(attr, follow)
        if isinstance(obj, torch.nn.Module):
            self._called(obj, label)

    def _users(self, cls: type) -> bool:
        """Whether `cls` is the notebook's or a module's of the user's own, not installed."""
        if cls not in self.users:
            module = sys.modules.get(cls.__module__)
            # under pytest or python -m, `__main__` is an installed file
            self.users[cls] = (cls.__module__ == self.ns.get("__name__") or module is None
                               or not _installed(vars(module)))
        return self.users[cls]

    def _called(self, module: torch.nn.Module, label: str) -> None:
        """What calling `module` runs: its forward and hooks, its submodules' (pushed in
        turn), and the hooks of its own parameters and buffers (those run in backward).
        Its dicts are read directly: `named_children()` and the like cost far more."""
        if not self.called:  # the first module: every module's call runs these
            self.called = True
            self.name(("forward",))
            for attr, kind in _MODULE_HOOKS:
                self._hooks(torch.nn.modules.module, (f"_global{attr}",), f"global {kind} hook")
        for attr, kind in _MODULE_HOOKS:
            self._hooks(module, (attr,), f"{kind} hook of {label}")
        for name, sub in module._modules.items():
            self.push(sub, f"{label}.{name}")
        for name, t in itertools.chain(module._parameters.items(), module._buffers.items()):
            if t is not None:
                self._hooks(t, _TENSOR_HOOKS, f"hook of {label}.{name}")

    def _hooks(self, owner: object, attrs: Iterable[str], role: str) -> None:
        """Follow the hooks `owner` keeps in its dicts `attrs`, labelled with `role`."""
        for attr in attrs:
            hooks = getattr(owner, attr, None)
            for hook in hooks.values() if hooks else ():
                fn = getattr(hook, "__func__", getattr(hook, "func", hook))  # a method, a partial
                self.roles.setdefault(id(fn), role)
                self.push(hook, role)


_CONSTRUCTORS = frozenset({"__new__", "__init__", "__post_init__"})


def _constructed(cls: type) -> str:
    """The name that stands for calling `cls` (no attribute can have it)."""
    return f"<{id(cls)}()>"


_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None), types.BuiltinFunctionType})


@functools.lru_cache(maxsize=4096)
def code_names(code: types.CodeType) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The global names `code` loads, stores or deletes, and the attribute names it names,
    its nested functions', lambdas' and comprehensions' included, in order, once each."""
    names: dict[str, None] = {}
    attributes: dict[str, None] = {}
    stack = [code]
    while stack:
        co = stack.pop()
        for ins in dis.get_instructions(co):
            if ins.opname in _GLOBAL_OPS:
                names[ins.argval] = None
            elif ins.opname in _ATTRIBUTE_OPS:
                attributes[ins.argval] = None
        stack.extend(c for c in co.co_consts if isinstance(c, types.CodeType))
    return tuple(names), tuple(attributes)


def _label(fn: object, ns: dict) -> str:
    """A function as the user knows it: `step`, `Trainer.fit`, `train.fit`."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    g = getattr(fn, "__globals__", None)
    if g is None or g is ns:
        return str(name)
    return f"{g.get('__name__', '?')}.{name}"


@functools.cache
def _installed_paths() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    found = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    with contextlib.suppress(AttributeError):  # old virtualenvs' site module lacks it
        found.update(site.getsitepackages())
    with contextlib.suppress(AttributeError):
        found.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(p), "") for p in found)


def _installed(g: dict) -> bool:
    """Whether the module whose globals are `g` is installed code (the standard library,
    site-packages), not a file of the user's own."""
    name = g.get("__name__")
    if name in sys.builtin_module_names:
        return True
    path = g.get("__file__")
    if not isinstance(path, str):
        spec = g.get("__spec__")
        return getattr(spec, "origin", None) in ("frozen", "built-in")
    return _installed_file(path)


@functools.lru_cache(maxsize=4096)
def _installed_file(path: str) -> bool:
    real = os.path.realpath(path)
    return real.startswith(_installed_paths()) or _distributed(real)


def _distributed(path: str) -> bool:
    """Whether the file `path` (real) is a distribution's, installed in the `sys.path`
    folder it is found in wherever that is (`pip install --target DIR` on PYTHONPATH):
    its top-level module is one of those the metadata there lists. The notebook's own
    folder holds the user's code, metadata or not (`pip install -e .` leaves some)."""
    folders = [f for f in map(_real_folder, sys.path) if path.startswith(f)]
    if not folders:
        return False
    folder = max(folders, key=len)
    if folder == _real_folder(""):  # the working directory: the notebook's folder
        return False
    top = path[len(folder):].split(os.sep)[0].split(".")[0]  # `pkg/`, `mod.py`, `_ext.cpython…so`
    return top in _distributions(folder)


def _real_folder(entry: str) -> str:
    """A `sys.path` entry as a real folder ending in the separator ('' is the working one)."""
    return _real(os.path.abspath(entry))


@functools.lru_cache(maxsize=256)
def _real(folder: str) -> str:
    return os.path.join(os.path.realpath(folder), "")


@functools.lru_cache(maxsize=256)
def _distributions(folder: str) -> frozenset[str]:
    """The top-level modules of the distributions whose metadata (`*.dist-info`,
    `*.egg-info`) stands in `folder`: from `top_level.txt`, else `RECORD`'s paths, else
    the distribution's name. Read once a folder."""
    found: set[str] = set()
    with contextlib.suppress(OSError):  # not a folder (a zip), or unreadable: none
        for entry in os.scandir(folder):
            if not entry.name.endswith((".dist-info", ".egg-info")):
                continue
            found.add(entry.name.split("-")[0])
            for listing, column in (("top_level.txt", False), ("RECORD", True)):
                with contextlib.suppress(OSError):
                    with open(os.path.join(entry.path, listing), encoding="utf-8") as lines:
                        for line in lines:
                            name = line.split(",")[0] if column else line
                            found.add(name.strip().split("/")[0].split(".")[0])
                    break
    found.discard("")
    return frozenset(found)
