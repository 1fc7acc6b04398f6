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
a name with a global is not taken for it; `cell_attributes` the attribute names
it names (`fit` in `trainer.fit()`), which say which methods it can call;
both read the Python `python_of` makes of a cell: IPython's transform, with a
nested cell magic's body of Python (`%%nograd`, `%%time`) and `%time`'s argument
read as the cell's code. What the functions the cell calls read is `reach.py`'s.
"""

from __future__ import annotations

import ast
import io
import symtable
import tokenize
from collections.abc import Callable, Collection
from typing import Any

from .errors import DeviceMagicError


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


# Cell magics whose body is Python that runs as the cell's code, the extension's own and
# IPython's; and line magics whose argument is.
PYTHON_BODIES = frozenset({"ondevice", "nograd", "gpumem", "profile", "devcompare",
                           "time", "timeit", "capture", "prun"})
PYTHON_ARGUMENTS = frozenset({"time", "timeit", "prun"})


def python_of(shell: Any, cell: str) -> tuple[str, str | None]:
    """`cell`'s Python, once IPython has made Python of its `!cmd` and `%magic` lines,
    for the names it reads: where the cell is a cell magic of `PYTHON_BODIES` (`%%nograd`,
    `%%time`), nested or not, its body's; with the Python argument of each line magic of
    `PYTHON_ARGUMENTS` (`%time y = f(x)`, `%timeit -n 3 f(x)`) added as a line. And the
    name of a cell magic whose body is not Python (`%%bash`, `%%writefile`), whose names
    are not read; else None."""
    while True:
        source = shell.transform_cell(cell)
        if "get_ipython()" not in source:  # no magic: the cell's own Python
            return source, None
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return source, None  # the cell runner reports it
        magics = _magic_calls(tree)
        cell_magic = [(name, body) for kind, name, body in magics if kind == "run_cell_magic"]
        if cell_magic and len(tree.body) == 1:
            name, body = cell_magic[0]
            if name not in PYTHON_BODIES:
                return source, name
            cell = body
            continue
        lines = [_past_options(arg) for kind, name, arg in magics
                 if kind == "run_line_magic" and name in PYTHON_ARGUMENTS]
        return "\n".join([source, *filter(None, lines)]), None


def _magic_calls(tree: ast.Module) -> list[tuple[str, str, str]]:
    """(kind, name, body or argument) of each `get_ipython().run_cell_magic(...)` and
    `.run_line_magic(...)` call IPython made of a cell's magics."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("run_cell_magic", "run_line_magic")):
            args = [a.value for a in node.args
                    if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if args and len(args) == len(node.args):
                found.append((node.func.attr, args[0], args[-1]))
    return found


def _past_options(argument: str) -> str | None:
    """A line magic's argument that is Python, past the options before it (`-n 3 -o f(x)`:
    `f(x)`); None where none is."""
    words = argument.split(None)
    for k in range(len(words)):
        skipped = words[:k]
        if any(not w.startswith("-") and not (i and skipped[i - 1].startswith("-"))
               for i, w in enumerate(skipped)):
            return None  # past what reads as options
        rest = argument.split(None, k)[k]
        try:
            ast.parse(rest)
        except SyntaxError:
            continue
        return rest
    return None


def names_read(shell: Any, cell: str) -> set[str]:
    """The namespace names `cell` reads (see `python_of` and `cell_names`)."""
    return cell_names(python_of(shell, cell)[0])


def attributes_read(shell: Any, cell: str) -> set[str]:
    """The attribute names `cell` names (see `python_of` and `cell_attributes`)."""
    return cell_attributes(python_of(shell, cell)[0])


def cell_attributes(source: str) -> set[str]:
    """The attribute names `source` names anywhere (`fit` and `steps` in
    `trainer.fit(); trainer.steps`): the methods it can call are among them."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()  # the cell runner reports it
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


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
    return top | _global_reads(table, inner, top=True, own=_comprehensions_own(tree))


def names_bound(source: str) -> set[str]:
    """The global names `source`'s top level binds (assigns, imports, defines, deletes);
    none where it does not parse."""
    try:
        tree = ast.parse(source)
        table = symtable.symtable(source, "<cell>", "exec")
    except (SyntaxError, ValueError):
        return set()
    return {s.get_name() for s in table.get_symbols()
            if s.is_assigned() or s.is_imported()} - _comprehensions_own(tree)


def names_changed(source: str, names: Collection[str], modules: Collection[str] = ()) -> set[str]:
    """Which of `names` `source`'s code changes where they stand, binding none of them
    again: an attribute set or deleted under one (`x.data = ...`), an in-place method
    called on one (`x.resize_(...)`), and for the `modules` among them, an item set
    (`m[0] = ...`) or a conversion, which returns the module itself (`m.cuda()`,
    `m.double()`, `m.to(...)`); none where it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, root = node.func.attr, _root(node.func.value)
            if root is not None and root in names and (
                    (method.endswith("_") and not method.startswith("_"))
                    or (root in modules and method in _CONVERSIONS)):
                found.add(root)
            continue
        targets: list[ast.expr] = (
            list(node.targets) if isinstance(node, (ast.Assign, ast.Delete)) else
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets += target.elts
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            elif isinstance(target, ast.Attribute) or (
                    isinstance(target, ast.Subscript) and _root(target) in modules):
                root = _root(target)
                if root is not None and root in names:
                    found.add(root)
    return found


# A module's methods that convert it in place and return it (a tensor's return a copy).
_CONVERSIONS = frozenset({"to", "cuda", "cpu", "xpu", "mtia", "half", "float", "double",
                          "bfloat16", "type", "to_empty"})


def _root(node: ast.expr) -> str | None:
    """The name at the root of `a.b[c].d` (a), or None (a call's result, a literal)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


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


_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _comprehensions_own(tree: ast.AST) -> set[str]:
    """The names that the top level of `tree` uses only as a comprehension's own variables
    (`x` in `[x for x in data]`). Python 3.12's symtable puts an inlined comprehension's
    names (PEP 709) in the scope around it; other Pythons give it a scope of its own."""
    own: set[str] = set()
    other: set[str] = set()  # bound or read at the top level itself
    todo: list[tuple[ast.AST, frozenset[str]]] = [(tree, frozenset())]
    while todo:
        node, bound = todo.pop()
        if isinstance(node, ast.Name):
            (own if node.id in bound else other).add(node.id)
        elif isinstance(node, _SCOPES):
            other.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            other.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            other.update(node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            other.add(node.name)
        if isinstance(node, _COMPREHENSIONS):  # its first iterable is read around it
            first, *_ = node.generators
            todo.append((first.iter, bound))
            inner = bound | {n.id for g in node.generators for n in ast.walk(g.target)
                             if isinstance(n, ast.Name)}
            todo += [(child, inner) for child in ast.iter_child_nodes(node)
                     if child is not first]
            todo += [(child, inner) for child in ast.iter_child_nodes(first)
                     if child is not first.iter]
            continue
        for field, value in ast.iter_fields(node):
            if field == "body" and isinstance(node, (*_SCOPES, ast.Lambda)):
                continue  # a scope of its own in every Python: the table's child
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    todo.append((child, bound))
    return own - other


def _global_reads(table: symtable.SymbolTable, augmented: set[str], top: bool,
                  own: Collection[str] = ()) -> set[str]:
    # At the top every name read is the namespace's (but the comprehensions' `own`, which
    # 3.12's table puts there); inside a function, lambda, class or comprehension only
    # those not bound there (nor in an enclosing function) are, and a name declared
    # `global` there that `+=` updates.
    names = {
        s.get_name() for s in table.get_symbols()
        if (s.is_referenced() and (top or s.is_global()) and s.get_name() not in own)
        or (s.is_declared_global() and s.get_name() in augmented)
    }
    for child in table.get_children():
        names |= _global_reads(child, augmented, top=False)
    return names
