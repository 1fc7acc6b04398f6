"""The recording: torch.profiler's sessions of one capture, paused and resumed, watched for
another profiler, read as one (`Recording`, `Pieces`)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..errors import DeviceMagicError, first_sentence
from ..kineto.events import Event, from_kineto
from ..probes import active_accelerator
from .stderr import quiet_stderr


def refuse_if_recording(active: bool) -> None:
    """`%%profile` under `%%profile`, or under a torch.profiler the user started, is refused."""
    if active:
        raise DeviceMagicError("%%profile cannot run inside %%profile: profile the outer cell")
    if torch.autograd.profiler._is_profiler_enabled or torch.autograd._profiler_enabled():
        raise DeviceMagicError(
            "%%profile: a torch.profiler is already recording; stop it first (prof.stop(), or "
            "leave its `with` block)"
        )


def sync() -> None:
    accel = active_accelerator()
    if accel is not None:
        accel.synchronize()


def _profiler(cuda: bool, threads: bool = False) -> Any:
    """torch's profiler, recording CUDA only where asked, and every thread of the process
    with `threads` (else the cell's own thread, and autograd's for its backward). Each
    `start()` after a `stop()` begins a session of its own (`Recording` keeps each)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    extra = {"experimental_config": ALL_THREADS} if threads else {}
    prof = profile(activities=activities, record_shapes=True, profile_memory=True, **extra)
    prof.record_steps = False  # its ProfilerStep ranges would be rows of the op table
    return prof


def _release(prof: Any) -> None:
    """Break torch.profiler.profile's reference cycle (its `action_map` holds its own bound
    methods), so that kineto's record goes with the last reference to the profiler (the
    report's, with -o) instead of waiting for a full garbage collection."""
    prof.action_map = {}


def _all_threads_config() -> Any:
    """torch's experimental config that records every thread; None where it has none.

    In torch 2.13 a profiler so configured records no memory events at all (pytorch
    issue 166121), so it is used only where asked (`--threads`)."""
    try:
        return torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # an older torch: the option is not there
        return None


ALL_THREADS = _all_threads_config()


class Recording:
    """Our kineto sessions, from the first start to the last stop.

    The line tracer pauses the recording (a session stopped, kept in `pieces`) where a
    loop's steps run past the window, and resumes it (a new session) where the code
    outside them runs; the report reads every piece.

    torch records one profile at a time: a profiler the cell prepares or starts (its own
    `with torch.profiler.profile()`, a library's) ends ours, and reading or exporting a
    session something else ended crashes the process. So torch's entry points are
    watched while we record, or pause; where another profiler came, ours is neither
    stopped, resumed nor read (one that still records is the cell's, and keeps
    recording), and `stop` says why there is no profile."""

    _ENTRIES = ("_prepare_profiler", "_enable_profiler")  # torch.autograd.profiler's

    def __init__(self, prof: Any, heard: list[str], cuda: bool = False) -> None:
        self.prof, self.heard = prof, heard
        self.cuda = cuda  # the profiler records CUDA: a pause waits for its queued work
        self.other = False  # another profiler was prepared or started while we recorded
        # stops our line tracer, whose ranges would land in the cell's profile
        self.stop_tracer: Callable[[], None] | None = None
        self.paused = False  # the tracer stopped, as another profiler came
        self.thread = threading.get_ident()  # the cell's: where `stop_tracer` works
        self.real: dict[str, Any] = {}
        self.spare: list[torch.Tensor] = []
        self.flagged = True
        self.own = False  # we are pausing or resuming our own recording
        self.running = False  # a session of ours records
        self.pieces: list[Any] = []  # each session's torch.autograd.profiler.profile, stopped
        self.to_end = True  # the last session recorded to the end (the cell ended unpaused)
        # the seconds of torch's profiler's first start in this process, where this
        # recording made it (it imports torch._dynamo and sympy: a second or so, once)
        self.first_start_s: float | None = None

    def start(self) -> None:
        """Start recording (DeviceMagicError where torch refuses; nothing is left on then);
        what torch warned goes to `heard` ('CUDA is not available, disabling CUDA
        profiling'), not to the user."""
        # blocks of their own, made in one call (a Python loop takes several times longer)
        blocks = list(torch._foreach_neg([torch.zeros(1, device="cpu")] * _WARN_EVERY))
        try:
            self._start(blocks)
        except RuntimeError as err:  # kineto refused (another profiler, a broken build)
            raise DeviceMagicError(
                f"%%profile could not start torch.profiler: {first_sentence(err)}"
            ) from None
        # torch's flag, as the start left it: a profiler of every thread (--threads) keeps
        # its state process-wide and leaves the flag off
        self.flagged = torch.autograd._profiler_enabled()
        module = torch.autograd.profiler
        for name in self._ENTRIES:
            real = getattr(module, name, None)
            if real is not None:
                self.real[name] = real
                setattr(module, name, self._watched(real))

    def _start(self, blocks: list[torch.Tensor]) -> None:
        """A session of ours begins; where `blocks`, torch's warning is spent on them. Where
        torch refuses, its flag is put back off (it sets it before kineto starts): the first
        start and a resume mid-cell alike, or every later %%profile is refused."""
        with warnings.catch_warnings(record=True) as warned, quiet_stderr(self.heard) as caught:
            warnings.simplefilter("always")
            first = not _started
            t0 = time.perf_counter()
            try:
                self.prof.start()
                _mark_started()
                if first:
                    self.first_start_s = time.perf_counter() - t0
            except BaseException:
                if not torch.autograd._profiler_enabled():
                    torch.autograd.profiler._is_profiler_enabled = False
                raise
            self.running = True
            if caught and blocks:
                self.spare = _spend_unknown_block_warning(blocks)
        self.heard.extend(str(w.message) for w in warned)

    def pause(self) -> None:
        """Stop our session mid-cell and keep it (the tracer's: past a loop's window)."""
        if self.other or not self.running:
            return
        self.own = True
        try:
            if self.cuda:  # so that the kernels the session launched end in its record
                sync()
            with quiet_stderr(self.heard):  # a Ctrl-C held comes after the state is set
                self.prof.stop()
                self.running = False
                self.pieces.append(self.prof.profiler)
        finally:
            self.own = False

    def resume(self) -> None:
        """Begin a new session of ours (the tracer's: where code outside the steps runs).
        torch's warning is not spent again (a thousand frees, milliseconds): the first
        start left it 999 frees of blocks it cannot size away, and only the frees while
        we record count."""
        if self.other or self.running:
            return
        self.own = True
        try:
            self._start([])
        finally:
            self.own = False

    def _watched(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def entry(*args: Any, **kwargs: Any) -> Any:
            if self.own:
                return real(*args, **kwargs)
            if (self.stop_tracer is not None and not self.paused
                    and threading.get_ident() == self.thread):
                self.stop_tracer()
                self.paused = True
            self.other = True
            return real(*args, **kwargs)

        return entry

    def stop(self) -> str | None:
        """Stop recording; None, or the sentence that says why there is nothing to read."""
        module = torch.autograd.profiler
        for name, real in self.real.items():
            setattr(module, name, real)
        self.real.clear()
        try:
            # off: as the start left it (--threads), or paused by us
            on = torch.autograd._profiler_enabled() or not self.flagged or not self.running
            if self.other or not on:
                if not on:  # ended, by the cell's profiler or by torch: its flag too
                    module._is_profiler_enabled = False
                self.pieces.clear()
                return ("%%profile: the cell's own torch.profiler ended this recording "
                        "(torch runs one at a time), so there is no profile of this cell; "
                        "its own profiler works as without %%profile")
            self.to_end = self.running
            if self.running:
                with quiet_stderr(self.heard):
                    self.prof.stop()
                    self.running = False
                    self.pieces.append(self.prof.profiler)
            return None
        finally:
            _release(self.prof)
            self.spare.clear()  # freed once nothing records: they count no more


_TAIL = 8192  # bytes: kineto's trace ends `}\n  ],"traceName": "PATH" }`

_started = False  # a recording of ours started torch's profiler in this process


def _mark_started() -> None:
    global _started
    _started = True


_WARN_EVERY = 1000  # torch's CPU allocator warns once per this many frees it cannot size


def _spend_unknown_block_warning(blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Free `blocks` (made before the start) one by one while descriptor 2 is caught,
    until torch's allocator has said "Memory block of unknown size was allocated before
    the profiling started": it says so once per `_WARN_EVERY` such frees, and a cell
    rebinding a tensor made earlier frees one, while descriptor 2 is the user's again.
    The rest are returned, to be freed after the stop."""
    size = os.fstat(2).st_size
    while blocks:
        blocks.pop()
        if os.fstat(2).st_size != size:
            break
    return blocks


class Pieces:
    """The sessions of one capture (`Recording.pieces`) read as one: their events on the
    first one's clock, one trace, one event tree."""

    def __init__(self, pieces: list[Any], to_end: bool = True) -> None:
        self.pieces = pieces
        self.to_end = to_end  # the last session recorded to the cell's end (not paused)

    def events(self) -> list[list[Event]]:
        """Each session's events, on the first one's clock."""
        if not self.pieces:
            return []
        origin = self.pieces[0].kineto_results.trace_start_ns()
        return [from_kineto(piece.kineto_results, origin) for piece in self.pieces]

    def export_chrome_trace(self, path: str) -> None:
        """One trace file (gzipped where `path` ends in .gz, as torch's): the sessions'
        events together (kineto stamps them all from one base time). The first session,
        the largest (the steps window's), is kineto's file as it wrote it, never parsed
        again: the later sessions' events are spliced in before its events' list ends."""
        if not self.pieces:
            raise RuntimeError("nothing was recorded")
        if path.endswith(".gz"):
            with tempfile.TemporaryDirectory() as folder:
                plain = os.path.join(folder, "trace.json")
                self._export(plain)
                with open(plain, "rb") as f, gzip.open(path, "wb") as out:
                    shutil.copyfileobj(f, out)
            return
        self._export(path)

    def _export(self, path: str) -> None:
        self.pieces[0].export_chrome_trace(path)  # kineto's JSON, whatever the name
        if len(self.pieces) == 1:
            return
        later: list[Any] = []
        with tempfile.TemporaryDirectory() as folder:
            part = os.path.join(folder, "part.json")
            for piece in self.pieces[1:]:
                piece.export_chrome_trace(part)
                with open(part) as f:
                    # not the metadata, the first session's
                    later += [e for e in json.load(f)["traceEvents"] if e.get("ph") != "M"]
        with open(path, "r+b") as out:
            size = out.seek(0, os.SEEK_END)
            out.seek(max(size - _TAIL, 0))
            tail = out.read()
            # the list's end: the last "]" before "traceName" (whose path may hold one)
            end = tail.rfind(b"]", 0, max(tail.rfind(b'"traceName"'), 0))
            if end < 0:
                raise ValueError("kineto's trace ends in an unknown form")
            out.seek(size - len(tail) + end)
            out.truncate()
            events = json.dumps(later, separators=(",", ":"))[1:-1]
            out.write(b"," + events.encode() + tail[end:])

    def trees(self) -> list[list[Any]]:
        """Each session's event tree (memtimeline's)."""
        return [p.kineto_results.experimental_event_tree() for p in self.pieces]
