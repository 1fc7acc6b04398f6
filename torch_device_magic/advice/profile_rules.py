"""`%%profile`'s advice: what to change, from the events the capture already read.

Each rule is a plain function of the capture's events (kineto.events.Event), their
analysis, the line names and a few settings read once at the report (`Setting`);
it returns an `Advice` record or None. The texts live here and nowhere else; the
thresholds in thresholds.py, beside the per-cell notes' (two are shared, so that a
note under a cell and this advice say the same thing).
"""

from __future__ import annotations

import ast
import functools
import math
import os
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..kineto import names, peaks
from ..kineto.analysis import Analysis
from ..kineto.events import Event
from ..units import fmt_bytes, fmt_flops, fmt_seconds, plural
from . import compiles
from .thresholds import (
    COLD_RUN,
    COUNTED_SHARE,
    CPU_OPS_SHARE,
    DATA_PARALLEL_GPUS,
    DEVICE_BUSY,
    FRAGMENTED,
    INDEX_GLUE_S,
    INDEXED_ROWS,
    LOADER_SHARE,
    MFU_HIGH,
    MFU_LOW,
    NEAR_CAPACITY,
    PAGEABLE_BYTES,
    SHORT_KERNELS,
    TENSOR_CORES,
    TINY_CALL_S,
    TINY_HITS,
    TINY_SHARE,
    WARM_UP_LINE,
    WARM_UP_WALL,
    WORKER_BATCH_S,
    WORKER_START_S,
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
    # the code the text says to type, where it gives one: it runs as typed in the cell's
    # namespace (with the tensors the text names: `I1`, `V`) and does what the line did
    example: str | None = None


@dataclass(slots=True)
class Loader:
    """A single-process DataLoader the cell reads, or a dataset of tensors in memory that
    it reads (the input-pipeline rule's): how the cell names the dataset, whether its rows
    are tensors in memory (a TensorDataset, or a Subset of one), whether the loader takes
    each batch's indices at once already (batch_size=None), and the loader that would,
    where it can be written."""

    dataset: str  # 'ds', 'loader.dataset'
    in_memory: bool
    batched: bool = False
    remedy: str | None = None


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
    source: str = ""  # the cell's code, as the line table numbers it: what each line writes
    # the names the cell reads that hold a tensor ('tensor') or a list or tuple of tensors of
    # one shape, dtype and device ('tensors'): what a remedy may index or stack
    kinds: dict[str, str] = field(default_factory=dict)
    loader: Loader | None = None  # the DataLoader (or in-memory dataset) the cell reads
    claim: peaks.Claim | None = None  # the MFU claimed, or why none (kineto.peaks)


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
        setting.tf32_matmul = peaks.tf32_matmul()
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


def name_kinds(values: Iterable[tuple[str, Any]]) -> dict[str, str]:
    """Which of these (name, value) pairs hold a tensor ('tensor'), or a list or tuple of
    tensors that torch.stack takes ('tensors': one shape, dtype and device)."""
    import torch

    out = {}
    for name, value in values:
        if isinstance(value, torch.Tensor):
            out[name] = "tensor"
        elif (isinstance(value, (list, tuple)) and 0 < len(value) <= 100_000
              and all(isinstance(v, torch.Tensor) for v in value)
              and len({(v.shape, v.dtype, v.device) for v in value}) == 1):
            out[name] = "tensors"
    return out


def loader(values: Iterable[tuple[str, Any]],
           namespace: Mapping[str, Any] | None = None) -> Loader | None:
    """The first single-process DataLoader among these (name, value) pairs, else the first
    dataset of tensors in memory (a loader the cell makes itself reads it); its dataset
    named as a name of the `namespace` holds it, where one does."""
    from torch.utils.data import (
        DataLoader,
        RandomSampler,
        SequentialSampler,
        Subset,
        TensorDataset,
    )
    from torch.utils.data._utils.collate import default_collate

    def in_memory(ds: Any) -> bool:
        while isinstance(ds, Subset):  # random_split's: a list of indices reaches its dataset
            ds = ds.dataset
        return isinstance(ds, TensorDataset)

    pairs = list(values)
    named = [*pairs, *((n, v) for n, v in (namespace or {}).items() if not n.startswith("_"))]
    for name, value in pairs:
        if not isinstance(value, DataLoader) or value.num_workers:
            continue
        ds = next((n for n, v in named if v is value.dataset), f"{name}.dataset")
        if value.batch_size is None:
            return Loader(ds, in_memory(value.dataset), batched=True)
        if not in_memory(value.dataset) or value.collate_fn is not default_collate:
            return Loader(ds, in_memory(value.dataset))
        sampler: Any = value.sampler
        kind = type(sampler)
        if kind is RandomSampler and not sampler.replacement and sampler.generator is None \
                and sampler._num_samples is None:
            order = f"RandomSampler({ds})"
        elif kind is SequentialSampler:
            order = f"SequentialSampler({ds})"
        else:
            order = f"{name}.sampler"
        pin = ", pin_memory=True" if value.pin_memory else ""
        return Loader(ds, True, remedy=(
            f"DataLoader({ds}, sampler=BatchSampler({order}, {value.batch_size}, "
            f"drop_last={value.drop_last}), batch_size=None{pin})"))
    return next((Loader(name, True) for name, value in pairs if in_memory(value)), None)


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
    cell: dict[int, _Line] | None = None  # the cell's statements by line, read when asked

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

    def code(self, where: str, code: str) -> _Line | None:
        """What a line writes: its statement in the cell's code, else (a line of -f's
        function, a cell that is not Python as it stands) the line's own text alone."""
        if self.cell is None:
            self.cell = _statements(self.setting.source)
        found = self.cell.get(int(where)) if where.isdigit() else None
        return found or _statements(code.strip()).get(1)

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
        f"{said}: {rest}; run the cell again for a warm run's figures (a training cell "
        "trains once more)"))


def _on(line: str | None) -> str:
    return f" on line {line}" if line is not None else ""


def tiny_ops(f: _Facts) -> Advice | None:
    """Rule 6 (ours): many calls of the same small op, each a few µs, on independent data:
    a line that runs many times a step of the loop it sits in (an inner loop, a
    comprehension), and not a chain where each run takes the last one's result
    (x = layer(x)); a line that called no torch op spends Python's time, not this. The
    remedy from what the line writes (`_remedy`)."""
    wall = f.setting.wall_s
    if not wall or f.cold():
        return None
    by_where = {w: n for n, (w, _) in f.line_names.items()}
    counts = None
    for row in sorted(f.analysis.lines, key=lambda r: -r.wall_s):
        name = by_where.get(row.where)
        if name is None or row.wall_s / wall < TINY_SHARE or _chained(row.code):
            continue
        counts = counts or _LineCounts(f)
        if row.hits <= counts.steps(name):
            continue
        found = counts.of(name, row.hits)
        if found is None or found[1] < TINY_HITS or found[3] >= TINY_CALL_S:
            continue
        op, calls, runs, call_s = found
        share = row.wall_s / wall
        # the line's wall is the tracer's too: said as what it is, a run's (a call's in a
        # comprehension, whose runs are few), beside the op's own median call
        each = (f"{fmt_seconds(row.wall_s / calls)} a call" if runs != row.hits
                else f"{fmt_seconds(row.wall_s / row.hits)} a run")
        ran = plural(runs, "time") if runs != row.hits else f"{row.hits:,} times"
        text, example = _remedy(f.code(row.where, row.code), f.setting.kinds, op,
                                functools.partial(counts.per_run, name, hits=row.hits))
        return Advice("tiny ops", share, TINY_SHARE, row.where, (
            f"line {row.where} ran {ran}: {calls:,} calls of {op} ({fmt_seconds(call_s)} "
            f"in the op, their median; the line's wall under the tracer {each}) took "
            f"{share:.0%} of the wall (over {TINY_SHARE:.0%}), mostly the per-call overhead "
            f"of small ops; {text}"), example)
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

    def _scale(self, name: str, hits: int) -> tuple[float, int]:
        """The events' counts to every step (they may cover fewer), and the line's runs."""
        scale = hits / self.events[name]
        return scale, max(round(self.runs[name] * scale), 1)

    def of(self, name: str, hits: int) -> tuple[str, int, int, float] | None:
        """The op a line range spent most in, its calls and the line's runs, over every step,
        and the median time of one of the op's calls recorded; None: it called none."""
        if not self.events[name] or not self.ops[name]:
            return None
        scale, runs = self._scale(name, hits)
        # the op the line spent most in: a line of small selects around big matmuls is work
        op, took = max(self.ops[name].items(), key=lambda item: sum(item[1]))
        return op, round(len(took) * scale), runs, statistics.median(took) / 1e9

    def per_run(self, name: str, op: str, *, hits: int) -> int | None:
        """How many calls of `op` each run of the line made, where every run made as many."""
        if not self.events[name] or not self.ops[name].get(op):
            return None
        scale, runs = self._scale(name, hits)
        calls = round(len(self.ops[name][op]) * scale)
        return calls // runs if calls % runs == 0 else None


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


# --- what a line writes: the tiny-ops remedy, from the line's own code ---------------------


@dataclass(slots=True)
class _Line:
    """A line's statement, read from the cell's code: the loops around it as (target,
    iterable), innermost first and the statement's own comprehensions before them, and
    the names a run of it may find bound anew (the loops' targets, what their bodies bind,
    a function's arguments): its indices, the tensors it takes one at a time."""

    stmt: ast.stmt
    head: list[ast.AST]  # what the line runs: the statement, or a compound one's header
    loops: list[tuple[ast.expr, ast.expr]]
    varying: set[str]

    def nodes(self) -> Iterator[ast.AST]:
        return (n for h in self.head for n in ast.walk(h))

    def iterable(self, var: str) -> ast.expr | None:
        """What the loop binding `var` runs over."""
        return next((it for t, it in self.loops if isinstance(t, ast.Name) and t.id == var),
                    None)

    def varies(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id in self.varying for n in ast.walk(node))


def _statements(source: str) -> dict[int, _Line]:
    """Each line of `source` to its statement: the first one that spans it, a compound
    one by its header's line."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return {}
    out: dict[int, _Line] = {}

    def visit(body: list[ast.stmt], loops: list[tuple[ast.expr, ast.expr]],
              varying: set[str]) -> None:
        for node in body:
            simple = not hasattr(node, "body")
            head = [node] if simple else [getattr(node, a) for a in ("iter", "test")
                                          if hasattr(node, a)]
            own = _comprehensions(head)
            line = _Line(node, head, own + loops, varying | _bound(*(t for t, _ in own)))
            last = (node.end_lineno or node.lineno) if simple else node.lineno
            for n in range(node.lineno, last + 1):
                out.setdefault(n, line)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
                visit(node.body, [], varying | args | _bound(*node.body))
                continue
            if isinstance(node, (ast.For, ast.AsyncFor)):
                visit(node.body, [(node.target, node.iter), *loops],
                      varying | _bound(node.target, *node.body))
            elif isinstance(node, ast.While):
                visit(node.body, loops, varying | _bound(*node.body))
            elif not simple:
                visit(node.body, loops, varying)  # type: ignore[attr-defined]
            for block in ("orelse", "finalbody"):
                visit(getattr(node, block, []), loops, varying)
            for handler in getattr(node, "handlers", []):
                visit(handler.body, loops, varying)

    visit(tree.body, [], set())
    return out


def _comprehensions(nodes: list[ast.AST]) -> list[tuple[ast.expr, ast.expr]]:
    """The comprehensions' loops in these nodes as (target, iterable), innermost first."""
    return [(c.target, c.iter) for n in nodes for c in ast.walk(n)
            if isinstance(c, ast.comprehension)][::-1]


def _bound(*nodes: ast.AST) -> set[str]:
    """The names these nodes bind."""
    return {n.id for node in nodes for n in ast.walk(node)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _elements(index: ast.expr) -> list[ast.expr]:
    return list(index.elts) if isinstance(index, ast.Tuple) else [index]


Remedy = tuple[str, str | None]  # the text, and the example it gives (`Advice.example`)
_FEWER = "do the work in fewer, larger calls"


def _remedy(line: _Line | None, kinds: Mapping[str, str], op: str,
            per_run: Callable[[str], int | None]) -> Remedy:
    """The remedy for what the line writes, decided from its code and the names' values
    (`kinds`), not from the op it spent most in: a parameter update by its .grad, an
    in-place update of indexed elements (one scatter), a factory call (one batched call),
    a slice or index of each of many tensors of one shape (one stack), an index of one
    tensor by the loop's values (one gather); else only what is slow. Each example runs
    as typed and does what the line did, else there is none."""
    if line is not None:
        for remedy in (_update(line), _scatter(line, kinds), _factory(line, op, per_run),
                       _stacked(line, kinds), _gathered(line, kinds)):
            if remedy is not None:
                return remedy
    return _FEWER, None


def _is_grad(node: ast.AST, var: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "grad"
            and isinstance(node.value, ast.Name) and node.value.id == var)


def _coefficient(value: ast.expr, var: str) -> ast.expr | None:
    """c where `value` is c * var.grad (var.grad: 1), else None."""
    if _is_grad(value, var):
        return ast.Constant(1)
    if isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.USub):
        inner = _coefficient(value.operand, var)
        return None if inner is None else ast.UnaryOp(ast.USub(), inner)
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mult):
        for this, other in ((value.left, value.right), (value.right, value.left)):
            if _is_grad(this, var) and not any(_is_grad(n, var) for n in ast.walk(other)):
                return other
    return None


def _update(line: _Line) -> Remedy | None:
    """A parameter update: the loop's variable (or its .data) updated in place by its own
    .grad (`p.data += -lr * p.grad`, `p.add_(p.grad, alpha=-lr)`); not a sum of the grads
    into another name (a gradient norm), which updates nothing."""
    stmt, alpha = line.stmt, None
    target: ast.expr
    if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, (ast.Add, ast.Sub)):
        target, value, minus = stmt.target, stmt.value, isinstance(stmt.op, ast.Sub)
    elif (isinstance(stmt, ast.Expr) and isinstance(call := stmt.value, ast.Call)
          and isinstance(call.func, ast.Attribute) and call.func.attr in ("add_", "sub_")
          and len(call.args) == 1 and all(k.arg == "alpha" for k in call.keywords)):
        target, value, minus = call.func.value, call.args[0], call.func.attr == "sub_"
        alpha = call.keywords[0].value if call.keywords else None
    else:
        return None
    if isinstance(target, ast.Attribute) and target.attr == "data":
        target = target.value
    if not isinstance(target, ast.Name) or (params := line.iterable(target.id)) is None:
        return None
    var = target.id
    if not any(_is_grad(n, var) for n in ast.walk(value)):
        return None
    scale = _coefficient(value, var)
    if scale is None or line.varies(scale) or (alpha is not None and line.varies(alpha)):
        return ("update every parameter in one call: torch._foreach_add_ over the "
                "parameters and their grads, or a torch.optim optimizer (foreach=True)"), None
    if alpha is not None:
        scale = alpha if isinstance(scale, ast.Constant) else ast.BinOp(scale, ast.Mult(), alpha)
    if minus:
        scale = ast.UnaryOp(ast.USub(), scale)
    it = ast.unparse(params)
    example = (f"torch._foreach_add_([{var}.data for {var} in {it}], [{var}.grad for {var} "
               f"in {it}], alpha={ast.unparse(scale)})")
    return (f"update every parameter in one call: {example}, or a torch.optim optimizer "
            "(foreach=True)"), example


def _scatter(line: _Line, kinds: Mapping[str, str]) -> Remedy | None:
    """An in-place add to elements of a tensor indexed by the loop's values
    (`N[ix1, ix2] += 1`): one scatter of every run's, index_put_ with accumulate=True."""
    stmt = line.stmt
    if not (isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, (ast.Add, ast.Sub))
            and isinstance(stmt.target, ast.Subscript)):
        return None
    into, index = stmt.target.value, _elements(stmt.target.slice)
    if not (isinstance(into, ast.Name) and kinds.get(into.id) == "tensor") or line.varies(into):
        return None
    if any(isinstance(e, ast.Slice) or not line.varies(e) for e in index):
        return None
    held = [f"I{k}" for k in range(1, len(index) + 1)]
    value, minus, also = stmt.value, isinstance(stmt.op, ast.Sub), ""
    if isinstance(value, ast.Constant) and isinstance(value.value, (int, float)) \
            and not isinstance(value.value, bool):
        c = -value.value if minus else value.value
        values = (f"torch.ones(len(I1), dtype={into.id}.dtype)" if c == 1 else
                  f"torch.full((len(I1),), {c!r}, dtype={into.id}.dtype)")
    else:
        values = "-V" if minus else "V"
        also = f", and V those of {ast.unparse(value)}, stacked"
    example = (f"{into.id}.index_put_(({', '.join(held)}{',' if len(held) == 1 else ''}), "
               f"{values}, accumulate=True)")
    return (f"gather the indices of every run and update once: {example}, where "
            f"{_holding(held, index)}{also} (accumulate=True adds up repeated indices), not "
            "one element a call"), example


def _holding(held: list[str], index: list[ast.expr]) -> str:
    """'I1, I2 hold the values of ix1, ix2 over the loop, as tensors'."""
    one = len(held) == 1
    return (f"{', '.join(held)} {'holds' if one else 'hold'} the values of "
            f"{', '.join(map(ast.unparse, index))} over the loop, as "
            f"{'a tensor' if one else 'tensors'}")


def _factory(line: _Line, op: str, per_run: Callable[[str], int | None]) -> Remedy | None:
    """A factory call whose arguments the loop does not bind (`torch.randint(0, 100, (8,))`
    3,000 times): one call of the batched form of that call, where there is one."""
    calls = [n for n in line.nodes() if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
             and n.func.value.id == "torch" and f"aten::{n.func.attr}" in names.FACTORIES]
    call = next((c for c in calls if f"aten::{c.func.attr}" == op), None)  # type: ignore[attr-defined]
    call = call or (calls[0] if calls else None)
    if call is None or line.varies(call):
        return None
    fn = call.func.attr  # type: ignore[attr-defined]
    known = per_run(f"aten::{fn}")
    if known is None:  # runs that made more or fewer: no one count
        return None
    count = str(known)
    it = line.loops[0][1] if line.loops else None  # the loop's own count, where it is written
    if (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range"
            and len(it.args) == 1 and not line.varies(it.args[0])
            and not (isinstance(it.args[0], ast.Constant) and it.args[0].value != known)):
        count = ast.unparse(it.args[0])
    batched = _batched_call(call, count)
    if batched is None:
        return None
    return (f"make them one batched call: {batched}, not {ast.unparse(call)} {known:,} times",
            batched)


def _batched_call(call: ast.Call, count: str) -> str | None:
    """The one call that makes `count` of what `call` makes, stacked, where it is written
    from the call's own arguments (a size whose length the code does not say: none)."""
    fn, args = call.func.attr, list(call.args)  # type: ignore[attr-defined]
    kw = {k.arg: k.value for k in call.keywords}
    if None in kw or any(isinstance(a, ast.Starred) for a in args):
        return None

    def rest(*skip: str) -> str:
        return "".join(f", {k}={ast.unparse(v)}" for k, v in kw.items() if k not in skip)

    def sized(size: ast.expr) -> str:  # a size argument with the count in front
        if isinstance(size, (ast.Tuple, ast.List)):
            dims = [ast.unparse(e) for e in size.elts]
        elif isinstance(size, ast.Constant) and type(size.value) is int:
            dims = [str(size.value)]
        else:
            dims = [f"*{ast.unparse(size)}"]
        return f"({', '.join([count, *dims])})"

    if fn in ("randn", "rand", "zeros", "ones", "empty"):
        if "size" in kw and not args:
            return f"torch.{fn}({sized(kw['size'])}{rest('size')})"
        if len(args) == 1 and isinstance(args[0], ast.Name):
            return None  # an int or a shape: the code does not say which
        if len(args) == 1 and not isinstance(args[0], ast.Constant):
            return f"torch.{fn}({sized(args[0])}{rest()})"
        return f"torch.{fn}({', '.join([count, *map(ast.unparse, args)])}{rest()})" if args \
            else None
    if fn in ("randint", "normal", "full"):
        at = {"randint": len(args) - 1 if len(args) in (2, 3) else None,
              "normal": 2 if len(args) == 3 else None, "full": 0 if args else None}[fn]
        if "size" in kw:
            given = [ast.unparse(a) for a in args]
            parts = [sized(kw["size"]), *given] if fn == "full" else [*given, sized(kw["size"])]
            return f"torch.{fn}({', '.join(parts)}{rest('size')})"
        if at is None:
            return None
        args_text = [ast.unparse(a) for a in args]
        args_text[at] = sized(args[at])
        return f"torch.{fn}({', '.join(args_text)}{rest()})"
    if fn in ("arange", "linspace", "eye"):  # the same tensor each time
        ones = ", ".join(["1"] * (2 if fn == "eye" else 1))
        return f"{ast.unparse(call)}.repeat({count}, {ones})"
    if fn == "randperm" and len(args) == 1 and set(kw) <= {"device", "generator"}:
        return f"torch.rand({count}, {ast.unparse(args[0])}{rest()}).argsort(1)"
    return None


def _stacked(line: _Line, kinds: Mapping[str, str]) -> Remedy | None:
    """A slice or an index of each of many tensors of one shape, the loop's variable
    (`[c[:4] for c in chunks]`): one stack of them, indexed once."""
    for node in line.nodes():
        if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and isinstance(node.ctx, ast.Load)) or line.varies(node.slice):
            continue
        it = line.iterable(node.value.id)
        if isinstance(it, ast.Name) and kinds.get(it.id) == "tensors":
            index = _elements(node.slice)
            example = f"torch.stack({it.id})[{', '.join([':', *map(ast.unparse, index)])}]"
            what = "slice" if any(isinstance(e, ast.Slice) for e in index) else "index"
            return (f"stack the tensors once and take the {what} of all at once: {example} "
                    f"(its rows are what the line took, one a tensor), not a {what} a "
                    "tensor"), example
    return None


def _gathered(line: _Line, kinds: Mapping[str, str]) -> Remedy | None:
    """An index of one tensor by the loop's values (`P[ix1, ix2]`, `x[i]`): one index by
    tensors of every run's."""
    for node in line.nodes():
        if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                and isinstance(node.ctx, ast.Load) and kinds.get(node.value.id) == "tensor"
                and not line.varies(node.value)):
            continue
        index = _elements(node.slice)
        moving = [e for e in index if line.varies(e)]
        if not moving or any(isinstance(e, ast.Slice) for e in moving):
            continue
        held = {id(e): f"I{k}" for k, e in enumerate(moving, 1)}
        parts = [held.get(id(e)) or ast.unparse(e) for e in index]
        example = f"{node.value.id}[{', '.join(parts)}]"
        return (f"index once with tensors of every run's indices: {example}, where "
                f"{_holding(list(held.values()), moving)} (then the rest of the line on the "
                "result), not one index a call"), example
    return None


def input_pipeline(f: _Facts) -> Advice | None:
    """Rule 1 (tb, its remedies ours): the single-process DataLoader's share of the wall,
    and what it did there. Rows of tensors in memory indexed one at a time (index calls
    and a stack a batch, little else) get one index a batch, which a worker would not
    speed: each batch would cross a process boundary. Other loading (Python in the
    dataset's __getitem__ past indexing, other ops: decoding, files, transforms) gets
    workers, where they would overlap enough of it with the rest of the loop to pay their
    start and their hand-back; else nothing."""
    nexts = [e for e in f.of_kind("op") if all(n in e.name for n in names.LOADER_NEXT)]
    wall = f.events_wall()
    if not nexts or not wall:
        return None
    took = sum(e.end_ns - e.start_ns for e in nexts) / 1e9
    share = took / wall
    if share <= LOADER_SHARE:
        return None
    ids = {id(e) for e in nexts}
    rows = ops = other = 0.0
    batches: set[int] = set()  # the calls of __next__ that called ops (not the last, empty)
    for e in f.of_kind("op"):  # the ops each batch called itself (not inside another op)
        up = e.parent
        while up is not None and up.kind == "line":  # a dataset of the cell's: its lines
            up = up.parent
        if up is None or id(up) not in ids:
            continue
        batches.add(id(up))
        ops += e.end_ns - e.start_ns
        if e.name in names.INDEXING:
            rows += 1
        elif e.name not in names.COLLATE:
            other += e.end_ns - e.start_ns
    work = (other + max(took * 1e9 - ops - INDEX_GLUE_S * 1e9 * rows, 0.0)) / 1e9
    by_line: dict[str | None, float] = defaultdict(float)
    for e in nexts:
        by_line[e.line] += e.end_ns - e.start_ns
    line, seen = f.top_line(by_line), f.setting.loader
    head = (f"the DataLoader{_on(line)} took {share:.0%} of the wall (over {LOADER_SHARE:.0%}) "
            "in this process")
    per_row = rows >= INDEXED_ROWS * len(batches) and not (seen is not None and seen.batched)
    if per_row and ((seen is not None and seen.in_memory) or work < took / 2):
        ds = seen.dataset if seen is not None else "dataset"
        example = seen.remedy if seen is not None else None
        how = example or (f"DataLoader({ds}, sampler=BatchSampler(RandomSampler({ds}), "
                          "batch_size, drop_last=False), batch_size=None)" + (
                              "" if seen is not None else ", where the dataset takes a list "
                              "of indices (a TensorDataset does)"))
        return Advice("input pipeline", share, LOADER_SHARE, line, (
            f"{head}, indexing tensors in memory one row at a time ({rows / len(batches):,.0f} "
            f"index calls and a stack a batch): index each batch at once, {how} (BatchSampler and "
            "RandomSampler from torch.utils.data), or index the tensors with slices of "
            "torch.randperm(n); workers would not speed it (each batch would cross to this "
            "process)"), example)
    # the figures over the whole cell, where the events cover some of a loop's steps: the
    # workers start once
    scale = max(f.setting.wall_s / wall, 1.0) if f.setting.wall_s else 1.0
    rest = max(wall - took, 0.0) * scale  # the loop's other work, which workers would overlap
    loading, whole = took * scale, wall * scale
    # as many workers as bring the loading under the rest, or as the cores allow
    workers = max(min(f.setting.cores - 1, math.ceil(loading / max(rest, 1e-9) - 1e-9)), 1)
    after = (max(rest + len(nexts) * scale * WORKER_BATCH_S, loading / workers)
             + workers * WORKER_START_S)
    if work < took / 2 or whole - after < LOADER_SHARE * whole:
        return None  # neither remedy would pay
    pin = (", and pin_memory=True with .to(device, non_blocking=True)" if f.setting.cuda
           else "")
    return Advice("input pipeline", share, LOADER_SHARE, line, (
        f"{head}, loading (Python in its dataset past indexing, and ops: decoding, files, "
        f"transforms): give it workers, num_workers={workers} ({f.setting.cores} cores), "
        f"persistent_workers=True{pin}, to overlap its {fmt_seconds(loading)} with the "
        f"{fmt_seconds(rest)} of the rest"))


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


def mfu(f: _Facts) -> Advice | None:
    """Issue 39 (ours): what bounds a low MFU where the counted work is most of the
    device's busy time (the first of the rules that explains it: fp32 without tensor
    cores, syncs, launches, an idle device, the DataLoader; else the counted kernels
    themselves), and where the MFU is high, that what is left is the rest of the cell."""
    claim, a = f.setting.claim, f.analysis
    if claim is None or claim.mfu is None or claim.peak is None or not a.device_busy_s:
        return None
    value, peak = claim.mfu, claim.peak
    said = (f"MFU {peaks.percent(value)} of the {peak.dtype} peak "
            f"({fmt_flops(peak.flops, True)})")
    if value >= MFU_HIGH:
        idle = 1 - a.device_busy_s / f.events_wall() if f.events_wall() else 0.0
        return Advice("MFU", value, MFU_HIGH, None, (
            f"{said}, at {MFU_HIGH:.0%} or more: the matmuls are near the limit; what is "
            f"left to win is the rest of the cell (the device idle {max(idle, 0.0):.0%} of "
            "the wall, and its work outside the counted ops)"))
    if value >= MFU_LOW:
        return None
    by_id = {e.correlation: e for e in f.of_kind("op") if e.correlation}
    counted_ns = 0
    for k in f.of_kind("kernel"):
        op = by_id.get(k.linked)
        while op is not None and op.name not in names.FLOP_OPS:
            op = op.parent
        counted_ns += (k.end_ns - k.start_ns) if op is not None else 0
    share = counted_ns / 1e9 / a.device_busy_s
    if share < COUNTED_SHARE:
        return None  # the matmuls are not what the device spent its time on
    head = (f"{said}, under {MFU_LOW:.0%}, while the counted ops' kernels took {share:.0%} "
            f"of the device's busy time: ")
    for rule in (tensor_cores, device_waits, input_pipeline):
        found = rule(f)
        if found is not None:
            return Advice("MFU", value, MFU_LOW, found.line, head + (
                f"what bounds it is the '{found.rule}' advice's ({_figure(found)})"))
    own = a.work.flops / (counted_ns / 1e9) if counted_ns else 0.0
    return Advice("MFU", value, MFU_LOW, None, head + (
        f"the counted kernels themselves ran at {fmt_flops(own, True)} over their own time, "
        f"{peaks.percent(own / peak.flops)} of the peak: matmuls too small for this device "
        "(a bigger batch, wider layers)"))


def _figure(advice: Advice) -> str:
    """The figure an advice rests on, as its rule says it."""
    if advice.rule == "tensor cores":
        return f"{advice.figure:,.0f} fp32 matmul/conv kernels without tensor cores"
    if advice.rule.startswith("device waits"):
        return f"the device busy {advice.figure:.0%} of the wall"
    return f"the DataLoader {advice.figure:.0%} of the wall"


def _line_key(where: str) -> tuple[int, str]:
    return (int(where), "") if where.isdigit() else (1 << 30, where)


RULES: tuple[Callable[[_Facts], Advice | None], ...] = (
    warm_up, input_pipeline, device_waits, tensor_cores, memory, pageable_copies, tiny_ops,
    cpu_threads, data_parallel_gpus, cudnn_benchmark, recompiles, mfu,
)
