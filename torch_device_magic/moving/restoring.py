"""`restore`: send back what a restorable move moved (from meta: the originals)."""

from __future__ import annotations

import contextlib
import time

import torch

from ..tensors import stored_bytes
from ..units import fmt_bytes
from .commit import SigintHold, _execute, _like, _rebind, _sigint_held, _swap_all
from .plan import _IS_META, _Plan
from .result import MoveResult, _Undo


def restore(ns: dict, moved: MoveResult, hold: SigintHold | None = None) -> MoveResult:
    """Send back what `move(..., restorable=True)` moved, carrying what was done to it since.

    Once only: `moved` then lets go of what it kept for this (from meta, the originals),
    which a traceback holding it would otherwise keep alive. SIGINT waits until it is done:
    a Ctrl-C neither cancels it nor leaves it half done. Under `hold`, engaged by the
    caller (who releases it, handing over what it caught), else under a hold of its own,
    whose Ctrl-Cs the result keeps for `deliver`.
    """
    held = contextlib.nullcontext(hold.caught) if hold is not None else _sigint_held()
    with held as interrupted:
        undo, moved._undo = moved._undo, None
        if undo is None:
            raise ValueError("restore() needs the result of move(..., restorable=True), once")
        start = time.perf_counter()
        if undo.originals is not None:
            result = _put_back_originals(ns, moved, undo, start)
        else:
            plan = _Plan.back(undo)
            plan.walk(ns, [n for n in undo.names if n in ns])
            result = _execute(plan, ns, None, None, held=True)
        if interrupted:
            result.said.append("Ctrl-C during --restore: it finished first, everything went back")
            if hold is None:
                result.interrupted = len(interrupted)  # the caller delivers, with this result
                interrupted.clear()
    return result


def _put_back_originals(ns: dict, moved: MoveResult, undo: _Undo, start: float) -> MoveResult:
    """Restore from a data-less device: the original C++ tensors go back into their objects."""
    pairs, undo.originals = undo.originals, None
    assert pairs is not None, "a restore from meta keeps the originals"
    olds, keepers = [t for t, _ in pairs], [k for _, k in pairs]
    pairs.clear()
    refused = _swap_all(olds, keepers)  # the keepers now hold the meta ones
    replaced = {id(olds[i]): _like(olds[i], keepers[i]) for i in refused}
    replaced.update(undo.rebound)
    if replaced:
        _rebind(ns, undo.names, replaced, [])
    for opt, state in undo.optimizer_state:
        opt.state.clear()
        opt.state.update({p: dict(s) for p, s in state.items()})
    with torch.no_grad():
        for t, value in undo.values:
            t.copy_(value)
    # A name the cell bound to meta tensors (`x = x.flatten(1)`) holds no data: its own comes back.
    given = [n for n, obj in undo.bindings.items() if ns.get(n, obj) is not obj and _on_meta(ns[n])]
    for name in given:
        ns[name] = undo.bindings[name]
    notes = [
        f"a tensor of {fmt_bytes(stored_bytes(olds[i]))} came back as a new object: "
        "torch refused to swap it"
        for i in refused
    ]
    count = len(olds) + len(undo.rebound)
    keepers.clear()  # what the cell left holding the meta tensors keeps them; we let go
    return MoveResult(
        next(iter(undo.home.values()), torch.device("cpu")),
        dict(moved.names),
        time.perf_counter() - start,
        notes,
        restored=count,
        said=[_given_back(given)] if given else [],
    )


def _given_back(names: list[str]) -> str:
    which = f"the name {names[0]}" if len(names) == 1 else f"the names {', '.join(names)}"
    return (f"--restore from meta gave back what {which} held: the cell bound "
            f"{'it' if len(names) == 1 else 'them'} to meta tensors, which hold no data")


def _on_meta(obj: object) -> bool:
    """Whether `obj` is or holds (as a move would find it) a tensor on meta."""
    plan = _Plan.to(torch.device("cpu"))  # plans every tensor not on the CPU
    plan.walk({"": obj}, [""])
    return any(map(_IS_META, plan.tensors))
