"""Measuring: `%%gpumem`, `%devhistory`, `%devreport` (the per-cell report's switch)."""

from __future__ import annotations

from typing import Any

from IPython.core.magic import line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from .. import cells, gpumem
from ..errors import DeviceMagicError
from ..history import save_plot
from .arguments import cell_form, parse, user_errors
from .core import MagicsGroup


@magics_class
class TorchDeviceMeasureMagics(MagicsGroup):
    """Measuring: one cell's memory, the report's history, the report on or off."""

    @magic_arguments()
    @argument("mode", nargs="?", default="status",
              help="on, off, status (the default), or live (then on or off)")
    @argument("switch", nargs="?", help="after live: on or off")
    @line_magic
    @user_errors
    def devreport(self, line: str) -> None:
        """Turn the line after every cell (or the live line) on or off, or say how it is set.

        In [1]: %devreport off
        per-cell report: off (every cell; synchronise: on; live line after 1.00 s); 12 cells in
        the history (%devhistory)

        A cell that runs longer than `live_delay` seconds (1 by default) gets a
        live line under its output, updated about once a second: elapsed time,
        the line of the cell running now, device memory (where its runtime is
        up), host memory and its change, cores busy. The report line takes its
        place when the cell ends. `%devreport live off` turns it off (the
        trait's 0), `%devreport live on` back on.

        The line shows wall time, device time (where the cell did accelerator
        work), device allocated change and peak, and host RSS change and peak.
        With `report_min_seconds` or `report_min_bytes` set (0 = unset), only
        cells reaching one of them are shown; every measured cell is kept in the
        history, shown or not. The device is synchronised before the clock stops
        only where its runtime is already up (`sync`); no CUDA context is ever
        created.

        It is the same switch as `%config TorchDeviceMagics.auto_report =
        True/False`: whichever was used last wins, and it lasts through
        `%reload_ext`. Where an accelerator is in use, the report resets
        torch's process-wide peak counter before each cell, so
        `torch.cuda.max_memory_allocated()` then covers one cell only; the
        session's peak is in `%devhistory`.
        """
        args = parse(self.devreport, line)
        if args.mode == "live":
            self._switch_live(args.switch)
        elif args.switch is not None:
            raise DeviceMagicError(f"%devreport {args.mode} takes nothing after it, not "
                                   f"{args.switch!r} (%devreport live on|off switches the "
                                   "live line)")
        elif args.mode not in ("on", "off", "status"):
            raise DeviceMagicError(f"%devreport takes on, off or status, not {args.mode!r} "
                                   "(or live on|off, for the live line)")
        elif args.mode != "status":
            self.core.auto_report = args.mode == "on"
            # %config keeps its value in the shell's config, which %reload_ext reads
            # again: the switch goes there too, so that the latest choice wins.
            self.shell.config[type(self.core).__name__]["auto_report"] = self.core.auto_report
        print(self.core.reporter.status())

    def _switch_live(self, switch: str | None) -> None:
        """`%devreport live on|off`: the live_delay trait, 0 for off; on again restores
        the last delay that was not 0 (the default's otherwise)."""
        if switch not in ("on", "off"):
            said = "nothing" if switch is None else repr(switch)
            raise DeviceMagicError(f"%devreport live takes on or off, not {said}")
        core = self.core
        if switch == "off":
            if core.live_delay:
                self._live_delay_on = core.live_delay
            core.live_delay = 0.0
        elif not core.live_delay:
            core.live_delay = getattr(self, "_live_delay_on", type(core).live_delay.default_value)
        self.shell.config[type(core).__name__]["live_delay"] = core.live_delay

    @magic_arguments(name="%gpumem")  # its usage reads %%gpumem
    @argument("-o", dest="output", action="store_true",
              help="return the report object instead of the cell's value (fields wall_s, "
              "device_s, device_delta_bytes, device_peak_bytes, device_reserved_delta_bytes, "
              "host_delta_bytes, host_peak_bytes; None where not measured)")
    @argument("-q", dest="quiet", action="store_true", help="do not display the report")
    @argument("--device", help="the accelerator to measure, one this machine has, or cpu "
              "for host memory only (default: the session device if it is an accelerator, "
              "else the current device of the runtime in use)")
    @line_cell_magic  # the line form is there for `%gpumem?`: it says it is a cell magic
    @user_errors
    def gpumem(self, line: str, cell: str | None = None) -> Any:
        """Run the cell and report what it did to accelerator memory.

        In [1]: %%gpumem
           ...: y = model(x)

        Shows allocated before -> after, the peak above the start (the
        process-wide peak counter is reset for this), the allocator cache
        (reserved) change, device-wide used memory from NVML (the CUDA context
        and other processes included), wall time with the device synchronised,
        device time on the current stream (work on other streams is outside it),
        the allocator backend, host RSS change and peak, and the five largest
        tensors bound to names the cell created or rebound (the storage each
        keeps alive). Where the cell had child processes (DataLoader workers,
        torch.multiprocessing, notebook_launcher), a row per worker: its pid,
        whether it still runs, its peak RSS, its PSS at the end (shared pages
        split between the processes sharing them) and, where NVML lists it,
        its GPU memory. Without an accelerator in use (or with
        `--device cpu`) it says so and reports host memory only. The cell is
        not reported a second time by the per-cell line. `-o` makes the report
        the cell's output instead of its last value (as `%%timeit -o` does);
        `-q` leaves only that output. A cell that raises shows no report.
        """
        __tracebackhide__ = True
        cell = cell_form("gpumem", "the code to measure", cell)
        args = parse(self.gpumem, line, cell=True)
        device = None if args.device is None else self._resolve(args.device)[0]
        if device is not None and device.type == "meta":
            raise DeviceMagicError("%%gpumem --device meta: meta tensors hold no memory, so "
                                   "there is nothing to measure (--device cpu: host memory)")
        self.core.reporter.say_live("measuring")
        report, value = gpumem.measure(self.shell.user_ns, cells.compiled(self.shell, cell), device)
        self.core.reporter.adopt(report)
        if args.output:
            return report
        if not args.quiet:
            display(report)
        return value

    @magic_arguments()
    @argument("-o", dest="output", action="store_true", help="return the records")
    @argument("--csv", metavar="PATH", help="write the records to a CSV file (~ is your home; "
              'a path with spaces goes in quotes: --csv "my cells.csv")')
    @argument("--plot", action="store_true", help="plot time and memory per cell (matplotlib); a "
              "terminal that shows no images gets a PNG file, and its path")
    @line_magic
    @user_errors
    def devhistory(self, line: str) -> Any:
        """Show, return, save or plot what the per-cell report measured.

        In [1]: %devhistory --csv cells.csv
        wrote 12 records to cells.csv

        Records carry the `%%gpumem -o` fields plus `cell`; the last 1000
        measured cells are kept. Under the table: the session peak per device
        (the most allocated in any kept cell), since the report resets torch's
        process-wide peak counter before each cell. `--plot` needs matplotlib;
        in a terminal that shows no images it saves a PNG in the temporary
        folder and prints its path. Columns that no kept cell has (the device's,
        on a CPU machine) are left out.
        """
        args = parse(self.devhistory, line)
        history = self.core.reporter.history
        if args.csv is not None:
            print(f"wrote {history.write_csv(args.csv)} records to {args.csv}")
        if args.plot:
            figure = history.plot()
            formatter = self.shell.display_formatter
            if formatter is not None and "image/png" in formatter.active_types:
                display(figure)
            else:  # a terminal that shows no images would print only `<Figure size ...>`
                print(f"this terminal shows no images: the plot is in {save_plot(figure)}")
        if args.output:
            return history.records()
        if not (args.csv is not None or args.plot):
            display(history.table())
        return None
