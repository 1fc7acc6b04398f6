"""Notes: one line each, under the report line, only where a cell left something to act on.

    In [7]: pred = model(x)          # model.eval(), autograd on
    time 1.2 s | host +412.0 MiB (peak 530.1 MiB)
    pred keeps an autograd graph holding 412.0 MiB: for inference run the cell under
    %%nograd, or torch.no_grad()

This module is the one place where each note's text lives (its threshold is in
thresholds.py, beside `%%profile`'s): a `Note` is a small record (rule, figure,
threshold, where, text), made by the plain functions below, which `%%profile`'s advice
can call too. `Advisor.notes` looks after each cell. What it
looks at on an ordinary cell costs well under a microsecond: whether torch's compiler
was imported (never importing it: that takes seconds) and recorded a compilation since
the last cell, whether the cell displayed a result, and figures the report already read.
Only a cell that passes such a cheap test gets the dearer look (its result's tensors,
the autograd graph of its new names).
"""

from __future__ import annotations

import ast
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from ..probes import free_and_total, guarded, nvml_busy_percent
from ..units import fmt_bytes, fmt_per_device, fmt_seconds
from . import compiles
from .compiles import UTILS
from .holders import traceback_bytes
from .thresholds import (
    BUSY_LOW,
    BUSY_MIN_S,
    DISPLAYED_MIN_BYTES,
    DISPLAYED_SHARE,
    IDLE_HELD_BYTES,
    IDLE_MAX,
    INFERENCE_MIN_BYTES,
    NEAR_CAPACITY_SHARE,
    TRACEBACK_MIN_BYTES,
    capacity_share,
)

_log = logging.getLogger(__name__)
_MAX_ITEMS = 1000  # a displayed container longer than this is not looked into
_MAX_NODES = 100_000  # an autograd graph is walked this far, no further


@dataclass(frozen=True, slots=True)
class Note:
    """One note: which rule made it, the figure it found, the threshold it crossed (None:
    the rule has none), where (a name, a function, a line), and the line to show."""

    rule: str
    text: str
    figure: float | None = None
    threshold: float | None = None
    where: str | None = None

    def __str__(self) -> str:
        return self.text


# --- the notes' texts ---------------------------------------------------------------------


def near_capacity(device: str, peak_bytes: int, total_bytes: int) -> Note | None:
    """The cell's peak reached NEAR_CAPACITY_SHARE of the device's memory."""
    share = capacity_share(peak_bytes, total_bytes)
    if share is None:
        return None
    return Note("near_capacity", f"peak at {share:.0%} of {device}: a larger batch will likely "
                "run out of memory; see %%profile --memory", share, NEAR_CAPACITY_SHARE, device)


def displayed(name: str, nbytes: int, device: str, total_bytes: int | None) -> Note | None:
    """The displayed result (`Out[n]`, `_`) keeps `nbytes` of tensors alive on `device`."""
    limit = DISPLAYED_MIN_BYTES
    if total_bytes:
        limit = min(limit, int(DISPLAYED_SHARE * total_bytes))
    if nbytes < limit:
        return None
    fix = "end the line with ';'" + (f" or del {name}" if name.startswith("Out[") else "")
    return Note("displayed", f"{name} keeps {fmt_bytes(nbytes)} on {device}: {fix}",
                nbytes, limit, name)


def inference(names: list[str], nbytes: int) -> Note | None:
    """New names of an inference cell (no backward, modules in eval mode) keep a graph."""
    if nbytes < INFERENCE_MIN_BYTES:
        return None
    who = ", ".join(names)
    verb = "keeps" if len(names) == 1 else "keep"
    return Note("inference", f"{who} {verb} an autograd graph holding {fmt_bytes(nbytes)}: for "
                "inference run the cell under %%nograd, or torch.no_grad()",
                nbytes, INFERENCE_MIN_BYTES, who)


def traceback_kept(nbytes: dict[str, int]) -> Note | None:
    """A failing cell's traceback keeps `nbytes` (per device) of tensors in its frames'
    locals that no name holds."""
    total = sum(nbytes.values())
    if total < TRACEBACK_MIN_BYTES:
        return None
    return Note("traceback", "the last traceback keeps tensors alive in its frames' locals "
                f"({fmt_per_device(nbytes)}): %gpufree gives it back",
                total, TRACEBACK_MIN_BYTES, "the last traceback")


def gpu_busy(device: str, percent: float, held_bytes: int | None) -> Note | None:
    """The cell's CUDA device ran kernels `percent` of the cell's time."""
    if percent >= BUSY_LOW:
        return None
    if percent <= IDLE_MAX and (held_bytes or 0) >= IDLE_HELD_BYTES:
        return Note("gpu_idle", f"{device} held {fmt_bytes(held_bytes)} and was busy "
                    f"{percent:.0f}% of the cell: the GPU waited, on input or on Python; "
                    "%%profile shows where",
                    percent, IDLE_MAX, device)
    return Note("gpu_busy", f"GPU busy {percent:.0f}% of the cell: the GPU waited, on input "
                "or on Python; %%profile shows where", percent, BUSY_LOW, device)


def compiled(function: str, frames: int, seconds: float) -> Note:
    plural = "s" if frames != 1 else ""
    return Note("compiled", f"compiled {function}: {frames} frame{plural} in "
                f"{fmt_seconds(seconds)}", seconds, None, function)


def recompiled(function: str, reason: str, count: int, limit: int | None,
               times: int = 1) -> Note:
    """`function` compiled again `times` times in the cell, the last for `reason`; it now
    has `count` compiled versions of the `limit` that torch allows."""
    again = "" if times == 1 else f" {times} times"
    of = "" if limit is None else f" ({count} of {limit} before the recompile limit)"
    return Note("recompiled", f"recompiled {function}{again}: {reason}{of}",
                count, limit, function)


def graph_break(function: str, line: int | None, reason: str) -> Note:
    at = "" if line is None else f" at line {line}"
    return Note("graph_break", f"graph break in {function}{at}: {reason}", line, None, function)


def recompile_limit(function: str, limit: int | None, reason: str) -> Note:
    of = "" if limit is None else f" ({limit})"
    why = f"; the last reason: {reason}" if reason else ""
    return Note("recompile_limit", f"{function} hit the recompile limit{of} and now runs "
                f"uncompiled{why}", limit, limit, function)


def cudagraphs_skipped(function: str, reason: str) -> Note:
    return Note("cudagraphs_skipped", f"CUDA graphs skipped for {function}: {reason}",
                None, None, function)


# --- looking after a cell -----------------------------------------------------------------


class Advisor:
    """Makes a cell's notes from its record, its result and the shell's namespace."""

    def __init__(self, shell: Any) -> None:
        self._shell = shell
        self._totals: dict[str, int | None] = {}  # device name: total bytes, read once
        self._seen: object = compiles.last_record()  # torch's last compilation record seen

    def notes(self, record: Any, result: Any) -> tuple[Note, ...]:
        """The notes for a cell just measured; () for an ordinary cell, and where looking
        failed (a user's object that raises when looked at: logged at debug level).

        An ordinary cell (nothing compiled, nothing displayed, little memory kept, no
        accelerator) costs a few comparisons here, and nothing more."""
        utils = sys.modules.get(UTILS)  # only where the user's code imported it
        compiled = utils is not None and compiles.recorded_since(utils, self._seen)
        if not (compiled or getattr(result, "result", None) is not None
                or getattr(result, "error_in_exec", None) is not None
                or record.device is not None
                or (record.host_delta_bytes or 0) >= INFERENCE_MIN_BYTES):
            return ()
        try:
            return tuple(self._notes(record, result, utils if compiled else None))
        except (Exception, KeyboardInterrupt):
            _log.debug("making the cell's notes failed", exc_info=True)
            return ()

    def _notes(self, record: Any, result: Any, utils: Any) -> Iterator[Note]:
        if utils is not None:
            yield from self._compilations(utils)
        value = getattr(result, "result", None)
        if value is not None:
            found = self._displayed(value, getattr(result, "execution_count", None))
            if found is not None:
                yield found
        kept = max(record.device_delta_bytes or 0, record.host_delta_bytes or 0)
        if kept >= INFERENCE_MIN_BYTES:
            found = self._inference(getattr(getattr(result, "info", None), "raw_cell", ""))
            if found is not None:
                yield found
        if record.device is not None and record.device_peak_bytes:
            found = self._near_capacity(record)
            if found is not None:
                yield found
        if record.wall_s >= BUSY_MIN_S and (record.device or "").startswith("cuda"):
            found = self._busy(record)
            if found is not None:
                yield found
        error = getattr(result, "error_in_exec", None)
        if error is not None:
            found = self._traceback(error)
            if found is not None:
                yield found

    def _traceback(self, error: BaseException) -> Note | None:
        """What a failing cell's traceback keeps alive (the out-of-memory hint, made
        before the notes, has cleared its frames already)."""
        shell = self._shell
        return traceback_kept(traceback_bytes(
            error, shell.user_ns, shell.user_ns_hidden, TRACEBACK_MIN_BYTES))

    def _busy(self, record: Any) -> Note | None:
        """Read how busy the cell's GPU was over the cell (NVML), into the record."""
        index = torch.device(record.device).index or 0
        since_us = int((time.time() - record.wall_s) * 1e6)
        record.gpu_busy = nvml_busy_percent(index, since_us, _our_pids())
        if record.gpu_busy is None:
            return None
        return gpu_busy(record.device, record.gpu_busy, record.device_allocated_bytes)

    def total_bytes(self, device: str) -> int | None:
        """The device's memory, read once per device; None for the CPU."""
        if device not in self._totals:
            self._totals[device] = None if device == "cpu" else _total_bytes(device)
        return self._totals[device]

    def _near_capacity(self, record: Any) -> Note | None:
        peak = record.device_top_bytes()
        total = self.total_bytes(record.device)
        if peak is None or not total:
            return None
        return near_capacity(record.device, peak, total)

    def _displayed(self, value: object, cell: int | None) -> Note | None:
        held = _tensor_bytes(value)
        if not held:
            return None
        device, nbytes = max(held.items(), key=lambda item: item[1])
        out = self._shell.user_ns.get("Out", {})
        name = f"Out[{cell}]" if cell is not None and out.get(cell) is value else "_"
        return displayed(name, nbytes, device, self.total_bytes(device))

    def _inference(self, source: str) -> Note | None:
        """A cell that called modules, all in eval mode, and no backward, whose new names
        carry an autograd graph."""
        if "backward" in source or not torch.is_grad_enabled():
            return None
        try:
            tree = ast.parse(source)
        except SyntaxError:  # a cell magic's text, or IPython's own syntax
            return None
        ns = self._shell.user_ns
        modules = [m for m in _called(tree, ns) if isinstance(m, torch.nn.Module)]
        if not modules or any(m.training for m in modules):
            return None
        names = [n for n in _assigned(tree) if _graph_roots(ns.get(n))]
        if not names:
            return None
        skip = {_storage_key(t) for m in modules for t in (*m.parameters(), *m.buffers())}
        skip.update(_storage_key(v) for v in ns.values() if isinstance(v, torch.Tensor))
        roots = [fn for n in names for fn in _graph_roots(ns[n])]
        return inference(names, _saved_bytes(roots, skip))

    def _compilations(self, utils: Any) -> Iterator[Note]:
        """Notes on what torch's compiler recorded since the last cell: compiles, graph
        breaks, recompiles and their reasons, the recompile limit, skipped CUDA graphs."""
        new, everything = compiles.records_since(utils, self._seen)
        self._seen = everything[-1]
        yield from _compile_notes(new, everything, compiles.recompile_limit())


def _our_pids() -> set[int]:
    """This process and its workers."""
    me = psutil.Process()
    children = guarded(me.children, True) or []
    return {me.pid, *(c.pid for c in children)}


def _compile_notes(new: list[Any], everything: list[Any], limit: int | None) -> Iterator[Note]:
    """Per function: its first compiles, its recompiles (one note: the first reason, how
    many), its graph breaks (a break's resumed part is compiled anew only the first
    time), the recompile limit, skipped CUDA graphs."""
    frames: dict[str, list[float]] = {}  # first compiles per function: their times
    again: dict[str, tuple[str, int, int]] = {}  # recompiles: the last reason, count, times
    breaks: dict[str, str] = {}  # a function's graph-break reason, waiting for its line
    notes: list[Note] = []
    for entry in new:
        function, line = compiles.function_of(entry, everything)
        fail = entry.fail_reason or ""
        if compiles.hit_limit(entry):
            why = compiles.short_reason(entry.recompile_reason)
            notes.append(recompile_limit(function, limit, why))
            continue
        first = not entry.cache_size
        if entry.recompile_reason and not first:
            first_why = compiles.short_reason(entry.recompile_reason)
            why, count, times = again.get(function, (first_why, 0, 0))
            # A resumed part recompiles with its function: one recompile of the function.
            again[function] = (why, max(count, entry.cache_size + 1), times + (line is None))
        elif first and not fail:
            frames.setdefault(function, []).append(entry.entire_frame_compile_time_s or 0.0)
        if entry.restart_reasons and first:
            breaks[function] = compiles.short_reason(sorted(entry.restart_reasons)[0])
        if line is not None and first and function in breaks:
            notes.append(graph_break(function, line, breaks.pop(function)))
        if getattr(entry, "cudagraph_skip_reason", None):
            skipped = compiles.short_reason(entry.cudagraph_skip_reason)
            notes.append(cudagraphs_skipped(function, skipped))
    yield from (compiled(f, len(times), sum(times)) for f, times in frames.items())
    yield from (recompiled(f, why, count, limit, times)
                for f, (why, count, times) in again.items())
    yield from (graph_break(f, None, why) for f, why in breaks.items())  # line unknown
    yield from notes


def _total_bytes(device: str) -> int | None:
    dev = torch.device(device)
    if dev.type == "cuda":
        props = guarded(torch.cuda.get_device_properties, dev.index or 0)
        return getattr(props, "total_memory", None)
    found = free_and_total(dev)
    return None if found is None else found[1]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors in a displayed result: a tensor, or a short tuple, list or dict of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list, dict)) and len(value) <= _MAX_ITEMS:
        items = value.values() if isinstance(value, dict) else value
        yield from (v for v in items if isinstance(v, torch.Tensor))


def _tensor_bytes(value: object) -> dict[str, int]:
    """Bytes of storage the value's tensors keep alive, per device, each storage once."""
    seen: set[tuple[str, int]] = set()
    held: dict[str, int] = {}
    for t in _tensors(value):
        if t.is_sparse or t.device.type == "meta":
            continue
        key = _storage_key(t)
        if key not in seen:
            seen.add(key)
            held[key[0]] = held.get(key[0], 0) + t.untyped_storage().nbytes()
    return held


def _assigned(tree: ast.AST) -> list[str]:
    """The names a cell binds at its top level, in order, each once."""
    names: dict[str, None] = {}
    for node in getattr(tree, "body", []):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Name):
                    names[sub.id] = None
    return list(names)


def _called(tree: ast.AST, ns: dict[str, Any]) -> Iterator[Any]:
    """The objects a cell calls by a name or a dotted name (`model(x)`, `net.head(x)`)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            found = _lookup(node.func, ns)
            if found is not None:
                yield found


def _lookup(node: ast.AST, ns: dict[str, Any]) -> Any:
    if isinstance(node, ast.Name):
        return ns.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _lookup(node.value, ns)
        return None if owner is None else getattr(owner, node.attr, None)
    return None


def _graph_roots(value: object) -> list[Any]:
    """The autograd nodes of a value's tensors (a tensor, or a tuple, list or dict)."""
    return [t.grad_fn for t in _tensors(value) if t.grad_fn is not None]


_SAVED: dict[type, tuple[str, ...]] = {}  # per node type, its saved-tensor attributes


def _saved_bytes(roots: Iterable[Any], skip: set[tuple[str, int]]) -> int:
    """Bytes of the tensors the graphs behind `roots` saved for backward, each storage
    once, less those in `skip` (the modules' weights, the namespace's tensors)."""
    seen_nodes: set[int] = set()
    seen = set(skip)
    total = 0
    todo = list(roots)
    while todo and len(seen_nodes) < _MAX_NODES:
        node = todo.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        kind = type(node)
        if kind not in _SAVED:
            _SAVED[kind] = tuple(a for a in dir(node) if a.startswith("_saved_"))
        for attr in _SAVED[kind]:
            try:
                saved = getattr(node, attr)
            except RuntimeError:  # freed by a backward already
                continue
            for t in saved if isinstance(saved, (tuple, list)) else (saved,):
                if isinstance(t, torch.Tensor) and not t.is_sparse:
                    key = _storage_key(t)
                    if key not in seen:
                        seen.add(key)
                        total += t.untyped_storage().nbytes()
        todo.extend(fn for fn, _ in node.next_functions)
    return total
