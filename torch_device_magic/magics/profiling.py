"""`%%profile`."""

from __future__ import annotations

import functools
from typing import Any

from IPython.core.magic import line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from .. import cells, profile, reach
from .arguments import cell_form, parse, user_errors
from .core import MagicsGroup, TorchDeviceMagics


@magics_class
class TorchDeviceProfileMagics(MagicsGroup):
    """`%%profile`: where a cell's time and memory go, by op and by line."""

    def __init__(self, core: TorchDeviceMagics) -> None:
        super().__init__(core)
        self._profiling = False  # a %%profile cell is running

    @magic_arguments(name="%profile")  # its usage reads %%profile
    @argument("-n", dest="runs", type=int, default=1,
              help="profiled runs (default 1); each run repeats the cell's side effects")
    @argument("--warmup", type=int, default=0,
              help="unprofiled runs first (default 0); they repeat the side effects too (a "
              "training cell trains once more), and the last one, where it is not the "
              "code's first run, is the plain run the overview compares with")
    @argument("--sort", default="self",
              help="the op table's order: self (CPU time, the default), total, device, memory")
    @argument("--top", type=int, default=10, help="rows of the op and kernel tables (default 10)")
    @argument("--trace", metavar="PATH",
              help="write the Chrome/Perfetto trace there, a file in a folder that exists "
              "(default: a temporary file, shown, kept until the next %%%%profile or the "
              "session's end); a folder that exists holds the traces of the ranks a "
              "launcher starts in the cell, one per rank (default: a temporary folder)")
    @argument("--steps", type=int, default=5,
              help="where the cell has loops, record each loop's first step and STEPS more in "
              "full (ops, memory, trace; default 5), with the code outside the loops and each "
              "line's first run, and time the lines of every step; 0 records all")
    @argument("--memory", action="store_true",
              help="also draw the cell's memory over time, offline, its largest allocations "
              "labelled by line: from the CUDA allocator's history where the cell used CUDA "
              "(its snapshot saved for pytorch.org/memory_viz), else from the profiler's "
              "memory events")
    @argument("--threads", action="store_true",
              help="also record the ops of the threads the cell starts (every thread; this "
              "torch then records no memory allocations, so not with --memory)")
    @argument("-f", dest="functions", action="append", default=[], metavar="NAME",
              help="also give the lines of this function (defined elsewhere: a notebook "
              "function, a method, a module's forward); repeatable")
    @argument("-o", dest="output", action="store_true",
              help="return the ProfileReport instead of the cell's value (.ops, .kernels, "
              ".lines, .trace_path, .profiler for key_averages(): of the last recorded stretch "
              "only, where a loop's steps were windowed)")
    @line_cell_magic  # the line form is there for `%profile?`: it says it is a cell magic
    @user_errors
    def profile(self, line: str, cell: str | None = None) -> Any:
        """Profile the cell with torch.profiler: where its time and memory go, by op and by line.

        In [1]: %%profile
           ...: loss = loss_fn(model(x), y)
           ...: loss.backward()

        Shows an overview (wall time; where a GPU's activity was recorded, its busy
        time and share of the wall, kernel launches, host-device copies and
        synchronisations, naming an .item() or .cpu() that a loop repeats), then
        the table by line: for each line of the cell, and of the functions it
        defines, its hits, wall time, torch CPU time, device time and memory
        allocated, each event counted once, on the innermost line running when
        it happened (a line that calls a function of the cell gets only what ran
        on it outside that function's lines, as those have their own rows); then
        the top ops (calls, self and total CPU time, device time, memory
        allocated, the most frequent input shapes) and on a GPU the top kernels.
        The overview counts the matmuls', convolutions' and attention's FLOPs
        and their rate; on a GPU it says the MFU against the device's dense peak
        for their precision, the peak beside it (a GPU the table lacks: set
        `%config TorchDeviceMagics.peak_flops = FLOP/s`, or a dict by precision).

        The cell runs as a cell: Out[n], tracebacks at its lines, names bound.
        `-n` and `--warmup` run it more than once, and each run repeats its side
        effects (appends, training steps). The trace goes to `--trace PATH` or a
        temporary file (only the last one is kept, deleted at unload and exit),
        stamped rank 0 so Holistic Trace Analysis reads it. A loop at the cell's
        top level is recorded in full over its steps 1 to 6 (`--steps`), each
        loop and each run alike, and its lines timed over every step, so that a
        long loop costs about what it costs without the profiler.
        `--memory` adds the memory over the cell's time, drawn inline without
        network, its largest allocations labelled by line: from the CUDA
        allocator's history where the cell used CUDA, else from the
        profiler's memory events.

        Cost: the profiler adds a few µs to every op and each traced line a few
        more; the overview compares with a warm plain run of the same code where
        one is known (the last warm-up, else the last run of a cell with this
        code that ran before, blank lines and trailing spaces aside, unless a
        later cell bound a name it reads again or changed one in place:
        x.data = ..., x.resize_(), model.cuda()) and the per-cell line says
        "(profiled)". Ops of threads the cell starts are
        recorded with `--threads` (every thread; torch 2.13 then records no
        memory allocations), else the overview says the cell started threads.
        CUDA is recorded only where it was already up when recording began (a
        warm-up that starts it counts): %%profile never starts it. Where the
        device's activity could not be recorded (CUPTI missing or refused) the
        overview says so and shows the CPU side only. A cell that raises (or
        Ctrl-C) shows its partial profile, then its own traceback; the profiler
        is stopped either way (a Ctrl-C while it starts or stops waits until
        that is done). It cannot run under another %%profile or while a
        torch.profiler records. A torch.profiler the cell itself starts works
        as it would without %%profile: torch records one profile at a time, so
        the cell then gets no profile, said in one line.

        A cell that starts ranks (torch.multiprocessing's start_processes or
        spawn, torch elastic's launch and accelerate's notebook_launcher through
        it, a multiprocessing.Process that forms a process group) profiles each
        rank's function, its outer loop's steps windowed as the cell's: one
        trace per rank in `--trace DIR` (a folder) or a temporary folder, then a
        row per rank (steps, median and slowest step, collectives' share, peak
        memory), the straggler or "the ranks are even", and advice on them.
        Ranks forked after this process ran multi-threaded CPU ops hang in
        torch's OpenMP, with or without %%profile: use start_method='spawn'.
        """
        __tracebackhide__ = True
        cell = cell_form("profile", "the code to profile", cell)
        args = parse(self.profile, line, cell=True)
        rank_folder = profile.trace_folder(args.trace)  # --trace DIR: the ranks' traces
        options = profile.Options(
            args.runs, args.warmup, args.sort, args.top, None if rank_folder else args.trace,
            args.memory, threads=args.threads, steps=args.steps,
        )
        options.check()
        profile.refuse_if_recording(self._profiling)
        functions = profile.functions(
            self.shell.user_ns, args.functions, functools.partial(cells.cell_label, self.shell)
        )
        run, filename = cells.compile_cell(self.shell, cell)
        reads = cells.names_read(self.shell, cell)  # and what the code it calls reads
        reads |= reach.reach(self.shell.user_ns, reads,
                             cells.attributes_read(self.shell, cell)).names
        capture = profile.Capture(
            run, filename, f"In[{cells.cell_number(self.shell)}]", options, functions,
            *self.core.reporter.plain_run(cell, reads), source=cell,
            loops=profile.outer_loops(self.shell.transform_cell(cell)),
        )
        self.core.reporter.mark_profiled()
        self._profiling = True
        try:
            report, value = profile.profile_cell(
                capture, display, self.core.traces, self.shell.user_ns, reads,
                self.core.peak_flops, rank_folder)
        finally:
            self._profiling = False
        if args.output:
            return report
        if report is not None:
            display(report)
        return value
