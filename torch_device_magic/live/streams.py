"""The cell's writes to `sys.stdout` and `sys.stderr`, seen by the live line while it is
shown: put in by its thread at the first draw, taken out at the cell's end (only where
nothing wrapped the stream again over it)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class StreamWatch:
    """Calls `before(text)` ahead of each write of the cell's to stdout or stderr."""

    def __init__(self, before: Callable[[str], None]) -> None:
        self._before = before
        self._wrapped: list[tuple[Any, Any, bool]] = []  # (stream, our write, had its own)

    def install(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            watched = _watched(stream.write, self._before)

            had_own = "write" in getattr(stream, "__dict__", ())
            try:
                stream.write = watched  # type: ignore[method-assign]  # undone at the end
            except (AttributeError, TypeError):  # a stream that cannot be wrapped
                continue
            self._wrapped.append((stream, watched, had_own))

    def remove(self) -> None:
        for stream, watched, had_own in reversed(self._wrapped):
            watched_write: Any = watched
            if getattr(stream, "__dict__", {}).get("write") is not watched:
                continue  # wrapped again over ours and not put back: left as it is
            if had_own:
                stream.write = watched_write.__wrapped__
            else:
                del stream.write
        self._wrapped = []


def _watched(write: Any, before: Callable[[str], None]) -> Any:
    def watched(text: str, *args: Any, **kwargs: Any) -> Any:
        if text:
            before(text)
        return write(text, *args, **kwargs)

    watched.__wrapped__ = write  # type: ignore[attr-defined]
    return watched
