"""kineto's start and stop lines, which go straight to file descriptor 2, kept out of the
user's output (`quiet_stderr`)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

from .ctrl_c import ctrl_c_held

_NOISE = ("profiler_start", "profiler_stop", "Completed Stage:", "ActivityProfilerController",
          "Memory block of unknown size was allocated before the profiling started",
          # a CUDA build's kineto on a machine with no GPU (a laptop, a CI runner), at its
          # first stop: "ERROR:... DeviceProperties.cpp:50] gpuGetDeviceCount failed with
          # code 35"; the profile says itself what it recorded of CUDA
          "gpuGetDeviceCount failed")


@contextlib.contextmanager
def quiet_stderr(heard: list[str]) -> Iterator[bool]:
    """Keep kineto's start/stop lines, which go straight to file descriptor 2, out of the
    user's output: the block's writes there are caught, what else was written comes
    back on `sys.stderr`, and all of it is appended to `heard`. Yields whether they are
    caught.

    Only for our short calls into torch, never around the cell: a child it forks or
    spawns, or a fatal error's last words (faulthandler's, a C++ abort's), must reach
    the real stderr. Ctrl-C waits until descriptor 2 is back."""
    with ctrl_c_held():
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):  # no descriptor 2 to catch: let it be
            yield False
            return
        with tempfile.TemporaryFile() as caught:
            os.dup2(caught.fileno(), 2)
            try:
                yield True
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                caught.seek(0)
                text = caught.read().decode(errors="replace")
                heard.append(text)
                kept = [ln for ln in text.splitlines()
                        if ln.strip() and not any(n in ln for n in _NOISE) and "CUPTI" not in ln]
                if kept:
                    sys.stderr.write("\n".join(kept) + "\n")
