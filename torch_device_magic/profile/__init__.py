"""`%%profile`'s engine, one module per concern, each importing only those below it:

- `compose`: capture -> reading -> advice -> report, for one cell (`profile_cell`);
- `tables`: `ProfileReport`, what `%%profile` shows, as text and HTML;
- `reading`: a recording read: events on one clock, their analysis, the notes, the trace
  file, the memory timeline;
- `capture`: one capture (`Capture`, its `Options`): the cell run under the recording and
  the tracer, Ctrl-C held while they start and stop; returns what it `Recorded`;
- `lines`: the line tracer, the cell's outer loops and the steps window;
- `memtimeline`: `--memory`'s timeline of a cell's allocations;
- `recording`: torch.profiler's sessions of one capture, paused, resumed, read as one;
- `stderr`: kineto's lines on file descriptor 2 kept out of the user's output;
- `ctrl_c`: SIGINT held and handed on; `traces`: the session's unnamed trace files.

What the events are and mean is below the advice, in `kineto`; only `compose` (and the
`tables` that render it) knows the advice.
"""

from .capture import Capture, Options, trace_folder
from .compose import profile_cell
from .lines import functions, outer_loops
from .recording import refuse_if_recording
from .tables import ProfileReport
from .traces import TraceFiles

__all__ = ["Capture", "Options", "ProfileReport", "TraceFiles", "functions", "outer_loops",
           "profile_cell", "refuse_if_recording", "trace_folder"]
