"""Run a cell magic's body as IPython runs a cell, the way `%%time` does.

`shell.run_cell` inside a magic would swallow the body's exception (the outer
cell reports success and "Run All" goes on), fire the per-cell hooks twice and
shift `In[n]`; `shell.ex` loses `Out[n]` and real tracebacks. So: transform the
cell (`!cmd`, nested magics), register its source under the cell's own number
(tracebacks read `Cell In[n], line k`), exec the body, eval a trailing
expression and return it for the display hook, unless the cell ends with `;`.
The user's exception propagates unchanged.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Callable
from typing import Any


def run(shell: Any, cell: str) -> Any:
    """Run `cell` in the user namespace; return its last expression's value (None after `;`)."""
    __tracebackhide__ = True
    return compiled(shell, cell)()


def compiled(shell: Any, cell: str) -> Callable[[], Any]:
    """Compile `cell` once; each call of the result runs it as `run` does (for timing)."""
    source = shell.transform_cell(cell)
    filename = shell.compile.cache(source, cell_number(shell), raw_code=cell)
    # Parsed under the cell's name, a SyntaxError reads `Cell In[n], line k`, not `<unknown>`.
    tree = shell.transform_ast(shell.compile.ast_parse(source, filename))
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = shell.compile(ast.Expression(tree.body.pop().value), filename, "eval")
    body = shell.compile(tree, filename, "exec")
    silent = ends_with_semicolon(cell)

    def execute() -> Any:
        __tracebackhide__ = True
        namespace = (shell.user_global_ns, shell.user_ns)
        exec(body, *namespace)
        if last is None:
            return None
        value = eval(last, *namespace)
        return None if silent else value

    return execute


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
