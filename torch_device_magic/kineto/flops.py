"""The floating-point work of a capture's ops, from what the profiler recorded (the inputs'
shapes, and the scalar arguments kineto keeps as concrete inputs): torch's own formulas
(`torch.utils.flop_counter`'s registry, as `FlopCounterMode` uses them), applied to the
outermost counted op of each nest, as a dispatch mode sees them (`aten::linear` counts as
its `aten::addmm`, `aten::convolution` not again as its `aten::_convolution`). No mode runs
around the user's code: a compiled function is never touched.

    >>> work = count(ops)          # after kineto.analysis nested them
    >>> work.flops, work.ops       # 2 * m * n * k for each mm, and how many were counted
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from . import names
from .events import Event

_log = logging.getLogger(__name__)
# torch's CPU kernels of scaled-dot-product attention, which its registry (written for the
# GPU's) lacks: the same work as the flash kernel's, by the same formula
_CPU_ATTENTION = {
    "aten::_scaled_dot_product_flash_attention_for_cpu":
        "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward":
        "aten::_scaled_dot_product_flash_attention_backward",
}
# the convolutions whose arguments begin (input, weight, bias, stride, padding, dilation,
# transposed, output_padding, groups); the backend's own (cudnn_convolution, ...) run inside them
_CONVOLUTIONS = frozenset({"aten::convolution", "aten::_convolution",
                           "aten::convolution_overrideable"})


@cache
def formulas() -> dict[str, Callable[..., int]]:
    """Each counted op's name ('aten::mm', of names.FLOP_OPS) and torch's formula for it."""
    try:
        from torch.utils.flop_counter import flop_registry
    except ImportError:  # a torch without the counter: nothing is counted
        return {}
    found = {str(getattr(op, "_qualified_op_name", "")): f for op, f in flop_registry.items()}
    found.update({cpu: found[gpu] for cpu, gpu in _CPU_ATTENTION.items() if gpu in found})
    return {name: f for name, f in found.items() if name in names.FLOP_OPS}


@dataclass(slots=True)
class Work:
    """The floating-point operations of the counted ops."""

    flops: int = 0
    ops: int = 0  # the counted ops' calls
    by_op: Counter[str] = field(default_factory=Counter)  # an op name's FLOPs
    by_line: Counter[str] = field(default_factory=Counter)  # a line range's FLOPs
    by_dtype: Counter[str] = field(default_factory=Counter)  # kineto's dtype name's FLOPs
    conv_by_dtype: Counter[str] = field(default_factory=Counter)  # of them, convolutions'
    uncounted: int = 0  # counted ops whose arguments the formula could not read
    on_device: int = 0  # the FLOPs of the ops that launched device work (a GPU's kernels)


def count(ops: Sequence[Event]) -> Work:
    """The work of `ops` (nested: each one's `parent` set), each nest counted once, at its
    outermost counted op."""
    table = formulas()
    work = Work()
    launched: set[int] = set()  # the ops around device work: a counted op ran there
    for op in ops:
        up = op if op.device_ns else None
        while up is not None and id(up) not in launched:
            launched.add(id(up))
            up = up.parent
    for op in ops:
        formula = table.get(op.name)
        if formula is None or _inside_counted(op, table):
            continue
        try:
            args, kwargs = _by_schema(op.name, _arguments(op))
            flops = int(formula(*args, out_val=_out_shape(op), **kwargs))
        except Exception:  # ours: an argument kineto did not keep
            _log.debug("no FLOP count for %s", op.name, exc_info=True)
            work.uncounted += 1
            continue
        work.flops += flops
        work.ops += 1
        work.by_op[op.name] += flops
        if id(op) in launched:
            work.on_device += flops
        if op.line is not None:
            work.by_line[op.line] += flops
        if op.dtypes:
            work.by_dtype[op.dtypes[0]] += flops
            if "conv" in op.name:  # cuDNN's TF32 switch, not the matmuls'
                work.conv_by_dtype[op.dtypes[0]] += flops
    return work


def _inside_counted(op: Event, table: dict[str, Callable[..., int]]) -> bool:
    parent = op.parent
    while parent is not None:
        if parent.name in table:
            return True
        parent = parent.parent
    return False


def _arguments(op: Event) -> list[Any]:
    """The op's arguments as the formulas take them: a tensor's shape, else its value."""
    concrete = op.concrete or (None,) * len(op.shapes)
    return [value if value is not None else tuple(shape)
            for shape, value in zip(op.shapes, concrete)]


@cache
def _keywords(name: str, given: int) -> tuple[str, ...] | None:
    """The names of the keyword-only arguments among the `given` recorded ones of op `name`
    (addmm's beta and alpha): a formula takes those by keyword, as a dispatch mode is given
    them. None where no overload of the op takes `given` arguments."""
    import torch

    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    for overload in (packet.overloads() if packet is not None else []):
        arguments = getattr(packet, overload)._schema.arguments
        if len(arguments) == given:
            return tuple(a.name if a.kwarg_only else "" for a in arguments)
    return None


def _by_schema(name: str, values: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """The recorded `values` as the op's positional and keyword arguments."""
    keywords = _keywords(name, len(values))
    if keywords is None:
        return values, {}
    return ([v for v, k in zip(values, keywords) if not k],
            {k: v for v, k in zip(values, keywords) if k})


def _out_shape(op: Event) -> Any:
    """What the formula needs of the op's output, which kineto does not record: a
    convolution's shape (from its input, weight and scalar arguments), a convolution
    backward's three gradients' (those of its input, weight and bias)."""
    if op.name == "aten::convolution_backward":
        _grad, x, w, bias_sizes, *_ = _arguments(op)
        return (x, w, tuple(bias_sizes or ()))
    if op.name not in _CONVOLUTIONS:
        return None
    x, w, _bias, stride, padding, dilation, transposed, *rest = _arguments(op)
    output_padding = rest[0] if rest else None
    groups = rest[1] if len(rest) > 1 else 1
    dims = len(x) - 2
    stride, padding, dilation = (_per_dim(v, dims) for v in (stride, padding, dilation))
    if transposed:
        output_padding = _per_dim(output_padding or 0, dims)
        spatial = [(x[2 + i] - 1) * stride[i] - 2 * padding[i]
                   + dilation[i] * (w[2 + i] - 1) + output_padding[i] + 1 for i in range(dims)]
        channels = w[1] * groups
    else:
        spatial = [math.floor((x[2 + i] + 2 * padding[i] - dilation[i] * (w[2 + i] - 1) - 1)
                              / stride[i] + 1) for i in range(dims)]
        channels = w[0]
    return (x[0], channels, *spatial)


def _per_dim(value: Any, dims: int) -> list[int]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return values * dims if len(values) == 1 else values
