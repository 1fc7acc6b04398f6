"""The events `%%profile` reads from kineto, as plain records: `from_kineto` turns
kineto's events into `Event`s (names and shapes, never a tensor)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from . import names

LINE_PREFIX = "tdm:"  # our ranges' names start with it (and never an op's)


# --- the events, as plain records -------------------------------------------------------


@dataclass(slots=True)
class Event:
    """One kineto event, its times relative to the trace's start.

    kind: "op" (a CPU op or a user's range), "line" (ours), "memory", "runtime" (a
    CUDA runtime or driver call), "kernel", "memcpy", "memset" (device activity),
    "overhead" (the profiler's own rows, CUPTI's: in no table, read by the advice).
    """

    name: str
    kind: str
    start_ns: int
    end_ns: int = 0
    thread: int = 0
    correlation: int = 0  # a CPU op's id; device and runtime events link to it
    linked: int = 0
    shapes: tuple[tuple[int, ...], ...] = ()
    nbytes: int = 0  # memory: + allocated, - freed; memcpy: bytes copied (0: unknown)
    on_device: bool = False  # memory: on an accelerator (else host)
    dtypes: tuple[str, ...] = ()  # an op's inputs', as kineto names them ('float', 'c10::Half')
    concrete: tuple[Any, ...] = ()  # a counted op's (names.FLOP_OPS) scalar arguments, in
    # place (a tensor's: None): stride, padding, a convolution's transposed flag
    # filled by the analysis
    self_ns: int = 0
    alloc_bytes: int = 0
    device_ns: int = 0
    line: str | None = None
    parent: Event | None = None  # the innermost op or range around it, on its thread


def from_kineto(result: Any, origin: int | None = None) -> list[Event]:
    """The events of a finished capture (`prof.profiler.kineto_results`), their times
    from `origin` (the trace's start by default; another session's, to put several on one
    clock); read once, in one pass (tens of thousands of events: every call per event
    counts)."""
    start = result.trace_start_ns() if origin is None else origin
    events = result.events()
    cpu = torch.autograd.DeviceType.CPU
    older = bool(events) and not hasattr(events[0], "activity_type")  # older torch
    linked = bool(events) and hasattr(events[0], "linked_correlation_id")
    concrete = bool(events) and hasattr(events[0], "concrete_inputs")
    out: list[Event] = []
    append = out.append
    for e in events:
        name = e.name()
        activity = "" if older else e.activity_type()
        device = e.device_type() != cpu
        if name == "[memory]":
            append(Event(name, "memory", e.start_ns() - start, e.start_ns() - start,
                         e.start_thread_id(), nbytes=e.nbytes(), on_device=device))
            continue
        if name.startswith(LINE_PREFIX):
            kind = "line"
        elif _profilers_own(name, activity):
            kind = "overhead"  # on either side: no activity of the user's
        elif device:
            kind = ("memcpy" if "memcpy" in activity or name.startswith("Memcpy")
                    else "memset" if "memset" in activity or name.startswith("Memset")
                    else "kernel")
        elif activity in names.RUNTIME or _driver_call(name, activity) or (
                older and name.startswith(("cuda", "hip"))):
            kind = "runtime"
        elif name in names.FILTERED or e.is_async() or e.start_thread_id() != e.end_thread_id():
            continue
        else:
            kind = "op"
        append(Event(
            name, kind, e.start_ns() - start, e.end_ns() - start, e.start_thread_id(),
            e.correlation_id(), e.linked_correlation_id() if linked else 0,
            tuple(map(tuple, e.shapes())) if kind == "op" else (),
            _copied_bytes(e) if kind == "memcpy" else 0,
            dtypes=tuple(e.dtypes()) if kind == "op" and name in names.DTYPES_READ else (),
            concrete=tuple(e.concrete_inputs()) if concrete and kind == "op"
            and name in names.FLOP_OPS else (),
        ))
    return out




def _profilers_own(name: str, activity: str) -> bool:
    """A row the profiler made about itself (or CUDA's loading it saw), not an op of the
    user's."""
    return activity == "overhead" or name in names.PROFILERS_OWN


def _driver_call(name: str, activity: str) -> bool:
    """A CUDA driver API call (cuLaunchKernelEx), whatever activity kineto gave it; a
    user's range of that look is one of theirs."""
    return (activity != "user_annotation" and name.startswith("cu") and name[2:3].isupper()
            and name.isalnum())


def _copied_bytes(event: Any) -> int:
    """The bytes of a device copy, where kineto put them in the event's metadata."""
    try:
        return int(json.loads("{" + (event.metadata_json() or "") + "}").get("bytes", 0))
    except (ValueError, TypeError, AttributeError):
        return 0
