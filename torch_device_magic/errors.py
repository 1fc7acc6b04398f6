"""The one exception the package raises for a user's mistake.

Pure modules raise `DeviceMagicError` with a one-sentence message; the magics
turn it into IPython's own `UsageError` (only that exact class prints without a
traceback, ipython#14024).
"""


class DeviceMagicError(Exception):
    """A mistake in what the user asked for: the message is one sentence for them."""


def first_sentence(err: BaseException) -> str:
    """What went wrong, in one sentence: torch's messages go on for pages (a dispatcher
    error lists every backend) and only their first sentence says what happened."""
    text = (str(err).strip().splitlines() or [""])[0]
    return text.split(". ", 1)[0].rstrip(".") or type(err).__name__
