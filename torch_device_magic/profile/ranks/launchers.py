"""The launchers' entry points, patched for one cell (`launches`): each rank's function is
wrapped in `child.Rank` as the launcher starts it, and the launch is otherwise the
launcher's own (its exceptions, its exit codes). Reached: `torch.multiprocessing`'s
`start_processes` (`spawn` calls it; fork and spawn), torch elastic's `launch_agent`
(`elastic_launch`, which accelerate's `notebook_launcher` uses) and
`multiprocessing.Process.start` (a process that runs torch.distributed code: one that never
forms a process group writes nothing). A launcher nested in another (elastic's agent
starts its workers with `start_processes`) passes through."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import multiprocessing.process
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.multiprocessing

from ..capture import Options
from .child import CELL_ENDED, Rank


@dataclass
class Launches:
    """What the cell launched: the folder of the ranks' traces (made at the first launch)
    and the ranks each launcher was asked for."""

    folder: Callable[[], str]
    expected: list[int] = field(default_factory=list)
    made: str | None = None
    depth: int = 0  # inside one of our launchers: a nested one passes through

    def where(self) -> str:
        if self.made is None:
            self.made = self.folder()
            with contextlib.suppress(FileNotFoundError):  # an earlier cell's, in --trace DIR
                os.remove(os.path.join(self.made, CELL_ENDED))
        return self.made

    def ended(self) -> None:
        """The cell ended (returned, raised, Ctrl-C): ranks still running (in Jupyter the
        kernel's Ctrl-C reaches only the kernel; a launch not joined) stop their profilers
        and write what they recorded at their next step, and run on as without us."""
        if self.made is not None:
            with contextlib.suppress(OSError), open(os.path.join(self.made, CELL_ENDED), "w"):
                pass


_PATCHED: list[tuple[Any, str, Any]] = []  # (owner, name, the original): undone in a fork


def _undo() -> None:
    while _PATCHED:
        owner, name, real = _PATCHED.pop()
        setattr(owner, name, real)


@contextlib.contextmanager
def launches(options: Options, folder: Callable[[], str]) -> Iterator[Launches]:
    """The launchers patched for the block, undone however it ends."""
    got = Launches(folder)

    def rank(fn: Callable[..., Any], indexed: bool) -> Rank:
        return Rank(fn, options, got.where(), indexed, _undo)

    @contextlib.contextmanager
    def ours() -> Iterator[None]:
        got.depth += 1
        try:
            yield
        finally:
            got.depth -= 1

    # the module (its name is the package's `spawn` function too): spawn() calls it there
    spawning = importlib.import_module("torch.multiprocessing.spawn")
    real_start = spawning.start_processes

    def start_processes(fn: Any, args: Any = (), nprocs: int = 1, join: bool = True,
                        daemon: bool = False, start_method: str = "spawn") -> Any:
        __tracebackhide__ = True
        if got.depth:
            return real_start(fn, args, nprocs, join, daemon, start_method)
        got.expected.extend(range(nprocs))
        with ours():
            return real_start(rank(fn, True), args, nprocs, join, daemon, start_method)

    targets: list[tuple[Any, str, Any]] = [
        (spawning, "start_processes", start_processes),
        (torch.multiprocessing, "start_processes", start_processes),
    ]
    with contextlib.suppress(ImportError):
        import torch.distributed.launcher.api as elastic

        real_agent = elastic.launch_agent

        def launch_agent(config: Any, entrypoint: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if got.depth or not callable(entrypoint):  # a script's path: not ours to wrap
                return real_agent(config, entrypoint, *args, **kwargs)
            got.expected.extend(range(config.max_nodes * config.nproc_per_node))
            with ours():
                return real_agent(config, rank(entrypoint, False), *args, **kwargs)

        targets.append((elastic, "launch_agent", launch_agent))

    process = multiprocessing.process.BaseProcess
    real_process_start = process.start

    def start(self: Any) -> None:
        target = getattr(self, "_target", None)
        if not got.depth and target is not None and not isinstance(target, Rank) and not (
                getattr(target, "__module__", None) or "").startswith(
                    ("torch.", "multiprocessing")):  # a DataLoader's workers, torch's own
            self._target = rank(target, False)
        return real_process_start(self)

    targets.append((process, "start", start))
    for owner, name, patch in targets:
        _PATCHED.append((owner, name, getattr(owner, name)))
        setattr(owner, name, patch)
    try:
        yield got
    finally:
        _undo()
        got.ended()


class RankFolders:
    """The session's folder of the ranks' traces where the user named none: the last one
    is kept (until the next cell that launches ranks, or the interpreter's exit)."""

    def __init__(self) -> None:
        self.kept: str | None = None
        self._pid = os.getpid()
        atexit.register(self._exit)

    def new(self, label: str) -> str:
        self.clear()
        self.kept = tempfile.mkdtemp(
            prefix=f"tdm-ranks-{label.replace('[', '').replace(']', '')}-")
        return self.kept

    def clear(self) -> None:
        path, self.kept = self.kept, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def _exit(self) -> None:
        if os.getpid() == self._pid:  # a forked child that exits leaves the session's
            self.clear()


FOLDERS = RankFolders()
