"""What every magic shares with IPython's argument handling: parsing its line, the
one-sentence `UsageError` a mistake becomes, a cell magic used as a line magic."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import MethodType
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from ..errors import DeviceMagicError


def user_errors(method: Callable) -> Callable:
    """Turn the package's `DeviceMagicError` into the exact `UsageError` IPython prints cleanly."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            return method(*args, **kwargs)
        except DeviceMagicError as err:
            message = str(err)
        # Raised out here, the UsageError has no __context__: the DeviceMagicError's
        # frames (a failed move's plan, with the user's tensors) are not kept with it.
        raise UsageError(message)

    return wrapper


def parse(magic: MethodType, line: str, cell: bool = False) -> Any:
    """Parse a magic's line (`cell`: its `%%` form's); a mistake names the magic as typed
    and where to read its options."""
    name = magic.__name__
    typed = f"%%{name}" if cell else f"%{name}"
    try:
        args = parse_argstring(magic, line)
    except UsageError as err:
        raise UsageError(f"{typed}: {err} (see %{name}? for its options)") from err
    except ValueError as err:  # unbalanced quotes, from the line splitter
        raise UsageError(f"{typed}: cannot read {line!r}: {err}") from err
    for key, value in vars(args).items():
        if isinstance(value, str):
            setattr(args, key, unquote(value))
        elif isinstance(value, list):
            setattr(args, key, [unquote(v) if isinstance(v, str) else v for v in value])
    return args


def cell_form(name: str, body: str, cell: str | None) -> str:
    """The cell of a magic that is only a cell magic; its line form is a mistake."""
    if cell is None:
        raise DeviceMagicError(f"%{name} is a cell magic: put %%{name} on a cell's first "
                               f"line and {body} under it")
    return cell


def unquote(text: str) -> str:
    """`"my file.csv"` as `my file.csv`: IPython's line splitter keeps the quotes."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text
