"""`%%profile`'s advice: what to change, from the events the capture already read.

Each rule is a plain function of the capture's events (kineto.events.Event), their
analysis, the line names and a few settings read once at the report (`Setting`);
it returns an `Advice` record or None. The texts live here and nowhere else; the
thresholds in thresholds.py, beside the per-cell notes' (two are shared, so that a
note under a cell and this advice say the same thing).
"""

from __future__ import annotations

import ast
import os
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..kineto import names
from ..kineto.analysis import Analysis
from ..kineto.events import Event
from ..units import fmt_bytes, fmt_seconds, plural
from . import compiles
from .thresholds import (
    COLD_RUN,
    CPU_OPS_SHARE,
    DATA_PARALLEL_GPUS,
    DEVICE_BUSY,
    FRAGMENTED,
    LOADER_SHARE,
    NEAR_CAPACITY,
    PAGEABLE_BYTES,
    SHORT_KERNELS,
    TENSOR_CORES,
    TINY_CALL_S,
    TINY_HITS,
    TINY_SHARE,
    WARM_UP_LINE,
    WARM_UP_WALL,
    capacity_share,
)


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
    tf32_matmul: bool = False  # torch.backends.cuda.matmul.allow_tf32 (precision 'high')
    tf32_conv: bool = True  # torch.backends.cudnn.allow_tf32 (torch's default: on)
    total_memory: int | None = None  # the device's
    peak_bytes: int | None = None  # allocated on the device at the cell's peak
    # (Measurement.device_top_bytes: what it held before, and the peak over that)
    reserved_bytes: int | None = None  # reserved by the caching allocator at the end
    cudnn_benchmark: bool = False
    # torch.compile's functions that recompiled or hit the recompile limit in the cell
    recompiles: list[compiles.Function] = field(default_factory=list)
    recompile_limit: int | None = None
    largest: tuple[str, int, str] | None = None  # --memory: the largest allocation's line,
    # its bytes and its code
    gpus: int = 0  # CUDA's devices, where CUDA is initialised
    data_parallel: str | None = None  # a name the cell reads that holds a DataParallel
    # the cell's outer loops that ran: each one's lines as the line table numbers them (its
    # header to its body's end) and its steps, every run's together
    loops: list[tuple[range, int]] = field(default_factory=list)


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
        setting.tf32_matmul = bool(torch.backends.cuda.matmul.allow_tf32)
        setting.tf32_conv = bool(torch.backends.cudnn.allow_tf32)
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
    facts.loading, facts.loaded = _loading(facts)
    return [a for rule in RULES if (a := rule(facts)) is not None]


@dataclass(slots=True)
class _Facts:
    by_kind: dict[str, list[Event]]
    analysis: Analysis
    line_names: dict[str, tuple[str, str]]
    setting: Setting
    loading: dict[str | None, int] = field(default_factory=dict)  # a line range's
    # first-call loading (ns)
    loaded: list[str] = field(default_factory=list)  # what loaded: its kinds, in words

    def cold(self) -> bool:
        """Most of the run was first-call loading: its launch and host figures mislead."""
        wall = self.events_wall()  # the loading is the events': like with like
        return bool(wall) and sum(self.loading.values()) / 1e9 >= COLD_RUN * wall

    def warm_up_lines(self) -> set[str | None]:
        """The line ranges most of whose wall was first-call loading."""
        walls = {r.where: r.wall_s for r in self.analysis.lines}
        return {name for name, ns in self.loading.items()
                if ns / 1e9 >= WARM_UP_LINE * walls.get(self.where(name) or "", 0.0)}

    def where(self, line: str | None) -> str | None:
        """The cell's line ('3') of a line range's name."""
        return self.line_names[line][0] if line in self.line_names else None

    def top_line(self, weights: Mapping[str | None, float]) -> str | None:
        named = {k: v for k, v in weights.items() if self.where(k) is not None}
        return self.where(max(named, key=named.__getitem__)) if named else None

    def events_wall(self) -> float:
        """The wall the events cover: the recorded time where the profiler paused."""
        return self.analysis.recorded_s or self.setting.wall_s

    def of_kind(self, *kinds: str) -> list[Event]:
        return [e for kind in kinds for e in self.by_kind.get(kind, ())]


def _loading(f: _Facts) -> tuple[dict[str | None, int], list[str]]:
    """Each line range's first-call loading: CUDA's lazy loading of a kernel's module (a
    first cuBLAS or cuDNN call's, an autotuner's candidates' too), the driver's module
    loads, compiling; the outermost of nested ones, by the line that ran at its start.
    And what loaded, in words."""
    found = [e for e in f.of_kind("overhead") if e.name in names.LOADING]
    found += [e for e in f.of_kind("runtime") if e.name.startswith(names.LOADING_CALLS)]
    kinds = ["CUDA loading kernels"] if found else []  # a first cuBLAS/cuDNN call's too
    compiling = [e for e in f.of_kind("op") if e.name.endswith(names.COMPILING)]
    kinds += ["torch.compile compiling"] if compiling else []
    found += compiling
    line_at = f.analysis.line_at or (lambda t: None)
    out: dict[str | None, int] = defaultdict(int)
    end = -1
    for e in sorted(found, key=lambda e: (e.start_ns, -e.end_ns)):
        if e.start_ns >= end:  # not inside the last one counted
            out[line_at(e.start_ns)] += e.end_ns - e.start_ns
            end = e.end_ns
    return dict(out), kinds


def warm_up(f: _Facts) -> Advice | None:
    """Ours: a run whose time went to first-call loading, which a second run does not pay."""
    wall, total = f.events_wall(), sum(f.loading.values()) / 1e9
    if not wall or total < WARM_UP_WALL * wall:
        return None
    line = f.top_line(f.loading)
    said = (f"{fmt_seconds(total)} ({total / wall:.0%} of the wall, over "
            f"{WARM_UP_WALL:.0%}){_on(line)} went to first-call loading "
            f"({' and '.join(f.loaded)})")
    rest = ("this was a cold first run, whose launch and host figures do not hold"
            if f.cold() else "a cost of the first run only")
    return Advice("warm-up", total / wall, WARM_UP_WALL, line, (
        f"{said}: {rest}; run the cell again for a warm run's figures"))


def _on(line: str | None) -> str:
    return f" on line {line}" if line is not None else ""


def tiny_ops(f: _Facts) -> Advice | None:
    """Rule 6 (ours): many calls of the same small op, each a few µs, on independent data:
    a line that runs many times a step of the loop it sits in (an inner loop, a
    comprehension), and not a chain where each run takes the last one's result
    (x = layer(x)); the remedy from what the line does."""
    wall = f.setting.wall_s
    if not wall or f.cold():
        return None
    names = {w: n for n, (w, _) in f.line_names.items()}
    counts = None
    for row in sorted(f.analysis.lines, key=lambda r: -r.wall_s):
        name = names.get(row.where)
        if name is None or row.wall_s / wall < TINY_SHARE or _chained(row.code):
            continue
        counts = counts or _LineCounts(f)
        if row.hits <= counts.steps(name):
            continue
        op, calls, runs, call_s = counts.of(name, row.hits)
        each, share = row.wall_s / calls, row.wall_s / wall
        if calls < TINY_HITS or (each if call_s is None else call_s) >= TINY_CALL_S:
            continue
        ran = (f"ran {plural(runs, 'time')} ({row.hits:,} iterations of its loop or "
               f"comprehension)" if runs != row.hits else f"ran {row.hits:,} times")
        what = (f"{calls:,} calls of {op} at {fmt_seconds(each)} a call"
                + ("" if call_s is None else f" ({fmt_seconds(call_s)} in the op)")
                if op else f"at {fmt_seconds(each)} a time")
        return Advice("tiny ops", share, TINY_SHARE, row.where, (
            f"line {row.where} {ran}: {what} took {share:.0%} of the wall (over "
            f"{TINY_SHARE:.0%}), mostly the per-call overhead of small ops; "
            f"{_batched(f, row.code, op, calls // runs)}"))
    return None


class _LineCounts:
    """Per line range, counted once over the events: its events, its statement runs
    (consecutive events of one range are one run: a comprehension's iterations), the ops
    it called at the top (not inside another op), and the cell's top-level lines it ran
    under (itself, or the lines that called its function)."""

    def __init__(self, f: _Facts) -> None:
        self.facts = f
        self.events: Counter[str] = Counter()
        self.runs: Counter[str] = Counter()
        self.tops: dict[str, set[str]] = defaultdict(set)
        last = None
        for e in sorted(f.of_kind("line"), key=lambda e: e.start_ns):
            self.events[e.name] += 1
            self.runs[e.name] += e.name != last
            last = e.name
            top, up = e, e.parent
            while up is not None:
                top = up if up.kind == "line" else top
                up = up.parent
            self.tops[e.name].add(top.name)
        self.ops: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        for e in f.of_kind("op"):
            if e.line is not None and (e.parent is None or e.parent.kind == "line"):
                self.ops[e.line][e.name].append(e.end_ns - e.start_ns)

    def steps(self, name: str) -> int:
        """How many steps the loop a line range sits in ran: the cell's outer loop around
        the top-level line it ran under (the longest, where it ran under several); 1
        outside the loops. A line that runs once a step is sequential work."""
        lines = {int(w) for top in self.tops[name] or {name}
                 if (w := self.facts.where(top)) is not None and w.isdigit()}
        return max((steps for loop, steps in self.facts.setting.loops
                    for n in lines if n in loop), default=1)

    def of(self, name: str, hits: int) -> tuple[str | None, int, int, float | None]:
        """The op a line range spent most in, its calls and the line's runs, over every step
        (the events' counts scaled by the line's hits where the events cover fewer
        steps), and the median time of one of the op's calls recorded (None: no op)."""
        if not self.events[name]:
            return None, hits, hits, None
        scale = hits / self.events[name]
        runs = max(round(self.runs[name] * scale), 1)
        if not self.ops[name]:
            return None, hits, runs, None
        # the op the line spent most in: a line of small selects around big matmuls is work
        op, took = max(self.ops[name].items(), key=lambda item: sum(item[1]))
        return op, round(len(took) * scale), runs, statistics.median(took) / 1e9


def _chained(code: str) -> bool:
    """An assignment whose value reads the name it binds (x = layer(x)): each run takes
    the last one's result, so the runs cannot be one call."""
    try:
        tree = ast.parse(code.strip())
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            bound = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if bound & {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}:
                return True
    return False




def _batched(f: _Facts, code: str, op: str | None, per_run: int) -> str:
    """The remedy for what the line does: a parameter update, a factory call, indexing;
    without an example where its kind is not known."""
    if ".grad" in code and ("+=" in code or "-=" in code or "_(" in code):
        return ("update every parameter in one call: an optimizer with foreach=True "
                "(torch.optim.SGD(parameters, lr=..., foreach=True)), or "
                "torch._foreach_add_(params, grads, alpha=-lr)")
    if op in names.FACTORIES:
        fn = "torch." + op.removeprefix("aten::")
        shape = max((c.shapes[0] for c in f.of_kind("op") if c.parent is not None
                     and c.parent.name == op and c.shapes and c.shapes[0]), default=None)
        if shape is not None and per_run > 1:
            dims = ", ".join(map(str, shape))
            return (f"make them one batched call ({fn}({per_run}, {dims}), not {fn}({dims}) "
                    f"{per_run:,} times)")
        return f"make them one batched call ({fn} with a leading dimension for the count)"
    if op in names.INDEXING:
        return ("index once with a tensor of all the indices (x[idx], torch.gather, or "
                "index_add_ to accumulate), not one element a call")
    return "do the work in fewer, larger calls"


def input_pipeline(f: _Facts) -> Advice | None:
    """Rule 1 (tb): the single-process DataLoader's share of the wall."""
    nexts = [e for e in f.of_kind("op")
             if "DataLoaderIter.__next__" in e.name and "_SingleProcess" in e.name]
    wall = f.events_wall()
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
    s, wall = f.setting, f.events_wall()
    ops = sum(e.self_ns for e in f.of_kind("op") if e.name.startswith("aten::")) / 1e9
    if not wall or ops / wall < CPU_OPS_SHARE:
        return None
    if s.threads > s.cores:
        why = "above"
    elif s.threads < s.cores // 2:
        why = "far below"
    else:
        return None
    return Advice("CPU threads", s.threads, s.cores, None, (
        f"torch's CPU ops took {ops / wall:.0%} of the wall on {plural(s.threads, 'thread')}"
        f", {why} the {plural(s.cores, 'core')} this process may use: "
        f"torch.set_num_threads({s.cores})"))


def device_waits(f: _Facts) -> Advice | None:
    """Rule 2 (tb, HTA): the device busy below half the wall, and which kind of wait."""
    a, wall = f.analysis, f.events_wall()
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
    if f.cold():  # the warm-up rule says why, and to run it again
        return None
    warm = f.warm_up_lines()  # no launch or host advice on a line that was loading
    kernels = sorted((k for k in f.of_kind("kernel") if k.line not in warm),
                     key=lambda e: e.start_ns)
    launches = {e.correlation: e for e in f.of_kind("runtime") if e.name in names.LAUNCH}
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
    if [gaps.pop(name) for name in warm if name in gaps] and not gaps:
        return None  # idle only while lines were loading
    line = f.top_line(gaps)
    held = f", most while line {line} ran" if line is not None else ""
    return Advice("device waits (host)", busy, DEVICE_BUSY, line, head + (
        f"the host left it idle between kernels{held}; give it more work per launch (a "
        "bigger batch), or move that line's work to the device"))


def tensor_cores(f: _Facts) -> Advice | None:
    """Rule 3 (tb): fp32 matmuls and convolutions with TF32 off, so no tensor cores."""
    cap = f.setting.capability
    if cap is None or cap < TENSOR_CORES:
        return None
    by_id = {e.correlation: e for e in f.of_kind("op") if e.correlation}
    without: list[tuple[Event, Event]] = []  # (kernel, its matmul or convolution)
    for k in f.of_kind("kernel"):
        op = by_id.get(k.linked)
        # The innermost matmul around the kernel; a cast's kernel is none of its (under
        # autocast an fp32 matmul casts its inputs, then calls a bf16 one)
        while op is not None and op.name not in names.MATMULS and op.name not in names.CASTS:
            op = op.parent
        if op is None or op.name in names.CASTS:
            continue
        uses = _op_tensor_cores(op, f.setting)
        if uses is None:
            uses = _kernel_tensor_cores(k.name)
        if uses is False:
            without.append((k, op))
    if not without:
        return None
    lines = sorted({w for k, _ in without if (w := f.where(k.line)) is not None}, key=_line_key)
    said = f" on line{'s' if len(lines) > 1 else ''} {', '.join(lines)}" if lines else ""
    conv = ("; for convolutions, torch.backends.cudnn.allow_tf32 = True"
            if any(op.name not in names.CUBLAS for _, op in without) else "")
    return Advice("tensor cores", float(len(without)), 0.0, lines[0] if lines else None, (
        f"{len(without):,} matmul/conv kernels{said} ran in fp32 without tensor cores on a "
        f"device of compute capability {cap[0]}.{cap[1]} (7.0 has them): torch.autocast("
        "'cuda', dtype=torch.bfloat16) (float16 with a GradScaler before 8.0), or "
        f"torch.set_float32_matmul_precision('high'){conv}"))


def _op_tensor_cores(op: Event, s: Setting) -> bool | None:
    """Whether a matmul or convolution ran on tensor cores, from what it ran with: its
    inputs' dtypes and torch's TF32 setting for it; None where its inputs say nothing
    (not recorded, or float64, integers)."""
    dtypes = [d for shape, d in zip(op.shapes, op.dtypes) if shape]  # tensors', not scalars
    if any(d.startswith(names.REDUCED) for d in dtypes):
        return True
    if not dtypes or any(d != "float" for d in dtypes):
        return None
    return s.tf32_matmul if op.name in names.CUBLAS else s.tf32_conv


def _kernel_tensor_cores(name: str) -> bool | None:
    """The second signal: what a kernel's name says, where it says anything."""
    name = name.lower()
    if any(m in name for m in names.TENSOR_CORE_MARKS):
        return True
    if any(m in name for m in names.NO_TENSOR_CORE_MARKS):
        return False
    return None


def memory(f: _Facts) -> Advice | None:
    """Rule 4 (tb): the peak near the device's memory, by the test of the note under a
    cell (thresholds.capacity_share) on the same figure."""
    s = f.setting
    share = capacity_share(s.peak_bytes, s.total_memory)
    if share is None or s.peak_bytes is None or s.total_memory is None:
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
        f"{fmt_bytes(s.total_memory)} (at {NEAR_CAPACITY:.0%} or more): activation "
        f"checkpointing, torch.autocast or a smaller batch{frag}{top}"))


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
    warm_up, input_pipeline, device_waits, tensor_cores, memory, pageable_copies, tiny_ops,
    cpu_threads, data_parallel_gpus, cudnn_benchmark, recompiles,
)
