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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from ..cells import cell_names, names_bound
from ..probes import free_and_total, guarded, nvml_busy_percent
from ..units import fmt_bytes, fmt_per_device, fmt_seconds
from . import compiles
from .compiles import UTILS
from .holders import (
    bytes_by_device,
    graph_tensors,
    held_too,
    result_bytes,
    storage_keys,
    traceback_bytes,
)
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


def displayed(names: list[str], nbytes: int, device: str, total_bytes: int | None) -> Note | None:
    """The displayed result (`Out[n]`, `_`) alone keeps `nbytes` of tensors alive on
    `device`, IPython holding it under `names` (`Out[n]`, `_n`, `_`). Not `del Out[n]`:
    `_n`, `_` and the last result keep it too; %gpufree lets go of them all."""
    limit = _displayed_limit(total_bytes)
    if nbytes < limit:
        return None
    also = f", and {held_too(names)}: %gpufree lets go of them all" if len(names) > 1 else (
        ": %gpufree lets go of it")
    return Note("displayed", f"{names[0]} keeps {fmt_bytes(nbytes)} on {device}{also} (or end "
                "the line with ';')", nbytes, limit, names[0])


def _displayed_limit(total_bytes: int | None) -> int:
    """A displayed result this large is said: DISPLAYED_MIN_BYTES, or DISPLAYED_SHARE
    of an accelerator's memory where that is less."""
    if total_bytes:
        return min(DISPLAYED_MIN_BYTES, int(DISPLAYED_SHARE * total_bytes))
    return DISPLAYED_MIN_BYTES


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
        if getattr(result, "result", None) is not None:  # no name here: it would hold it
            found = self._displayed(result)
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
        return traceback_kept(traceback_bytes(error) or {})

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

    def _displayed(self, result: Any) -> Note | None:
        """The cell's result, where IPython's references to it alone keep it alive (a
        result that a name holds, `x` or `x[:3]`, gets none: deleting it frees nothing).
        The result's tensors are summed first, which costs nothing on a small one."""
        held = _tensor_bytes(result.result)
        if all(n < _displayed_limit(self.total_bytes(d)) for d, n in held.items()):
            return None
        shell = self._shell
        found = result_bytes(shell.user_ns, shell.user_ns_hidden, shell, id(result.result))
        if not found or not found[1]:
            return None
        names, alone = found
        device, nbytes = max(alone.items(), key=lambda item: item[1])
        return displayed(names, nbytes, device, self.total_bytes(device))

    def _inference(self, source: str) -> Note | None:
        """A cell that called modules, all in eval mode, and no backward, whose new names
        (in its `with` and `for` blocks too) carry an autograd graph, and that asked for no
        gradient (a saliency map's input made with requires_grad=True, in this cell or an
        earlier one, wants its graph for the next cell's backward)."""
        if "backward" in source or not torch.is_grad_enabled():
            return None
        try:
            tree = ast.parse(source)
        except SyntaxError:  # a cell magic's text, or IPython's own syntax
            return None
        ns = self._shell.user_ns
        if _asks_for_gradients(tree) or _reads_an_input_leaf(source, ns):
            return None
        modules = [m for m in _called(tree, ns) if isinstance(m, torch.nn.Module)]
        if not modules or any(m.training for m in modules):
            return None
        names = sorted(n for n in names_bound(source) if _with_graph(ns.get(n)))
        if not names:
            return None
        # What the graphs saved, less the modules' weights and the namespace's tensors.
        skip = storage_keys(t for m in modules for t in (*m.parameters(), *m.buffers()))
        skip.update(storage_keys(v for v in ns.values() if isinstance(v, torch.Tensor)))
        saved = storage_keys(graph_tensors(t for n in names for t in _with_graph(ns[n])))
        return inference(names, sum(n for key, n in saved.items() if key not in skip))

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
    """Per function (its code: two `forward`s are two): its first compiles, its
    recompiles (one note: the first reason, how many), its graph breaks, the recompile
    limit, skipped CUDA graphs. A name that two functions share says where each is."""
    found = compiles.functions(new, everything)
    names = [f.name for f in found]
    label = {id(f): f.where() if names.count(f.name) > 1 else f.name for f in found}
    yield from (compiled(label[id(f)], len(f.first), sum(f.first)) for f in found if f.first)
    yield from (recompiled(label[id(f)], f.reason, f.versions, limit, f.recompiles)
                for f in found if f.recompiles)
    for f in found:
        yield from (graph_break(label[id(f)], line, why) for line, why in f.breaks)
    yield from (recompile_limit(label[id(f)], limit, f.limit)
                for f in found if f.limit is not None)
    for f in found:
        yield from (cudagraphs_skipped(label[id(f)], why) for why in f.cudagraphs)


def _total_bytes(device: str) -> int | None:
    dev = torch.device(device)
    if dev.type == "cuda":
        props = guarded(torch.cuda.get_device_properties, dev.index or 0)
        return getattr(props, "total_memory", None)
    found = free_and_total(dev)
    return None if found is None else found[1]


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors in a displayed result: a tensor, or a short tuple, list or dict of them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list, dict)) and len(value) <= _MAX_ITEMS:
        items = value.values() if isinstance(value, dict) else value
        yield from (v for v in items if isinstance(v, torch.Tensor))


def _tensor_bytes(value: object) -> dict[str, int]:
    """Bytes of storage the value's tensors keep alive, per device, each storage once."""
    return bytes_by_device(storage_keys(
        t for t in _tensors(value) if not t.is_sparse and t.device.type != "meta"))


def _asks_for_gradients(tree: ast.AST) -> bool:
    """Whether a cell makes or sets a leaf with requires_grad (`requires_grad=True`,
    `.requires_grad_()`, `x.requires_grad = True`) or enables autograd itself
    (`torch.enable_grad`, `set_grad_enabled`): what it runs is not inference."""
    for node in ast.walk(tree):
        made = (isinstance(node, ast.keyword) and node.arg == "requires_grad"
                and not _is_false(node.value))
        enabled = isinstance(node, ast.Attribute) and node.attr in (
            "requires_grad_", "enable_grad", "set_grad_enabled")
        set_ = isinstance(node, ast.Assign) and not _is_false(node.value) and any(
            isinstance(t, ast.Attribute) and t.attr == "requires_grad" for t in node.targets)
        if made or enabled or set_:
            return True
    return False


def _reads_an_input_leaf(source: str, ns: dict[str, Any]) -> bool:
    """Whether the cell reads a tensor that asks for its own gradient: a leaf with
    requires_grad that is no module's weight (a Parameter), made in this cell or an
    earlier one (`x.requires_grad_()`, then `scores = model(x)`)."""
    return any(t.is_leaf and t.requires_grad and not isinstance(t, torch.nn.Parameter)
               for name in cell_names(source) for t in _tensors(ns.get(name)))


def _is_false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


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


def _with_graph(value: object) -> list[torch.Tensor]:
    """The tensors of a value (a tensor, or a tuple, list or dict) that carry a graph."""
    return [t for t in _tensors(value) if t.grad_fn is not None]
