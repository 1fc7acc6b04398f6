"""The trace files `%%profile` writes where the user named none: the session's, not the user's.

    In [3]: %%profile
    ... | trace /tmp/tdm-profile-In3-k2x9.json (until the next %%profile)
    In [4]: %%profile          # In3's trace is deleted before In4's is written
    In [5]: %unload_ext torch_device_magic   # and In4's now (or at the interpreter's exit)

One file is kept, so that a session of many profiles (of hundreds of MB each for a
long loop) does not fill the temp folder; a trace given with `--trace PATH` is the
user's, and never deleted.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile

LARGE_BYTES = 10 * 2**20  # a trace at least this large has its size in the overview


class TraceFiles:
    """The session's unnamed traces: the last one is kept, the rest deleted."""

    def __init__(self) -> None:
        self.kept: str | None = None
        self._at_exit = False
        self._pid = os.getpid()

    def new(self, label: str) -> str:
        """A fresh file for the trace of the capture `label` ('In[3]'); the one kept before
        is deleted first, so the disk holds one at a time."""
        self.clear()
        if not self._at_exit:  # the interpreter's exit deletes the last one
            atexit.register(self._exit)
            self._at_exit = True
        fd, path = tempfile.mkstemp(
            prefix=f"tdm-profile-{label.replace('[', '').replace(']', '')}-", suffix=".json")
        os.close(fd)
        self.kept = path
        return path

    def clear(self) -> None:
        """Delete the kept trace, if any."""
        path, self.kept = self.kept, None
        if path is not None:
            with contextlib.suppress(OSError):
                os.remove(path)

    def close(self) -> None:
        """At unload: delete the kept trace; nothing is left for the exit to do."""
        self.clear()
        if self._at_exit:
            atexit.unregister(self._exit)
            self._at_exit = False

    def _exit(self) -> None:
        if os.getpid() == self._pid:  # a forked child that exits leaves the session's file
            self.clear()
