"""What a move or a restore did (`MoveResult`), and what a restore needs (`_Undo`)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..reports import Table
from ..units import fmt_bytes, fmt_seconds, plural


@dataclass
class MoveResult:
    """What a move did: bytes per name, time taken, references that could not follow,
    and what the walk did not look into (`skipped`)."""

    device: torch.device
    names: dict[str, int]
    seconds: float
    not_followed: list[str] = field(default_factory=list)
    _undo: _Undo | None = field(default=None, repr=False)
    skipped: list[str] = field(default_factory=list)
    restored: int | None = None  # a restore from meta: how many originals were put back
    # The Ctrl-Cs that came once a restorable move was done, or during a restore: held back
    # so that the caller has this result (and can restore, or show it) before it hands them
    # to the SIGINT handler with `deliver`, whichever it is: Python's, or a user's own that
    # may raise.
    interrupted: int = 0
    said: list[str] = field(default_factory=list)  # a restore: lines to show even without -v
    to: str = ""  # a restore to several devices: all of them ("cpu, cuda:0")
    # Bytes a name holds that are counted under another (a model's parameters, which its
    # optimizer holds too): one line each.
    counted_under: list[str] = field(default_factory=list)
    # The names that moved, though not asked for, as they share storage with what was asked
    joined: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(self.names.values())

    def table(self, rows: bool = True) -> Table:
        """The title, a row per name unless not `rows`, and the notes."""
        if self.restored is not None:  # nothing was copied: saying "moved in 1 ms" would mislead
            title = f"restored {plural(self.restored, 'tensor')} from meta (the originals put back)"
        elif self.names:
            took = fmt_seconds(self.seconds)
            title = f"moved {fmt_bytes(self.nbytes)} to {self.to or self.device} in {took}"
        else:
            title = f"nothing to move to {self.device}"
        listed = [(name, fmt_bytes(n)) for name, n in self.names.items()] if rows else []
        notes = list(self.counted_under)
        if self.joined:
            notes.append(
                f"moved too, as {'it shares' if len(self.joined) == 1 else 'they share'} "
                f"storage with what the cell uses: {', '.join(self.joined)}"
            )
        notes += [f"could not follow: {n}" for n in self.not_followed]
        notes += [f"not walked: {n}" for n in self.skipped]
        return Table(title, ("name", "bytes"), listed, notes)


@dataclass
class _Undo:
    """What `restore` needs: where things came from, or (from meta) the originals."""

    names: list[str]
    home: dict[int, torch.device]
    module_home: dict[int, torch.device]
    # From meta: each moved tensor and the copy that, once swapped, holds its original.
    originals: list[tuple[Tensor, Tensor]] | None = None
    rebound: dict[int, Tensor] = field(default_factory=dict)
    optimizer_state: list[tuple[torch.optim.Optimizer, dict]] = field(default_factory=list)
    values: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    bindings: dict[str, object] = field(default_factory=dict)  # from meta: what each name held


def deliver(result: MoveResult) -> None:
    """Hand the Ctrl-Cs that `result` held back to the SIGINT handler in force, once a
    press: Python's raises KeyboardInterrupt, a user's own runs (and may raise)."""
    presses, result.interrupted = result.interrupted, 0
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        for _ in range(presses):
            handler(signal.SIGINT, None)
