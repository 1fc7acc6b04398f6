"""The per-cell reporter and the hints: one object owns every IPython event callback of ours.

    In [3]: x = torch.ones(2**27); del x
    time 152.3 ms | host 0 B (peak 512.0 MiB)

`register(ip)` first drops callbacks that an older instance left behind (a
reload after a failed unload), so there is always exactly one set; pre and
post are paired through `result.info`, since blank cells and the `%load_ext`
cell fire `post_run_cell` without `pre_run_cell`. A cell run inside a cell
(`%%capture`, `get_ipython().run_cell(...)`) fires both events again inside the
outer pair: the cells open are kept as a stack, and only the outermost is
measured and reported (its line is not in the inner cell's captured output).

The cost per cell is what the measurement needs and no more. Below the
thresholds nothing is formatted. The line goes to the frontend as one MIME
bundle (text and HTML) through the display publisher, without IPython's
formatter machinery; where that publisher is IPython's own terminal one, which
would print the text and nothing else, the text is printed directly, and on an
ipykernel the message is queued behind the cell's output without waiting
(`kernel_publish.py`).
In the terminal, what the cell writes to `sys.stdout` is watched (its `write`
wrapped for the cell, as IPython 9 does to keep outputs) so that the line starts
on a line of its own after `print("x", end="")`.
A fault in a probe reads `n/a` in the line; a fault anywhere else is one line
saying so, never a traceback in the user's cell. An error that surfaces at the
end-of-cell synchronisation (a CUDA error from the cell's own kernels, which run
asynchronously) is kept in the record and always shown, whatever the
thresholds; Ctrl-C there is one line, not IPython's "Error in callback" traceback.

After a cell that raised, the hint (`advice/hints.py`, handed in by the magics while
the `hints` trait is on) is printed under the traceback, before the line; a
fault while making it prints nothing, and leaves a debug record on this module's
logger (as does every fault caught here). The hint runs after the measurement
stopped, and what it frees (an out-of-memory error's frames, released) is no
cell's: the next cell reads the allocator afresh. With the report off and hints
on, only `post_run_cell` stays registered.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from IPython.core.displaypub import DisplayPublisher

from .cells import cell_names, first_code_line, names_bound, names_changed, only_comments, python_of
from .history import History
from .kernel_publish import publish
from .live import LiveLine
from .live.engine import Ended
from .measure import Measurement, Meter
from .probes import clock, cuda_built, rss_and_high_water, runtime_up
from .units import fmt_bytes, fmt_seconds, plural

HISTORY_SIZE = 1000
_CUDA_START = "_torch_device_magic_cuda_start"  # the shell's attribute: see `_hook`
_log = logging.getLogger(__name__)
_NO_ATTRIBUTES: dict[str, Any] = {}  # a stream without a __dict__'s (never written to)


@dataclass(frozen=True)
class CudaStart:
    """The first cell after which CUDA was initialised, and that cell's first line of code."""

    cell: int | None  # None: before we watched (before loading, or with report and hints off)
    line: str = ""

    def __str__(self) -> str:
        if self.cell is None:
            return (
                "CUDA was initialised before torch_device_magic watched (before it was "
                "loaded, or while its report and hints were off)"
            )
        return f"CUDA initialised by cell [{self.cell}]" + (f": {self.line}" if self.line else "")


class CellReporter:
    """Measures every cell between `register` and `unregister` and shows one line after it."""

    def __init__(self, history_size: int = HISTORY_SIZE) -> None:
        self.min_seconds = 0.0  # 0 = unset; a cell is shown when it reaches any set threshold
        self.min_bytes = 0
        self._sync = True
        self.history = History(history_size)
        self._meter: Meter | None = None
        self._shell: Any = None
        self._open: list[object] = []  # the `info` of each cell running now, outermost first
        self._stdout_watch: tuple[Any, Any, Any, bool] | None = None
        self._line_open = False  # the cell's output so far ends inside a line
        self._printing = False  # the outermost cell's line is printed (decided as it starts)
        self._adopted: Measurement | None = None
        self._profiled = False  # the outermost cell runs under %%profile
        self._fault: str | None = None  # the line to show instead of the measurement
        self._hint: Callable[[BaseException, str], str | None] | None = None
        self.cuda_start: CudaStart | None = None  # noted after the first cell that starts it
        self._watch_cuda = False  # ask after each cell: a CUDA build, and CUDA not up yet
        self._loading: tuple[float, int | None, int | None] | None = None  # see `loading`
        # The notes under the line (advice.notes' `Advisor.notes`), None: no notes.
        self.advise: Callable[[Measurement, Any], tuple[Any, ...]] | None = None
        # The live line under a long cell (live/): replaced by the report at the end.
        self.live = LiveLine(lambda: self._line_open, self._host_start_bytes,
                             lambda: self._printing)
        self._live_ended: Ended | None = None

    @property
    def registered(self) -> bool:
        return self._meter is not None

    @property
    def sync(self) -> bool:
        """Synchronise the accelerator before stopping the clock (only where a runtime is up)."""
        return self._sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self._sync = value
        if self._meter is not None:
            self._meter.sync = value

    def register(self, ip: Any) -> None:
        """Start reporting on `ip`, replacing any callbacks of ours already there."""
        if self._meter is None:
            self._meter = Meter(sync=self._sync, carry=True)
        self._shell = ip
        self._hook(ip)

    def unregister(self, ip: Any) -> None:
        """Stop reporting on `ip`; the history stays."""
        if self._meter is not None:
            self._meter.close()
        self.live.close()
        self._unwatch_stdout()
        self._meter = self._shell = None
        self._open = []
        self._hook(ip)

    def loading(self, started: tuple[float, int | None]) -> None:
        """Report the cell that loads us, from `started` (clock, RSS) on: IPython fired its
        `pre_run_cell` before we were there. Called before `register`, whose probe resets
        the high-water mark: the mark of the load so far is read now."""
        now = rss_and_high_water()
        self._loading = (*started, None if now is None else now[1])

    def set_hint(self, ip: Any, hint: Callable[[BaseException, str], str | None] | None) -> None:
        """Show `hint(error, cell source)` after a failing cell's traceback; None: no hints."""
        self._hint = hint
        self._hook(ip)

    def _hook(self, ip: Any) -> None:
        """Register exactly what is needed: both events to report, `post_run_cell` for hints.

        Callbacks of ours that are not this object's (an older instance, after a
        reload that followed a failed unload) are dropped, so there is one set.
        """
        wanted = {
            "pre_run_cell": self.registered,
            "post_run_cell": self.registered or self._hint is not None,
        }
        for event, on in wanted.items():
            mine = getattr(self, event)
            for callback in list(ip.events.callbacks[event]):
                if is_ours(callback) and (callback != mine or not on):
                    ip.events.unregister(event, callback)
            if on and mine not in ip.events.callbacks[event]:
                ip.events.register(event, mine)
        # Which cell started CUDA is the process's fact, not this reporter's: it is kept on
        # the shell too, where the reporter that %reload_ext makes finds it.
        if self.cuda_start is None:
            self.cuda_start = getattr(ip, _CUDA_START, None)
        if wanted["post_run_cell"] and self.cuda_start is None and runtime_up("cuda"):
            self.cuda_start = CudaStart(None)  # up before we watched: which cell is unknown
        if self.cuda_start is not None:
            setattr(ip, _CUDA_START, self.cuda_start)
        self._watch_cuda = self.cuda_start is None and cuda_built()  # read once, not per cell

    def status(self) -> str:
        """On or off, the thresholds, synchronisation, the history's size; when on, what
        it does to torch's peak counter."""
        limits = [f"at least {fmt_seconds(self.min_seconds)}"] if self.min_seconds else []
        if self.min_bytes:
            limits.append(f"at least {fmt_bytes(self.min_bytes)}")
        shown = f"cells reaching {' or '.join(limits)}" if limits else "every cell"
        delay = self.live.delay_s
        live = f"live line after {fmt_seconds(delay)}" if delay else "live line off"
        line = (
            f"per-cell report: {'on' if self.registered else 'off'} ({shown}; "
            f"synchronise: {'on' if self.sync else 'off'}; {live}); "
            f"{plural(len(self.history), 'cell')} in the history (%devhistory)"
        )
        if not self.registered:
            return line
        return (
            f"{line}\n  It resets torch's process-wide peak memory counter before each cell, "
            "so max_memory_allocated() covers the last cell only; the session's peak is in "
            "%devhistory."
        )

    def adopt(self, measurement: Measurement) -> None:
        """Take `measurement` (from %%gpumem) as this cell's record, and show nothing more."""
        if len(self._open) == 1:  # in the outermost cell, not in a cell that it ran
            self._adopted = measurement

    def mark_profiled(self) -> None:
        """Say '(profiled)' in this cell's line (from %%profile), 'profiling' in its live line."""
        if len(self._open) == 1:
            self._profiled = True
            self.live.say("profiling")

    def say_live(self, label: str) -> None:
        """What the outermost cell is doing, first in its live line ('comparing 0:12')."""
        if len(self._open) == 1:
            self.live.say(label)

    def plain_run(
        self, source: str, reads: Collection[str] = ()
    ) -> tuple[float | None, str | None]:
        """The wall time of the last warm plain run of `source`'s code, and which cell that
        was ('In[4]'); (None, why not) where the only run known is the code's first (no
        earlier cell ran it, plainly or under a cell magic), which pays one-time costs;
        (None, None) where none is known.

        Found only when asked (by %%profile), from the history's cell numbers and the
        shell's raw inputs, comparing code without blank lines and trailing whitespace
        (IPython blanks a cell magic's whitespace-only lines). A cell run under a magic
        (%%profile, %%gpumem) has other text, so it is never taken. A run is not compared
        with where a later cell bound one of the names the code `reads` again, or changed
        one where it stands (`x.data = ...`, `x.resize_()`, `model.cuda()`: cells.
        names_changed): its inputs may have other shapes, dtypes or devices. Read from
        the later cells' text when asked, so that no cell pays for it; what a function
        changes out of sight is not seen."""
        inputs = getattr(getattr(self._shell, "history_manager", None), "input_hist_raw", None)
        if not inputs:
            return None, None
        code = _code(source)
        cold = None
        for record in reversed(self.history.records()):
            n = record.cell
            if n is None or not 0 < n < len(inputs) or _code(inputs[n]) != code:
                continue
            if any(_ran(earlier, code) for earlier in inputs[1:n]):
                later = self._shell.execution_count  # this cell's: not one after the run
                for k in range(n + 1, min(later, len(inputs))):
                    if _ran(inputs[k], code):  # this code again: as the run
                        continue
                    how = self._touched(inputs[k], reads)
                    if how:
                        return None, (
                            f"no plain run to compare with: In[{k}] {how} after In[{n}] ran "
                            "this code, so its inputs may differ (run the cell again without "
                            "%%profile: a training cell trains once more)")
                return record.wall_s, f"In[{n}]"
            cold = cold or n
        if cold is None:
            return None, None
        return None, (f"no plain run to compare with: In[{cold}] was this code's first run, "
                      "with one-time costs (run the cell again without %%profile, or "
                      "--warmup 1, which runs it once more first: either way a training cell "
                      "trains once more)")

    def _touched(self, source: str, names: Collection[str]) -> str | None:
        """What a cell's code (a cell magic's body too) did to one of `names`, in words:
        "bound x again", "changed x in place" (cells.names_changed), "moved every tensor"
        (`%device ... --move`), "moved x (%%ondevice cuda)" (without --restore, it keeps
        what the body reads on its device); None where nothing."""
        if any(line.startswith("%device") and "--move" in line for line in source.splitlines()):
            return "moved every tensor" if names else None
        first = source.partition("\n")[0]
        source = python_of(self._shell, source)[0]  # a (nested) cell magic's body of Python
        if first.startswith("%%ondevice") and "--restore" not in first:
            moved = sorted(cell_names(source) & set(names))
            if moved:  # the same objects, on another device since
                return f"moved {moved[0]} ({first.strip()})"
        bound = sorted(names_bound(source) & set(names))
        if bound:
            return f"bound {bound[0]} again"
        # A module of Python's (torch, np) is no input: torch.nn.init.zeros_(w) changes w
        ns = self._shell.user_ns
        values = {n: type(ns.get(n)) for n in names}
        inputs = {n for n, kind in values.items() if not issubclass(kind, types.ModuleType)}
        modules = {n for n in inputs if issubclass(values[n], torch.nn.Module)}
        changed = sorted(names_changed(source, inputs, modules))
        return f"changed {changed[0]} in place" if changed else None

    def pre_run_cell(self, info: object) -> None:
        self._loading = None  # a cell of its own: we were loaded outside a cell
        first = getattr(info, "raw_cell", "")[:1]
        if (first == "#" or first.isspace()) and only_comments(info.raw_cell):  # type: ignore[attr-defined]
            return  # it runs nothing: no line, as for a blank cell
        self._open.append(info)
        if len(self._open) > 1:
            return  # a cell run inside a cell: the outer one is measured
        self._adopted, self._fault, self._line_open, self._printing = None, None, False, False
        self._profiled = False
        try:
            self._printing = self._prints()  # once a cell: the cell's line goes the same way
            if self._printing:
                self._watch_stdout()
            assert self._meter is not None  # registered only with a meter
            self._meter.start()
            live = self.live  # the live line's sampler looks at `cell` (no call a cell)
            if not self._printing:
                live.on_kernel(self._shell.display_pub)
            live.cell = self._meter.started_s
            if live.idle:
                live.wake()
        except Exception as err:
            _log.debug("starting the measurement failed", exc_info=True)
            self._fault = f"torch_device_magic could not measure: {_describe(err)}"

    def _host_start_bytes(self) -> int | None:
        """RSS at the running cell's start (the live line's first tick asks)."""
        return getattr(getattr(self._meter, "host", None), "start_bytes", None)

    def post_run_cell(self, result: Any) -> None:
        try:  # one frame a cell; the live display the report did not replace is emptied
            # Not paired: a blank cell, the cell that loaded us, or no report (hints only).
            info = getattr(result, "info", None)
            cells = self._open
            if info is None:  # IPython failed before it made a result: the innermost cell ended
                at = len(cells) - 1 if cells else None
            elif cells and cells[-1] is info:  # the usual case: the innermost cell ended
                at = len(cells) - 1
            else:
                at = next((n for n, opened in enumerate(cells) if opened is info), None)
            if at is not None:
                del cells[at:]  # and any inner cell left open
            outermost = at == 0
            loading = self._loading
            if loading is not None:
                self._loading = None
            if self._watch_cuda and not cells and info is not None:
                self._note_cuda(result)  # before the hint, which names that cell
            measured = None
            if outermost:
                live = self.live
                live.cell = None  # then, where a tick ran: none after this, the line erased
                if live.touched is not None:
                    try:
                        self._live_ended = live.stop()
                    except Exception:
                        _log.debug("stopping the live line failed", exc_info=True)
                self._unwatch_stdout()
                try:
                    if self._fault is None and self._meter is not None:
                        measured = self._meter.stop()
                except KeyboardInterrupt:  # Ctrl-C while waiting for the device
                    self._fault = ("torch_device_magic: interrupted at the end of the cell; "
                                   "not measured")
                except Exception as err:
                    _log.debug("stopping the measurement failed", exc_info=True)
                    self._fault = f"torch_device_magic could not measure: {_describe(err)}"
            if self._hint is not None and getattr(result, "error_in_exec", None) is not None:
                self._show_hint(self._hint, result)
                if self._meter is not None:  # what the hint freed (an OOM's frames) is no cell's
                    self._meter.forget_stop()
            if loading is not None and at is None and not cells and info is not None:
                self._report_loading(loading, result)
            if not outermost or info is None or result.error_before_exec is not None:
                return  # a cell that never ran (a SyntaxError) has nothing to report
            try:
                if measured is not None:
                    if self.advise is not None and self._adopted is None:
                        measured.notes = self.advise(measured, result)
                    if self._live_ended is not None and self._live_ended.dropped:
                        measured.notes = (*measured.notes, *self._live_ended.dropped)
                    error = result.error_in_exec  # (no call on a cell that raised nothing)
                    self._record(measured, result.execution_count, error is not None
                                 and isinstance(error, KeyboardInterrupt))
            except Exception as err:
                _log.debug("recording the measurement failed", exc_info=True)
                self._fault = f"torch_device_magic could not measure: {_describe(err)}"
            if self._fault is not None:
                self._publish({"text/plain": self._fault})
        finally:
            if self._live_ended is not None:
                self._end_live(self._live_ended)

    def _end_live(self, ended: Ended) -> None:
        """Empty the live display that the report did not take the place of."""
        self._live_ended = None
        if ended.display is None:
            return
        try:
            publish(self._shell.display_pub, {"text/plain": ""}, ended.display.display_id)
        except Exception:
            _log.debug("the live line could not be emptied", exc_info=True)

    def _note_cuda(self, result: Any) -> None:
        """Note the cell after which CUDA is up: one cheap question a cell until then
        (`torch.cuda.is_initialized()`, never asked on a CPU build), none after."""
        if torch.cuda.is_initialized():
            raw = getattr(result.info, "raw_cell", "")
            self.cuda_start = CudaStart(result.execution_count, first_code_line(raw))
            self._watch_cuda = False

    def _report_loading(self, loading: tuple[float, int | None, int | None], result: Any) -> None:
        """The line of the cell that loaded us: from the start of loading to now."""
        if self._meter is None or "torch_device_magic" not in getattr(result.info, "raw_cell", ""):
            return  # the report is off, or not the loading cell (a blank one after a config load)
        started, rss0, hwm0 = loading
        wall_s = clock() - started
        now = rss_and_high_water()
        delta = peak = None
        if rss0 is not None and now is not None:
            rss, hwm = now
            delta = rss - rss0
            peak = max(0, delta, max(hwm, hwm0 or 0) - rss0)
        try:
            self._printing, self._line_open = self._prints(), False
            self._record(Measurement(wall_s, host_delta_bytes=delta, host_peak_bytes=peak),
                         result.execution_count)
        except Exception:
            _log.debug("the loading cell's line failed", exc_info=True)

    def _show_hint(self, hint: Callable[[BaseException, str], str | None], result: Any) -> None:
        """Print the hint for the cell's error under its traceback; a fault here shows
        nothing in the cell, and is logged at debug level."""
        try:
            text = hint(result.error_in_exec, getattr(result.info, "raw_cell", ""))
        except Exception:  # a bug of ours, or a user's object that raises when looked at
            _log.debug("the hint for %r failed", type(result.error_in_exec), exc_info=True)
            return
        if text:
            print(text)

    def _record(self, measured: Measurement, cell: int | None, interrupted: bool = False) -> None:
        """Keep the cell's record and show its line; `interrupted`: the cell ended with
        Ctrl-C, and its line says so."""
        adopted, self._adopted = self._adopted, None
        record = adopted or measured
        record.cell = cell
        self.history.append(record)
        if adopted is None and self.shows(record):
            note = " (profiled)" if self._profiled else ""
            if interrupted:
                note += " (interrupted)"
            ended = self._live_ended
            if ended is not None:
                self._show_after_live(record, note, ended)
            elif self._printing:
                self._print(record.text(note))
            else:
                publish(self._shell.display_pub, record.bundle(note))

    def _show_after_live(self, record: Measurement, note: str, ended: Ended) -> None:
        """The report of a cell whose live line ticked: with its memory pictures, in the
        live display's place where the cell wrote nothing under it."""
        pictures = ended.pictures(record.wall_s)
        if self._printing:
            self._print("\n".join([record.text(note), *(text for text, _ in pictures)]))
            return
        bundle = record.bundle(note)
        if pictures:
            bundle = _with_pictures(bundle, pictures)
        if ended.display is not None and ended.replace:
            self._live_ended = None  # in place: the display becomes the report
            publish(self._shell.display_pub, bundle, ended.display.display_id)
        else:
            publish(self._shell.display_pub, bundle)

    def shows(self, record: Measurement) -> bool:
        """Whether `record` reaches a set threshold (every record does when none is set)."""
        if (not self.min_seconds and not self.min_bytes) or record.device_error is not None or (
            record.notes
        ):
            return True  # an error the cell's kernels raised, and a note, are always said
        return bool(
            (self.min_seconds and record.wall_s >= self.min_seconds)
            or (self.min_bytes and record.largest_bytes() >= self.min_bytes)
        )

    def _prints(self) -> bool:
        """Whether the line is printed: IPython's own terminal publisher would print the
        text and nothing else."""
        shell = self._shell
        return type(shell.display_pub).publish is DisplayPublisher.publish and not getattr(
            shell, "mime_renderers", None
        )

    def _publish(self, bundle: dict[str, str]) -> None:
        try:
            if self._printing:
                self._print(bundle["text/plain"])
            else:
                publish(self._shell.display_pub, bundle)
        except Exception:  # nowhere to show it: the record is kept
            _log.debug("the report line could not be shown", exc_info=True)

    def _print(self, text: str) -> None:
        """One write (not print's two), on a line of its own."""
        sys.stdout.write(("\n" if self._line_open else "") + text + "\n")
        self._line_open = False

    def _watch_stdout(self) -> None:
        """Wrap `sys.stdout.write` for this cell, to learn whether its output ends a line."""
        stream = sys.stdout
        write = stream.write

        def watched(text: str, *args: Any, **kwargs: Any) -> Any:
            if text:
                self._line_open = not text.endswith("\n")
            return write(text, *args, **kwargs)

        had_own = "write" in getattr(stream, "__dict__", ())  # IPython 9 wraps it too
        try:
            stream.write = watched  # type: ignore[method-assign]  # undone after the cell
        except (AttributeError, TypeError):  # a stream that cannot be wrapped: not watched
            return
        self._stdout_watch = (stream, write, watched, had_own)

    def _unwatch_stdout(self) -> None:
        watch, self._stdout_watch = self._stdout_watch, None
        if watch is None:
            return
        stream, write, watched, had_own = watch
        if getattr(stream, "__dict__", _NO_ATTRIBUTES).get("write") is not watched:
            return  # wrapped again over ours and not put back: leave it as it is
        if had_own:
            stream.write = write
        else:
            del stream.write


def _with_pictures(bundle: dict[str, str], pictures: list[tuple[str, str]]) -> dict[str, str]:
    """The report's bundle with the live line's pictures of memory under it."""
    page = bundle["text/html"]
    cut = page.rindex("</div>")  # inside the report's own div
    return {
        "text/plain": "\n".join([bundle["text/plain"], *(text for text, _ in pictures)]),
        "text/html": page[:cut] + "".join(svg for _, svg in pictures) + page[cut:],
    }


def _code(source: str) -> str:
    """A cell's code for comparison: no blank lines, no trailing whitespace."""
    return "\n".join(line.rstrip() for line in source.splitlines() if line.strip())


def _ran(source: str, code: str) -> bool:
    """Whether a cell ran `code`: as it is, or as a cell magic's body (%%profile, %%time)."""
    if source.startswith("%%"):
        source = source.partition("\n")[2]
    return _code(source) == code


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def is_ours(callback: object) -> bool:
    """A bound method of an object defined in this package (any instance, any reload)."""
    owner = getattr(callback, "__self__", None)
    return type(owner).__module__.startswith("torch_device_magic.")
