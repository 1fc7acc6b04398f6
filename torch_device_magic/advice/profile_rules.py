"""`%%profile`'s advice: what to change, from the events the capture already read.

Each rule is a plain function of the capture's events (profile.events.Event), their
analysis, the line names and a few settings read once at the report (`Setting`);
it returns an `Advice` record or None. The texts live here and nowhere else; the
thresholds in thresholds.py, beside the per-cell notes' (two are shared, so that a
note under a cell and this advice say the same thing).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..units import fmt_bytes, fmt_seconds, plural
from . import compiles
from .thresholds import (
    CPU_OPS_SHARE,
    DATA_PARALLEL_GPUS,
    DEVICE_BUSY,
    FRAGMENTED,
    LOADER_SHARE,
    NEAR_CAPACITY,
    PAGEABLE_BYTES,
    SHORT_KERNELS,
    TENSOR_CORES,
    TINY_HIT_S,
    TINY_HITS,
    TINY_SHARE,
)

if TYPE_CHECKING:
    from ..profile.events import Analysis, Event

_MATMUL = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul",
                     "aten::linear", "aten::convolution", "aten::_convolution",
                     "aten::cudnn_convolution", "aten::conv1d", "aten::conv2d", "aten::conv3d"})
# kernel names of tensor-core GEMMs and convolutions (tb's list, and later archs'); an
# xmma kernel of f32f32 types alone is not one
_TENSOR_CORE_MARKS = ("884", "1688", "16816", "8816", "hmma", "wmma", "tensorop", "gmma",
                      "tf32", "f16", "implicit_gemm")
_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "hipLaunchKernel")


@dataclass(slots=True)
class Advice:
    """One line of advice, as data (`%%profile -o`'s `report.advice`)."""

    rule: str  # 'tiny ops', 'input pipeline', ...
    figure: float  # the measured figure the threshold is about
    threshold: float
    line: str | None  # the cell's line it concerns ('3'), where there is one
    text: str


@dataclass(slots=True)
class Setting:
    """What the rules read besides the events: the machine and torch's settings."""

    wall_s: float
    cores: int = 1  # the cores the process may use
    threads: int = 1  # torch.get_num_threads()
    cuda: bool = False  # CUDA was in use
    capability: tuple[int, int] | None = None
    total_memory: int | None = None  # the device's
    peak_bytes: int | None = None  # the cell's peak allocated on the device
    reserved_bytes: int | None = None  # reserved by the caching allocator at the end
    cudnn_benchmark: bool = False
    # torch.compile's functions that recompiled or hit the recompile limit in the cell
    recompiles: list[compiles.Function] = field(default_factory=list)
    recompile_limit: int | None = None
    largest: tuple[str, int, str] | None = None  # --memory: the largest allocation's line,
    # its bytes and its code
    gpus: int = 0  # CUDA's devices, where CUDA is initialised
    data_parallel: str | None = None  # a name the cell reads that holds a DataParallel


def read_setting(
    wall_s: float, cuda: bool, peak_bytes: int | None, compiled_before: Sequence[Any] = (),
) -> Setting:
    """The settings now; the device's only where CUDA was in use (nothing starts it), and
    the recompiles since `compiled_before` (compiles.records() before the cell)."""
    import torch

    before = {id(r) for r in compiled_before}
    everything = compiles.records()
    recompiled = [f for f in compiles.functions([r for r in everything if id(r) not in before],
                                                everything) if f.recompiles or f.limit]
    setting = Setting(wall_s, cores(), torch.get_num_threads(), cuda, peak_bytes=peak_bytes,
                      cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
                      recompiles=recompiled, recompile_limit=compiles.recompile_limit())
    if torch.cuda.is_initialized():  # never the call that starts CUDA
        setting.gpus = torch.cuda.device_count()
    if cuda:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        setting.capability = (props.major, props.minor)
        setting.total_memory = props.total_memory
        setting.reserved_bytes = torch.cuda.memory_reserved()
    return setting


def data_parallel(values: Iterable[tuple[str, Any]]) -> str | None:
    """The first of these (name, value) pairs whose value is a torch.nn.DataParallel or a
    module holding one."""
    import torch

    for name, value in values:
        if isinstance(value, torch.nn.Module) and any(
                isinstance(m, torch.nn.DataParallel) for m in value.modules()):
            return name
    return None


def cores() -> int:
    """The cores this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def advise(
    events: list[Event], analysis: Analysis, line_names: dict[str, tuple[str, str]],
    setting: Setting,
) -> list[Advice]:
    """Every rule's advice for one capture, in the rules' order."""
    by_kind: dict[str, list[Event]] = defaultdict(list)
    for e in events:  # one pass: a capture may hold 100,000 events
        by_kind[e.kind].append(e)
    facts = _Facts(by_kind, analysis, line_names, setting)
    return [a for rule in RULES if (a := rule(facts)) is not None]


@dataclass(slots=True)
class _Facts:
    by_kind: dict[str, list[Event]]
    analysis: Analysis
    line_names: dict[str, tuple[str, str]]
    setting: Setting

    def where(self, line: str | None) -> str | None:
        """The cell's line ('3') of a line range's name."""
        return self.line_names[line][0] if line in self.line_names else None

    def top_line(self, weights: Mapping[str | None, float]) -> str | None:
        named = {k: v for k, v in weights.items() if self.where(k) is not None}
        return self.where(max(named, key=named.__getitem__)) if named else None

    def of_kind(self, *kinds: str) -> list[Event]:
        return [e for kind in kinds for e in self.by_kind.get(kind, ())]


def _on(line: str | None) -> str:
    return f" on line {line}" if line is not None else ""


def tiny_ops(f: _Facts) -> Advice | None:
    """Rule 6 (ours): a line run thousands of times, each a few µs of tiny ops."""
    wall = f.setting.wall_s
    for row in sorted(f.analysis.lines, key=lambda r: -r.wall_s):
        if row.hits < TINY_HITS or not row.cpu_s or not wall:
            continue
        each, share = row.wall_s / row.hits, row.wall_s / wall
        if each < TINY_HIT_S and share >= TINY_SHARE:
            return Advice("tiny ops", share, TINY_SHARE, row.where, (
                f"line {row.where} ran {row.hits:,} times at {fmt_seconds(each)} a time: "
                f"{share:.0%} of the wall (over {TINY_SHARE:.0%}) is per-call overhead of tiny "
                "ops; make them one batched call (torch.randn(2000, 8), not torch.randn(8) in "
                "a loop of 2000)"))
    return None


def input_pipeline(f: _Facts) -> Advice | None:
    """Rule 1 (tb): the single-process DataLoader's share of the wall."""
    nexts = [e for e in f.of_kind("op")
             if "DataLoaderIter.__next__" in e.name and "_SingleProcess" in e.name]
    wall = f.setting.wall_s
    if not nexts or not wall:
        return None
    share = sum(e.end_ns - e.start_ns for e in nexts) / 1e9 / wall
    if share <= LOADER_SHARE:
        return None
    by_line: dict[str | None, float] = defaultdict(float)
    for e in nexts:
        by_line[e.line] += e.end_ns - e.start_ns
    line = f.top_line(by_line)
    pin = (", and pin_memory=True with .to(device, non_blocking=True)" if f.setting.cuda
           else "")
    return Advice("input pipeline", share, LOADER_SHARE, line, (
        f"the DataLoader{_on(line)} took {share:.0%} of the wall (over {LOADER_SHARE:.0%}) in "
        f"this process: give it workers, e.g. num_workers={max(f.setting.cores - 1, 1)} "
        f"({f.setting.cores} cores){pin}"))


def cpu_threads(f: _Facts) -> Advice | None:
    """Rule 7 (ours): torch's CPU work with threads far below the cores, or above them."""
    s = f.setting
    ops = sum(e.self_ns for e in f.of_kind("op") if e.name.startswith("aten::")) / 1e9
    if not s.wall_s or ops / s.wall_s < CPU_OPS_SHARE:
        return None
    if s.threads > s.cores:
        why = "above"
    elif s.threads < s.cores // 2:
        why = "far below"
    else:
        return None
    return Advice("CPU threads", s.threads, s.cores, None, (
        f"torch's CPU ops took {ops / s.wall_s:.0%} of the wall on {plural(s.threads, 'thread')}"
        f", {why} the {plural(s.cores, 'core')} this process may use: "
        f"torch.set_num_threads({s.cores})"))


def device_waits(f: _Facts) -> Advice | None:
    """Rule 2 (tb, HTA): the device busy below half the wall, and which kind of wait."""
    a, wall = f.analysis, f.setting.wall_s
    if not a.device_recorded or a.device_busy_s is None or not wall:
        return None
    busy = a.device_busy_s / wall
    if busy >= DEVICE_BUSY:
        return None
    head = f"the device was busy {busy:.0%} of the wall (under {DEVICE_BUSY:.0%}): "
    if a.stalls:
        return Advice("device waits (sync)", busy, DEVICE_BUSY, None, head + (
            f"the host waited for it: {a.stalls[0]}; keep values on the device until the "
            "end of the loop"))
    kernels = sorted(f.of_kind("kernel"), key=lambda e: e.start_ns)
    launches = {e.correlation: e for e in f.of_kind("runtime") if e.name in _LAUNCH}
    short = [k for k in kernels if (r := launches.get(k.correlation)) is not None
             and k.end_ns - k.start_ns < r.end_ns - r.start_ns]
    if kernels and len(short) / len(kernels) >= SHORT_KERNELS:
        line = f.top_line(Counter(k.line for k in short))
        return Advice("device waits (launch)", busy, DEVICE_BUSY, line, head + (
            f"{len(short):,} of {len(kernels):,} kernels{_on(line)} ran shorter than their "
            "launch; fuse them with torch.compile or CUDA graphs"))
    line_at = a.line_at or (lambda t: None)
    gaps: dict[str | None, float] = defaultdict(float)
    device = sorted(f.of_kind("kernel", "memcpy", "memset"), key=lambda e: e.start_ns)
    end = device[0].end_ns if device else 0
    for d in device[1:]:
        if d.start_ns > end:  # idle: the line the host ran meanwhile held it
            gaps[line_at((end + d.start_ns) // 2)] += d.start_ns - end
        end = max(end, d.end_ns)
    line = f.top_line(gaps)
    held = f", most while line {line} ran" if line is not None else ""
    return Advice("device waits (host)", busy, DEVICE_BUSY, line, head + (
        f"the host left it idle between kernels{held}; give it more work per launch (a "
        "bigger batch), or move that line's work to the device"))


def tensor_cores(f: _Facts) -> Advice | None:
    """Rule 3 (tb): fp32 matmuls and convolutions with no tensor-core kernels."""
    cap = f.setting.capability
    if cap is None or cap < TENSOR_CORES:
        return None
    by_id = {e.correlation: e for e in f.of_kind("op") if e.correlation}
    mats = []
    for k in f.of_kind("kernel"):
        op = by_id.get(k.linked)
        while op is not None and op.name not in _MATMUL:
            op = op.parent
        if op is not None:
            mats.append(k)
    names = {k.name.lower() for k in mats}  # a few distinct kernels, launched many times
    if not mats or any(m in n for n in names for m in _TENSOR_CORE_MARKS):
        return None
    lines = sorted({w for k in mats if (w := f.where(k.line)) is not None}, key=_line_key)
    said = f" on line{'s' if len(lines) > 1 else ''} {', '.join(lines)}" if lines else ""
    return Advice("tensor cores", float(len(mats)), 0.0, lines[0] if lines else None, (
        f"{len(mats):,} matmul/conv kernels{said} ran without tensor cores on a device of "
        f"compute capability {cap[0]}.{cap[1]} (7.0 has them): torch.autocast('cuda', "
        "dtype=torch.bfloat16) (float16 with a GradScaler before 8.0), or "
        "torch.set_float32_matmul_precision('high')"))


def memory(f: _Facts) -> Advice | None:
    """Rule 4 (tb): the peak near the device's memory."""
    s = f.setting
    if not s.peak_bytes or not s.total_memory:
        return None
    share = s.peak_bytes / s.total_memory
    if share <= NEAR_CAPACITY:
        return None
    frag = ""
    if s.reserved_bytes and s.reserved_bytes > FRAGMENTED * s.peak_bytes:
        frag = (f"; reserved {fmt_bytes(s.reserved_bytes)} is far above it: "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    line, top = None, ""
    if s.largest is not None:
        line, size, code = s.largest
        top = f"; the largest allocation: line {line} ({fmt_bytes(size)}): {code}"
    return Advice("memory", share, NEAR_CAPACITY, line, (
        f"the peak {fmt_bytes(s.peak_bytes)} is {share:.0%} of the device's "
        f"{fmt_bytes(s.total_memory)} (over {NEAR_CAPACITY:.0%}): activation checkpointing, "
        f"torch.autocast or a smaller batch{frag}{top}"))


def pageable_copies(f: _Facts) -> Advice | None:
    """Rule 5 (ours): host-to-device copies from pageable memory."""
    copies = [e for e in f.of_kind("memcpy") if "HtoD" in e.name and "Pageable" in e.name]
    total = sum(e.nbytes for e in copies)
    if total < PAGEABLE_BYTES:
        return None
    by_line: dict[str | None, float] = defaultdict(float)
    for e in copies:
        by_line[e.line] += e.nbytes
    lines = sorted({w for e in copies if (w := f.where(e.line)) is not None}, key=_line_key)
    took = sum(e.end_ns - e.start_ns for e in copies) / 1e9
    said = f" on line{'s' if len(lines) > 1 else ''} {', '.join(lines)}" if lines else ""
    return Advice("pageable copies", float(total), float(PAGEABLE_BYTES), f.top_line(by_line), (
        f"{len(copies):,} host-to-device copies{said} of {fmt_bytes(total)} from pageable "
        f"memory took {fmt_seconds(took)}: .pin_memory() the source (or pin_memory=True in "
        "the DataLoader) and copy with non_blocking=True"))


def cudnn_benchmark(f: _Facts) -> Advice | None:
    """Rule 9 (ours): convolutions of fixed shapes with cuDNN's autotuning off."""
    if f.setting.cudnn_benchmark:
        return None
    convs = [e for e in f.of_kind("op") if e.name == "aten::cudnn_convolution" and e.shapes]
    if len(convs) < 2 or len({e.shapes for e in convs}) > len(convs) // 2:
        return None  # one call, or shapes that change: autotuning would not pay
    line = f.top_line(Counter(e.line for e in convs))
    return Advice("cuDNN autotuning", float(len(convs)), 2.0, line, (
        f"{len(convs):,} convolutions{_on(line)} of fixed shapes ran with "
        "torch.backends.cudnn.benchmark off: turn it on (torch.backends.cudnn.benchmark = "
        "True) to let cuDNN pick the fastest kernel"))


def recompiles(f: _Facts) -> Advice | None:
    """Rule 10 (ours): torch.compile recompiled during the cell. The counts are the
    notes' (compiles.functions): a function's resumed parts recompile with it, and the
    compile that hits the recompile limit is no recompile."""
    done = f.setting.recompiles
    if not done:
        return None
    last = done[-1]
    times = sum(fn.recompiles for fn in done)
    limit = f.setting.recompile_limit
    of = "" if limit is None else f" ({limit})"
    hit = [fn for fn in done if fn.limit is not None]
    stop = "".join(f"; {fn.name} then hit the recompile limit{of} and now runs uncompiled"
                   for fn in hit)
    return Advice("recompiles", float(times), 0.0, None, (
        f"torch.compile recompiled {plural(times, 'time')} in this cell, "
        f"last {last.where()}: {last.last}{stop}; keep that input fixed, or mark it dynamic "
        "(torch._dynamo.mark_dynamic, or torch.compile(dynamic=True))"))


def data_parallel_gpus(f: _Facts) -> Advice | None:
    """Rule 8 (tb): DataParallel with more than one GPU."""
    s = f.setting
    if s.data_parallel is None or s.gpus < DATA_PARALLEL_GPUS:
        return None
    return Advice("DataParallel", float(s.gpus), float(DATA_PARALLEL_GPUS), None, (
        f"{s.data_parallel} is a torch.nn.DataParallel on {s.gpus} GPUs (more than one): "
        "one process drives them all and copies the model to each every step; "
        "DistributedDataParallel (a process per GPU, torchrun) is faster"))


def _line_key(where: str) -> tuple[int, str]:
    return (int(where), "") if where.isdigit() else (1 << 30, where)


RULES: tuple[Callable[[_Facts], Advice | None], ...] = (
    input_pipeline, device_waits, tensor_cores, memory, pageable_copies, tiny_ops,
    cpu_threads, data_parallel_gpus, cudnn_benchmark, recompiles,
)
