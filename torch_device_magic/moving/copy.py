"""Phase 2, the copy: one copy of each planned tensor, or the sentence that says why not."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import itertools
import traceback
from collections.abc import Collection

import torch
from torch import Tensor

from .. import probes
from ..errors import first_sentence
from ..units import fmt_bytes
from .plan import _PLAIN_TENSORS, _first_target, _label, _Plan, _span

_BAR_MIN_BYTES = 1 << 30  # about a second of host-to-device copying: show a progress bar
_OOM = getattr(torch, "OutOfMemoryError", ())


def _inference(tensors: list[Tensor]) -> set[int]:
    """The indices of the inference tensors among `tensors` (read only in inference mode:
    outside it no copy is one, and an inference tensor's copy is a normal tensor)."""
    return set(itertools.compress(itertools.count(), map(Tensor.is_inference, tensors)))


def _copy_all(plan: _Plan, inference: Collection[int] = ()) -> list[Tensor] | str:
    """Phase 2: a copy of each planned tensor, in plan order, or the one-sentence reason why
    not; those at the indices `inference` are copied in inference mode."""
    tensors, targets = plan.tensors, plan.targets
    if not tensors:
        return []
    news: list = []
    spans: dict[int, Tensor] = {}  # the copies of the tensors that share a storage, by index
    bar = _progress_bar(sum(plan.nbytes), _first_target(plan))
    group = None  # the shared storage being copied
    try:
        with torch.no_grad():
            for group in plan.shared.values():  # each as one span
                with _kind(group[0] in inference):
                    _copy_storage(plan, group, spans)
                if bar is not None:
                    probes.synchronize(targets[group[0]])
                    bar.update(plan.nbytes[group[0]])
            group = None
            if spans or bar is not None or inference or plan.special:  # (`t.to`: its own)
                for i, (t, target) in enumerate(zip(tensors, targets)):
                    new = spans.pop(i, None)
                    if new is None:  # a tensor with a storage of its own
                        with _kind(i in inference):
                            new = t.to(target)
                        if bar is not None:
                            probes.synchronize(target)
                            bar.update(plan.nbytes[i])
                    news.append(new)
            else:  # the same without a Python step per tensor (about 0.15 µs a tensor less)
                news.extend(map(Tensor.to, tensors, targets))
            for j in plan.requiring_grad:
                news[j].requires_grad_(True)  # under no_grad, `.to` of a leaf gives one without
            for j in plan.special:
                _check_followed(tensors[j], news[j], targets[j], j)
        return news
    except BaseException as exc:
        # What failed: a span, or the `.to` after the copies made (`extend` keeps those too).
        failed = group or [min(len(news), len(tensors) - 1)]
        if isinstance(exc, _LeftBehind):
            failed = [exc.index]
        news.clear()
        spans.clear()
        traceback.clear_frames(exc.__traceback__)  # the frames below hold copies too
        gc.collect()
        probes.empty_cache(targets[failed[0]])
        if not isinstance(exc, Exception):
            raise  # an interrupt goes on, holding no copies
        # out of memory, a dtype, data-less meta
        return _failure(plan, failed, targets[failed[0]], exc)
    finally:
        if bar is not None:
            bar.close()


def _kind(inference: bool) -> contextlib.AbstractContextManager:
    """Where a copy is made: in inference mode for an inference tensor's, else as it is."""
    return torch.inference_mode() if inference else contextlib.nullcontext()


def _copy_storage(plan: _Plan, members: list[int], spans: dict[int, Tensor]) -> None:
    """Copy the tensors `members` of `plan`, which share a storage, as one span of bytes."""
    # Each is rebuilt on the copied span at its own offset, so that they still share it.
    group = [plan.tensors[j] for j in members]
    target = plan.targets[members[0]]
    lo, n = _span(group)
    first = group[0]
    src = torch.empty(0, dtype=torch.uint8, device=first.device)
    src.set_(first.untyped_storage(), lo, (n,), (1,))
    storage = src.to(target).untyped_storage()
    bases = {  # (a lazy bit would be set twice on a view of its copy)
        id(t): j
        for t, j in zip(group, members, strict=True)
        if t._base is None and not (t.is_conj() or t.is_neg())
    }
    views = []  # a view of a tensor of the group: made a view of its base's copy, below
    # A view of a base the group has not (one that lives only in its views, `x[::2]` of a
    # temporary): made a view of a new base over the whole copy, one a base, as it was.
    unplanned: dict[tuple[int, torch.dtype], Tensor] = {}
    for t, j in zip(group, members, strict=True):
        if id(t._base) in bases:
            views.append((t, j))
            continue
        offset = t.storage_offset() - lo // t.element_size()
        if t._base is not None:
            flat = unplanned.get((id(t._base), t.dtype))
            if flat is None:
                flat = torch.empty(0, dtype=t.dtype, device=target)
                flat.set_(storage, 0, (n // t.element_size(),), (1,))
                unplanned[id(t._base), t.dtype] = flat
            spans[j] = _lazy_bits(t, flat.as_strided(t.size(), t.stride(), offset))
            continue
        new = torch.empty(0, dtype=t.dtype, device=target)
        new.set_(storage, offset, t.size(), t.stride())
        spans[j] = _lazy_bits(t, new)
    for t, j in views:
        # So that, once swapped, `t._base` is its base's object, and they share the version
        # counter that lets autograd see an in-place change to either.
        base = spans[bases[id(t._base)]]
        offset = t.storage_offset() - lo // t.element_size()
        if t.dtype == base.dtype:
            new = base.as_strided(t.size(), t.stride(), offset)
        else:  # `view(dtype)`, which torch does not make a view of its base either
            new = torch.empty(0, dtype=t.dtype, device=target)
            new.set_(storage, offset, t.size(), t.stride())
        spans[j] = _lazy_bits(t, new)


def _lazy_bits(t: Tensor, new: Tensor) -> Tensor:
    """`new` with the lazy bits of `t`: a lazy view (`c.conj()`, `r._neg_view()`) is its
    bytes and a bit, which a copy of its bytes does not carry."""
    if t.is_neg():
        new = new._neg_view()
    if t.is_conj():
        new = new.conj()
    return new


class _LeftBehind(Exception):
    """A subclass's own `.to` left some of its data behind: the copy at `index`."""

    def __init__(self, reason: str, index: int) -> None:
        super().__init__(reason)
        self.index = index


def _check_followed(t: Tensor, new: Tensor, target: torch.device, index: int) -> None:
    """Raise `_LeftBehind` unless `new`, the copy of `t` made by its class's own `.to`, is of
    its class and holds its data on `target`: its C++ tensor says so, its attributes too."""
    kind = type(t).__name__
    if type(new) is not type(t):
        raise _LeftBehind(f"its class {kind} copies itself as a {type(new).__name__}", index)
    inner = vars(new)
    if hasattr(new, "__tensor_flatten__"):
        inner = {name: getattr(new, name) for name in new.__tensor_flatten__()[0]}
    # ... and what only the original has, which stays with it
    kept = {k: v for k, v in vars(t).items() if k not in vars(new)}
    left = sorted(
        name
        for name, v in itertools.chain(inner.items(), kept.items())
        if isinstance(v, Tensor) and v.device != target and not _host_metadata(t, name)
    )
    if left or new.device != target:
        where = ", ".join(left) or "its data"
        raise _LeftBehind(
            f"it is a {kind}, which keeps tensors in Python attributes, and its own .to "
            f"left {where} on {t.device}",
            index,
        )


def _host_metadata(t: Tensor, name: str) -> bool:
    """Whether the inner tensor `name` of `t` is metadata its class keeps on the host
    whatever its device (a jagged nested tensor's cached sequence lengths)."""
    return t.is_nested and name in ("_min_seqlen_tensor", "_max_seqlen_tensor")


def _failure(plan: _Plan, members: list[int], target, exc: Exception | None) -> str:
    t = plan.tensors[members[0]]
    what = _label(plan.where(members[0]))
    size = fmt_bytes(sum(plan.nbytes[j] for j in members))  # a shared storage's: once
    if exc is None or t.device.type == "meta":  # None: refused in the plan, for that
        reason = "it is on the meta device, which holds no data"
    elif isinstance(exc, _OOM) or "out of memory" in str(exc).lower():
        free = probes.free_bytes(target)
        reason = "out of memory" + (f" with {fmt_bytes(free)} free" if free is not None else "")
    elif isinstance(exc, _LeftBehind):
        reason = str(exc)
    else:
        reason = _reason(t, exc)
    return f"Could not move {what} ({size}) to {target}: {reason}; nothing was moved."


def _reason(t: Tensor, exc: Exception) -> str:
    """Why copying `t` raised `exc`, as a sentence: a KeyError's message is the key it
    missed (a jagged nested tensor's `.to` says `<weakref at 0x...>`), which tells nothing."""
    line = first_sentence(exc)
    if isinstance(exc, KeyError) or line.startswith("<") or line == type(exc).__name__:
        if type(t) in _PLAIN_TENSORS:
            return f"copying it failed with a {type(exc).__name__}"
        return f"its class's own .to ({type(t).__name__}.to) failed with a {type(exc).__name__}"
    return line


def _progress_bar(total_bytes: int, target: torch.device):  # -> tqdm | None
    """A bar in bytes for moves long enough to wait for; gone when done (leave=False)."""
    if total_bytes < _BAR_MIN_BYTES:
        return None
    if _has_widgets():  # a widget in Jupyter, text elsewhere
        from tqdm.auto import tqdm
    else:  # tqdm.auto warns "IProgress not found" in Jupyter without ipywidgets
        from tqdm.std import tqdm

    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        desc=f"moving to {target}",
    )


def _has_widgets() -> bool:
    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except (ImportError, ValueError):  # a broken install, or one blocked in sys.modules
        return False
