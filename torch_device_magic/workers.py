"""The cell's other processes: which it had, and what they used (read, not decided).

    watch = ChildWatch()
    watch.start(); loader_epoch(); found = watch.stop()
    found.count, found.peak_bytes     # 2 DataLoader workers, the larger one's peak

A cell's workers are the child processes it had: those forked during it (seen
as they fork, through `os.register_at_fork`), those alive at its end that are
new or used CPU time during it, those that exited during it, and their own
children (a launched process's DataLoader workers). multiprocessing's own
helpers (the resource tracker, the forkserver) are not workers. A process is
known by its pid and its start time (`/proc/PID/stat`), so a pid the kernel
hands out again is a new process. Per live worker, at the end of the cell: its
RSS high-water mark (`VmHWM`, reset at the cell's start for one alive then) and
its PSS (`/proc/PID/smaps_rollup`: pages shared between processes split between
them, where summed RSS would count copy-on-write pages once per worker).
Workers that exited before the end are seen through
`getrusage(RUSAGE_CHILDREN)`, which keeps only the largest peak of any child
ever reaped: the cell's own largest is known exactly when it rose during the
cell, else only as "at most" that figure. A child that exited but is not yet
reaped (a zombie) is counted in the cell it exited in, never again.

What a cell pays without a child known (none alive or unreaped at the last look,
none forked since): nothing read where it ran under 100 µs (no process is
started and reaped in less); else this thread's `/proc/self/task/TID/children`
(kept open) and `getrusage`, which show a `subprocess.Popen` while it runs and
a `subprocess.run` or `os.system` child once reaped, and multiprocessing's list
of running children (spawn, forkserver). Where that file is missing (a kernel
without CONFIG_PROC_CHILDREN), forked and reaped children are still seen
(psutil's listing walks every process: milliseconds, too slow for every cell);
without /proc (macOS, Windows) nothing is read and a cell records no workers.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .units import fmt_bytes

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
    exit_code: int | None = None  # exited: as Popen's returncode (-9: SIGKILL); None: not known


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

    def figures(self) -> CellWorkers | None:
        """What the cell's record keeps of them; None for a cell without workers."""
        if not self.count:
            return None
        return CellWorkers(
            self.count, self.exited, self.uncounted, self.peak_bytes, self.peak_bound,
            self.pss_bytes, self.device_bytes, self.device_note,
            tuple(w.exit_code for w in self.processes if w.exit_code is not None),
        )


@dataclass(frozen=True, slots=True)
class CellWorkers:
    """A cell's workers in its record (`Measurement.workers`): what the line shows."""

    count: int  # processes the cell had, exited ones included
    exited: int = 0  # of them, exited before the end of the cell
    uncounted: bool = False  # True: an exit no listed process explains (more than counted)
    peak_bytes: int | None = None  # the largest one's RSS high-water mark
    peak_bound: bool = False  # True: an exited one's, known only as at most this
    pss_bytes: int | None = None  # total PSS of those alive at the end
    device_bytes: int | None = None  # their GPU memory at the end (NVML)
    note: str | None = None  # why a worker figure could not be read
    exit_codes: tuple[int, ...] = ()  # of the exited ones, those known (a zombie's, read)

    def summary(self) -> str:
        """'2 (exited), largest peak 412.0 MiB', '3 (1 exited), largest peak ≤ 1.0 GiB, PSS
        80.0 MiB', '2 (exited: codes 1, -9), largest peak 1.2 GiB'."""
        state = (
            "" if not self.exited
            else " (exited" if self.exited >= self.count
            else f" ({self.exited} exited"
        )
        state += f"{self._codes()})" if state else ""
        bound = "≤ " if self.peak_bound else ""
        text = (
            f"{self.count}{'+' if self.uncounted else ''}{state}, "
            f"largest peak {bound}{fmt_bytes(self.peak_bytes)}"
        )
        if self.pss_bytes is not None:
            text += f", PSS {fmt_bytes(self.pss_bytes)}"
        if self.device_bytes is not None:
            text += f", GPU {fmt_bytes(self.device_bytes)}"
        return text if self.note is None else f"{text} ({self.note})"

    def _codes(self) -> str:
        """': codes 1, -9' where a known exit code is not 0 (an unknown one reads '?'): a
        worker that died says so, where a cell waiting on it would say nothing. Else
        nothing: a worker the cell's own code waited for (a join) has no code left to
        read, and the code that waited has it (a DataLoader's, every epoch)."""
        if not any(self.exit_codes):
            return ""
        shown = [*map(str, self.exit_codes), *["?"] * (self.exited - len(self.exit_codes))]
        return f": code{'s' if len(shown) > 1 else ''} {', '.join(shown)}"


NONE = Workers()


class _Proc:
    """One live descendant, its /proc files kept open (a read of an fd whose process
    is gone fails, so a reused pid is never misread), known by `key`: (pid, start)."""

    __slots__ = ("fds", "new", "parent", "peak", "pid", "start", "ticks")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fds: dict[str, int] = {}
        self.ticks: int | None = None  # CPU time at the cell's start
        self.new = True  # not alive at the cell's start
        self.peak: int | None = None  # VmHWM at the last look
        try:  # OSError where there is no such process
            fields = _stat_fields(self.read("stat"))
        except OSError:
            self.close()
            raise
        self.parent = int(fields[1])
        self.start = int(fields[19])  # field 22: clock ticks after boot

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start)

    def read(self, name: str, size: int = 4096) -> bytes:
        fd = self.fds.get(name)
        if fd is None:
            fd = self.fds[name] = os.open(f"/proc/{self.pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        return os.pread(fd, size, 0)

    def children(self) -> list[int]:
        return [int(p) for p in self.read(f"task/{self.pid}/children").split()]

    def cpu_ticks(self) -> int:
        fields = _stat_fields(self.read("stat"))
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

    def exit_code(self) -> int:
        """A zombie's exit code, as Popen's returncode (stat's field 52, Linux 3.5 on)."""
        return os.waitstatus_to_exitcode(int(_stat_fields(self.read("stat"))[49]))

    def close(self) -> None:
        for fd in self.fds.values():
            _or_none(os.close, fd)
        self.fds.clear()


def _stat_fields(stat: bytes) -> list[bytes]:
    """/proc/PID/stat's fields from the third (state) on: the name before may hold spaces."""
    return stat.rsplit(b")", 1)[1].split()


def _kib(text: bytes, key: bytes) -> int | None:
    at = text.find(key)
    if at < 0:
        return None
    start = at + len(key)
    return int(text[start : text.index(b"kB", start)]) * _KIB


def _own_peak_bytes() -> int:
    """This process's RSS high-water mark (reset at the cell's start). A child's getrusage
    peak counts the pages it shared with us until its exec (fork and vfork alike): where
    only children we never saw (a `subprocess.run`, which execs) were reaped, a peak no
    higher than ours may be only our own size, so it is a bound. A worker we saw forked
    (a DataLoader's) keeps the pages it shares, as a live one's peak does."""
    try:
        with open("/proc/self/status", "rb") as status:
            return _kib(status.read(), b"VmHWM:") or 0
    except OSError:
        return 0


def _usage() -> tuple[int, float, int]:
    """Reaped children so far: (largest peak in bytes, CPU seconds, minor faults); the
    last two grow with every child reaped, the first only with a larger one."""
    if resource is None:
        return _NO_USAGE
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (ru.ru_maxrss * _MAXRSS_UNIT, ru.ru_utime + ru.ru_stime, ru.ru_minflt)


_NO_USAGE = (0, 0.0, 0)  # no child reaped yet (or no getrusage)
# No process is started and reaped in less: a quicker cell without a child known reads nothing.
_CHILD_S = 100e-6
Key = tuple[int, int]  # a process: (pid, start time)


class ChildWatch:
    """The cell's workers between `start()` and `stop()`; every read is guarded."""

    # Linux (/proc with each thread's children, and getrusage); elsewhere nothing is read
    sees = resource is not None and os.path.isdir("/proc/self/task")

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._children_fds: dict[int, int | None] = {}  # thread ident -> its children file
        self._ident: int | None = None  # the thread whose file `_fd` is
        self._fd: int | None = None
        self._live: dict[int, _Proc] = {}  # descendants alive at the last look, by pid
        self._roots: set[int] = set()  # of them, our own children (the walk starts there)
        self._forked: set[Key] = set()  # forked since the last look
        self._zombies: set[Key] = set()  # exited, not reaped, at the last look: counted then
        self._usage = _guarded_usage()  # the reaped children's figures at the last look
        self._looked = False  # a first start looks: children from before are not new
        if self.sees:
            _watches.add(self)
            _register_fork_handler()

    # --- per cell -------------------------------------------------------------------------

    def start(self) -> None:
        """Where a child is known, and at the first start: which children are alive
        (their CPU time and peaks reset), and the reaped children's figures to compare
        with at the end. What exited between cells is no cell's."""
        if self._looked and not (self._live or self._forked or self._zombies):
            return  # no child known
        self._looked = True
        try:
            live, zombies = self._look(self._listed())
            for proc in live.values():
                proc.new = False
                proc.ticks = _or_none(proc.cpu_ticks)
                _or_none(proc.reset_peak)
            self._live, self._zombies, self._forked = live, set(zombies), set()
        except Exception:
            _log.debug("reading the children at the start failed", exc_info=True)
        self._usage = _guarded_usage()

    def stop(self, elapsed_s: float = math.inf) -> Workers:
        """The cell's workers, as they are now (NONE for a cell without); `elapsed_s`: how
        long the cell ran.

        Without a child known, a cell quicker than any process can be started and reaped
        in reads nothing; a longer one reads the reaped children's figures and this
        thread's children, and multiprocessing's list of running children, and looks
        further only where one of them says there is a child."""
        knows = self._live or self._forked or self._zombies  # alive, forked, zombie
        if (not knows and elapsed_s < _CHILD_S) or not self.sees:
            return NONE  # the usual: a quick cell, nothing read
        listed = self._listed()
        usage = _guarded_usage()
        if not (knows or listed or usage != self._usage or _mp_children()):
            return NONE
        before, self._usage = self._usage, usage
        try:
            return self._read(before, usage, listed)
        except Exception:
            _log.debug("reading the workers failed", exc_info=True)
            self._live, self._roots, self._forked, self._zombies = {}, set(), set(), set()
            return NONE

    def _look(self, listed: set[int]) -> tuple[dict[int, _Proc], dict[Key, int | None]]:
        """The live descendants by pid (each with its peak read), and the zombies among
        them (closed) with their exit codes: from `listed` (this thread's children) and
        those known."""
        known = {pid for pid, _ in self._forked | self._zombies}
        helpers = _mp_helpers()
        found = self._tree((listed | self._roots | known | _mp_pids()) - helpers, helpers)
        zombies: dict[Key, int | None] = {}
        for pid, proc in list(found.items()):
            status = _or_none(proc.status)  # None: gone since
            if status is None or not status[0]:
                if status is not None:
                    zombies[proc.key] = _or_none(proc.exit_code)
                proc.close()
                del found[pid]
            else:
                proc.peak = status[1]
        self._roots &= found.keys()
        for pid, proc in self._live.items():
            if found.get(pid) is not proc:
                proc.close()
        return found, zombies

    def _read(self, before: tuple, usage: tuple, listed: set[int]) -> Workers:
        old = {p.key for p in self._live.values()} | self._forked
        ticks = {p.key: (p.new, p.ticks) for p in self._live.values()}
        live, zombies = self._look(listed)
        workers = []
        for proc in live.values():
            new, start_ticks = ticks.get(proc.key, (True, None))
            if not new and start_ticks is not None and start_ticks == _or_none(proc.cpu_ticks):
                continue  # alive all through the cell, and idle in it: not its worker
            workers.append(Worker(proc.pid, proc.peak, _or_none(proc.pss)))
        known = {p.key for p in live.values()} | zombies.keys()
        reaped_here = old - known  # ours, gone during the cell: exited and reaped
        exited = reaped_here | (zombies.keys() - self._zombies)  # an earlier cell's zombie is not
        earlier = bool(self._zombies - zombies.keys())  # an earlier cell's zombie was reaped
        self._live, self._zombies, self._forked = live, set(zombies), set()
        workers += [Worker(key[0], None, exited=True, exit_code=zombies.get(key))
                    for key in sorted(exited)]
        # The reaped figures moved: a child was reaped during the cell. Only an earlier
        # cell's zombie reaped, and none of the cell's own: none of it is the cell's.
        reaped = usage[1:] != before[1:] and bool(reaped_here or not earlier)
        return Workers(
            tuple(workers),
            exited_peak_bytes=usage[0] if reaped else None,
            exited_peak_bound=reaped and (usage[0] <= before[0] or earlier or (
                not reaped_here and usage[0] <= _own_peak_bytes())),
            uncounted=reaped and not reaped_here,
        )

    def _tree(self, pids: set[int], helpers: set[int]) -> dict[int, _Proc]:
        """The processes of `pids` (our children, or the children of multiprocessing's
        `helpers`) still there and all their descendants, by pid; a grandchild whose
        parent died is not ours any more, so not found, nor is a process another parent
        has under a pid one of ours had."""
        self._roots = set()
        parents = helpers | {self._pid}
        found: dict[int, _Proc] = {}
        todo = list(pids)
        while todo:
            pid = todo.pop()
            if pid in found or pid == self._pid:
                continue
            proc = self._live.get(pid)
            try:
                if proc is None:
                    proc = _Proc(pid)
                try:
                    proc.read("stat")  # (its children file reads empty once it is gone)
                except OSError:  # the process we knew is gone: the pid may be another's now
                    proc = _Proc(pid)
                if proc.parent not in parents and proc.parent not in found:
                    raise OSError(f"{pid} is not ours")
                todo += proc.children()
            except OSError:  # gone (or not ours to read)
                if proc is not None and proc is not self._live.get(pid):
                    proc.close()
                continue
            found[pid] = proc
            if pid in pids:
                self._roots.add(pid)
        return found

    def _listed(self) -> set[int]:
        """This thread's children, from the file kept open for it (none where it is
        missing)."""
        if threading.get_ident() != self._ident:
            self._open_children()
        if self._fd is None:
            return set()
        try:
            return {int(p) for p in os.pread(self._fd, 4096, 0).split()}
        except OSError:
            return set()

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
        """Note the child just forked, by pid and start time: the forking thread's
        children, read now, less those already known (a known pid the kernel handed out
        again is read at the end of the cell as the new process it is)."""
        path = f"/proc/self/task/{threading.get_native_id()}/children"
        with open(path, "rb") as f:
            pids = {int(p) for p in f.read().split()}
        known = {pid for pid, _ in self._forked} | self._live.keys() | _mp_helpers()
        for pid in pids - known:
            stat = _or_none(_read_stat, pid)
            if stat is not None:
                self._forked.add((pid, int(_stat_fields(stat)[19])))

    def _after_fork_in_child(self) -> None:
        """A forked child starts with no children, and its files must be its own."""
        self._pid = os.getpid()
        self._live, self._roots, self._forked, self._zombies = {}, set(), set(), set()
        self._looked = True  # it has no child yet
        # inherited fds name the parent's files: left open, never read in the child
        self._children_fds, self._ident, self._fd = {}, None, None
        self._usage = _guarded_usage()


def _read_stat(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read()


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
        return _NO_USAGE


def _mp_children() -> Any:
    """multiprocessing's running children (any start method), if it is imported: a
    spawned or forkserver worker is not forked here, so only this says it is there."""
    process = sys.modules.get("multiprocessing.process")
    return None if process is None else getattr(process, "_children", None)


def _mp_pids() -> set[int]:
    return {p.pid for p in list(_mp_children() or ()) if p.pid is not None}


def _mp_helpers() -> set[int]:
    """multiprocessing's own helper processes, once started: its resource tracker and
    its forkserver (whose children, the forkserver's workers, are in `_mp_children`)."""
    found = set()
    for module, holder, attr in (
        ("multiprocessing.resource_tracker", "_resource_tracker", "_pid"),
        ("multiprocessing.forkserver", "_forkserver", "_forkserver_pid"),
    ):
        pid = getattr(getattr(sys.modules.get(module), holder, None), attr, None)
        if isinstance(pid, int):
            found.add(pid)
    return found


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
