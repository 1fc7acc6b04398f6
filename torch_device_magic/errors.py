"""The one exception the package raises for a user's mistake, and how faults are told.

Pure modules raise `DeviceMagicError` with a one-sentence message; the magics
turn it into IPython's own `UsageError` (only that exact class prints without a
traceback, ipython#14024).

Chaining. An error raised while handling another is chained `from err`, so the
cause stays readable (`%debug`, `__cause__`). It is raised `from None`, or from
outside the `except` block, only where the error it replaces holds frames that
hold the user's tensors (a failed move's copies and plan, a cell's inputs): a
traceback keeps every frame's locals alive, and with them the memory that the
failure should have given back (pytorch#27600).

Faults inside the package that must not break the user's cell are caught
broadly only where a user's object or the machine can raise anything; each such
catch logs at debug level, with the traceback, on the module's own logger, as
IPython's autoreload does (`logging.basicConfig()` and
`logging.getLogger("torch_device_magic").setLevel("DEBUG")` show them).
"""


class DeviceMagicError(Exception):
    """A mistake in what the user asked for: the message is one sentence for them."""


def first_sentence(err: BaseException, named: bool = False) -> str:
    """What went wrong, in one line: torch's messages go on for pages (a dispatcher
    error lists every backend, a CUDA error adds advice) and only the start says what
    happened.

    By default the first sentence of the message. `named`: the exception's type, then
    the whole first line (`RuntimeError: CUDA error: an illegal memory access was
    encountered`), for a fault of the machine, where the type says what failed.
    """
    line = (str(err).strip().splitlines() or [""])[0]
    if named:
        return f"{type(err).__name__}: {line}" if line else type(err).__name__
    return line.split(". ", 1)[0].rstrip(".") or type(err).__name__
