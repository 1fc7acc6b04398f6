"""`%%profile`'s engine, one module per concern.

Each module imports only those listed above it, and the rules of its advice
(`advice.profile_rules`, which reads `events`' types for checking only):

- `traces`: the session's unnamed trace files;
- `memtimeline`: `--memory`'s timeline of a cell's allocations (IPython-free);
- `events`: kineto's events as plain `Event` records, and their `analyse`;
- `tables`: `ProfileReport`, what `%%profile` shows, as text and HTML;
- `capture`: one `%%profile` (`Capture`, its `Options`), the line tracer, the profiler's
  start and stop, Ctrl-C held while they run.
"""

from .capture import Capture, Options, functions, outer_loops, refuse_if_recording
from .tables import ProfileReport
from .traces import TraceFiles

__all__ = ["Capture", "Options", "ProfileReport", "TraceFiles", "functions", "outer_loops",
           "refuse_if_recording"]
