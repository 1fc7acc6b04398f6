"""The cell's other processes: which it had, and what they used (read, not decided).

    watch = ChildWatch()
    watch.start(); loader_epoch(); found = watch.stop()
    found.count, found.peak_bytes     # 2 DataLoader workers, the larger one's peak

A cell's workers are the child processes it had: those forked during it (seen
as they fork, through `os.register_at_fork`), those alive at its end that are
new or used CPU time during it, and their own children (a launched process's
DataLoader workers). Per live worker, at the end of the cell: its RSS
high-water mark (`VmHWM`, reset at the cell's start for one alive then) and its
PSS (`/proc/PID/smaps_rollup`: pages shared between processes split between
them, where summed RSS would count copy-on-write pages once per worker).
Workers that exited before the end are seen through
`getrusage(RUSAGE_CHILDREN)`, which keeps only the largest peak of any child
ever reaped: the cell's own largest is known exactly when it rose during the
cell, else only as "at most" that figure.

What a cell without children pays: nothing read, only a few attribute checks.
Children are known from their fork (`os.register_at_fork`: multiprocessing's
fork start method, DataLoader workers, `notebook_launcher`, Jupyter's `!cmd`),
from multiprocessing's own list of running children (spawn, forkserver), and
from the last look; only then is this thread's `/proc/self/task/TID/children`
read, and `getrusage`. So a process started otherwise (`subprocess.Popen`,
`os.system`) is seen only in a cell where other children are known. Where that
file is missing (a kernel without CONFIG_PROC_CHILDREN), forked children are
still seen (psutil's listing walks every process: milliseconds, too slow for
every cell); without /proc (macOS, Windows) nothing is read and the count is
None.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

try:
    import resource
except ImportError:  # Windows: no reaped-children figures
    resource = None  # type: ignore[assignment]

_log = logging.getLogger(__name__)
_KIB = 1024
_MAXRSS_UNIT = 1 if sys.platform == "darwin" else _KIB  # ru_maxrss: bytes on macOS, else KiB


@dataclass(frozen=True, slots=True)
class Worker:
    """One process of the cell's, as read at the end of the cell."""

    pid: int
    peak_bytes: int | None  # RSS high-water mark; None: exited (only getrusage knows)
    pss_bytes: int | None = None  # at the end of the cell; None: exited, or not readable
    device_bytes: int | None = None  # GPU memory NVML lists for it; None: none listed
    exited: bool = False


@dataclass(frozen=True, slots=True)
class Workers:
    """What a cell's workers used; see the module docstring for how each figure is read."""

    processes: tuple[Worker, ...] = ()
    exited_peak_bytes: int | None = None  # the largest exited worker's peak (getrusage)
    exited_peak_bound: bool = False  # True: exited_peak_bytes is only an upper bound
    uncounted: bool = False  # an exit no listed process explains: more workers than counted
    device_note: str | None = None  # why no device figure per worker (NVML's pids)

    @property
    def count(self) -> int:
        return len(self.processes) + self.uncounted

    @property
    def exited(self) -> int:
        return sum(w.exited for w in self.processes) + self.uncounted

    @property
    def peak_bytes(self) -> int | None:
        """The largest worker's peak; with `peak_bound`, only known not to exceed it."""
        peaks = [w.peak_bytes for w in self.processes if w.peak_bytes is not None]
        if self.exited_peak_bytes is not None:
            peaks.append(self.exited_peak_bytes)
        return max(peaks, default=None)

    @property
    def peak_bound(self) -> bool:
        live = max((w.peak_bytes or 0 for w in self.processes), default=0)
        return self.exited_peak_bound and (self.exited_peak_bytes or 0) > live

    @property
    def pss_bytes(self) -> int | None:
        """Total PSS of the workers alive at the end; None where none was read."""
        found = [w.pss_bytes for w in self.processes if w.pss_bytes is not None]
        return sum(found) if found else None

    @property
    def device_bytes(self) -> int | None:
        found = [w.device_bytes for w in self.processes if w.device_bytes is not None]
        return sum(found) if found else None


NONE = Workers()


class _Proc:
    """One live descendant, its /proc files kept open (a read of an fd whose process
    is gone fails, so a reused pid is never misread)."""

    __slots__ = ("fds", "new", "pid", "ticks")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fds: dict[str, int] = {}
        self.ticks: int | None = None  # CPU time at the cell's start
        self.new = True  # not alive at the cell's start

    def read(self, name: str, size: int = 4096) -> bytes:
        fd = self.fds.get(name)
        if fd is None:
            fd = self.fds[name] = os.open(f"/proc/{self.pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        return os.pread(fd, size, 0)

    def children(self) -> list[int]:
        return [int(p) for p in self.read(f"task/{self.pid}/children").split()]

    def cpu_ticks(self) -> int:
        fields = self.read("stat").rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    def reset_peak(self) -> None:
        fd = os.open(f"/proc/{self.pid}/clear_refs", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"5")
        finally:
            os.close(fd)

    def status(self) -> tuple[bool, int | None]:
        """(alive, VmHWM in bytes): a zombie (exited, not yet reaped) has no memory."""
        status = self.read("status")
        if b"\nState:\tZ" in status or b"\nState:\tX" in status:
            return False, None
        return True, _kib(status, b"VmHWM:")

    def pss(self) -> int | None:
        return _kib(self.read("smaps_rollup", 8192), b"\nPss:")

    def close(self) -> None:
        for fd in self.fds.values():
            _or_none(os.close, fd)
        self.fds.clear()


def _kib(text: bytes, key: bytes) -> int | None:
    at = text.find(key)
    if at < 0:
        return None
    start = at + len(key)
    return int(text[start : text.index(b"kB", start)]) * _KIB


def _usage() -> tuple[int, float, int]:
    """Reaped children so far: (largest peak in bytes, CPU seconds, minor faults); the
    last two grow with every child reaped, the first only with a larger one."""
    if resource is None:
        return (0, 0.0, 0)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (ru.ru_maxrss * _MAXRSS_UNIT, ru.ru_utime + ru.ru_stime, ru.ru_minflt)


class ChildWatch:
    """The cell's workers between `start()` and `stop()`; every read is guarded."""

    # Linux (/proc with each thread's children, and getrusage); elsewhere nothing is read
    sees = resource is not None and os.path.isdir("/proc/self/task")

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._children_fds: dict[int, int | None] = {}  # thread ident -> its children file
        self._ident: int | None = None  # the thread whose file `_fd` is
        self._fd: int | None = None
        self._live: dict[int, _Proc] = {}  # descendants alive at the last look
        self._roots: set[int] = set()  # of them, our own children (the walk starts there)
        self._forked: set[int] = set()  # pids forked since the last start (or stop)
        self._usage = _guarded_usage()
        if self.sees:
            _watches.add(self)
            _register_fork_handler()

    # --- per cell -------------------------------------------------------------------------

    def start(self) -> None:
        """Only where children were known (alive at the last look, or forked since) is
        anything read: which are alive, their CPU time, their peaks reset, and the
        reaped children's figures to compare with at the end."""
        if not self._live and not self._forked:
            return
        forked, self._forked = self._forked, set()
        try:
            live = self._tree(self._roots | forked)
            for proc in live.values():
                proc.new = False
                proc.ticks = _or_none(proc.cpu_ticks)
                _or_none(proc.reset_peak)
            self._live = live
        except Exception:
            _log.debug("reading the children at the start failed", exc_info=True)
        self._usage = _guarded_usage()

    def stop(self) -> Workers:
        """The cell's workers, as they are now (NONE, at once, for a cell without).

        Without a child known (none forked, none alive at the last look, no
        multiprocessing child running) nothing is read. Otherwise this thread's
        children file is read, and the reaped children's figures, whose starting
        point was read at the start or at the cell's first fork."""
        if not (self._live or self._forked or (self.sees and _mp_children())):
            return NONE  # the usual: no child known, nothing read
        listed = self._listed()
        before = self._usage
        usage = self._usage = _guarded_usage()
        try:
            pids = {int(p) for p in listed.split()} | self._roots | _mp_pids()
            return self._read(before, usage, pids)
        except Exception:
            _log.debug("reading the workers failed", exc_info=True)
            self._live, self._roots, self._forked = {}, set(), set()
            return NONE

    def _read(self, before: tuple, usage: tuple, pids: set[int]) -> Workers:
        forked, self._forked = self._forked, set()
        old = self._live
        live = self._tree(pids | forked)
        gone = (set(old) | forked) - set(live)
        workers = []
        for proc in live.values():
            alive, peak = _or_none(proc.status) or (False, None)
            if not alive:
                gone.add(proc.pid)
                continue
            if not proc.new and proc.ticks is not None and proc.ticks == _or_none(
                proc.cpu_ticks
            ):
                continue  # alive all through the cell, and idle in it: not its worker
            workers.append(Worker(proc.pid, peak, _or_none(proc.pss)))
        self._live = {pid: p for pid, p in live.items() if pid not in gone}
        self._roots -= gone
        for pid in gone:
            if pid in live:
                live[pid].close()
            if pid in old:
                old[pid].close()
        workers += [Worker(pid, None, exited=True) for pid in sorted(gone)]
        reaped = usage[1:] != before[1:]  # a child of ours was reaped during the cell
        return Workers(
            tuple(workers),
            exited_peak_bytes=usage[0] if reaped else None,
            exited_peak_bound=reaped and usage[0] <= before[0],
            uncounted=reaped and not gone,
        )

    def _tree(self, pids: set[int]) -> dict[int, _Proc]:
        """The processes of `pids` (our children) still there and all their descendants,
        by pid; a grandchild whose parent died is not ours any more, so not found."""
        self._roots = set()
        found: dict[int, _Proc] = {}
        todo = list(pids)
        while todo:
            pid = todo.pop()
            if pid in found or pid == self._pid:
                continue
            proc = self._live.get(pid) or _Proc(pid)
            try:
                todo += proc.children()
            except OSError:  # gone (or not ours to read)
                proc.close()
                continue
            found[pid] = proc
            if pid in pids:
                self._roots.add(pid)
        return found

    def _listed(self) -> bytes:
        """This thread's children ("pid pid "), from the file kept open for it (b"" where
        it is missing)."""
        if threading.get_ident() != self._ident:
            self._open_children()
        if self._fd is None:
            return b""
        try:
            return os.pread(self._fd, 4096, 0)
        except OSError:
            return b""

    def _open_children(self) -> None:
        """Keep the calling thread's children file open (threads keep their own)."""
        self._ident = threading.get_ident()
        fd = self._children_fds.get(self._ident, -1)
        if fd == -1:
            path = f"/proc/self/task/{threading.get_native_id()}/children"
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:  # no CONFIG_PROC_CHILDREN, or no /proc: forks and exits only
                fd = None
            self._children_fds[self._ident] = fd
        self._fd = fd

    def close(self) -> None:
        for proc in self._live.values():
            proc.close()
        self._live, self._roots = {}, set()
        for fd in self._children_fds.values():
            if fd is not None:
                _or_none(os.close, fd)
        self._children_fds, self._ident, self._fd = {}, None, None
        _watches.discard(self)

    # --- forks ----------------------------------------------------------------------------

    def _after_fork_in_parent(self) -> None:
        """Note the child just forked (the forking thread's children, read now)."""
        if not self._forked:  # the cell's first: what was reaped before it is not the cell's
            self._usage = _guarded_usage()
        path = f"/proc/self/task/{threading.get_native_id()}/children"
        with open(path, "rb") as f:
            self._forked.update(int(p) for p in f.read().split())

    def _after_fork_in_child(self) -> None:
        """A forked child starts with no children, and its files must be its own."""
        self._pid = os.getpid()
        self._live, self._roots, self._forked = {}, set(), set()
        # inherited fds name the parent's files: left open, never read in the child
        self._children_fds, self._ident, self._fd = {}, None, None
        self._usage = _guarded_usage()


def _or_none(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, or None where /proc refuses (a process gone, a file missing)."""
    try:
        return fn(*args)
    except (OSError, ValueError, IndexError):
        return None


def _guarded_usage() -> tuple[int, float, int]:
    try:
        return _usage()
    except (OSError, ValueError):
        return (0, 0.0, 0)


def _mp_children() -> Any:
    """multiprocessing's running children (any start method), if it is imported: a
    spawned or forkserver worker is not forked here, so only this says it is there."""
    process = sys.modules.get("multiprocessing.process")
    return None if process is None else getattr(process, "_children", None)


def _mp_pids() -> set[int]:
    return {p.pid for p in list(_mp_children() or ()) if p.pid is not None}


_watches: weakref.WeakSet[ChildWatch] = weakref.WeakSet()
_fork_handler_registered = False


def _in_parent() -> None:
    for watch in list(_watches):
        try:
            watch._after_fork_in_parent()
        except Exception:  # never break a fork
            _log.debug("noting a forked child failed", exc_info=True)


def _in_child() -> None:
    for watch in list(_watches):
        try:
            watch._after_fork_in_child()
        except Exception:
            _log.debug("resetting the watch in a forked child failed", exc_info=True)


def _register_fork_handler() -> None:
    """Once per process (it cannot be undone); it does nothing while no watch exists."""
    global _fork_handler_registered
    if not _fork_handler_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_parent=_in_parent, after_in_child=_in_child)
        _fork_handler_registered = True


def with_device_memory(found: Workers, per_pid: dict[int, int]) -> Workers:
    """`found` with each live worker's GPU memory from NVML's per-process list; where the
    list names processes but none of ours (inside a container NVML lists the host's
    process ids), a note says so instead of showing zeros."""
    live = {w.pid for w in found.processes if not w.exited}
    if not live:
        return found
    if per_pid and not (live | {os.getpid()}) & per_pid.keys():
        return replace(found, device_note=CONTAINER_NOTE)
    return replace(found, processes=tuple(
        w if w.exited else replace(w, device_bytes=per_pid.get(w.pid)) for w in found.processes
    ))


CONTAINER_NOTE = "GPU n/a: NVML lists no process of this machine's ids (a container?)"
