"""The one exception the package raises for a user's mistake.

Pure modules raise `DeviceMagicError` with a one-sentence message; the magics
turn it into IPython's own `UsageError` (only that exact class prints without a
traceback, ipython#14024).
"""


class DeviceMagicError(Exception):
    """A mistake in what the user asked for: the message is one sentence for them."""
