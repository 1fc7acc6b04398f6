"""`%gpufree`: collect garbage, hand the allocators' cache back, and say how much came back.

    >>> report = free_memory()  # after `del activations`
    >>> report.released_bytes, report.before["cuda:0"].reserved_bytes
    (6442450944, 8697308774)

Only accelerators whose runtime is already up are touched: on a machine that
never used one, this collects garbage and says so, and creates no CUDA context.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .devices import accelerators_in_use
from .probes import Counters, empty_cache, guarded
from .units import fmt_bytes, plural

if TYPE_CHECKING:
    from .advice.holders import Holder


@dataclass
class FreeReport:
    """What `%gpufree` did: objects collected, and each accelerator's counters before and after."""

    collected: int
    before: dict[str, Counters]
    after: dict[str, Counters]
    # what kept tensors alive behind no name: results and the traceback were let go of
    holders: list[Holder] = field(default_factory=list)
    # per holder let go of, the bytes per device that came back (measured after collecting)
    came_back: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def released_bytes(self) -> int:
        """Bytes the allocators gave back to the devices, over all that could be read."""
        return sum(_less(self.before[d], self.after[d]) or 0 for d in self.before)

    def __str__(self) -> str:
        freed = {name: sum(by_device.values()) for name, by_device in self.came_back.items()}
        parts: list[str] = []
        if any(freed.values()):
            parts.append("released " + ", ".join(
                f"{name} {fmt_bytes(n)}" for name, n in freed.items() if n))
        freed_nothing = [name for name, n in freed.items() if not n]
        if freed_nothing:  # something we cannot see holds what they alone seemed to keep
            their = "its" if len(freed_nothing) == 1 else "their"
            parts.append(f"let go of {', '.join(freed_nothing)}, but nothing came back "
                         f"(something else still holds {their} tensors)")
        parts.append(f"garbage collected ({plural(self.collected, 'object')})")
        if not self.before:
            parts.append("no accelerator in use, so no allocator cache to empty")
        for name, old in self.before.items():
            new = self.after[name]
            parts.append(
                f"{name}: {fmt_bytes(_less(old, new))} came back "
                f"(cached {fmt_bytes(old.reserved_bytes)} → {fmt_bytes(new.reserved_bytes)}, "
                f"in tensors {fmt_bytes(old.allocated_bytes)} → {fmt_bytes(new.allocated_bytes)})"
            )
        graphs = [h for h in self.holders if h.kind == "graph"]
        if graphs:  # the classic "del did not free it": a stored loss keeps its graph
            kept = ", ".join(f"{h.name} {fmt_bytes(h.total)} ({h.fix})" for h in graphs)
            parts.append(f"still held: {kept}")
        return "; ".join(parts)


def _less(before: Counters, after: Counters) -> int | None:
    if before.reserved_bytes is None or after.reserved_bytes is None:
        return None
    return before.reserved_bytes - after.reserved_bytes


def free_memory(let_go: Callable[[], list[Holder]] = list) -> FreeReport:
    """Run `gc.collect()`, then empty the cache of every accelerator already in use (and,
    on CUDA, release the memory of tensors shared with other processes that are gone);
    first `let_go()` drops what it can and says what it found (`holders.release`), and
    what each holder let go of freed is measured after collecting."""
    accelerators = accelerators_in_use()
    before = {a.name: a.counters() for a in accelerators}
    found = let_go()
    collected = gc.collect()
    came_back = {h.name: h.came_back() for h in found if h.kind in ("result", "traceback")}
    for kind in dict.fromkeys(a.kind for a in accelerators):
        empty_cache(torch.device(kind))
        if kind == "cuda":
            guarded(torch.cuda.ipc_collect)
    after = {a.name: a.counters() for a in accelerators}
    return FreeReport(collected, before, after, found, came_back)

