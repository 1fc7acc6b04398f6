"""Run a cell magic's body as IPython runs a cell, the way `%%time` does.

`shell.run_cell` inside a magic would swallow the body's exception (the outer
cell reports success and "Run All" goes on), fire the per-cell hooks twice and
shift `In[n]`; `shell.ex` loses `Out[n]` and real tracebacks. So: transform the
cell (`!cmd`, nested magics), register its source under the cell's own number
(tracebacks read `Cell In[n], line k`), exec the body, eval a trailing
expression and return it for the display hook, unless the cell ends with `;`.
The user's exception propagates unchanged. A body that does not compile runs
nothing and reads as a plain cell's syntax error, then one line; top-level
`await` cannot run inside a magic (IPython's own `%%time` refuses it too).

`cell_names` says which of the namespace's names a cell reads, for the magics
that move or copy them first: the free global names, found with `symtable`, so
that a parameter, a comprehension's variable or a function's local that shares
a name with a global is not taken for it. `reach` adds what the notebook's own
functions that those names hold read when called (their code's global loads,
found with `dis`, transitively), and says where a function reaches tensors
that no name of the notebook holds (a module of the user's own, a closure).
"""

from __future__ import annotations

import ast
import contextlib
import dis
import functools
import io
import itertools
import os
import site
import symtable
import sys
import sysconfig
import tokenize
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .errors import DeviceMagicError
from .namespace import holds_tensors


def run(shell: Any, cell: str) -> Any:
    """Run `cell` in the user namespace; return its last expression's value (None after `;`)."""
    __tracebackhide__ = True
    return compiled(shell, cell)()


def compiled(shell: Any, cell: str) -> Callable[[], Any]:
    """Compile `cell` once; each call of the result runs it as `run` does (for timing).

    A cell that does not compile is shown as IPython shows a plain cell's syntax error
    (`Cell In[n], line k`, none of our frames), and a `DeviceMagicError` says it did not run.
    """
    return compile_cell(shell, cell)[0]


def compile_cell(shell: Any, cell: str) -> tuple[Callable[[], Any], str]:
    """`compiled`, and the file name the cell's code carries (what a profiler sees)."""
    source = shell.transform_cell(cell)
    filename = shell.compile.cache(source, cell_number(shell), raw_code=cell)
    try:
        # Parsed under the cell's name, a SyntaxError reads `Cell In[n], line k`, not `<unknown>`.
        tree = shell.transform_ast(shell.compile.ast_parse(source, filename))
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = shell.compile(ast.Expression(tree.body.pop().value), filename, "eval")
        body = shell.compile(tree, filename, "exec")
    except SyntaxError as err:
        if _awaits(source):
            # Inside a magic no event loop can run it: in a kernel, the kernel's is running.
            raise DeviceMagicError(
                f"`await` outside a function (line {err.lineno}) cannot run under a cell "
                "magic: await it in a cell of its own"
            ) from err
        shell.showsyntaxerror()  # what a plain cell shows: only the error, at the cell's line
        raise DeviceMagicError("the cell did not run: it has the syntax error above") from err
    silent = ends_with_semicolon(cell)

    def execute() -> Any:
        __tracebackhide__ = True
        namespace = (shell.user_global_ns, shell.user_ns)
        exec(body, *namespace)
        if last is None:
            return None
        value = eval(last, *namespace)
        return None if silent else value

    return execute, filename


def cell_label(shell: Any, filename: str) -> str | None:
    """'In[3]' for the file name of a cell's code; None for any other file."""
    named = getattr(shell.compile, "format_code_name", None)  # IPython 8+
    if named is not None:
        found = named(filename)
        return found[1] if found else None
    if filename.startswith("<ipython-input-"):  # IPython 7: <ipython-input-3-hash>
        return f"In[{filename.split('-')[2]}]"
    return None


def cell_number(shell: Any) -> int:
    """The number of the cell running now (IPython 9 has already advanced its counter)."""
    result = getattr(shell.displayhook, "exec_result", None)
    number = getattr(result, "execution_count", None)
    return number if number is not None else shell.execution_count


def ends_with_semicolon(cell: str) -> bool:
    """True when the cell's last token is `;`, which silences `Out[n]`."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(cell).readline))
    except (tokenize.TokenError, SyntaxError):
        return False
    skip = (tokenize.ENDMARKER, tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)
    for tok in reversed(tokens):
        if tok.type not in skip:
            return tok.type == tokenize.OP and tok.string == ";"
    return False


def code_words(source: str) -> list[str]:
    """The names written in `source`'s code, in order, once each: not words of its comments
    or strings, nor attribute names (`.weight`). Read as far as it tokenizes, IPython's
    `%magic` lines included (their arguments are code too, as in `%time f(x)`)."""
    words: dict[str, None] = {}
    after_dot = False
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.NAME and not after_dot:
                words.setdefault(tok.string)
            after_dot = tok.type == tokenize.OP and tok.string == "."
    except (tokenize.TokenError, SyntaxError):  # the rest of an IPython-only line
        pass
    return list(words)


def first_code_line(source: str, width: int = 60) -> str:
    """The cell's first line that is neither blank nor a comment, stripped, cut to `width`."""
    for line in source.splitlines():
        text = line.strip()
        if text and not text.startswith("#"):
            return text if len(text) <= width else text[: width - 1] + "…"
    return ""


def only_comments(source: str) -> bool:
    """True for a cell of comments (and blank lines) alone: it runs nothing.

    Asked of every cell, so a cell whose first character is not `#` is answered at once.
    """
    return source.lstrip().startswith("#") and not first_code_line(source)


def _awaits(source: str) -> bool:
    """True when `source` compiles only with top-level `await` allowed."""
    try:
        compile(source, "<cell>", "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError:
        return False
    return True


def names_read(shell: Any, cell: str) -> set[str]:
    """The namespace names `cell` reads, once IPython has made Python of its `!cmd` and
    `%magic` lines (see `cell_names`)."""
    return cell_names(shell.transform_cell(cell))


def cell_names(source: str) -> set[str]:
    """The global names `source` reads: in its own lines (the roots of `a.b[c]` included)
    and in the functions, lambdas, classes and comprehensions it defines, but not
    their parameters, loop variables or locals."""
    try:
        tree = ast.parse(source)
        table = symtable.symtable(source, "<cell>", "exec")
    except SyntaxError:
        return set()  # the cell runner reports it
    # symtable takes `x += 1` for a store only, but it reads x.
    top, inner = _augmented(tree)
    return top | _global_reads(table, inner, top=True)


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _augmented(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The names `x += ...` updates at the cell's top level, and inside its functions and
    classes; statements only, which is quick (an expression holds no `+=`)."""
    top: set[str] = set()
    inner: set[str] = set()
    stack = [(node, True) for node in tree.body]
    while stack:
        node, at_top = stack.pop()
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            (top if at_top else inner).add(node.target.id)
        nested = at_top and not isinstance(node, _SCOPES)
        for part in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, part, ())
            if isinstance(children, list):
                stack.extend((child, nested) for child in children)
    return top, inner


def _global_reads(table: symtable.SymbolTable, augmented: set[str], top: bool) -> set[str]:
    # At the top every name read is the namespace's; inside a function, lambda, class or
    # comprehension only those not bound there (nor in an enclosing function) are, and
    # a name declared `global` there that `+=` updates.
    names = {
        s.get_name() for s in table.get_symbols()
        if (s.is_referenced() and (top or s.is_global()))
        or (s.is_declared_global() and s.get_name() in augmented)
    }
    for child in table.get_children():
        names |= _global_reads(child, augmented, top=False)
    return names


# ---------------------------------------------------------------------------------------
# What a cell reaches through the functions it calls
# ---------------------------------------------------------------------------------------

_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})
REACH_LIMIT = 10_000  # objects looked at per cell: the functions' code, classes, containers
_ITEMS_LOOKED_AT = 1_000  # entries of one container looked at for functions kept in it


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
    """What the notebook's own functions that a cell calls read from the namespace."""

    names: set[str] = field(default_factory=set)  # the namespace's names they read
    followed: dict[str, list[str]] = field(default_factory=dict)  # function -> those names
    unfollowed: list[Unfollowed] = field(default_factory=list)
    truncated: bool = False  # REACH_LIMIT objects were looked at: there may be more

    def notes(self) -> list[str]:
        """Lines for `-v`: the globals followed into functions, and what could not be."""
        lines = [f"followed into {fn}: {', '.join(names)}"
                 for fn, names in self.followed.items() if names]
        lines += [f"could not follow: {u}" for u in self.unfollowed]
        if self.truncated:
            lines.append(f"functions looked into: the first {REACH_LIMIT:,} objects only")
        return lines


def reach(ns: dict, names: Iterable[str]) -> Reach:
    """What `names` (the namespace names a cell reads) reach through code that runs when
    the cell calls it: the globals read by the notebook's own functions, lambdas, methods
    of its classes and partials, transitively (the code of nested functions, lambdas and
    comprehensions too, and what `functools.wraps` and decorators wrap).

    A function of another module that is not installed (a user's `train.py`) cannot be
    made to read copies: where the globals it reads there hold tensors, modules or
    optimizers, it is `unfollowed`; so is a notebook function that holds them in a
    closure, a default argument or a partial. Installed code (the standard library,
    site-packages: torch, numpy) is not looked into: its module state is no notebook's.
    """
    walker = _Reacher(ns)
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

    def push(self, obj: object, label: str) -> None:
        if type(obj) in _ATOMS or id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        self.stack.append((obj, label))

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
            held = [f"argument {i}" for i, a in enumerate(obj.args) if holds_tensors(a)]
            held += [f"{k}=" for k, v in obj.keywords.items() if holds_tensors(v)]
            if held:
                self.found.unfollowed.append(Unfollowed(label, tuple(held), "<partial>"))
        elif isinstance(obj, types.ModuleType):
            self._module(obj, label)
        elif isinstance(obj, type):
            self._class(obj)
        elif isinstance(obj, (list, tuple, dict)):
            items = obj.values() if isinstance(obj, dict) else obj
            for item in itertools.islice(items, _ITEMS_LOOKED_AT):
                self.push(item, label)
        elif not isinstance(obj, (Tensor, torch.Generator)):
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
        read = [n for n in code_globals(fn.__code__) if n in g]
        if own:
            self.found.names.update(read)
            self.found.followed.setdefault(label, []).extend(
                n for n in read if n not in self.found.followed.get(label, ()))
        held = []
        for n in read:
            if not own and holds_tensors(g[n]):
                held.append(n)
            self.push(g[n], n if own else label)
        if held:
            where = f"{g.get('__name__', '?')}"
            self.found.unfollowed.append(Unfollowed(label, tuple(held), where))
        self._captured(fn, label)

    def _captured(self, fn: types.FunctionType, label: str) -> None:
        """What a function holds itself, which no name of the namespace can stand in for."""
        closure = []
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # not yet assigned
                continue
            if holds_tensors(value):
                closure.append(var)
            self.push(value, label)
        if closure:
            self.found.unfollowed.append(Unfollowed(label, tuple(closure), "<closure>"))
        params = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        defaults = dict(zip(params[len(params) - len(fn.__defaults__ or ()):],
                            fn.__defaults__ or ()))
        defaults.update(fn.__kwdefaults__ or {})
        held = tuple(k for k, v in defaults.items() if holds_tensors(v))
        if held:
            self.found.unfollowed.append(Unfollowed(label, held, "<defaults>"))

    def _module(self, module: types.ModuleType, label: str) -> None:
        g = vars(module)
        if g is self.ns or _installed(g):
            return
        held = tuple(sorted(n for n, v in g.items()
                            if not n.startswith("__") and holds_tensors(v)))
        if held:
            self.found.unfollowed.append(Unfollowed(label, held, "<module>"))

    def _class(self, cls: type) -> None:
        for klass in cls.__mro__:
            functions = [fn for value in vars(klass).values()
                         for fn in (value, getattr(value, "__func__", None),
                                    getattr(value, "fget", None), getattr(value, "fset", None))
                         if isinstance(fn, types.FunctionType)]
            module = sys.modules.get(klass.__module__)
            if (module is not None and _installed(vars(module))
                    and not any(fn.__globals__ is self.ns for fn in functions)):
                continue  # torch's, the standard library's: no notebook's globals
            for fn in functions:
                self.push(fn, _label(fn, self.ns))

    def _instance(self, obj: object, label: str) -> None:
        self.push(type(obj), label)
        if isinstance(obj, torch.nn.Module):
            for sub in obj.modules():
                self.push(type(sub), label)
        for value in getattr(obj, "__dict__", {}).values():  # callbacks kept on it
            if callable(value):
                self.push(value, label)


_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None), types.BuiltinFunctionType})


@functools.lru_cache(maxsize=4096)
def code_globals(code: types.CodeType) -> tuple[str, ...]:
    """The global names `code` loads, stores or deletes, its nested functions',
    lambdas' and comprehensions' included, in order, once each."""
    names: dict[str, None] = {}
    stack = [code]
    while stack:
        co = stack.pop()
        for ins in dis.get_instructions(co):
            if ins.opname in _GLOBAL_OPS:
                names[ins.argval] = None
        stack.extend(c for c in co.co_consts if isinstance(c, types.CodeType))
    return tuple(names)


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
    return os.path.realpath(path).startswith(_installed_paths())
