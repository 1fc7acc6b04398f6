"""`%%profile`'s advice on a launcher's ranks (issue 40), from the figures each rank
brought back (`profile.ranks`' `RankRecord`s: `rank`, `collective_share`, `peak`,
`device_busy`) and the straggler found in them (its `Straggler`: `rank`, `late`, `own_s`,
`others_s`, `lag_s`): collectives taking most of a step, one slow rank, uneven memory.
The rules' texts live here; their thresholds in thresholds.py."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ..units import fmt_bytes, fmt_seconds
from .profile_rules import Advice
from .thresholds import (
    COLLECTIVE_SHARE,
    STRAGGLER_LATE_S,
    STRAGGLER_RATIO,
    UNEVEN_PEAK_BYTES,
    UNEVEN_PEAK_RATIO,
)


def advise_ranks(ranks: Sequence[Any], slow: Any | None, device: bool) -> list[Advice]:
    """Every rule's advice for the ranks of one cell; `device`: their peaks are the device's
    allocated bytes (a GPU), else the host's RSS."""
    found = [straggler(ranks, slow) if slow is not None else collectives(ranks),
             uneven_memory(ranks, device)]
    return [a for a in found if a is not None]


def collectives(ranks: Sequence[Any]) -> Advice | None:
    """Even ranks spending most of a step in collectives: communication sets the pace. (With
    a straggler the others' share is their wait for it: that rank's advice instead.)"""
    shares = {r.rank: r.collective_share for r in ranks if r.collective_share is not None}
    if len(shares) < 2:
        return None
    share = statistics.median(shares.values())
    if share < COLLECTIVE_SHARE:
        return None
    each = ", ".join(f"rank {k} {v:.0%}" for k, v in sorted(shares.items()))
    return Advice("collectives", share, COLLECTIVE_SHARE, None, (
        f"the ranks spend {share:.0%} of a step in collectives or waiting for them ({each}): "
        "communication, not compute, sets the pace: do more work between them (a larger "
        "batch per rank), sync less often (`with model.no_sync():` over gradient-"
        "accumulation steps), and let them overlap the backward pass "
        "(DistributedDataParallel does, bucket by bucket: a larger `bucket_cap_mb` sends "
        "fewer, larger all_reduces)"))


def straggler(ranks: Sequence[Any], slow: Any) -> Advice:
    """One rank the others wait for: what only it does."""
    if slow.late:
        return Advice("straggler", slow.lag_s, STRAGGLER_LATE_S, None, (
            f"rank {slow.rank} starts its steps {fmt_seconds(slow.lag_s)} after the other "
            "ranks, who wait for it at their first collective: its set-up before the loop "
            "(loading its data or shard, building its model, starting its device)"))
    busy = {r.rank: r.device_busy for r in ranks if r.device_busy is not None}
    device = ""
    if slow.rank in busy and len(busy) >= 2:
        others = statistics.median(v for k, v in busy.items() if k != slow.rank)
        device = (f"; its device was busy {busy[slow.rank]:.0%} of its steps against the "
                  f"others' {others:.0%}")
    ratio = slow.own_s / max(slow.others_s, 1e-9)
    return Advice("straggler", ratio, STRAGGLER_RATIO, None, (
        f"rank {slow.rank}'s own work in a step ({fmt_seconds(slow.own_s)}) is "
        f"{ratio:.1f}x the other ranks' "
        f"({fmt_seconds(slow.others_s)}), and they wait for it in every collective{device}: "
        "look at what only it does: its data (a larger shard, a slower DataLoader or disk), "
        "its device (another model, throttled, shared with another process)"))


def uneven_memory(ranks: Sequence[Any], device: bool) -> Advice | None:
    """One rank's peak well above another's: its extra work sets every rank's need."""
    peaks = {r.rank: r.peak for r in ranks if r.peak}
    if len(peaks) < 2:
        return None
    high = max(peaks, key=lambda k: peaks[k])
    low = min(peaks, key=lambda k: peaks[k])
    ratio = peaks[high] / peaks[low]
    if ratio < UNEVEN_PEAK_RATIO or peaks[high] - peaks[low] < UNEVEN_PEAK_BYTES:
        return None
    what = "its device's peak allocated" if device else "its peak host RSS"
    return Advice("uneven memory", ratio, UNEVEN_PEAK_RATIO, None, (
        f"rank {high} peaks at {fmt_bytes(peaks[high])} ({what}), {ratio:.1f}x rank {low}'s "
        f"{fmt_bytes(peaks[low])}: work only rank {high} does (evaluation, logging, a "
        "checkpoint or outputs gathered to it, a larger shard) sets the memory each rank "
        "must have: spread it over the ranks or move it out of the training loop"))
